"""MLP-output edits (edits.layers.mlp): each mode does what it says to the MLP's output; LEACE leaves no
covariance with the covariate where it was fitted and keeps the definitional mean difference; the
slot's site is the occupation's (and the phrase's) last token; the sweep's edits_mlp table
recomputes from edits_items; the chosen edits (at both sites) are saved, load and change every pass
of a model."""

import shutil
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import planted_covariate

import attnprobe
from attnprobe.edits import EditOptions, edited, load_edit
from attnprobe.edits.layers.mlp import MODES, MlpEdit, fitted, fitted_where, kind_of, mlp_outputs
from attnprobe.errors import AttnprobeError
from attnprobe.stats.edits import MLP
from attnprobe.stats.keeping.layers import stream_table

MLP_KINDS = tuple(kind_of(*where) for where in fitted())  # the MLP edits --mlp measures by default

LAYER = 1


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return attnprobe.load_model(str(tiny_llama_dir))


def _inputs(tiny, n=600, seed=0):
    """Random sequences whose covariate is their MLP output at LAYER (last token) along its first
    principal direction plus noise, and control prompts labelled by their last token."""
    site = lambda b: mlp_outputs(tiny.model, b)[:, LAYER]
    bank, x, control, sign, half = planted_covariate(tiny.model, n, seed, site)
    inputs = SimpleNamespace(
        bank=bank,
        covariate=x,
        fold=np.arange(n) % 4,
        control=control,
        control_sign=sign,
        control_half=half,
        keep_rows=lambda: half == 0,
    )
    return (
        inputs,
        mlp_outputs(tiny.model, bank)[:, LAYER],
        mlp_outputs(tiny.model, control)[:, LAYER],
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
        assert mlp_outputs(tiny.model, inputs.bank)[:, LAYER].abs().max() == 0
    assert not torch.equal(z, torch.zeros_like(z))


def test_the_mlp_table_recomputes_and_its_chosen_edits_apply(swept_run, tiny, tmp_path):
    _, _, swept = swept_run
    out = tmp_path / "run"
    shutil.copytree(swept, out)
    raw = pd.read_parquet(out / "edits_items.parquet")
    written = pd.read_csv(out / "edits_mlp.csv")
    n_layers = raw.loc[raw.kind == MLP + "leace", "k"].nunique()
    assert set(raw.loc[raw.kind.str.startswith(MLP), "kind"]) == set(MLP_KINDS)  # both sites
    assert len(written) == len(MLP_KINDS) * (n_layers + 1) and written["chosen"].sum() == len(MLP_KINDS)
    for kind in MLP_KINDS:
        table, _ = stream_table(raw, kind)
        mine = written[written["kind"].isin([kind, f"{kind}-chosen"])]
        for column in ("gradient_removed", "nouns_templates_factual_kept", "kl", "specificity"):
            assert np.allclose(table[column], mine[column], rtol=1e-9, atol=1e-12), (kind, column)
    zeroed = written[(written["kind"] == MLP + "zero") & ~written["chosen"]]
    assert (zeroed["kl"] > 0).all()  # removing an MLP's output costs something
    # the erasure checked after the fact at each layer's site: a zeroed output holds nothing to read
    assert written["readout_r2_before"].notna().all() and (zeroed["readout_r2_after"] <= 0.01).all()
    stream = pd.read_csv(out / "edits_stream.csv")
    several = stream["kind"].str.startswith("stream-layers")  # no readout: the edited vectors are several
    assert stream.loc[~several, "readout_r2_after"].notna().all() and several.any()
    assert stream.loc[several, "readout_r2_after"].isna().all()
    goal = pd.read_csv(out / "edits_goal.csv")
    sites = {"heads", "stream", "stream layers", "mlp", "search"}
    assert set(goal["site"]) == sites and goal["fails"].notna().all()
    ids = torch.tensor([tiny.tokenizer("The nurse said that she")["input_ids"]])
    clean = tiny.model(input_ids=ids).logits
    for kind in MLP_KINDS:
        loaded = load_edit(out / "edits" / f"{kind}.json")
        assert loaded.edit.name == kind and loaded.record["mode"] == loaded.edit.mode
        assert loaded.edit.at == ("slot" if kind.endswith("-slot") else "last")
        with edited(tiny, loaded):
            assert not torch.allclose(tiny.model(input_ids=ids).logits, clean, atol=1e-6), kind


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
def test_the_mlp_site_is_what_the_layer_adds_to_the_stream(family):
    """Llama and GPT-2 add their MLP's output; Gemma 3 adds it after a norm that scales each dimension,
    so the edit sits after that norm (an eraser before it would not erase). The site's output is not
    zero, and zeroing it changes what the layer passes on."""
    from conftest import build_tiny

    from attnprobe.model.anatomy import decoder_layers, mlp_added

    model = build_tiny(family)
    layer = decoder_layers(model)[0]
    site = mlp_added(layer)
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


def test_the_slot_site_is_the_occupations_and_the_phrases_last_token(swept_run, tiny):
    """The slot's fit reads each item at its occupation's last token and each control prompt (the
    file's and those put into the templates) at its phrase's last token."""
    from attnprobe.edits.inputs import phrase_end
    from attnprobe.suite import load_suite
    from attnprobe.testing.edit_kinds import edit_inputs

    inputs = edit_inputs(tiny, load_suite(swept_run[1]), texts=1)
    decode = lambda ids, at: tiny.tokenizer.decode(ids[: at + 1]).lower()
    for item, at in zip(inputs.items, inputs.slot_at):
        assert decode(item.x, at).endswith(item.original.lower()), item.item_id
    assert (inputs.control_at >= 0).all() and len(inputs.control_at) == len(inputs.control.lengths)
    phrases = {phrase.split()[-1].lower() for phrase in load_suite(swept_run[1]).control.phrases}
    for ids, at in zip(inputs.control.ids, inputs.control_at):
        word = decode(ids, at).split()[-1]
        assert word in phrases and decode(ids, at + 1).split()[-1] not in phrases
    assert phrase_end(tiny.tokenizer, "The nurse said that", "the king") == -1
    assert phrase_end(tiny.tokenizer, "The nurse said that", "") == -1
    # a control without phrases (or one not found) has no slot site: the modes at the prediction only
    without = SimpleNamespace(control_at=np.r_[inputs.control_at[:-1], -1])
    assert [at for _, at in fitted_where(without)] == ["last"] * len(MODES)
    assert len(fitted_where(inputs)) == len(MLP_KINDS) == 7


def test_an_edit_fitted_at_the_slot_erases_there_and_is_saved_as_such(tiny, tmp_path):
    """LEACE fitted on the outputs at one position (random here) leaves no covariance with the
    covariate at that position, though applied at every position it leaves most of it at the last
    token, whose output the covariate was drawn from; saved, it loads as fitted at the slot."""
    from attnprobe.edits import save_edit

    inputs, _, _ = _inputs(tiny)
    g = torch.Generator().manual_seed(1)
    inputs.slot_at = (torch.rand(len(inputs.covariate), generator=g) * (inputs.bank.lengths - 1)).long()
    inputs.control_at = inputs.control.lengths - 2
    at_slot = mlp_outputs(tiny.model, inputs.bank, inputs.slot_at)[:, LAYER]
    control = mlp_outputs(tiny.model, inputs.control, inputs.control_at)[:, LAYER]
    on = np.array([0, 1, 2, 3])
    x = torch.as_tensor(inputs.covariate - inputs.covariate.mean())
    edit = MlpEdit.fitted(at_slot, control, inputs, LAYER, on, "leace", "slot")
    with edited(tiny, edit):
        after = mlp_outputs(tiny.model, inputs.bank, inputs.slot_at)[:, LAYER].double()
    before = at_slot.double()
    assert ((after - after.mean(0)).T @ x).norm() < 1e-3 * ((before - before.mean(0)).T @ x).norm()
    assert edit.name == MLP + "leace-slot" and "fitted at the slot" in edit.sites()
    # the last token, where the covariate was drawn from, keeps most of its covariance: the site matters
    with edited(tiny, edit):
        after = mlp_outputs(tiny.model, inputs.bank)[:, LAYER].double()
    before = mlp_outputs(tiny.model, inputs.bank)[:, LAYER].double()
    assert ((after - after.mean(0)).T @ x).norm() > 0.5 * ((before - before.mean(0)).T @ x).norm()
    path = tmp_path / "mlp-leace-slot"
    save_edit(edit, path, tiny, {"fitted_on": "all items"})
    loaded = load_edit(path.with_suffix(".json"))
    assert loaded.edit.at == "slot" and loaded.edit.mode == "leace"


def test_an_edit_of_several_layers_fits_each_on_the_model_edited_below_it(tiny, tmp_path):
    """DAMA's design (edits.layers.mlp.MlpLayers): layer 0's part is fitted on the clean outputs, layer 1's on
    the outputs of the model with layer 0 already edited (not on the clean ones); applied together
    neither layer's output keeps covariance with the covariate on the rows fitted; saved and loaded it
    is the same edit."""
    from attnprobe.edits import save_edit
    from attnprobe.edits.layers.mlp import Recorded
    from attnprobe.edits.layers.several import MlpLayers, fitted_layers, state_at

    inputs, _, _ = _inputs(tiny, n=400)
    recorded = Recorded(tiny.model, inputs, "last")
    on = np.arange(4)
    both = fitted_layers(recorded, inputs, [0, 1], on, "leace")
    first = MlpEdit.fitted(*recorded.both(0), inputs, 0, on, "leace")
    assert torch.equal(both.parts[0].functional, first.functional)
    with edited(tiny, first):
        under = [mlp_outputs(tiny.model, bank)[:, 1] for bank in (inputs.bank, inputs.control)]
        assert torch.allclose(state_at(tiny.model, inputs.bank, None, 1), under[0], atol=1e-6)
    # from the recorded stream entering layer 1 (no edit below it): the clean output
    clean_1 = mlp_outputs(tiny.model, inputs.bank)[:, 1]
    assert torch.allclose(state_at(tiny.model, inputs.bank, None, 1, start=1), clean_1, atol=1e-5)
    sequential = MlpEdit.fitted(*under, inputs, 1, on, "leace")
    independent = MlpEdit.fitted(*recorded.both(1), inputs, 1, on, "leace")
    assert torch.allclose(both.parts[1].functional, sequential.functional, atol=1e-5)
    assert not torch.allclose(both.parts[1].functional, independent.functional, atol=1e-3)
    x = torch.as_tensor(inputs.covariate - inputs.covariate.mean())
    clean = mlp_outputs(tiny.model, inputs.bank).double()
    with edited(tiny, both):
        after = mlp_outputs(tiny.model, inputs.bank).double()
    for layer in (0, 1):
        left = lambda z, n=layer: ((z[:, n] - z[:, n].mean(0)).T @ x).norm()
        assert left(after) < 1e-3 * left(clean), layer
    assert both.name == MLP + "layers-leace" and both.sites() == "MLP outputs of layers 0, 1 (leace)"
    path = tmp_path / "mlp-layers-leace"
    save_edit(both, path, tiny, {"fitted_on": "all items"})
    loaded = load_edit(path.with_suffix(".json"))
    assert isinstance(loaded.edit, MlpLayers) and [p.layer for p in loaded.edit.parts] == [0, 1]
    ids = torch.tensor([tiny.tokenizer("The nurse said that she")["input_ids"]])
    with edited(tiny, both):
        fitted_logits = tiny.model(input_ids=ids).logits
    with edited(tiny, loaded):
        assert torch.allclose(tiny.model(input_ids=ids).logits, fitted_logits, atol=1e-6)
    assert not torch.allclose(tiny.model(input_ids=ids).logits, fitted_logits, atol=1e-6)


def test_every_mode_works_over_several_layers_zero_and_mean_as_written(tiny):
    """--mlp-layer-modes: any mode edits a window. zero over layers 0 and 1 gives the logits of the
    model with both MLP outputs zeroed by hand; mean over them replaces layer 1's output by its mean in
    the model whose layer 0 already outputs its own mean (not the clean model's layer-1 mean)."""
    from attnprobe.edits.layers.mlp import Recorded
    from attnprobe.edits.layers.several import fitted_layers
    from attnprobe.model.anatomy import decoder_layers, mlp_added

    inputs, _, _ = _inputs(tiny, n=200)
    recorded, on = Recorded(tiny.model, inputs, "last"), np.arange(4)
    ids = torch.tensor([tiny.tokenizer("The nurse said that she")["input_ids"]])
    zero = fitted_layers(recorded, inputs, [0, 1], on, "zero")
    assert zero.name == MLP + "layers-zero" and [p.layer for p in zero.parts] == [0, 1]
    blocks = decoder_layers(tiny.model)
    handles = [
        mlp_added(blocks[n]).register_forward_hook(lambda m, a, out: torch.zeros_like(out)) for n in (0, 1)
    ]
    try:
        by_hand = tiny.model(input_ids=ids).logits
    finally:
        for handle in handles:
            handle.remove()
    with edited(tiny, zero):
        assert torch.allclose(tiny.model(input_ids=ids).logits, by_hand, atol=1e-6)
    mean = fitted_layers(recorded, inputs, [0, 1], on, "mean")
    with edited(tiny, mean.__class__(mean.parts[:1])):
        under = mlp_outputs(tiny.model, inputs.bank)[:, 1].mean(0)
    clean = mlp_outputs(tiny.model, inputs.bank)[:, 1].mean(0)  # the tiny model's outputs are ~1e-4
    assert (mean.parts[1].mean - under).norm() < 0.01 * (mean.parts[1].mean - clean).norm()


def test_pls_directions_are_dama_s_subspace_and_dual_keeps_what_carries_the_label():
    """estimate.pls_directions: orthonormal, the first the unit slope direction (project at rank 1),
    the items' covariance with x gone once it is removed; dual (2DAMA's keep rule) drops a direction
    that carries the definitional label more than the covariate and keeps one that carries only the
    covariate, where project removes both."""
    from attnprobe.edits.estimate import covariate_directions, pls_directions
    from attnprobe.edits.layers.modes import SITE_MODES

    g, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    n, width = 300, 24
    x = rng.normal(size=n)
    z = torch.randn(n, width, generator=g)
    z[:, 0] += 2 * torch.as_tensor(x, dtype=torch.float32)
    w = pls_directions(z, x, 6)
    assert torch.allclose(w @ w.T, torch.eye(6), atol=1e-5)
    assert torch.allclose(w[0], covariate_directions(z[:, None, None, :], x)[0, 0], atol=1e-6)
    left = (z - (z @ w[:1].T) @ w[:1]) - z.mean(0)
    assert float((left.double().T @ torch.as_tensor(x - x.mean())).norm()) < 1e-3
    sign = np.repeat([1.0, -1.0], 40)
    control = torch.randn(80, width, generator=g)
    for labelled in (False, True):  # the label on a direction of its own, then on the covariate's
        kept = control.clone()
        kept[:, 0 if labelled else 5] += 6 * torch.as_tensor(sign, dtype=torch.float32)
        dual = SITE_MODES["dual"].fit_ranked(z, x, kept, sign, 2)
        project = SITE_MODES["project"].fit_ranked(z, x, kept, sign, 2)
        assert all(float(a.norm()) == pytest.approx(1) for a, _, _ in project)
        assert (float(dual[0][0].norm()) == 0) == labelled, labelled
    with pytest.raises(AttnprobeError, match="fits rank 1 only"):
        SITE_MODES["leace"].fit_ranked(z, x, control, sign, 2)


def test_an_edit_of_rank_two_removes_two_directions_per_layer_and_reads_back(tiny, tmp_path):
    """--mlp-ranks 2: each layer's MLP output loses the span of its two PLS directions (I - W'W, two
    parts applied in order); named mlp-layers-project-r2, saved with each layer twice and read back;
    a file whose layers are uneven is refused."""
    from attnprobe.edits import save_edit
    from attnprobe.edits.layers.mlp import Recorded
    from attnprobe.edits.layers.several import MlpLayers, fitted_layers

    inputs, _, _ = _inputs(tiny, n=400)
    both = fitted_layers(Recorded(tiny.model, inputs, "last"), inputs, [0, 1], np.arange(4), "project", 2)
    assert [p.layer for p in both.parts] == [0, 0, 1, 1] and both.rank == 2
    assert both.name == MLP + "layers-project-r2" and both.sites().endswith("(project, rank 2)")
    clean = mlp_outputs(tiny.model, inputs.bank).double()
    with edited(tiny, MlpLayers(both.parts[:2])):
        after = mlp_outputs(tiny.model, inputs.bank).double()[:, 0]
    w = torch.stack([p.along for p in both.parts[:2]]).double()
    assert torch.allclose(after, clean[:, 0] - clean[:, 0] @ w.T @ w, atol=1e-5)
    path = tmp_path / "mlp-layers-project-r2"
    save_edit(both, path, tiny, {"fitted_on": "all items"})
    loaded = load_edit(path.with_suffix(".json")).edit
    assert loaded.rank == 2 and all(torch.equal(a.along, b.along) for a, b in zip(loaded.parts, both.parts))
    with pytest.raises(ValueError, match="each as often"):
        MlpLayers.restored({"layers": [0, 0, 1]}, {})


@pytest.mark.parametrize(
    "ranks, phrase", [("0", "from 1 to 64"), ("65", "from 1 to 64"), ("2,2", "lists 2 twice")]
)
def test_mlp_ranks_out_of_range_are_one_line_before_the_model_loads(edited_run, ranks, phrase):
    from click.testing import CliRunner
    from conftest import one_line_error

    from attnprobe.cli import main

    one_line_error(CliRunner().invoke(main, ["edit", str(edited_run), "--mlp-ranks", ranks]), phrase)
    assert EditOptions(mlp_ranks=(1, 8)).mlp_layers and not EditOptions().mlp_layers  # Run.edit as the CLI
    assert EditOptions(mlp_layer_modes=("zero",)).mlp_layers
    # the MLPs' and the stream's lists likewise; their defaults ask for nothing
    assert EditOptions(mlp_modes=("zero",)).mlp and EditOptions(stream_layer_modes=("project",)).stream_layers
    assert not any(getattr(EditOptions(), flag) for flag in ("mlp", "mlp_layers", "stream_layers"))


@pytest.mark.thorough  # a whole sweep: the fast lane keeps the several-layer fit and apply tests
def test_the_sweep_measures_saves_and_applies_edits_of_several_layers(swept_run, tiny_llama_dir, tmp_path):
    """edit --mlp-ranks 1,2 --mlp-layer-modes project,dual,leace_mid,zero (implying --mlp-layers) on a
    tiny model of 2 layers: windows of 1 and 2 layers ending at layer 1, for DAMA's projection, 2DAMA's
    rule (dual, both also at rank 2), leace_mid and zero (no placebo: not fitted), at the slot; a
    chosen row whose count each quarter takes from the other quarters; the chosen edit saved with its
    layers and applied by run --edit. With --stream-layer-modes the stream's windows by leace_mid too."""
    from click.testing import CliRunner
    from conftest import EDIT_SWEEP

    from attnprobe.cli import main
    from attnprobe.edits.layers.several import LAYERS_MODES, MlpLayers

    _, suite, swept = swept_run
    out = tmp_path / "run"
    shutil.copytree(swept, out)
    # the swept run's settings, its parts read back, but for the kinds (zero alone: no head placebo)
    kinds, modes = ["--kinds", "zero"], [*LAYERS_MODES, "zero"]
    result = CliRunner().invoke(
        main,
        ["edit", str(out), *EDIT_SWEEP, *kinds, "--mlp-ranks", "1,2", "--mlp-layer-modes", ",".join(modes)]
        + ["--stream-layer-modes", "leace,leace_mid", "--placebo", "2"],
    )
    assert result.exit_code == 0, result.output
    table = pd.read_csv(out / "edits_mlp.csv")
    raw = pd.read_parquet(out / "edits_items.parquet")
    grid = [(mode, "") for mode in modes] + [("project", "-r2"), ("dual", "-r2")]
    assert {k for k in table["kind"] if "-r2" in k} == {
        f"{MLP}layers-{m}-r2-slot{c}" for m in ("project", "dual") for c in ("", "-chosen")
    }
    for mode, ranked in grid:
        kind = f"{MLP}layers-{mode}{ranked}-slot"
        rows = table[table["kind"] == kind]
        assert sorted(rows["layer"]) == [1, 2] and (table["kind"] == f"{kind}-chosen").sum() == 1
        # the placebo repeats the choice of how many layers: each refit names the counts it chose
        placebo = raw[raw["kind"] == f"placebo-{kind}-chosen"]
        if mode == "zero":  # not fitted on the covariate: nothing to permute
            assert placebo.empty and table.loc[table["kind"] == f"{kind}-chosen", "placebo_p"].isna().all()
            continue
        assert placebo["draw"].nunique() == 2 and placebo["heads"].notna().all()
        assert table.loc[table["kind"] == f"{kind}-chosen", "placebo_p"].notna().all()
        loaded = load_edit(out / "edits" / f"{kind}.json")
        assert isinstance(loaded.edit, MlpLayers) and loaded.edit.parts[-1].layer == 1
        assert {p.mode for p in loaded.edit.parts} == {mode} and loaded.edit.rank == (2 if ranked else 1)
    # the stream's windows by the midpoint-kept eraser beside LEACE's, refitted by the placebo, saved
    streams = pd.read_csv(out / "edits_stream.csv")
    assert (streams["kind"] == "stream-layers-leace_mid").sum() == 2
    assert (raw["kind"] == "placebo-stream-layers-leace_mid-chosen").any()
    assert load_edit(out / "edits" / "stream-layers-leace_mid.json").edit.mode == "leace_mid"
    goal = pd.read_csv(out / "edits_goal.csv")
    assert goal["kind"].str.startswith(f"{MLP}layers-").any()
    assert goal.loc[goal["kind"] == "stream-layers-leace_mid-chosen", "site"].tolist() == ["stream layers"]
    from attnprobe.plotting.plots import goal_frontier

    legend = {text.get_text() for text in goal_frontier(goal).axes[0].get_legend().get_texts()}
    assert {"DAMA (project, mlp layers)", "2DAMA (dual, mlp layers)", "mlp layers", "the goal"} <= legend
    again = tmp_path / "again"
    args = ["run", str(suite), "--model", str(tiny_llama_dir), "--out", str(again), "--no-report"]
    result = CliRunner().invoke(
        main, [*args, "--edit", str(out / "edits" / f"{MLP}layers-project-slot.json")]
    )
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    "modes, phrase",
    [
        ("", "unknown MLP mode (none); modes: zero, mean, project, leace, leace_mid"),
        ("zero,zero", "--mlp-modes lists zero twice; give each once"),
        ("layers", "unknown MLP mode layers"),
        ("leace,Leace", "unknown MLP mode Leace"),
    ],
)
def test_mlp_modes_that_are_not_registered_are_one_line_before_the_model_loads(edited_run, modes, phrase):
    from click.testing import CliRunner
    from conftest import one_line_error

    from attnprobe.cli import main

    one_line_error(CliRunner().invoke(main, ["edit", str(edited_run), "--mlp-modes", modes]), phrase)
    layer_modes = ["edit", str(edited_run), "--mlp-layer-modes", modes]
    one_line_error(CliRunner().invoke(main, layer_modes), phrase.replace("--mlp-modes", "--mlp-layer-modes"))
    with pytest.raises(AttnprobeError, match=r"mlp_modes 'leace': give a list of mode names"):
        EditOptions(mlp_modes="leace")  # a string, not a list: Run.edit(mlp_modes="leace")
