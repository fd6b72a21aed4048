"""Activation patching on tiny random models: the machinery checked exactly and against plain HF eager."""

import numpy as np
import pytest
import torch
from conftest import build_tiny, eager_twin
from reference_patching import behaviour, decoder_layers, effects, mlp_modules

POS, NEG = 7, 11


def ids(seed, T=7):
    return torch.randint(3, 100, (T,), generator=torch.Generator().manual_seed(seed))


def pair(seed=0, slot_cf=3):
    """x = 3 prefix tokens, a 1-token slot, 3 suffix tokens; x' the same with a slot of `slot_cf`
    tokens. Returns x, x', and the aligned positions (the slot's last token and after) in each."""
    prefix, suffix = ids(seed, 3), ids(seed + 1, 3)
    x = torch.cat([prefix, ids(seed + 2, 1), suffix])
    x_cf = torch.cat([prefix, ids(seed + 3, slot_cf), suffix])
    return x, x_cf, torch.arange(3, len(x)), torch.arange(len(x_cf) - 4, len(x_cf))


def all_heads(L=2, H=4):
    return torch.ones(L, H, dtype=torch.bool)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2", "qwen3"])
def test_patching_x_into_itself_changes_nothing(family):
    model = build_tiny(family, dtype=torch.float64)
    x, _, at, _ = pair()
    result = effects(model, x, x.clone(), at, at, POS, NEG, all_heads())
    assert abs(result["te"]) <= 1e-12
    for key in (
        "output_in",
        "output_out",
        "pattern_in",
        "attention_in",
        "attention_out",
        "mlp_in",
        "mlp_out",
    ):
        assert result[key].abs().max() <= 1e-6, key
    assert abs(result["all_heads_in"]) <= 1e-6 and abs(result["all_heads_pattern_in"]) <= 1e-6
    assert (
        result["attribution_output"].abs().max() <= 1e-12
        and result["attribution_pattern"].abs().max() <= 1e-12
    )


def _attention_outputs(model, ids_, layers_, replace=None, at=None):
    """Run ids (T,) with forward hooks on every attention module: record each layer's output
    (after the output projection), or replace it at positions `at` by `replace[layer]`."""
    recorded = {}

    def hook(layer):
        def fn(module, args, output):
            out = output[0]
            if replace is not None and layer in replace:
                out = out.clone()
                out[:, at] = replace[layer]
                return (out, *output[1:])
            recorded[layer] = out.detach()

        return fn

    handles = [layer.self_attn.register_forward_hook(hook(i)) for i, layer in enumerate(layers_)]
    try:
        with torch.no_grad():
            logits = model(input_ids=ids_[None]).logits[0, -1]
    finally:
        for h in handles:
            h.remove()
    return behaviour(logits, POS, NEG).item(), recorded


@pytest.mark.parametrize(
    "slot_cf", [1, 3]
)  # x' of the same length, and two tokens longer (aligned from the end)
def test_patching_every_head_output_equals_patching_the_attention_layer_outputs(slot_cf):
    model = build_tiny("llama", dtype=torch.float64)
    x, x_cf, at, at_cf = pair(slot_cf=slot_cf)
    result = effects(model, x, x_cf, at, at_cf, POS, NEG, all_heads())
    layers_ = decoder_layers(model)
    y, _ = _attention_outputs(model, x, layers_)
    y_cf, donor = _attention_outputs(model, x_cf, layers_)
    assert abs(y - result["y"]) <= 1e-6 and abs(y_cf - result["y_cf"]) <= 1e-6
    every, _ = _attention_outputs(model, x, layers_, {l: donor[l][:, at_cf] for l in range(2)}, at)
    assert abs((every - y) - result["all_heads_in"]) <= 1e-5
    for layer in range(2):  # one layer's attention output alone
        one, _ = _attention_outputs(model, x, layers_, {layer: donor[layer][:, at_cf]}, at)
        assert abs((one - y) - result["attention_in"][layer].item()) <= 1e-5
    assert abs(result["all_heads_in"]) > 1e-3  # a real effect, not zeros agreeing with zeros
    if slot_cf != 1:
        assert result["pattern_in"].isnan().all()  # the pattern channel needs equal lengths


