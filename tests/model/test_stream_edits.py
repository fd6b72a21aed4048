"""The residual-stream eraser (edits.layers.stream): fitted on a tiny model's stream it leaves the planted
covariate unreadable on held-out rows and keeps the definitional mean difference; the sweep's
edits_stream table is recomputed from edits_items alone, and each quarter's layer is chosen without
its own items (changing them does not move it; changing the others' does); applied to a model it
changes every pass and a run inside it is refused."""

import shutil
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from conftest import build_tiny, planted_covariate
from test_erasers import _r2

import attnprobe
from attnprobe.analyses.tracing import GROUPS, tracing_table
from attnprobe.cli import main
from attnprobe.edits import edited, load_edit, save_edit
from attnprobe.edits.layers.stream import StreamEdit, last_states, stream_behaviour
from attnprobe.errors import AttnprobeError, RunError
from attnprobe.model import from_pretrained_objects
from attnprobe.stats.edits import STREAM, STREAM_CHOSEN
from attnprobe.stats.keeping.layers import chosen_layers, picked_layers, stream_table

LAYER = 1


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return attnprobe.load_model(str(tiny_llama_dir))


def _inputs(tiny, n=2400, seed=0):
    """What StreamEdit.fit reads, from the tiny model's own stream: random sequences whose covariate
    is the stream entering LAYER at the last token along one of its principal directions plus noise
    (R^2 about 0.9), and control
    prompts labelled by their last token."""
    site = lambda b: last_states(b, LAYER)[:, 0, 0]
    bank, x, control, sign, half = planted_covariate(tiny.model, n, seed, site, 1)  # its second direction
    return SimpleNamespace(
        bank=bank,
        covariate=x,
        fold=np.arange(n) % 4,
        control=control,
        control_sign=sign,
        control_half=half,
        control_set=np.full(200, ""),
        control_pair=np.full(200, ""),
        keep_rows=lambda: half == 0,
    )


def test_the_stream_eraser_leaves_nothing_to_read_and_keeps_the_definitional_difference(tiny):
    inputs = _inputs(tiny)
    edit = StreamEdit.fit(inputs, LAYER, np.array([0, 1]))  # fitted on half the rows
    h = last_states(inputs.bank, LAYER)[:, 0, 0]
    erased = edit.erase(h[None])[0].double().numpy()
    x, fold = inputs.covariate, inputs.fold
    train, a, b = np.isin(fold, [0, 1]), fold == 2, fold == 3
    before = _r2(h.numpy()[a], x[a], h.numpy()[b], x[b])
    after = _r2(erased[a], x[a], erased[b], x[b])
    assert before > 0.9 and abs(after) < 0.01, (before, after)  # a probe on held-out rows reads nothing
    xc = x[train] - x[train].mean()
    covariance = (erased[train] - erased[train].mean(0)).T @ xc / train.sum()
    assert np.abs(covariance).max() < 1e-4 * np.abs(h.numpy()).max()  # none left where it was fitted
    control = last_states(inputs.control, LAYER)[:, 0, 0]
    fit = inputs.control_half == 0
    pos, neg = fit & (inputs.control_sign > 0), fit & (inputs.control_sign < 0)
    delta = (control[pos].mean(0) - control[neg].mean(0)).double()
    kept_after = edit.erase(control[None])[0].double()
    delta_after = kept_after[pos].mean(0) - kept_after[neg].mean(0)
    assert (delta_after - delta).norm() <= 0.01 * delta.norm()  # the mean difference moves <= 1%
    # the placebo's passes run only the rows a layer's quarters hold: the same y there, NaN elsewhere
    labels = torch.tensor([[[3], [4]]]).expand(len(fold), 2, 1)
    every = stream_behaviour(tiny.model, inputs.bank, edit, labels)
    some = np.flatnonzero(fold == 2)[::3]
    only = stream_behaviour(tiny.model, inputs.bank, edit, labels, some)
    assert np.allclose(only[some], every[some], atol=1e-5) and np.isnan(np.delete(only, some)).all()


