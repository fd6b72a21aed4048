"""Saved edits (edits.saved), `attnprobe run --edit` and `attnprobe compare` on a tiny model: an edit
saved and loaded is the same edit; a quarter's saved edit applied to a whole run reproduces the
sweep's values for that quarter's items, and `compare` of the two runs gives the sweep's change on
them with the same CI; bad input is one line each."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from conftest import EDIT_SWEEP_NO_PATHS, FUZZ_EXAMPLES, build_tiny, edit_suite, one_line_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnprobe
from attnprobe.cli import main
from attnprobe.edits import Mean, Project, Resample, Scale, Zero, edited, load_edit, save_edit
from attnprobe.edits.layers.mlp import fitted, kind_of
from attnprobe.errors import AttnprobeError
from attnprobe.model import from_pretrained_objects
from attnprobe.stats.kinds.next_token import item_log_ratios
from attnprobe.stats.kinds.referents import referent_choice

MLP_KINDS = tuple(kind_of(*where) for where in fitted())  # the MLP edits --mlp measures by default

SWEEP = EDIT_SWEEP_NO_PATHS


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return attnprobe.load_model(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def swept(swept_run):
    """The edit suite run on the tiny Llama, and its sweep (which saves every chosen edit)."""
    return swept_run


def _logits(model, text="The nurse said that she"):
    ids = torch.tensor([model.tokenizer(text)["input_ids"]])
    with torch.no_grad():
        return model.model(input_ids=ids, use_cache=False).logits[0]


def test_every_kind_saved_and_loaded_is_the_same_edit(tiny, tmp_path):
    L, H, D = tiny.info.n_layers, tiny.info.n_heads, tiny.info.head_dim
    g = torch.Generator().manual_seed(0)
    heads = ((1, 1), (0, 0))
    directions = torch.nn.functional.normalize(torch.randn(L, H, D, generator=g), dim=-1)
    for edit in (
        Zero(heads=heads),
        Mean(heads=heads, means=torch.randn(L, H, D, generator=g)),
        Resample(heads=heads, bank=torch.randn(L, H, 7, D, generator=g), seed=3),
        Scale(heads=heads, factor=0.25),
        Project(heads=heads, directions=directions),
    ):
        path = save_edit(edit, tmp_path / edit.kind, tiny, {"made by": "test"})
        loaded = load_edit(path)
        assert loaded.edit.kind == edit.kind and loaded.edit.heads == heads
        assert loaded.record["source"] == {"made by": "test"} and loaded.name == edit.kind
        with edited(tiny, edit):
            expected = _logits(tiny)
        with edited(tiny, loaded):  # a SavedEdit is checked against the model, then applied
            got = _logits(tiny)
        assert torch.equal(got, expected), edit.kind
        assert not torch.allclose(got, _logits(tiny), atol=1e-5), edit.kind  # the edit does something
        # only the edited heads' parameters are stored: the others read back as zeros
        for name in loaded.record["tensors"]:
            stored = getattr(loaded.edit, name)
            assert torch.equal(stored[1, 1], getattr(edit, name)[1, 1].float())
            assert not stored[1, 0].any() and not stored[0, 1].any()
    # two edits apply in order, and an edit composes with itself the way the replacement says
    with edited(tiny, Scale(heads=heads, factor=0.5), Scale(heads=heads, factor=0.5)):
        twice = _logits(tiny)
    with edited(tiny, Scale(heads=heads, factor=0.25)):
        assert torch.allclose(twice, _logits(tiny), atol=1e-6)


def test_the_sweep_saves_each_chosen_edit_with_where_it_came_from(swept):
    _, suite, out = swept
    edits = pd.read_csv(out / "edits.csv")
    for kind in ("zero", "mean", "scale", "project"):
        saved = load_edit(out / "edits" / f"{kind}-k1.json")
        row = edits[(edits.kind == kind) & (edits.k == 1)].iloc[0]
        assert str(attnprobe.HeadSet(saved.edit.heads)) == row.heads_all
        source = saved.record["source"]
        assert (
            source["fitted_on"] == "all items"
            and source["suite_sha256"] == attnprobe.load_suite(suite).sha256
        )
        for f in range(4):
            quarter = load_edit(out / "edits" / "quarters" / f"{kind}-k1-q{f}.json")
            assert quarter.record["source"]["quarter"] == f and quarter.record["source"]["held_out_items"]
            heads = row.heads.split(" | ")[f]
            assert str(attnprobe.HeadSet(quarter.edit.heads)) == heads


@pytest.mark.parametrize("kind", ["zero", "project", "stream"])
def test_a_saved_quarter_edit_reproduces_the_sweep_and_compare_gives_its_change(swept, tiny_llama_dir, kind):
    tmp, suite, out = swept
    name = "stream-q0" if kind == "stream" else f"{kind}-k1-q0"
    file = out / "edits" / "quarters" / f"{name}.json"
    edited_out = tmp / f"edited-{kind}"
    args = ["run", str(suite), "--model", str(tiny_llama_dir), "--out", str(edited_out), "--no-report"]
    result = CliRunner().invoke(main, [*args, "--no-head-effects", "--edit", str(file)])
    assert result.exit_code == 0, result.output
    manifest = attnprobe.Run(edited_out).manifest
    assert [e["name"] for e in manifest.edits] == [name] and manifest.edits[0]["same_weights"]
    # the sweep's values for quarter 0's items, each edited by quarter 0's edit (the stream's: at the
    # layer chosen for quarter 0)
    raw = pd.read_parquet(out / "edits_items.parquet")
    k = load_edit(file).edit.layer if kind == "stream" else 1
    sweep = raw[
        (raw.target == "bias") & (raw.kind == kind) & (raw.k == k) & (raw.draw == -1) & (raw.quarter == 0)
    ]
    run_y = item_log_ratios(attnprobe.Run(edited_out))["pronoun"]
    got = run_y.reindex(sweep["item_id"]).to_numpy()
    assert np.abs(got - sweep["y"].to_numpy()).max() < 1e-4
    x = sweep["covariate"].to_numpy()
    assert abs(np.polyfit(x, got, 1)[0] - np.polyfit(x, sweep["y"].to_numpy(), 1)[0]) < 1e-4
    # compare: the original against the edited run, on the items the edit was held out for
    cmp = CliRunner().invoke(main, ["compare", str(out), str(edited_out), "--out", str(tmp / f"cmp-{kind}")])
    assert cmp.exit_code == 0, cmp.output
    rows = pd.read_csv(tmp / f"cmp-{kind}" / "compare_next_token.csv").set_index("scope")
    held = rows.loc[f"held out by {name}"]
    quarter = pd.read_csv(out / "edits_quarters.csv")
    if kind == "stream":  # the chosen row's quarter
        quarter = quarter[(quarter.kind == "stream-chosen") & (quarter.quarter == 0)].iloc[0]
    else:
        quarter = quarter[(quarter.kind == kind) & (quarter.k == 1) & (quarter.quarter == 0)].iloc[0]
    assert held.n_items == quarter.n_items == len(sweep)
    for name in ("gradient_change", "gradient_change_ci_low", "gradient_change_ci_high"):
        assert abs(held[name] - quarter[name]) < 1e-4, name  # one weighting: every template the same
    assert abs(held.gradient_a - quarter.gradient_before) < 1e-4
    assert abs(held.gradient_b - quarter.gradient_after) < 1e-4
    assert (tmp / f"cmp-{kind}" / "compare.html").read_text().count("<table") >= 2
    attention = pd.read_parquet(tmp / f"cmp-{kind}" / "compare_attention.parquet")
    assert set(attention["quantity"]) == {"difference"} and attention["change_q"].between(0, 1).all()


def test_bad_saved_edits_and_comparisons_are_one_line_each(swept, tiny_llama_dir, tmp_path):
    tmp, suite, out = swept
    run = ["run", str(suite), "--model", str(tiny_llama_dir), "--no-report", "--no-head-effects"]
    good = out / "edits" / "zero-k1.json"
    # an edit fitted on a model of another shape (2 layers x 4 heads against 2 x 2)
    tokenizer = attnprobe.load_model(str(tiny_llama_dir)).tokenizer
    other = from_pretrained_objects(build_tiny("llama", vocab_size=len(tokenizer)), tokenizer, "other")
    foreign = save_edit(Zero(heads=((1, 3),)), tmp_path / "foreign", other, {})
    bad = CliRunner().invoke(main, [*run, "--out", str(tmp_path / "o1"), "--edit", str(foreign)])
    one_line_error(bad, "foreign.json: this edit was fitted on other (2 layers x 4 heads", "same shape")
    assert not (tmp_path / "o1").exists()  # refused before anything is written
    # a damaged or truncated tensor file
    for name, damage in (("cut", lambda b: b[: len(b) // 2]), ("flipped", lambda b: b[:-1] + b"\x01")):
        for suffix in (".json", ".safetensors"):
            (tmp_path / f"{name}{suffix}").write_bytes((out / "edits" / f"zero-k1{suffix}").read_bytes())
        tensors = tmp_path / f"{name}.safetensors"
        tensors.write_bytes(damage(tensors.read_bytes()))
        bad = CliRunner().invoke(
            main, [*run, "--out", str(tmp_path / "o2"), "--edit", str(tmp_path / f"{name}.json")]
        )
        one_line_error(bad, f"{name}.safetensors: damaged or truncated")
    # a kind this version does not know; a file that is not an edit; a missing half
    record = json.loads(good.read_text())
    (tmp_path / "melt.json").write_text(json.dumps({**record, "kind": "melt"}))
    (tmp_path / "melt.safetensors").write_bytes((out / "edits" / "zero-k1.safetensors").read_bytes())
    bad = CliRunner().invoke(
        main, [*run, "--out", str(tmp_path / "o3"), "--edit", str(tmp_path / "melt.json")]
    )
    one_line_error(bad, "edit kind 'melt' is not one this attnprobe knows")
    (tmp_path / "junk.json").write_text("[1, 2")
    (tmp_path / "junk.safetensors").write_bytes(b"")
    bad = CliRunner().invoke(
        main, [*run, "--out", str(tmp_path / "o4"), "--edit", str(tmp_path / "junk.json")]
    )
    one_line_error(bad, "junk.json: not an edit record")
    bad = CliRunner().invoke(
        main, [*run, "--out", str(tmp_path / "o5"), "--edit", str(tmp_path / "none.json")]
    )
    one_line_error(bad, "no edit file none.json there")
    # an edited run is not swept again; compare refuses other prompts and other suites
    edited_out = tmp_path / "edited"
    assert CliRunner().invoke(main, [*run, "--out", str(edited_out), "--edit", str(good)]).exit_code == 0
    one_line_error(
        CliRunner().invoke(main, ["edit", str(edited_out)]), "was made with the edit(s) zero-k1 applied"
    )
    fewer = tmp_path / "fewer"
    assert CliRunner().invoke(main, [*run, "--out", str(fewer), "--limit", "10"]).exit_code == 0
    one_line_error(
        CliRunner().invoke(main, ["compare", str(out), str(fewer)]), "ran different prompts", "--limit"
    )
    other_suite = tmp_path / "other.yaml"
    other_suite.write_text(suite.read_text().replace("name: e", "name: other"))
    (tmp_path / "jobs.tsv").write_text((suite.parent / "jobs.tsv").read_text())
    (tmp_path / "definitional.tsv").write_text((suite.parent / "definitional.tsv").read_text())
    elsewhere = tmp_path / "elsewhere"
    args = ["run", str(other_suite), "--model", str(tiny_llama_dir), "--no-report", "--no-head-effects"]
    assert CliRunner().invoke(main, [*args, "--out", str(elsewhere)]).exit_code == 0
    one_line_error(
        CliRunner().invoke(main, ["compare", str(out), str(elsewhere)]), "runs of different suites"
    )
    # a model of another shape (2 layers x 4 heads) on the same suite
    other.model.save_pretrained(tmp_path / "other-model")
    tokenizer.save_pretrained(tmp_path / "other-model")
    wider = tmp_path / "wider"
    args = ["run", str(suite), "--model", str(tmp_path / "other-model"), "--no-report", "--no-head-effects"]
    assert CliRunner().invoke(main, [*args, "--out", str(wider)]).exit_code == 0
    one_line_error(
        CliRunner().invoke(main, ["compare", str(out), str(wider)]), "runs of models of different shapes"
    )


@pytest.mark.thorough  # a whole sweep; the fast lane keeps the --also refusals
def test_edit_also_applies_each_chosen_edit_to_another_suite(swept, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(swept[2], out)  # the swept run is shared: edit a copy
    shutil.copytree("probes/coref", tmp_path / "coref")
    # the suite's first two frames (f1 type 1, f5 type 2) without its head effects: the transfer reads
    # referent choice, and runs the suite 6 times here
    text = re.sub(r"\nhead_effects:\n(  .*\n|\n)*", "\n", Path("probes/coref.yaml").read_text())
    text = re.sub(r"\n  - \{<<: \*shape, id: f[234678],.*", "", text)
    text = text.replace("[f1, f2, f3, f4]", "[f1]").replace("[f5, f6, f7, f8]", "[f5]")
    (tmp_path / "coref.yaml").write_text(text)
    assert "head_effects" not in text.split("referent_choice:")[1] and "id: f2" not in text
    shutil.copy("probes/occupations-bls.tsv", tmp_path / "occupations-bls.tsv")
    args = ["edit", str(out), *SWEEP, "--also", str(tmp_path / "coref.yaml"), "--also-k", "1"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    # the sweep is read back: its 4 kinds and the 2 fitted in order, the heads alone, the stream at one
    # layer and at several, the 7 MLP edits and tracing
    assert result.output.count("read from an earlier session") == 17
    table = pd.read_csv(out / "edits_transfer.csv")
    mlp = set(MLP_KINDS)  # the 4 modes at the prediction, 3 at the slot
    assert (
        set(table["kind"])
        == {"zero", "mean", "scale", "project", "mean-seq", "project-seq", "stream", "stream-layers"} | mlp
    )  # the stream's and MLPs' too
    per_layer = table.kind.isin({"stream", "stream-layers"} | mlp)  # a layer's edit has no k
    assert set(table.loc[per_layer, "k"]) == {0} and set(table.loc[~per_layer, "k"]) == {1}
    gap = table[
        (table.table == "compare_referent_choice") & (table.quantity == "correct") & (table.label == "gap")
    ]
    assert len(gap) == 15  # 6 head kinds, the stream at one layer and at several, 7 MLP edits
    # the pro - anti gap before is the original run's own statistic; after, the edited run's
    gap_of = lambda run: referent_choice(run).set_index("scope").loc["all", "gap"]  # its statistic alone
    before = gap_of(attnprobe.Run(out / "also" / "coref" / "original"))
    content = json.loads((out / "manifest.json").read_text())["model"]["weights_content"]
    for manifest in (out / "also" / "coref").glob("*/manifest.json"):  # the hashes the edit checked
        assert json.loads(manifest.read_text())["model"]["weights_content"] == content
    for row in gap.itertuples():
        name = row.kind if row.k == 0 else f"{row.kind}-k1"
        edited_run = attnprobe.Run(out / "also" / "coref" / name)
        after = gap_of(edited_run)
        assert np.isclose(row.mean_a, before) and np.isclose(row.mean_b, after)
        assert (
            np.isclose(row.mean_change, after - before)
            and row.change_ci_low <= row.mean_change <= row.change_ci_high
        )
        assert edited_run.manifest.edits[0]["name"] == name
        # what the row is: its runs and direction, the share of the gap removed, a sign test (not 0/1)
        assert (row.a, row.b, row.direction) == ("original", name, "change = b - a, per item")
        if row.mean_a:  # a share of nothing is none
            assert np.isclose(row.share_removed, -row.mean_change / row.mean_a)
            assert row.share_removed_ci_low <= row.share_removed <= row.share_removed_ci_high
        else:
            assert np.isnan(row.share_removed)
        binary = np.isfinite(
            getattr(row, "mcnemar_p", np.nan)
        )  # 0/1 outcomes: McNemar; others: the sign test
        assert binary or (row.n_rose + row.n_fell <= row.n_items and 0 <= row.sign_p <= 1)
    assert (table["change_p_holm"] >= table["change_p"] - 1e-12).all()  # Holm over the whole table
    # the report shows the transfer and each top head alone
    assert CliRunner().invoke(main, ["report", str(out)]).exit_code == 0
    html = (out / "report.html").read_text()
    assert "attnprobe edit --also" in html and "referent_choice correct gap" in html
    assert "Each of the top heads zeroed alone" in html
    # the sweep: its table (project at k 1 and 2, and in the transfer rows), the null's floor shown
    assert "Editing the heads (attnprobe edit)" in html and html.count('<td class="text">project</td>') >= 2
    assert "<th>its floor</th>" in html and "<td>0.5</td>" in html
    # the found heads' share on the items the random sets ran on, beside the random sets' figures
    sweep = pd.read_csv(out / "edits.csv").iloc[0]
    shares = (sweep.gradient_removed, sweep.gradient_removed_sampled, sweep.random_removed_mean)
    assert "<th>removed, sampled items</th>" in html
    assert "".join(f"<td>{100 * v:.0f}%</td>" for v in shares) in html
    # the path parts: a row per receiver, each head with its role by size
    parts = pd.read_csv(out / "paths_parts.csv").drop_duplicates("receiver")
    assert "value at the occupation: of the output" in html and len(parts) >= 2
    for row in parts[parts["role"].notna()].itertuples():
        assert f'<td class="text">{row.receiver}</td><td class="text">{row.role}</td>' in html
    # a suite with no bias to measure is refused before the sweep, in one line
    (tmp_path / "plain.yaml").write_text(
        "name: plain\nslots: {x: {values: [a, b]}}\ntemplates: [{id: t, text: 'The {x} said'}]\n"
        "attention: [{source: x, targets: x}]\n"
    )
    bad = CliRunner().invoke(main, ["edit", str(out), *SWEEP, "--also", str(tmp_path / "plain.yaml")])
    one_line_error(bad, "--also", "plain.yaml: the suite compares no two labels")


def test_a_run_inside_an_edited_block_is_refused_instead_of_recorded_unedited(tiny, tmp_path):
    with (
        edited(tiny, Zero(heads=((1, 1),))),
        pytest.raises(attnprobe.RunError, match="inside `attnprobe.edited"),
    ):
        attnprobe.run_suite(edit_suite(tmp_path), tiny, out=tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_edits_without_tensors_are_told_apart_by_what_they_do(tiny, tmp_path):
    """Zero and scale edits store no tensors: keyed by the tensors' hash alone, `run --edit` of one
    into a directory holding a run of another reused that run's numbers under the new edit's name."""
    one = load_edit(save_edit(Zero(heads=((0, 1),)), tmp_path / "zero-k1", tiny, {}))
    two = load_edit(save_edit(Zero(heads=((1, 0), (0, 1))), tmp_path / "zero-k2", tiny, {}))
    half = load_edit(save_edit(Scale(heads=((0, 1),), factor=0.5), tmp_path / "scale-a", tiny, {}))
    other = load_edit(save_edit(Scale(heads=((0, 1),), factor=0.25), tmp_path / "scale-b", tiny, {}))
    assert one.record["sha256"] == two.record["sha256"]  # the same (empty) tensor file
    assert len({one.key, two.key, half.key, other.key}) == 4
    again = load_edit(save_edit(Zero(heads=((0, 1),)), tmp_path / "again" / "zero-k1", tiny, {"other": 1}))
    assert again.key == one.key  # where an edit came from is not what it does
    suite, out = edit_suite(tmp_path), tmp_path / "run"
    attnprobe.run_suite(suite, tiny, out=out, edits=(one,), progress=False, log=lambda m: None)
    with pytest.raises(attnprobe.RunError, match=r"holds a run with other settings \(edits differ\)"):
        attnprobe.run_suite(suite, tiny, out=out, edits=(two,), progress=False, log=lambda m: None)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_saved_edit_with_a_non_finite_number_is_never_applied(tiny, tmp_path, value):
    import hashlib
    import json

    from safetensors.torch import load_file, save_file

    scale = save_edit(Scale(heads=((0, 1),), factor=0.5), tmp_path / "scale", tiny, {})
    record = json.loads(scale.read_text())
    record["parameters"]["factor"] = value  # json writes NaN and Infinity, and reads them back
    scale.write_text(json.dumps(record))
    with pytest.raises(attnprobe.AttnprobeError, match="factor not finite"):
        load_edit(scale)
    L, H, D = tiny.info.n_layers, tiny.info.n_heads, tiny.info.head_dim
    heads = ((0, 1), (1, 0))
    for edit in (
        Mean(heads=heads, means=torch.randn(L, H, D)),
        Project(heads=heads, directions=torch.randn(L, H, D)),
    ):
        saved = save_edit(edit, tmp_path / edit.kind, tiny, {})
        tensors_path = saved.with_suffix(".safetensors")
        tensors = load_file(str(tensors_path))
        name = next(iter(tensors))
        tensors[name][0, 0] = value
        save_file(tensors, str(tensors_path), metadata={"format": "attnprobe-edit"})
        record = json.loads(saved.read_text())
        record["sha256"] = hashlib.sha256(tensors_path.read_bytes()).hexdigest()  # not merely damaged
        saved.write_text(json.dumps(record))
        with pytest.raises(attnprobe.AttnprobeError, match=f"{name} not finite"):
            load_edit(saved)


@pytest.mark.parametrize("heads", [((-1, -1),), ((0, -1),), ((2, 0),), ((0, 2),)])
def test_a_head_outside_the_model_is_refused_not_counted_from_the_end(tiny, heads):
    with pytest.raises(
        attnprobe.AttnprobeError, match=r"is not in this model \(2 layers L0-L1, 2 heads H0-H1"
    ):
        with edited(tiny, Zero(heads=heads)):
            pass


def _replace_record(path, change):
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


@pytest.mark.parametrize(
    "kind, change, message",
    [
        (
            "scale",
            lambda r: r["parameters"].update(factor="half"),
            "parameter factor is 'half', not a number",
        ),
        (
            "scale",
            lambda r: r["parameters"].update(factor=1e308),
            r"parameter factor is 1e\+308, beyond \+-100",
        ),
        ("resample", lambda r: r["parameters"].update(seed="3"), "parameter seed is '3', not a whole number"),
        ("resample", lambda r: r["parameters"].update(seed=2**64), "outside 0 .. 2\\*\\*63 - 1"),
        ("resample", lambda r: r["parameters"].update(seed=True), "not a whole number"),
        ("zero", lambda r: r.update(heads=[[0, 1]]), "heads must be a string"),
        ("zero", lambda r: r.update(heads="L9H0"), "head L9H0 is not in this model"),
        ("scale", lambda r: r.update(parameters=[0.5]), "are not the scale kind's"),
        ("zero", lambda r: r.update(model=[2, 2]), "not a JSON object with a model"),
    ],
)
def test_a_saved_edit_with_values_of_the_wrong_type_is_one_error(tiny, tmp_path, kind, change, message):
    """Issue 55: each was applied and failed mid-run with a traceback, or read a list as heads."""
    made = {
        "zero": Zero(heads=((0, 1),)),
        "scale": Scale(heads=((0, 1),), factor=0.5),
        "resample": Resample(heads=((0, 1),), bank=torch.zeros(2, 2, 3, 8), seed=1),
    }[kind]
    path = save_edit(made, tmp_path / kind, tiny, {})
    _replace_record(path, change)
    with pytest.raises(AttnprobeError, match=message):
        load_edit(path)


def test_a_saved_edit_of_the_wrong_width_or_nested_deep_is_one_error(tiny, tmp_path):
    L, H, D = tiny.info.n_layers, tiny.info.n_heads, tiny.info.head_dim
    path = save_edit(Mean(heads=((0, 1),), means=torch.zeros(L, H, D)), tmp_path / "mean", tiny, {})
    _replace_record(path, lambda r: r["model"].update(head_dim=D + 1))
    with pytest.raises(AttnprobeError, match=f"tensor means is {D} wide; the heads are {D + 1}"):
        load_edit(path)
    _replace_record(path, lambda r: r["model"].update(head_dim=D, n_layers=10**12))  # was a huge allocation
    with pytest.raises(AttnprobeError, match="not three whole numbers up to 65,536"):
        load_edit(path)
    _replace_record(path, lambda r: r["model"].update(n_layers=2**16, n_heads=2**16))
    with pytest.raises(AttnprobeError, match="more heads than any model"):
        load_edit(path)
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(AttnprobeError, match="not an edit record"):
        load_edit(path)


RECORD_FIELDS = [
    ("kind",),
    ("heads",),
    ("parameters",),
    ("parameters", "factor"),
    ("parameters", "seed"),
    ("model",),
    ("model", "n_layers"),
    ("model", "n_heads"),
    ("model", "head_dim"),
    ("model", "hidden_size"),
    ("sha256",),
    ("format_version",),
    ("tensors",),
]
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@settings(
    max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(kind=st.sampled_from(["zero", "scale", "mean"]), field=st.sampled_from(RECORD_FIELDS), value=ANY_JSON)
def test_fuzzed_edit_records_are_read_and_applied_or_one_error(
    tiny, saved_kinds, tmp_path, kind, field, value
):
    """Any field of a saved edit replaced by any JSON value (1,000 examples in `make test`): the edit
    loads and runs a forward pass, or loading or applying it raises one AttnprobeError; never another
    exception, never a non-finite output."""
    record = json.loads(saved_kinds[kind].read_text())
    target = record
    for key in field[:-1]:
        target = target.setdefault(key, {}) if isinstance(target, dict) else {}
    if isinstance(target, dict):
        target[field[-1]] = value
    path = tmp_path / f"{kind}.json"
    shutil.copy(saved_kinds[kind].with_suffix(".safetensors"), path.with_suffix(".safetensors"))
    path.write_text(json.dumps(record))
    try:
        loaded = load_edit(path)
        with edited(tiny, loaded):  # applying checks the model's shape against the record's
            assert torch.isfinite(_logits(tiny)).all()
    except AttnprobeError:
        return


@pytest.fixture(scope="module")
def saved_kinds(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("kinds")
    L, H, D = tiny.info.n_layers, tiny.info.n_heads, tiny.info.head_dim
    made = {
        "zero": Zero(heads=((0, 1),)),
        "scale": Scale(heads=((0, 1),), factor=0.5),
        "mean": Mean(heads=((1, 0),), means=torch.zeros(L, H, D)),
    }
    return {kind: save_edit(edit, folder / kind, tiny, {}) for kind, edit in made.items()}


def test_a_circuit_knockout_holds_its_heads_and_mlps_at_their_means_and_reads_back(tiny, tmp_path):
    """A circuit saved by `edit --circuits` (CircuitKnockout): within the edit head L1H0's output and
    MLP0's (what it adds) are their means over the reference tokens at every position of any
    prompt, layer 0's heads are untouched; saved and loaded it gives the same logits, and
    `run --edit` applies it. A knockout of MLPs alone is an edit too."""
    from attnprobe.edits.estimate import token_means
    from attnprobe.edits.layers.several import MlpLayers
    from attnprobe.edits.saved import CircuitKnockout
    from attnprobe.edits.sweep.fitted import _mean_mlp
    from attnprobe.intervene.engine import record

    prompts = [torch.tensor(tiny.tokenizer(t)["input_ids"]) for t in ("The nurse said that", "A cook left")]
    clean = record(tiny.model, prompts)
    reference = record(tiny.model, [torch.tensor(tiny.tokenizer("The person said")["input_ids"])])
    means, mlp = token_means(reference), _mean_mlp(tiny, reference, 0)
    knockout = CircuitKnockout(Mean(((1, 0),), means), MlpLayers((mlp,)))
    assert knockout.sites() == "L1H0, MLP0"
    with edited(tiny, knockout):
        after = record(tiny.model, prompts)
    valid = torch.arange(clean.ids.shape[1])[None] < clean.lengths[:, None]
    assert torch.allclose(after.outputs[1][:, 0][valid], means[1, 0].expand(int(valid.sum()), -1), atol=1e-5)
    assert torch.allclose(after.mlp[0][valid], mlp.params[2].expand(int(valid.sum()), -1), atol=1e-5)
    assert torch.equal(after.outputs[0], clean.outputs[0])
    assert not torch.allclose(after.outputs[1][:, 1], clean.outputs[1][:, 1])  # downstream of MLP0
    path = save_edit(knockout, tmp_path / "circuit-person", tiny, {"comparison": "person"})
    loaded = load_edit(path)
    with edited(tiny, knockout):
        expected = _logits(tiny)
    with edited(tiny, loaded):
        assert torch.allclose(_logits(tiny), expected, atol=1e-6)
    assert not torch.allclose(_logits(tiny), expected, atol=1e-4)
    only_mlps = CircuitKnockout(None, MlpLayers((mlp,)))
    with edited(tiny, load_edit(save_edit(only_mlps, tmp_path / "circuit-mlps", tiny, {}))):
        assert not torch.allclose(_logits(tiny), expected, atol=1e-4)
    suite = Path(__file__).parents[2] / "probes" / "minimal.yaml"
    args = ["run", str(suite), "--model", tiny.info.spec, "--out", str(tmp_path / "run"), "--no-report"]
    result = CliRunner().invoke(main, [*args, "--edit", str(path)])
    assert result.exit_code == 0, result.output
    assert (
        json.loads((tmp_path / "run" / "manifest.json").read_text())["edits"][0]["kind"] == "circuit_knockout"
    )