def test_head_output_patching_agrees_with_plain_hf_eager_hooks():
    """An independent implementation: transformers' eager attention, and a pre-hook on each layer's
    output projection that overwrites one head's slice of its input (the per-head context)."""
    model = build_tiny("qwen2")
    twin = eager_twin(model)
    x, x_cf, at, at_cf = pair(seed=4, slot_cf=2)
    result = effects(model, x, x_cf, at, at_cf, POS, NEG, all_heads())
    D = 8

    def run(ids_, replace=None):
        recorded = {}

        def hook(layer):
            def fn(module, args):
                (z,) = args  # (1, T, H * D)
                if replace is None:
                    recorded[layer] = z.detach().clone()
                    return None
                if layer not in replace:
                    return None
                head, values, where = replace[layer]
                z = z.clone()
                z[:, where, head * D : (head + 1) * D] = values
                return (z,)

            return fn

        handles = [
            layer.self_attn.o_proj.register_forward_pre_hook(hook(i))
            for i, layer in enumerate(decoder_layers(twin))
        ]
        try:
            with torch.no_grad():
                y = behaviour(twin(input_ids=ids_[None]).logits[0, -1], POS, NEG).item()
        finally:
            for h in handles:
                h.remove()
        return y, recorded

    y, own = run(x)
    y_cf, donor = run(x_cf)
    for layer in range(2):
        for head in range(4):
            sl = slice(head * D, (head + 1) * D)
            patched_in, _ = run(x, {layer: (head, donor[layer][:, at_cf, sl], at)})
            patched_out, _ = run(x_cf, {layer: (head, own[layer][:, at, sl], at_cf)})
            assert abs((patched_in - y) - result["output_in"][layer, head].item()) <= 1e-5
            assert abs((y_cf - patched_out) - result["output_out"][layer, head].item()) <= 1e-5
    assert result["output_in"].abs().max() > 1e-3


def _linear_in_last_layer(model):
    """y becomes linear in the last layer's head outputs: no final norm, no last MLP (and y, a
    difference of two log-probabilities of single tokens, is a logit difference)."""
    model.model.norm = torch.nn.Identity()
    torch.nn.init.zeros_(mlp_modules(model)[-1].down_proj.weight)
    return model


def test_joint_patch_equals_the_sum_of_singles_where_the_model_is_linear_in_the_set():
    model = _linear_in_last_layer(build_tiny("llama", dtype=torch.float64))
    x, x_cf, at, at_cf = pair(seed=5)
    last, first = torch.zeros(2, 4, dtype=torch.bool), torch.zeros(2, 4, dtype=torch.bool)
    last[1], first[0] = True, True
    result = effects(model, x, x_cf, at, at_cf, POS, NEG, all_heads(), sets={"last": last, "first": first})
    assert abs(result["last_in"] - result["output_in"][1].sum().item()) <= 1e-9
    assert abs(result["last_out"] - result["output_out"][1].sum().item()) <= 1e-9
    # attribution is exact where y is linear in the head output
    assert (result["attribution_output"][1] - result["output_in"][1]).abs().max() <= 1e-9
    # the first layer feeds a nonlinear network: there the joint effect is not the sum
    assert abs(result["first_in"] - result["output_in"][0].sum().item()) > 1e-4


def test_mlp_patch_equals_hooking_the_mlp_output():
    model = build_tiny("gemma3", dtype=torch.float64)
    x, x_cf, at, at_cf = pair(seed=6, slot_cf=2)
    result = effects(model, x, x_cf, at, at_cf, POS, NEG, torch.zeros(2, 4, dtype=torch.bool))
    mlp = mlp_modules(model)[0]
    donor = {}
    handle = mlp.register_forward_hook(lambda m, a, out: donor.setdefault("out", out.detach()))
    with torch.no_grad():
        model(input_ids=x_cf[None])
    handle.remove()

    def replace(module, args, out):
        out = out.clone()
        out[:, at] = donor["out"][:, at_cf]
        return out

    handle = mlp.register_forward_hook(replace)
    with torch.no_grad():
        patched = behaviour(model(input_ids=x[None]).logits[0, -1], POS, NEG).item()
    handle.remove()
    assert (
        abs((patched - result["y"]) - result["mlp_in"][0].item()) <= 1e-6 and abs(result["mlp_in"][0]) > 1e-4
    )
    assert result["output_in"].isnan().all()  # no singles asked for


def test_behaviour_adds_the_probabilities_of_a_set():
    logits = torch.randn(50, dtype=torch.float64)
    p = torch.softmax(logits, -1)
    expected = torch.log(p[3]) - torch.log(p[4] + p[9])
    assert abs(behaviour(logits, 3, [4, 9]) - expected) <= 1e-12


