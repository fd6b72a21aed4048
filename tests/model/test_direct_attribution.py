"""Direct attribution on tiny models: the parts add up to the logit difference, y is the model's own
logit difference, and each head's part equals an independent computation through its output
projection (other heads zeroed, the final norm's scale frozen by hand)."""

import pytest
import torch
import transformers as T
from conftest import EFFECT_SUITE, INTERFACE_FAMILIES, build_tiny

from attnprobe.measures.direct_attribution import PREDICTION
from attnprobe.measures.direct_attribution.compute import attribute
from attnprobe.model import load_model
from attnprobe.run import RunOptions, run_suite
from attnprobe.run.files.reader import RunFiles

SUITE = EFFECT_SUITE.replace("head_effects:", "direct_attribution: {cut: pronoun}\n# head_effects:")
CONFIGS = {
    "llama-gqa (RMSNorm, no biases)": lambda V: T.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "gpt2 (LayerNorm, Conv1D, biases)": lambda V: T.GPT2Config(vocab_size=V, n_embd=32, n_layer=3, n_head=4),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, smollm_tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("dla")
    torch.manual_seed(1)
    model = T.AutoModelForCausalLM.from_config(CONFIGS[request.param](len(smollm_tokenizer)))
    with torch.no_grad():  # a final norm with a real gain and bias, so freezing it is tested
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "ln_f.weight")):
                p.uniform_(0.5, 1.5)
            if name.endswith("ln_f.bias"):
                p.uniform_(-0.2, 0.2)
    model.save_pretrained(folder)
    smollm_tokenizer.save_pretrained(folder)
    return load_model(str(folder))


def _head_directly(pm, ids, t, layer, head, d):
    """Head `head` of `layer` at position t through its output projection alone (its slot of the
    projection's input kept, the others zeroed, no bias), then the final norm with its scale frozen."""
    model = pm.model
    projection = [
        m
        for n, m in model.named_modules()
        if n.endswith((f"layers.{layer}.self_attn.o_proj", f"h.{layer}.attn.c_proj"))
    ][0]
    norm = [m for n, m in model.named_modules() if n.endswith(("model.norm", "transformer.ln_f"))][0]
    seen = {}
    h1 = projection.register_forward_pre_hook(lambda m, a: seen.update(z=a[0][0, t].detach().clone()))
    h2 = norm.register_forward_pre_hook(lambda m, a: seen.update(x=a[0][0, t].detach().clone()))
    with torch.no_grad():
        model(input_ids=torch.tensor([ids[: t + 1]]))
    h1.remove(), h2.remove()
    D = seen["z"].numel() // 4
    z = torch.zeros_like(seen["z"])
    z[head * D : (head + 1) * D] = seen["z"][head * D : (head + 1) * D]
    with torch.no_grad():
        c = projection(z[None])[0] - projection(torch.zeros_like(z)[None])[0]
        x = seen["x"]
        if isinstance(norm, torch.nn.LayerNorm):
            scale = norm.weight / torch.sqrt(x.var(unbiased=False) + norm.eps)
            return float(((c - c.mean()) * scale * d).sum())
        rms = torch.sqrt((x**2).mean() + norm.variance_epsilon)
        return float((c * norm.weight / rms * d).sum())


def test_parts_add_up_and_heads_match_an_independent_path(tiny):
    pm = tiny
    text = "The nurse said that she left."
    ids = pm.tokenizer(text)["input_ids"]
    t = len(pm.tokenizer("The nurse said that")["input_ids"]) - 1
    she, he = (
        pm.tokenizer(" she", add_special_tokens=False)["input_ids"][0],
        pm.tokenizer(" he", add_special_tokens=False)["input_ids"][0],
    )
    classes = ["other"] * (t + 1)
    classes[1], classes[t] = "occupation", PREDICTION
    (result,) = attribute(pm, [ids], [t], [([she], [he])], [classes])
    with torch.no_grad():
        logits = pm.model(input_ids=torch.tensor([ids[: t + 1]])).logits[0, t]
    assert result["y"] == pytest.approx(float(logits[she] - logits[he]), abs=1e-4)
    assert abs(result["error"]) < 1e-4 * max(1.0, abs(result["y"]))
    W = pm.model.get_output_embeddings().weight
    d = (W[she] - W[he]).float()
    for layer in range(3):
        for head in range(4):
            ours = sum(v for (l_, h_, _), v in result["parts"].items() if l_ == layer and h_ == head)
            assert ours == pytest.approx(_head_directly(pm, ids, t, layer, head, d), abs=1e-5)
    # a wrong frozen scale would show: doubling one head's part breaks the sum
    broken = dict(result["parts"])
    broken[(0, 0, "occupation")] += 1.0
    assert abs(result["y"] - sum(broken.values())) > 0.5


