"""Head interventions on tiny random models: the machinery checked exactly."""

import pytest
import torch

from attnprobe.capture import editing, run_with_capture
from attnprobe.interventions import PatternSwap, ZeroAblation, attribution, behaviour, head_means, item_effects, one_hot_heads

from conftest import build_tiny

POS, NEG = 7, 11


def ids(seed, T=7):
    return torch.randint(3, 100, (T,), generator=torch.Generator().manual_seed(seed))


def last_logits(model, x, editor=None):
    mask = torch.ones(x.shape, dtype=torch.long)
    if editor is None:
        return run_with_capture(model, x, mask, layers=[], logit_positions=torch.tensor([x.shape[1] - 1])).logits[:, 0]
    with editing(editor):
        return run_with_capture(model, x, mask, layers=[], logit_positions=torch.tensor([x.shape[1] - 1])).logits[:, 0]


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_patching_a_head_with_its_own_pattern_changes_nothing(family):
    model = build_tiny(family, dtype=torch.float64)
    x = ids(0)
    effects = item_effects(model, x, x.clone(), POS, NEG, 2, 4, means=None)
    assert abs(effects["te"]) <= 1e-12  # x and x' run as two rows of one batch
    assert effects["pattern"].abs().max() <= 1e-6
    assert effects["attribution"].abs().max() <= 1e-12  # A' - A = 0


def test_ablating_every_head_of_the_last_layer_equals_zeroing_its_attention_output():
    model = build_tiny("llama")
    x = ids(1)[None]
    heads = torch.zeros(1, 2, 4, dtype=torch.bool)
    heads[0, 1] = True  # every head of layer 1 (the last)
    ablated = last_logits(model, x, ZeroAblation(heads))
    attention = model.model.layers[1].self_attn
    handle = attention.register_forward_hook(lambda module, args, output: (torch.zeros_like(output[0]), output[1]))
    try:
        zeroed = last_logits(model, x)
    finally:
        handle.remove()
    assert (ablated - zeroed).abs().max() <= 1e-5
    assert (ablated - last_logits(model, x)).abs().max() > 1e-3  # the ablation did something


def test_mean_ablation_uses_the_suite_mean():
    model = build_tiny("qwen2", dtype=torch.float64)
    prompts = [ids(s) for s in range(3)]
    means = head_means(model, prompts, 2)
    assert means[0].shape == (4, 8)
    # with one prompt of one token, a head's mean output is that token's output: replacing it changes nothing
    single = [ids(5, T=1)]
    effects = item_effects(model, single[0], single[0].clone(), POS, NEG, 2, 4, means=head_means(model, single, 2))
    assert effects["mean"].abs().max() <= 1e-9


def test_attribution_matches_finite_differences():
    model = build_tiny("llama", dtype=torch.float64)
    x, x_cf = ids(2), ids(3)
    donor = run_with_capture(model, x_cf[None], torch.ones(1, 7, dtype=torch.long)).weights
    estimate = attribution(model, x, donor, POS, NEG, 2)  # (L, H)
    heads = one_hot_heads(2, 4)
    batch = x[None].expand(len(heads), -1)
    # central differences along A + eps (A' - A). transformers' RMSNorm runs in float32 even in a
    # float64 model, so y carries ~1e-7 noise: eps = 1e-3 keeps that and the O(eps^2) error near 1e-5.
    eps = 1e-3
    up = behaviour(last_logits(model, batch, PatternSwap(heads, donor=donor, alpha=eps)), POS, NEG)
    down = behaviour(last_logits(model, batch, PatternSwap(heads, donor=donor, alpha=-eps)), POS, NEG)
    finite = ((up[1:] - down[1:]) / (2 * eps)).view(2, 4)
    assert (finite - estimate).abs().max() <= 1e-3 * estimate.abs().max()
    assert estimate.abs().max() > 1e-3  # a real signal, not zeros agreeing with zeros


def test_top_k_patches_only_the_heads_attribution_ranks_first():
    model = build_tiny("llama", dtype=torch.float64)
    effects = item_effects(model, ids(2), ids(3), POS, NEG, 2, 4, means=None, top_k=3)
    computed = ~torch.isnan(effects["pattern"])
    assert computed.sum() == 3
    top = effects["attribution"].abs().flatten().topk(3).indices
    assert set(computed.flatten().nonzero().flatten().tolist()) == set(top.tolist())
    full = item_effects(model, ids(2), ids(3), POS, NEG, 2, 4, means=None)
    assert torch.allclose(effects["pattern"][computed], full["pattern"][computed], atol=1e-9)


@pytest.mark.slow
def test_run_with_head_effects_end_to_end(smollm, tmp_path):
    import textwrap

    import pandas as pd

    import attnprobe
    from attnprobe.report import write_report

    suite = tmp_path / "effects.yaml"
    suite.write_text(textwrap.dedent("""\
        name: effects
        contrast: pronoun
        slots:
          occupation: [nurse, engineer, teacher, electrician]
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
          positive: female
          negative: male
          counterfactual: {occupation: woman}
        """))
    run = attnprobe.run_suite(suite, model=smollm, out=tmp_path / "run", progress=False, log=lambda m: None)
    info = run.manifest["head_effects"]
    assert info["n_items"] + len(info["dropped"]) == 4 and info["n_items"] >= 2
    assert all("tokens but x'" in line for line in info["dropped"])  # named, with the reason
    totals = pd.read_csv(run.directory / "head_effects_totals.csv").set_index("item_id")
    item = totals.index[0]
    occupation = totals.loc[item, "occupation"]
    tok = smollm.tokenizer
    she, he = tok(" she")["input_ids"][0], tok(" he")["input_ids"][0]
    for text, column in ((f"The {occupation} said that", "y"), ("The woman said that", "y_cf")):
        with torch.no_grad():
            logits = smollm.model(input_ids=tok(text, return_tensors="pt")["input_ids"]).logits[0, -1]
        assert abs(behaviour(logits, she, he).item() - totals.loc[item, column]) <= 1e-4
    items = pd.read_parquet(run.directory / "head_effects_items.parquet")
    assert len(items) == info["n_items"] * 30 * 9 and items[["pattern", "zero", "mean", "attribution"]].notna().all().all()
    # a completed re-run (make demo twice) keeps the head effects and their summary, recomputing nothing
    before = (run.directory / "head_effects_items.parquet").stat().st_mtime_ns
    again = attnprobe.run_suite(suite, model=smollm, out=tmp_path / "run", progress=False, log=lambda m: None)
    assert again.manifest["head_effects"] == info and (run.directory / "head_effects_items.parquet").stat().st_mtime_ns == before
    html = write_report(run.directory).read_text()
    assert "Head interventions" in html and "of it;" in html
    summary = pd.read_csv(run.directory / "head_effects_summary.csv").iloc[0]
    assert -1 <= summary["spearman_attribution_exact"] <= 1 and summary["top_heads"].count("L") == 5