def test_a_stream_edit_changes_every_pass_saves_and_refuses_a_run_inside_it(tiny, tiny_llama_dir, tmp_path):
    inputs = _inputs(tiny, n=400)
    edit = StreamEdit.fit(inputs, LAYER, np.arange(4))
    ids = torch.tensor([tiny.tokenizer("The nurse said that she")["input_ids"]])
    clean = tiny.model(input_ids=ids).logits
    with edited(tiny, edit):
        got = tiny.model(input_ids=ids).logits
        with pytest.raises(RunError, match="inside `attnprobe.edited"):
            attnprobe.run_suite("probes/gender.yaml", tiny)
    assert not torch.allclose(got, clean, atol=1e-5)
    assert torch.equal(tiny.model(input_ids=ids).logits, clean)  # gone after the block
    loaded = load_edit(save_edit(edit, tmp_path / "s", tiny, {}))
    assert loaded.edit.layer == LAYER and loaded.record["layer"] == LAYER
    with edited(tiny, loaded):
        assert torch.equal(tiny.model(input_ids=ids).logits, got)
    other = from_pretrained_objects(build_tiny("llama", vocab_size=len(tiny.tokenizer)), tiny.tokenizer, "o")
    with pytest.raises(AttnprobeError, match="s.json: this edit was fitted on .* same shape"):
        with edited(other, loaded):
            pass


def test_the_stream_erased_at_several_layers_fits_each_on_the_model_erased_below_it(tiny, tmp_path):
    """edits.layers.several.StreamLayers: layer 0's eraser is fitted on the recorded stream, layer 1's on
    the stream of the model with layer 0's applied (not on the clean one); applied together, the
    stream entering each layer keeps no covariance with the covariate on the rows fitted; saved and
    loaded it is the same edit, applied as one."""
    from attnprobe.edits.layers.several import fitted_stream_layers, state_at

    inputs, on = _inputs(tiny, n=400), np.arange(4)
    both = fitted_stream_layers(tiny.model, inputs, [0, 1], on)
    first = StreamEdit.fit(inputs, 0, on)
    assert torch.equal(both.parts[0].functional, first.functional)
    entering = lambda bank, start=0, edit=None, at=1: state_at(tiny.model, bank, None, at, start, True, edit)
    clean_1 = last_states(inputs.bank, 1)[:, 0, 0]
    for start in (0, 1):  # no edit: as recorded, from either layer
        assert torch.allclose(entering(inputs.bank, start), clean_1, atol=1e-5)
    under = [entering(bank, 0, first) for bank in (inputs.bank, inputs.control)]
    with edited(tiny, first), torch.no_grad():  # the whole model with the eraser on: the same stream
        full = tiny.model(inputs.bank.ids[:8].clone(), output_hidden_states=True).hidden_states[1]
    last = inputs.bank.lengths[:8] - 1
    assert torch.allclose(full[torch.arange(8), last], under[0][:8], atol=1e-5)
    assert not torch.allclose(under[0], clean_1, atol=1e-3)
    sequential = StreamEdit.fitted(inputs, 1, on, *under)
    assert torch.allclose(both.parts[1].functional, sequential.functional, atol=1e-5)
    assert not torch.allclose(both.parts[1].functional, StreamEdit.fit(inputs, 1, on).functional, atol=1e-3)
    x = torch.as_tensor(inputs.covariate - inputs.covariate.mean())
    left = lambda h: ((h.double() - h.double().mean(0)).T @ x).norm()
    for layer in (0, 1):
        after = entering(inputs.bank, 0, both, at=layer)
        assert left(after) < 1e-3 * left(last_states(inputs.bank, layer)[:, 0, 0]), layer
    assert both.name == STREAM + "-layers" and both.sites() == "stream entering layers 0, 1"
    ids = torch.tensor([tiny.tokenizer("The nurse said that she")["input_ids"]])
    loaded = load_edit(save_edit(both, tmp_path / "both", tiny, {}))
    assert loaded.record["layers"] == [0, 1] and loaded.record["kind"] == "stream_layers"
    with edited(tiny, both):
        got = tiny.model(input_ids=ids).logits
    with edited(tiny, loaded):
        assert torch.equal(tiny.model(input_ids=ids).logits, got)


