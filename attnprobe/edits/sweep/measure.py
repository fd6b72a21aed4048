"""`attnprobe edit RUN_DIR`: edit the heads a run found (by default k = 1, 5), and measure on items
that did not choose them the bias removed against what it costs.

Heads. Each item belongs to a fold (unit half x template half, intervene/selection.py). For the
items of a fold, the k heads are the k with the largest share of the stereotype gradient on the
opposite fold: per head, the least-squares slope over the covariate of its attribution (patch-in
estimate, from the run's screen) for the reference counterfactual word ("person" in the gender
suite), signed like that word's total-effect slope. So no item tests heads chosen on its own
occupation or template. Edit parameters (reference means, resample bank, projection directions)
are estimated on the same opposite fold. `--heads L26H2,...` edits the listed heads on every item.

Measured per edit kind and k (raw values in edits_items.parquet; statistics in stats/edits.py):
- bias: y = log p(positive) - log p(negative) at the cut of every head-effects item, before and after;
- control: y on the shipped definitional prompts (probes/edits/definitional.tsv), before and after;
- cost: KL(original || edited) over text the original model writes from neutral openings (seeded),
  and with `--text FILE` the log-loss of that file's tokens, before and after;
- chance: `draws` distinct random sets of other heads of the same layers as the heads chosen on all
  items, made up from every other head of the model where the layers hold fewer sets (null_sets),
  edited on every RANDOM_EVERY-th item (the found heads' values on those items are the comparison) and on the
  texts (their cost: the random band of the frontier figure).
Control, cost and chance use the heads (and parameters) chosen on all items.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter

import numpy as np
import pandas as pd
import torch

from ...heads import HeadSet
from ...intervene.selection import chosen_heads
from ...intervene.sites import behaviour_rows
from ...stats.edits import SINGLE
from ..estimate import last_outputs
from ..inputs import Inputs
from ..kinds import Heads, Zero
from ..passes import Variants, edited_behaviour, edited_text_costs, raw_rows
from ..sequential import HeadFit
from .erased import readout_rows
from .options import EditOptions

RANDOM_EVERY = 4  # random head sets are edited on every 4th item
RANDOM_TEXTS = 8  # and their cost measured on the first 8 texts (the found heads': on every text)


class GradientScores:
    """Per head (flat l H + h): the slope over the covariate of its attribution for `word`, signed
    like the slope of that word's total effect (positive: the head carries the stereotype gradient).
    The items x heads attributions are pivoted once; `of(covariate, items)` scores any covariate
    (the real one or a permutation) on any subset of the items."""

    def __init__(self, head_items: pd.DataFrame, totals: pd.DataFrame, word: str, L: int, H: int):
        rows = head_items[head_items["counterfactual"] == word]
        wide = rows.pivot_table(index="item_id", columns=["layer", "head"], values="attribution_output")
        wide = wide.reindex(columns=pd.MultiIndex.from_product([range(L), range(H)]))
        self.items, self.values = wide.index, wide.to_numpy()  # (items, L H)
        te = totals[totals["counterfactual"] == word].set_index("item_id")["te"]
        self.te = te.reindex(wide.index).to_numpy()

    def of(self, covariate: dict, items=None) -> np.ndarray:
        """The scores on `items` (item ids; None: every item), each item's covariate from `covariate`."""
        keep = np.ones(len(self.items), bool) if items is None else self.items.isin(items)
        values, te = self.values[keep], self.te[keep]
        x = np.array([covariate[i] for i in self.items[keep]], dtype=float)
        xc = x - x.mean()
        if not len(x) or (xc**2).sum() == 0:
            return np.full(values.shape[1], np.nan)
        slopes = np.nansum(xc[:, None] * (values - np.nanmean(values, 0)), 0) / (xc**2).sum()
        sign = np.sign(np.nansum(xc * (te - np.nanmean(te)))) or 1.0
        return sign * slopes


def found_sets(
    inputs: Inputs, scores: dict, ks: tuple[int, ...], listed: Heads | None, n_heads: int
) -> dict[int, dict]:
    """k -> {fold: heads}: for folds 0-3 the top k of scores[fold] (computed on the fold's
    training folds), for "all" of scores["all"] (every item)."""
    if listed is not None:
        return {len(listed): {f: listed for f in (0, 1, 2, 3, "all")}}
    out = {}
    for k in ks:
        sets = {f: chosen_heads(scores[f], k, n_heads) for f in range(4)}
        sets["all"] = chosen_heads(scores["all"], k, n_heads)
        out[k] = sets
    return out


