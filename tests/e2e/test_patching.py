"""Batched patching (attnprobe.measures.head_effects: engine, phases) computes what patching one
item at a time with whole forward passes computes (interventions.effects, the reference): every
head, layer and set, in and out, and the attribution, on tiny models of several families (float64)
and on SmolLM2's gender items (float32)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import INTERFACE_FAMILIES, build_tiny
from reference_patching import effects

from attnprobe.intervene.items import Counterfactual, PatchItem, Selection
from attnprobe.intervene.selection import head_mask
from attnprobe.measures.head_effects import screen as phases

POSITIVE, NEGATIVE = [30], [31, 32]
# x and x' of different lengths in one padded bank: a same-length x', a longer x' (aligned from the
# end), and a second, shorter item
ITEMS = [
    ((5, 6, 7, 8, 9, 10), [((5, 11, 7, 8, 9, 10), 1, 1), ((5, 12, 13, 7, 8, 9, 10), 1, 2)]),
    ((20, 21, 22, 23), [((20, 24, 22, 23), 1, 1)]),
]


def _items(specs, positive=POSITIVE, negative=NEGATIVE) -> list[PatchItem]:
    items = []
    for k, (x, cfs) in enumerate(specs):
        counterfactuals = tuple(
            Counterfactual(f"w{j}", torch.tensor(cf), at, at_cf) for j, (cf, at, at_cf) in enumerate(cfs)
        )
        x = torch.tensor(x)
        items.append(
            PatchItem(
                f"i{k}", "t", "o", f"u{k}", np.nan, x, counterfactuals, tuple(positive), tuple(negative)
            )
        )
    return items


def _compare(pm, items, singles, tolerance, every_head=True):
    """The screen (every head and layer exact, or attribution only) and the selected phase against
    reference_patching.effects, pair by pair; returns the largest difference."""
    L, H = pm.info.n_layers, pm.info.n_heads
    measure = SimpleNamespace(exact="all" if every_head else int(singles.sum()), slot="occupation")
    screen = phases.screen(pm, measure, items, set())
    flat = tuple(singles.flatten().nonzero()[:, 0].tolist())
    crossfit = flat[:2]
    words = {cf.word for i in items for cf in i.counterfactuals}
    draws = (flat[-2:], flat[:1])  # two "random" sets, patched jointly like the cross-fitted one
    ids = frozenset(i.item_id for i in items)
    selection = Selection(
        {i.item_id: 0 for i in items},
        {w: (crossfit,) * 4 for w in words},
        flat,
        {w: (draws,) * 4 for w in words},
        ids,
    )
    chosen = phases.selected(pm, items, selection)
    worst = 0.0
    for item in items:
        for cf in item.counterfactuals:
            sets = {"crossfit": head_mask(crossfit, L, H)}
            sets.update({f"random{r}": head_mask(d, L, H) for r, d in enumerate(draws)})
            r = effects(
                pm,
                item.x,
                cf.x_cf,
                torch.arange(cf.at, len(item.x)),
                torch.arange(cf.at_cf, len(cf.x_cf)),
                list(item.positive),
                list(item.negative),
                torch.ones(L, H, dtype=torch.bool) if every_head else singles,
                sets,
                layers=every_head,
                every=True,
            )
            key = lambda t, item=item, cf=cf: (
                (t["item_id"] == item.item_id) & (t["counterfactual"] == cf.word)
            )
            heads, layers = screen["items"][key(screen["items"])], screen["layers"][key(screen["layers"])]
            totals = screen["totals"][key(screen["totals"])].iloc[0]
            for column in (
                "output_in",
                "output_out",
                "pattern_in",
                "attribution_output",
                "attribution_pattern",
            )[0 if every_head else 3 :]:
                got, want = heads[column].to_numpy(), r[column].reshape(-1).numpy()
                assert np.array_equal(np.isnan(got), np.isnan(want)), column
                worst = max(worst, np.nanmax(np.abs(got - want), initial=0.0))
            for column in ("attention_in", "attention_out", "mlp_in", "mlp_out") if every_head else ():
                worst = max(worst, np.abs(layers[column].to_numpy() - r[column].numpy()).max())
            for column in ("y", "y_cf", "te", "all_heads_in", "all_heads_out", "all_heads_pattern_in"):
                if np.isfinite(r[column]) and np.isfinite(totals[column]):
                    worst = max(worst, abs(totals[column] - r[column]))
            picked = chosen["items"][key(chosen["items"])]
            for column in ("output_in", "output_out", "pattern_in"):
                got, want = picked[column].to_numpy(), r[column][singles].numpy()
                worst = max(worst, np.nanmax(np.abs(got - want), initial=0.0))
            set_totals = chosen["totals"][key(chosen["totals"])].iloc[0]
            worst = max(
                worst,
                abs(set_totals["crossfit_in"] - r["crossfit_in"]),
                abs(set_totals["crossfit_out"] - r["crossfit_out"]),
                *(abs(set_totals[f"random_in_{k}"] - r[f"random{k}_in"]) for k in range(len(draws))),
            )
    assert worst <= tolerance, worst
    return worst


@pytest.mark.parametrize("name", INTERFACE_FAMILIES)
def test_batched_patching_equals_one_item_at_a_time(name):
    model = build_tiny(name, dtype=torch.float64)
    pm = SimpleNamespace(
        model=model,
        info=SimpleNamespace(
            n_layers=model.config.num_hidden_layers, n_heads=model.config.num_attention_heads
        ),
    )
    singles = torch.zeros(pm.info.n_layers, pm.info.n_heads, dtype=torch.bool)
    singles[-1, 1] = singles[-1, 3] = singles[0, 2] = (
        True  # layers skipped below the last, and none below the first
    )
    _compare(pm, _items(ITEMS), singles, 1e-10)


@pytest.mark.slow
def test_batched_patching_of_gender_items_equals_the_reference_in_float32(smollm):
    """Float32: batching changes the order of sums, as a different batch does in any forward pass."""
    from attnprobe.run.plan import encode_prompts
    from attnprobe.suite import load_suite

    suite = load_suite("probes/gender.yaml")
    prompts = [p for p in suite.prompts if p.template_id in ("said_would", "thanked_praised")]
    items, _ = suite.head_effects.items(
        smollm.tokenizer, encode_prompts(suite, prompts, smollm.tokenizer, None)
    )
    items = [next(i for i in items if i.template_id == t) for t in ("said_would", "thanked_praised")]
    singles = torch.zeros(smollm.info.n_layers, smollm.info.n_heads, dtype=torch.bool)
    singles[10, 6] = singles[25, 2] = singles[27, 5] = True
    assert len(items) == 2 and 0 < _compare(smollm, items, singles, 5e-5, every_head=False)