def test_the_measure_runs_and_its_statistics_read_back(tiny, tmp_path):
    (tmp_path / "s.yaml").write_text(SUITE)
    out = run_suite(
        tmp_path / "s.yaml", tiny, RunOptions(out=tmp_path / "o", progress=False, log=lambda m: None)
    )
    run = RunFiles(out)
    table = run.direct_attribution
    errors = table[table["position"] == "error"]["value"].abs()
    totals = table[table["position"] == "logit_difference"]["value"].abs()
    assert len(errors) == 10 and errors.max() < 1e-4 * max(1.0, totals.max())  # 10 occupations: 10 prefixes
    from attnprobe.measures import analyse

    stats = analyse(run)["direct_attribution_shares"]
    total = stats[(stats["position"] == "logit_difference")].iloc[0]
    assert stats["layer"].dtype == "Int64" and stats["head"].dtype == "Int64"  # NA: summed over them
    sums = stats[stats["layer"].isna()]
    heads = sums[~sums["position"].isin(["logit_difference", "error", "mlp"])]
    rest = stats[(stats["head"] == -1) & stats["layer"].notna()]
    assert heads["mean"].sum() + rest[rest["position"] != "mlp"]["mean"].sum() + sums[
        (sums["position"] == "mlp")
    ]["mean"].sum() == pytest.approx(total["mean"], abs=1e-4)


def test_the_report_states_the_gradient_shares(tiny, tmp_path):
    import shutil

    from attnprobe.report import write_report

    for name in ("gender.yaml", "occupations-bls.tsv"):
        shutil.copy(f"probes/{name}", tmp_path)
    shutil.copytree("probes/edits", tmp_path / "edits")
    options = RunOptions(
        out=tmp_path / "o", limit=40, skip=("head_effects",), progress=False, log=lambda m: None
    )
    out = run_suite(tmp_path / "gender.yaml", tiny, options)
    html = write_report(out).read_text()
    assert "Direct attribution of the prediction" in html
    assert "Per 10 points of occupation.bls_pct_female, y changes by" in html and "all MLPs" in html


@pytest.mark.parametrize("family", INTERFACE_FAMILIES)
def test_the_parts_add_up_in_every_family(family):
    """On every family routed through attnprobe (pre-norm, post-sublayer norms, parallel attention
    and MLP, GQA, biases), y is the model's logit difference and the parts add up to it; a family
    whose layers this attribution cannot read is refused in one line, not attributed wrongly."""
    from types import SimpleNamespace

    from attnprobe.model.anatomy import parts_of

    model = build_tiny(family)
    if parts_of(model) is None:
        assert family == "opt"  # its MLP is two loose linear layers: no module to read
        return
    pm = SimpleNamespace(model=model, tokenizer=SimpleNamespace(pad_token_id=0), device=torch.device("cpu"))
    ids = [[5, 17, 3, 9, 22, 41, 7], [8, 2, 30, 11]]
    t = [5, 3]
    classes = [["span" if s in (1, 2) else "other" for s in range(k)] + [PREDICTION] for k in t]
    results = attribute(pm, ids, t, [([12], [13]), ([12, 14], [13])], classes)
    W = model.get_output_embeddings().weight
    for b, result in enumerate(results):
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids[b][: t[b] + 1]]), output_hidden_states=True)
        d = W[[12, 14] if b else [12]].mean(0) - W[13]
        h = out.hidden_states[-1][0, t[b]]  # the final norm's output (transformers keeps it last)
        lm_head = model.get_output_embeddings()
        expected = float(d @ h)
        if getattr(lm_head, "bias", None) is not None:
            expected += float(lm_head.bias[[12, 14] if b else [12]].mean() - lm_head.bias[13])
        assert result["y"] == pytest.approx(expected, rel=1e-4, abs=1e-4), family
        assert abs(result["error"]) < 1e-4 * max(1.0, abs(result["y"])), (
            family,
            result["error"],
            result["y"],
        )