def test_the_stream_over_several_layers_takes_any_mode_and_keeps_it_when_saved(tiny, tmp_path):
    """--stream-layer-modes leace_mid: each layer's part fitted by the midpoint-kept eraser (layer 0's
    equals StreamEdit.fitted by leace_mid, not by leace: the midpoint moves under leace, not under
    it), the edit named stream-layers-leace_mid and saved with its mode; a file saved before the
    stream took modes reads back as LEACE, and an unknown mode is refused."""
    from attnprobe.edits.layers.several import StreamLayers, fitted_stream_layers

    inputs, on = _inputs(tiny, n=400), np.arange(4)
    mid = fitted_stream_layers(tiny.model, inputs, [0, 1], on, "leace_mid")
    items, control = (last_states(bank, 0)[:, 0, 0] for bank in (inputs.bank, inputs.control))
    by_mode = {m: StreamEdit.fitted(inputs, 0, on, items, control, m) for m in ("leace", "leace_mid")}
    assert torch.equal(mid.parts[0].functional, by_mode["leace_mid"].functional)
    kept = control[torch.as_tensor(inputs.keep_rows())]
    midpoint = lambda edit: edit.erase(kept[None])[0].mean(0)  # the labels are balanced: their midpoint
    moved = {m: float((midpoint(e) - kept.mean(0)).norm() / kept.mean(0).norm()) for m, e in by_mode.items()}
    assert moved["leace_mid"] < 1e-4 < 0.01 < moved["leace"], moved
    assert mid.name == STREAM + "-layers-leace_mid" and mid.sites().endswith("(leace_mid)")
    loaded = load_edit(save_edit(mid, tmp_path / "mid", tiny, {}))
    assert loaded.edit.mode == "leace_mid" and loaded.edit.name == mid.name
    tensors = {
        f"{i}.{n}": getattr(p, n) for i, p in enumerate(mid.parts) for n in ("along", "functional", "mean")
    }
    record = {"layers": [0, 1], "model": {"hidden_size": items.shape[1], "n_layers": 2}}
    assert StreamLayers.restored(record, tensors).name == STREAM + "-layers"  # no mode saved: LEACE
    with pytest.raises(ValueError, match="not a registered mode"):
        StreamLayers.restored({**record, "mode": "nope"}, tensors)


def test_the_stream_table_recomputes_and_each_quarter_is_chosen_without_its_items(swept_run, tmp_path):
    _, _, swept = swept_run
    out = tmp_path / "run"
    shutil.copytree(swept, out)
    raw = pd.read_parquet(out / "edits_items.parquet")
    table, _ = stream_table(raw)
    written = pd.read_csv(out / "edits_stream.csv")
    several = written.kind.str.startswith(STREAM + "-layers")  # --stream-layers' windows, after the layers
    count = lambda kind: raw.loc[raw.kind == kind, "k"].nunique() + 1  # its k and its chosen row
    assert several.sum() == count(STREAM + "-layers") == 3 and written.loc[several, "chosen"].sum() == 1
    written = written[~several]
    assert len(written) == count(STREAM) and written["chosen"].sum() == 1
    for column in ("gradient_removed", "definitional_gap_kept", "kl", "specificity"):
        assert np.allclose(table[column], written[column].to_numpy(), rtol=1e-9, atol=1e-12), column
    chosen = chosen_layers(raw)
    bias = (raw.kind == STREAM) & (raw.target == "bias")
    # quarter 0's own values at every layer replaced: its choice stays
    mine = raw.copy()
    own = bias & (mine.quarter == 0)
    mine.loc[own, "y"] = np.random.default_rng(1).normal(size=own.sum()) * 5
    assert chosen_layers(mine)[0] == chosen[0]
    # every layer passing the gate (the gap kept whole, no KL), the other quarters' values at another
    # layer flattened (all of the gradient gone there): quarter 0's choice moves to it
    passing = _gate_passed(raw)
    other_layer = next(k for k in sorted(raw.loc[bias, "k"].unique()) if k != chosen_layers(passing)[0])
    flat = passing.copy()
    flat.loc[bias & (flat.quarter != 0) & (flat.k == other_layer), "y"] = 0.0
    assert chosen_layers(flat)[0] == other_layer
    # the control prompts and texts of half 0 take the layer whose gate was judged on half 1 alone:
    # the gap broken at that layer on half 1's words moves it, on half 0's words it does not
    best = chosen_layers(passing)["all"]
    for h in (0, 1):
        broken = passing.copy()
        at = (broken.kind == STREAM) & (broken.k == best) & (broken.target == "control") & (broken.half == h)
        broken.loc[at, "y"] = 0.0  # no gap left there
        got = chosen_layers(broken)
        assert got[f"half{1 - h}"] != best and got[f"half{h}"] == best and got["all"] != best
    # a fitted pair's words in the new frame (half 2: no fit used them) take their pair's half's layer
    layers = raw[raw.kind == STREAM]
    picked = picked_layers(raw, layers, {**chosen, "half0": 100, "half1": 101})
    of_pair = layers[(layers.target == "control") & layers.half.isin([0, 1])].groupby("pair")["half"].first()
    frame = ((layers.target == "control") & (layers.half == 2) & layers.pair.isin(of_pair.index)).to_numpy()
    assert frame.any() and (picked[frame] == 100 + layers.loc[frame, "pair"].map(of_pair).to_numpy()).all()
    # the report shows the table, the chosen row with its quarters' layers
    assert CliRunner().invoke(main, ["report", str(out)]).exit_code == 0
    html = (out / "report.html").read_text()
    chosen_row = written[written["chosen"]].iloc[0]
    assert (
        "residual stream entering each layer" in html and f'<td class="text">{chosen_row.heads}</td>' in html
    )
    assert "attnprobe edit --trace" in html  # and the tracing table
    assert "attnprobe edit --paths" in html and "Senders into each head" in html  # and the paths tables
    assert "value input from the occupation" in html
    assert "becomes linearly readable" in html  # and the readout
    assert "The debiasing goal, per edit" in html and "none meets every condition" in html  # and the goal