@pytest.mark.slow
def test_run_with_head_effects_end_to_end(smollm, tmp_path):
    import textwrap

    import pandas as pd

    import attnprobe
    from attnprobe.report import write_report

    suite = tmp_path / "effects.yaml"
    suite.write_text(
        textwrap.dedent("""\
        name: effects
        contrast: pronoun
        slots:
          occupation:
            values: [{value: nurse, bls: 90}, {value: engineer, bls: 15}, {value: electrician, bls: 2}]
          pronoun:
            forms: [nom]
            values: [{label: female, nom: she}, {label: male, nom: he}]
        templates:
          - {id: said, text: "The {occupation} said that {pronoun.nom} left."}
        attention:
          - {source: pronoun, targets: occupation}
        next_token:
          - {cut: pronoun, candidates: pronoun}
        head_effects:
          cut: pronoun
          counterfactual: {occupation: [woman, man]}
          select: 3
        analysis: {contrast: pronoun, positive: female, negative: male, covariate: occupation.bls}
        """)
    )
    run = attnprobe.run_suite(suite, model=smollm, out=tmp_path / "run", progress=False, log=lambda m: None)
    info = run.manifest.entry("head_effects")
    assert (
        info["n_items"] == 3 and info["n_pairs"] == 6 and not info["dropped"]
    )  # electrician: 2 tokens, aligned
    assert (info["positive"], info["negative"]) == ("female", "male")  # from the analysis
    totals = pd.read_csv(run.directory / "head_effects_totals.csv").set_index(["item_id", "counterfactual"])
    tok = smollm.tokenizer
    she, he = tok(" she")["input_ids"][0], tok(" he")["input_ids"][0]
    for (_item, word), row in totals.iterrows():
        for text, column in ((f"The {row['occupation']} said that", "y"), (f"The {word} said that", "y_cf")):
            with torch.no_grad():
                logits = smollm.model(input_ids=tok(text, return_tensors="pt")["input_ids"]).logits[0, -1]
            assert abs(behaviour(logits, she, he).item() - row[column]) <= 1e-4
    assert (totals["n_tokens"] != totals["n_tokens_cf"]).sum() == 2  # electrician -> woman, man
    assert (totals["all_heads_in"] - totals["te"]).abs().max() <= 1e-4  # every path runs through some head
    assert totals["crossfit_heads"].str.count("L").eq(3).all()
    items = pd.read_parquet(run.directory / "head_effects_items.parquet")
    assert (
        len(items) == 6 * 30 * 9
        and items[["output_in", "output_out", "attribution_output"]].notna().all().all()
    )
    assert items["pattern_in"].isna().sum() == 2 * 270  # the two aligned pairs have no pattern channel
    layers = pd.read_parquet(run.directory / "head_effects_layers.parquet")
    assert len(layers) == 6 * 30 and layers[["attention_in", "mlp_out"]].notna().all().all()
    # a completed re-run (make demo twice) keeps the head effects and their summary, recomputing nothing
    before = (run.directory / "head_effects_items.parquet").stat().st_mtime_ns
    again = attnprobe.run_suite(suite, model=smollm, out=tmp_path / "run", progress=False, log=lambda m: None)
    assert (
        again.manifest.entry("head_effects") == info
        and (run.directory / "head_effects_items.parquet").stat().st_mtime_ns == before
    )
    html = write_report(run.directory).read_text()
    assert "activation patching" in html and 'occupation &rarr; "man"' in html
    summary = pd.read_csv(run.directory / "head_effects_summary.csv").set_index("counterfactual")
    assert list(summary.index) == ["woman", "man"] and (summary["share_all_heads_in"] - 1).abs().max() <= 1e-4
    assert summary["spearman_attribution_exact"].between(-1, 1).all() and (
        summary["te_mean"]["woman"] > 0 > summary["te_mean"]["man"]
    )
    # the stereotype gradient: TE's slope on the covariate, all heads carry all of it (by construction)
    te = totals.reset_index().groupby(["counterfactual", "occupation"])["te"].mean()
    for word in ("woman", "man"):
        slope = np.polyfit([2.0, 15.0, 90.0], te[word][["electrician", "engineer", "nurse"]].to_numpy(), 1)[0]
        assert summary.loc[word, "te_gradient_per10"] == pytest.approx(10 * slope, abs=1e-9)
    assert (summary["gradient_share_all_heads_in"] - 1).abs().max() <= 1e-4
    # the cross-fitted set against 20 random sets of its layers, on every 4th item (here the first)
    assert (summary["n_random_items"] == 1).all() and summary["share_crossfit_random_p"].between(
        1 / 21, 1
    ).all()
    heads = pd.read_csv(run.directory / "head_effects.csv").set_index("counterfactual")
    # natural direct effect = TE - patched-out effect, per head
    direct = heads["mean_direct"] + heads["mean_output_out"] - summary["te_mean"].reindex(heads.index)
    assert direct.abs().max() <= 1e-9 and heads["gradient_share_output_in"].notna().all()
    shares = pd.read_csv(run.directory / "head_effects_layer_shares.csv")
    # attention, mlp x in, out, attribution; a share's CI inverts its numerator's test: on 3
    # occupations most denominators cannot be told from 0, and those intervals are unbounded or none
    defined = shares["ci_low"].notna()
    assert len(shares) == 2 * 30 * 6 and shares.loc[defined, "ci_low"].le(shares.loc[defined, "share"]).all()
    both = defined & shares["search_ci_low"].notna()  # the search's wider level: a wider interval
    assert shares["gradient_share"].notna().all()
    assert shares.loc[both, "search_ci_low"].le(shares.loc[both, "ci_low"] + 1e-12).all()
    # a layer's attention attribution is the sum of its heads'
    per_head = items.groupby(["item_id", "counterfactual", "layer"])["attribution_output"].sum()
    assert (
        layers.set_index(["item_id", "counterfactual", "layer"])["attention_attribution"] - per_head
    ).abs().max() <= 1e-9
