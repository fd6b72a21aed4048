"""MLP-output edits (edits.mlp): each mode does what it says to the MLP's output; LEACE leaves no
covariance with the covariate where it was fitted and keeps the definitional mean difference; the
sweep's edits_mlp table recomputes from edits_items; the chosen edits are saved, load and change
every pass of a model."""

import shutil
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

import attnprobe
from attnprobe.edits import edited, load_edit
from attnprobe.edits.mlp import MODES, MlpEdit, last_mlp_outputs
from attnprobe.intervene.engine import record
from attnprobe.stats.edits import MLP, stream_table

LAYER = 1


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return attnprobe.load_model(str(tiny_llama_dir))


def _inputs(tiny, n=600, seed=0):
    """Random sequences whose covariate is their MLP output at LAYER (last token) along its first
    principal direction plus noise, and control prompts labelled by their last token."""
    g = torch.Generator().manual_seed(seed)
    vocab = tiny.model.config.vocab_size
    sequences = [
        torch.randint(1, vocab, (int(t),), generator=g) for t in torch.randint(3, 9, (n,), generator=g)
    ]
    bank = record(tiny.model, sequences)
    outputs = last_mlp_outputs(tiny.model, bank)[:, LAYER].double()
    w = torch.linalg.svd(outputs - outputs.mean(0), full_matrices=False).Vh[0]
    x = (outputs - outputs.mean(0)) @ w / (outputs @ w).std() + 0.3 * torch.randn(
        n, generator=g, dtype=torch.float64
    )
    control = record(
        tiny.model,
        [torch.cat([s[:-1], torch.tensor([7 if i % 2 else 9])]) for i, s in enumerate(sequences[:200])],
    )
    half = (np.arange(200) // 2) % 2
    inputs = SimpleNamespace(
        bank=bank,
        covariate=x.numpy(),
        fold=np.arange(n) % 4,
        control=control,
        control_sign=np.where(np.arange(200) % 2, 1.0, -1.0),
        control_half=half,
        keep_rows=lambda: half == 0,
    )
    return (
        inputs,
        last_mlp_outputs(tiny.model, bank)[:, LAYER],
        last_mlp_outputs(tiny.model, control)[:, LAYER],
    )


def test_each_mode_changes_the_mlp_output_as_it_says(tiny):
    inputs, outputs, control = _inputs(tiny)
    on = np.array([0, 1])
    train = np.isin(inputs.fold, on)
    fitted = {mode: MlpEdit.fitted(outputs, control, inputs, LAYER, on, mode) for mode in MODES}
    z = outputs.double()
    assert torch.equal(fitted["zero"].erase(outputs[None])[0], torch.zeros_like(outputs))
    mean = fitted["mean"].erase(outputs[None])[0]
    assert torch.allclose(mean, outputs[train].mean(0).expand_as(outputs), atol=1e-6)
    for mode in ("project", "leace"):  # nothing of the covariate left where it was fitted
        erased = fitted[mode].erase(outputs[None])[0].double()[train]
        xc = torch.as_tensor(inputs.covariate[train] - inputs.covariate[train].mean())
        clean = z[train]
        before, after = (clean - clean.mean(0)).T @ xc, (erased - erased.mean(0)).T @ xc
        assert after.norm() < 1e-3 * before.norm(), mode
    # LEACE keeps the definitional mean difference of the prompts it was fitted on
    keep, sign = inputs.keep_rows(), inputs.control_sign
    erased = fitted["leace"].erase(control[None])[0].double()
    delta = lambda v: v[keep & (sign > 0)].mean(0) - v[keep & (sign < 0)].mean(0)
    assert (delta(erased) - delta(control.double())).norm() <= 0.01 * delta(control.double()).norm()
    # applied to the model, the layer's MLP output is the erased one at every position
    with edited(tiny, fitted["zero"]):
        assert last_mlp_outputs(tiny.model, inputs.bank)[:, LAYER].abs().max() == 0
    assert not torch.equal(z, torch.zeros_like(z))


def test_the_mlp_table_recomputes_and_its_chosen_edits_apply(swept_run, tiny, tmp_path):
    _, _, swept = swept_run
    out = tmp_path / "run"
    shutil.copytree(swept, out)
    raw = pd.read_parquet(out / "edits_items.parquet")
    written = pd.read_csv(out / "edits_mlp.csv")
    n_layers = raw.loc[raw.kind == MLP + "leace", "k"].nunique()
    assert len(written) == len(MODES) * (n_layers + 1) and written["chosen"].sum() == len(MODES)
    for mode in MODES:
        table, _ = stream_table(raw, MLP + mode)
        mine = written[written["kind"].isin([MLP + mode, f"{MLP}{mode}-chosen"])]
        for column in ("gradient_removed", "nouns_templates_factual_kept", "kl", "specificity"):
            assert np.allclose(table[column], mine[column], rtol=1e-9, atol=1e-12), (mode, column)
    zeroed = written[(written["kind"] == MLP + "zero") & ~written["chosen"]]
    assert (zeroed["kl"] > 0).all()  # removing an MLP's output costs something
    # the erasure checked after the fact at each layer's site: a zeroed output holds nothing to read
    assert written["readout_r2_before"].notna().all() and (zeroed["readout_r2_after"] <= 0.01).all()
    stream = pd.read_csv(out / "edits_stream.csv")
    assert stream["readout_r2_after"].notna().all()
    goal = pd.read_csv(out / "edits_goal.csv")
    assert set(goal["site"]) == {"heads", "stream", "mlp"} and goal["fails"].notna().all()
    ids = torch.tensor([tiny.tokenizer("The nurse said that she")["input_ids"]])
    clean = tiny.model(input_ids=ids).logits
    for mode in MODES:
        loaded = load_edit(out / "edits" / f"{MLP}{mode}.json")
        assert loaded.edit.mode == mode and loaded.record["mode"] == mode
        with edited(tiny, loaded):
            assert not torch.allclose(tiny.model(input_ids=ids).logits, clean, atol=1e-6), mode


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
def test_the_mlp_site_is_what_the_layer_adds_to_the_stream(family):
    """Llama and GPT-2 add their MLP's output; Gemma 3 adds it after a norm that scales each dimension,
    so the edit sits after that norm (an eraser before it would not erase). The site's output is not
    zero, and zeroing it changes what the layer passes on."""
    from conftest import build_tiny

    from attnprobe.edits.mlp import output_module
    from attnprobe.model.anatomy import decoder_layers

    model = build_tiny(family)
    layer = decoder_layers(model)[0]
    site = output_module(layer)
    assert site is (layer.post_feedforward_layernorm if family == "gemma3" else layer.mlp)
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    caught = []
    handle = site.register_forward_hook(lambda _, args, out: caught.append(out))
    width = model.config.get_text_config().hidden_size
    zero = MlpEdit(0, *(torch.zeros(width) for _ in range(3)), mode="zero")
    with edited(model, zero):
        model(input_ids=ids)
    handle.remove()
    assert caught[0].abs().max() > 0  # the site's own output, before the edit replaced it
    with edited(model, zero):
        zeroed = model(input_ids=ids, output_hidden_states=True).hidden_states[1]
    assert not torch.allclose(zeroed, model(input_ids=ids, output_hidden_states=True).hidden_states[1])