def null_sets(heads: Heads, n_layers: int, n_heads: int, rng, draws: int) -> list[Heads]:
    """`draws` different random head sets to edit instead of `heads`: sets of other heads of the same
    layers, layer for layer (all of them when there are at most `draws`, as for one head of a 9-head
    layer: 8), then, to make up the number, sets of as many heads drawn from every head of the model
    but `heads` (of every head where fewer are left: k above half the model). All distinct, so the
    null's p floor is 1 / (1 + draws) (stats.edits)."""
    if not heads or not draws:
        return []
    per_layer = Counter(layer for layer, _ in heads)
    pools = {
        layer: [h for h in range(n_heads) if (layer, h) not in heads]
        if n_heads - c >= c
        else list(range(n_heads))
        for layer, c in per_layer.items()
    }
    same = math.prod(math.comb(len(pool), per_layer[layer]) for layer, pool in pools.items())
    found: list[Heads] = []
    own = tuple(sorted(heads))
    if same <= draws:  # every set of the same layers, then sets from every head
        for combo in itertools.product(*(itertools.combinations(pools[l], per_layer[l]) for l in pools)):
            draw = tuple(sorted((l, h) for l, hs in zip(pools, combo) for h in hs))
            if draw != own:
                found.append(draw)
    everyone = [(l, h) for l in range(n_layers) for h in range(n_heads) if (l, h) not in heads]
    if len(everyone) < len(heads):  # k above half the model: sets of any heads but the found set
        everyone = [(l, h) for l in range(n_layers) for h in range(n_heads)]
    seen, attempts = set(found), 0
    while len(found) < draws and attempts < 100 * draws:  # a tiny model may have fewer sets
        attempts += 1
        if same > draws:
            draw = tuple(
                sorted((l, int(h)) for l in pools for h in rng.choice(pools[l], per_layer[l], replace=False))
            )
        else:
            picked = rng.choice(len(everyone), len(heads), replace=False)
            draw = tuple(sorted(everyone[i] for i in picked))
        if draw not in seen and draw != own:
            seen.add(draw)
            found.append(draw)
    return found


def measure_kind(
    model, fit: HeadFit, options: EditOptions, inputs: Inputs, sets: dict, n_heads: int, log=lambda m: None
) -> pd.DataFrame:
    """Raw values of one edit kind (`fit`'s: KIND, or KIND-seq fitted in order, edits.sequential),
    every k: rows (target, k, draw, index, y, kl, loss); draw -1 is the found heads, 0... the random
    sets (none for a kind fitted in order: each set would need fits of its own)."""
    started = time.monotonic()
    L, H, kind = model.info.n_layers, n_heads, fit.name
    rng = np.random.default_rng(options.seed)
    frames, ks = [], list(sets)
    draws = 0 if fit.sequential else options.draws
    random_by_k = {k: null_sets(per_fold["all"], L, H, rng, draws) for k, per_fold in sets.items()}
    sampled = np.arange(len(inputs.items)) % RANDOM_EVERY == 0
    # bias: per quarter f and k, its found heads on its items and the random sets on its sampled items,
    # edited with the parameters of its training quarters (edits[f, k]); all in one call
    edits = {(f, k): fit(inputs, inputs.training(f), sets[k][f]) for f in range(4) for k in ks}
    base, masks, keys, which, slot = [], [], [], [], {key: i for i, key in enumerate(edits)}
    for f in range(4):
        for k, per_fold in sets.items():
            for index in np.flatnonzero(inputs.fold == f):
                drawn = random_by_k[k] if sampled[index] else []
                for r, heads in [(-1, per_fold[f]), *enumerate(drawn)]:
                    base.append(index), masks.append(HeadSet(heads).mask(L, H)), keys.append((k, r, index))
                    which.append(slot[f, k])
    if base:  # a variant's edit is its item's quarter's
        y = behaviour_values(model, inputs.bank, tuple(edits.values()), base, masks, inputs.labels, which)
        frames.append(raw_rows("bias", keys, y=y))
        frames += readout_rows(last_outputs(inputs.bank), inputs, edits, sets)
        log(f"edit: {kind}, bias items of the 4 quarters ({time.monotonic() - started:.0f} s)")
    everywhere = {k: fit(inputs, np.arange(4), per_fold["all"]) for k, per_fold in sets.items()}
    for target, bank in (("control", inputs.control), ("text", inputs.texts)):
        base, masks, keys, of_k = [], [], [], []
        for i, (k, per_fold) in enumerate(sets.items()):
            random = enumerate(random_by_k[k]) if target == "text" else ()  # the band's cost, not its control
            for r, heads in [(-1, per_fold["all"]), *random]:
                n = len(bank.lengths) if r < 0 else min(RANDOM_TEXTS, len(bank.lengths))
                for index in range(n):
                    base.append(index), masks.append(HeadSet(heads).mask(L, H)), keys.append((k, r, index))
                    of_k.append(i)
        if target == "control":  # each prompt's edit kept a direction fitted on the other half's words
            other = inputs.other_half()
            crossed = tuple(e for k in ks for e in (everywhere[k], fit(other, np.arange(4), sets[k]["all"])))
            which = 2 * np.array(of_k, dtype=int) + inputs.judged_by_other_half()[base]
            y = behaviour_values(model, bank, crossed, base, masks, inputs.control_labels, which)
            frames.append(raw_rows(target, keys, y=y))
        else:
            costs = edited_text_costs(
                model, bank, inputs.clean_logp, tuple(everywhere.values()), torch.stack(masks), base, of_k
            )
            frames.append(raw_rows(target, keys, kl=costs[0].cpu().numpy(), loss=costs[1].cpu().numpy()))
        log(f"edit: {kind}, {target} ({time.monotonic() - started:.0f} s)")
    out = pd.concat(frames, ignore_index=True)
    heads_text = {k: " | ".join(str(HeadSet(per_fold[f])) for f in range(4)) for k, per_fold in sets.items()}
    out["heads"] = [
        heads_text[k] if r < 0 else str(HeadSet(random_by_k[k][r])) for k, r in zip(out["k"], out["draw"])
    ]
    out["heads_all"] = [str(HeadSet(sets[k]["all"])) for k in out["k"]]
    return out.assign(kind=kind)