def test_tracing_recomputes_and_is_exact_where_the_answer_is_known(swept_run):
    """tracing.csv from tracing_items.parquet alone; entering layer 0 the stream is the tokens'
    embeddings, so patching the occupation's one token from x' is running x' (share 1 item by item),
    and patching tokens x and x' share changes nothing."""
    _, _, out = swept_run
    raw = pd.read_parquet(out / "tracing_items.parquet")
    written = pd.read_csv(out / "tracing.csv")
    table = tracing_table(raw).reset_index(drop=True)
    assert len(written) == 2 * len(GROUPS)  # 2 layers x 3 groups
    for column in ("te_share", "te_share_ci_low", "gradient_share", "gradient_share_ci_high"):
        assert np.allclose(table[column], written[column], rtol=1e-9, equal_nan=True), column
    layer0 = raw[raw.layer == 0].pivot_table(index="item_id", columns="position", values="y_patched")
    items = raw.drop_duplicates("item_id").set_index("item_id").loc[layer0.index]
    suite_items = {i.item_id: i for i in _items(out)}
    one_token = [
        i
        for i in layer0.index
        if len(suite_items[i].x) == len(_reference(suite_items[i]).x_cf)
        and (suite_items[i].x != _reference(suite_items[i]).x_cf).sum() == 1
    ]
    assert len(one_token) >= 10
    assert np.allclose(layer0.loc[one_token, "occupation"], items.loc[one_token, "y_cf"], atol=1e-4)
    assert np.allclose(layer0.loc[one_token, "prediction"], items.loc[one_token, "y"], atol=1e-4)
    between = layer0.loc[one_token, "between"].dropna()
    assert len(between) and np.allclose(between, items.loc[between.index, "y"], atol=1e-4)
    # and the check can fail: the occupation patched one layer up is no longer x' exactly
    assert not np.allclose(layer0.loc[one_token, "occupation"], items.loc[one_token, "y"], atol=1e-4)


def _items(out):
    """The run's head-effects items, as the sweep planned them."""
    from attnprobe.run.options import RunOptions
    from attnprobe.run.plan import plan_run

    run = attnprobe.Run(out)
    suite = attnprobe.load_suite(run.manifest.suite.path)
    model = attnprobe.load_model(run.manifest.model.spec)
    plan = plan_run(suite, model, RunOptions(limit=run.manifest.settings["limit"], out=out))
    return plan.parts["head_effects"].items


def _reference(item):
    return next(cf for cf in item.counterfactuals if cf.word == "person")


def _gate_passed(raw: pd.DataFrame) -> pd.DataFrame:
    """The sweep's raw rows with every stream layer keeping the definitional gap whole and costing no
    KL: each layer passes the gate on any half of the words and texts."""
    out = raw.copy()
    control0 = out[(out.kind == "none") & (out.target == "control")].set_index("index")["y"]
    layer_control = (out.kind == STREAM) & (out.target == "control")
    out.loc[layer_control, "y"] = out.loc[layer_control, "index"].map(control0).to_numpy()
    out.loc[(out.kind == STREAM) & (out.target == "text"), "kl"] = 0.0
    return out


def test_the_search_chooses_among_every_edit_without_the_rows_it_is_judged_on(swept_run):
    """stats.keeping.edit_search: each head kind per k and each per-layer edit's chosen row is a candidate;
    quarter 0's items take the candidate chosen on the other quarters' items (flattening one
    candidate's other quarters moves quarter 0 to it; changing quarter 0's own values does not;
    reversing half the stereotype is no credit); the goal table holds the search's row; its placebo
    repeats the choice on refits (refits that remove nothing give the floor, refits equal to the
    real edits p = 1)."""
    from attnprobe.stats.edits import MLP
    from attnprobe.stats.keeping.edit_search import CHOSEN, candidates, search_table
    from attnprobe.stats.keeping.goal import goal_table
    from attnprobe.stats.keeping.layers import layer_tables

    _, _, swept = swept_run
    raw = pd.read_parquet(swept / "edits_items.parquet")
    raw = pd.concat([raw, stream_table(raw)[1], layer_tables(raw, MLP)[1]], ignore_index=True)
    options = candidates(raw)
    kinds = {kind for kind, _ in options}
    assert {"zero", STREAM_CHOSEN} <= kinds and STREAM not in kinds and "mlp-mean-chosen" in kinds
    passing = raw.copy()  # every candidate keeps the gap whole at no KL: the choice is the removal
    control0 = passing[(passing.kind == "none") & (passing.target == "control")].set_index("index")["y"]
    edited = passing.kind.isin(kinds) & (passing.draw == -1)
    at_control = edited & (passing.target == "control")
    passing.loc[at_control, "y"] = passing.loc[at_control, "index"].map(control0)
    passing.loc[edited & (passing.target == "text"), "kl"] = 0.0
    bias = edited & (passing.target == "bias")
    of = lambda frame, key: bias & (frame.kind == key[0]) & (frame.k == key[1])
    for target in (options[0], options[-1]):  # each in turn flattened outside quarter 0
        flat = passing.copy()
        flat.loc[of(flat, target) & (flat.quarter != 0), "y"] = 0.0
        summary, rows = search_table(flat)
        assert summary["choices"].iloc[0].startswith(f"q0: {target[0]} {target[1]} |")
        mine = rows[(rows.target == "bias") & (rows.quarter == 0)].set_index("index")["y"].sort_index()
        own = flat[of(flat, target) & (flat.quarter == 0)].set_index("index")["y"].sort_index()
        assert np.array_equal(mine.to_numpy(), own.to_numpy())
        noisy = flat.copy()  # quarter 0's own values scrambled: its choice stays
        quarter0 = bias & (noisy.quarter == 0)
        noisy.loc[quarter0, "y"] = np.random.default_rng(2).normal(size=quarter0.sum()) * 5
        assert search_table(noisy)[0]["choices"].iloc[0].startswith(f"q0: {target[0]} {target[1]} |")
    # another candidate reversing half the stereotype outside quarter 0 (150% removed) loses to the one
    # removing all of it: over-removal is no credit
    before = passing[(passing.kind == "none") & (passing.target == "bias")].set_index("index")["y"]
    flat = passing.copy()
    over = of(flat, options[-1]) & (flat.quarter != 0)
    flat.loc[of(flat, options[0]) & (flat.quarter != 0), "y"] = 0.0
    flat.loc[over, "y"] = -0.5 * flat.loc[over, "index"].map(before) + before.mean()
    assert search_table(flat)[0]["choices"].iloc[0].startswith(f"q0: {options[0][0]} {options[0][1]} |")
    # the placebo: `project` on one head made to remove all of the gradient (the search's pick; the other
    # candidates nothing), refitted on 4 permutations: refits removing nothing give the floor, refits
    # equal to it p = 1
    base = passing.copy()
    base.loc[bias, "y"] = base.loc[bias, "index"].map(before)  # every other candidate removes nothing
    base.loc[of(base, ("project", 1)), "y"] = 0.0
    refitted = base[bias & (base.kind == "project")]
    assert search_table(base)[0]["choices"].iloc[0].endswith("on every item: project 1")
    for refit, p in ((refitted.assign(y=refitted["index"].map(before)), 1 / 5), (refitted, 1.0)):
        draws = [refit.assign(kind="placebo-project", draw=d) for d in range(4)]
        summary = search_table(pd.concat([base, *draws], ignore_index=True))[0]
        assert summary["placebo_p"].iloc[0] == pytest.approx(p) and summary["n_placebo"].iloc[0] == 4
    assert "placebo_p" not in search_table(raw)[0]
    goal = goal_table(pd.read_csv(swept / "edits.csv"), pd.read_csv(swept / "edits_stream.csv"), None, raw)
    row = goal[goal["kind"] == CHOSEN]
    assert len(row) == 1 and row["site"].iloc[0] == "search" and "placebo not run" in row["fails"].iloc[0]