def behaviour_values(model, bank, edit, base, masks, labels: torch.Tensor, which=None) -> np.ndarray:
    """y of each variant (a sequence of `bank` and its head mask) with its sequence's labels;
    `which` names each variant's edit where `edit` is a tuple."""
    base = torch.as_tensor(base)
    pos, neg = labels[base, 0], labels[base, 1]
    which = None if which is None else torch.as_tensor(which)
    variants = Variants(bank, edit, base, torch.stack(masks), which)
    return edited_behaviour(model, variants, pos, neg).cpu().numpy()


def clean_values(model, inputs: Inputs) -> pd.DataFrame:
    """The unedited values (k 0): y of the items and the control prompts, the texts' log-loss."""
    n, m = len(inputs.items), len(inputs.control.lengths)
    y = behaviour_rows(inputs.bank.logits, inputs.labels[:, 0], inputs.labels[:, 1])
    y_control = behaviour_rows(
        inputs.control.logits, inputs.control_labels[:, 0], inputs.control_labels[:, 1]
    )
    loss = [
        -logp.gather(1, inputs.texts.ids[t, 1 : len(logp) + 1, None]).mean().item()
        for t, logp in enumerate(inputs.clean_logp)
    ]
    frames = [
        raw_rows("bias", [(0, -1, i) for i in range(n)], y=y.double().cpu().numpy()),
        raw_rows("control", [(0, -1, i) for i in range(m)], y=y_control.double().cpu().numpy()),
        raw_rows("text", [(0, -1, i) for i in range(len(loss))], kl=0.0, loss=np.array(loss)),
    ]
    return pd.concat(frames, ignore_index=True).assign(kind="none", heads="", heads_all="")


# Each of the sweep's top heads zeroed alone on every item, control prompt and text: what one head
# carries of the stereotype gradient, of the definitional gap and their difference (specificity),
# each with its CI, and its KL cost (edits_heads.csv, the statistics of stats.edits.edit_tables with
# one row per head).
#
# The heads are the TOP with the largest gradient score on all items (the ranking the sweep's sets
# are drawn from), measured on those same items: the first rows carry the winner's curse of being
# ranked first (the sweep's cross-fitted k = 1 row is the selection-free estimate for a top head).
# The raw rows are those of an edit kind named "single", k = the head's rank, so the sweep's
# statistics and resume apply unchanged.
TOP = 10


def ranked_heads(scores: np.ndarray, n_heads: int, top: int = TOP) -> list[tuple[int, int]]:
    """The `top` heads with the largest finite scores (flat l H + h), largest first."""
    order = np.argsort(-np.where(np.isfinite(scores), scores, -np.inf), kind="stable")
    return [(int(i) // n_heads, int(i) % n_heads) for i in order[:top] if np.isfinite(scores[i])]


def measure_single(
    model, inputs, scores: np.ndarray, n_heads: int, top: int = TOP, log=lambda m: None
) -> pd.DataFrame:
    """Raw values (as sweep.measure_kind's) of each of the `top` heads zeroed alone: bias on every
    item, control on every prompt, KL and loss on every text."""
    L = model.info.n_layers
    heads = ranked_heads(scores, n_heads, top)
    if not heads:
        columns = ["target", "k", "draw", "index", "y", "kl", "loss", "heads", "heads_all", "kind"]
        return pd.DataFrame(columns=columns)
    frames = []
    for target, bank in (("bias", inputs.bank), ("control", inputs.control), ("text", inputs.texts)):
        n = len(bank.lengths)
        base = [index for _ in heads for index in range(n)]
        masks = [HeadSet((head,)).mask(L, n_heads) for head in heads for _ in range(n)]
        keys = [(rank, -1, index) for rank in range(1, len(heads) + 1) for index in range(n)]
        if target == "text":
            kl, loss = edited_text_costs(model, bank, inputs.clean_logp, Zero(), torch.stack(masks))
            frames.append(raw_rows(target, keys, kl=kl.cpu().numpy(), loss=loss.cpu().numpy()))
        else:
            labels = inputs.labels if target == "bias" else inputs.control_labels
            frames.append(
                raw_rows(target, keys, y=behaviour_values(model, bank, Zero(), base, masks, labels))
            )
        log(f"edit: each of the top {len(heads)} heads alone, {target}")
    out = pd.concat(frames, ignore_index=True)
    out["heads"] = out["heads_all"] = [str(HeadSet((heads[k - 1],))) for k in out["k"]]
    return out.assign(kind=SINGLE)
