"""Hostile input, round 6 (issue 67): designs the edits cannot measure, controls that leave the
factual term unidentified, links planted in a run, runs whose weights cannot be told apart, the
notebook's writes, --also misuse, and the round-5 cases still open. Each is one line naming the file
or argument and the fix, before the expensive work, and nothing is written outside the run."""

import json
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from conftest import edit_suite, one_line_error, unswept_copy
from test_published_formats import EXAMPLES, _stereoset_suite
from transformers import AutoModelForCausalLM

import attnprobe
from attnprobe.cli import main
from attnprobe.errors import AnalysisError, AttnprobeError, SuiteError
from attnprobe.suite import load_suite

SWEEP = ["--kinds", "zero", "--k", "1", "--draws", "2", "--texts", "2", "--alone", "0"]


def _invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _run(tmp_path, model_dir, occupations=None, out="run", extra=()):
    suite = edit_suite(tmp_path)
    if occupations is not None:
        rows = "".join(f"{o}\t{p}\n" for o, p in occupations)
        (tmp_path / "jobs.tsv").write_text("occupation\tbls_pct_female\n" + rows)
    result = _invoke("-q", "run", suite, "--model", model_dir, "--out", tmp_path / out, "--no-report", *extra)
    assert result.exit_code == 0, result.output
    return suite, tmp_path / out


@pytest.mark.parametrize(
    "occupations, halves",
    [
        ([("nurse", 88), ("pilot", 9)], "1 and 1"),  # round 5: heads chosen from all-NaN scores
        ([("nurse", 88), ("pilot", 9), ("chef", 88)], "2 and 1"),  # one half holds one unit
    ],
)
def test_a_design_whose_halves_have_no_gradient_is_refused_before_the_model_loads(
    tiny_llama_dir, tmp_path, occupations, halves
):
    suite, out = _run(tmp_path, tiny_llama_dir, occupations)
    result = _invoke("edit", out, *SWEEP, "--paths")
    one_line_error(result, f"{suite}: ", f"this run's halves have {halves}", "at least 4 occupations")
    assert "loading" not in result.output and not (out / "edits.csv").exists()


def _control(tmp_path, rows):
    suite = edit_suite(tmp_path)
    (tmp_path / "definitional.tsv").write_text(
        "prompt\tlabel\tpair\tset\tphrase\n" + "".join("\t".join(r) + "\n" for r in rows)
    )
    return suite


def test_a_control_set_of_one_label_leaves_the_factual_term_unidentified_and_is_refused(tmp_path):
    rows = [("The queen said that", "female", "king/queen", "nouns", "the queen")] * 1
    rows += [("The mother said that", "female", "father/mother", "nouns", "the mother")]
    suite = _control(tmp_path, rows)
    with pytest.raises(
        SuiteError, match=r"definitional.tsv: the set 'nouns' carries the label 'female' only"
    ):
        load_suite(suite)
    rows += [("The king said that", "male", "king/queen", "frame", "the king")]  # the other label elsewhere
    with pytest.raises(SuiteError, match=r"the set 'nouns' carries the label 'female' only"):
        load_suite(_control(tmp_path, rows))


def test_a_control_prompt_with_both_labels_is_refused(tmp_path):
    rows = [
        ("The king said that", "male", "king/queen", "nouns", "the king"),
        ("The king said that", "female", "king/queen", "nouns", "the king"),
    ]
    with pytest.raises(
        SuiteError, match=r"definitional.tsv:3: this prompt is also row 2's, with the label 'male'"
    ):
        load_suite(_control(tmp_path, rows))


def test_the_suite_copys_list_planted_as_a_link_is_replaced_not_followed(tiny_llama_dir, tmp_path):
    suite, out = _run(tmp_path, tiny_llama_dir)
    (tmp_path / "precious.txt").write_text("mine")
    (out / "suite" / "files.json").unlink()
    (out / "suite" / "files.json").symlink_to(tmp_path / "precious.txt")
    result = _invoke("-q", "run", suite, "--model", tiny_llama_dir, "--out", out, "--no-report", "--fresh")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "precious.txt").read_text() == "mine"
    assert not (out / "suite" / "files.json").is_symlink()


def test_a_data_folder_planted_as_a_link_in_the_suite_copy_is_refused(tiny_llama_dir, tmp_path):
    (tmp_path / "data").mkdir()
    suite = edit_suite(tmp_path / "data")
    moved = tmp_path / "e.yaml"
    moved.write_text(
        suite.read_text().replace("jobs.tsv", "data/jobs.tsv").replace("definitional", "data/definitional")
    )
    out, outside = tmp_path / "run", tmp_path / "outside"
    assert _invoke("-q", "run", moved, "--model", tiny_llama_dir, "--out", out, "--no-report").exit_code == 0
    assert (out / "suite" / "data" / "jobs.tsv").is_file()
    shutil.rmtree(out / "suite" / "data")
    outside.mkdir()
    (out / "suite" / "data").symlink_to(outside)
    result = _invoke("-q", "run", moved, "--model", tiny_llama_dir, "--out", out, "--no-report", "--fresh")
    one_line_error(result, f"{out / 'suite' / 'data'} is a symbolic link", "writes only inside the run")
    assert list(outside.iterdir()) == []


def test_an_edit_of_a_run_without_the_weights_content_hash_is_refused(edited_run, tmp_path):
    run = unswept_copy(edited_run, tmp_path)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["model"].pop("weights_content")
    (run / "manifest.json").write_text(json.dumps(manifest))
    result = _invoke("edit", run, *SWEEP)
    one_line_error(result, "records no content hash of its model's weights", "run --fresh")
    assert "loading" not in result.output


def _other_weights(tiny_llama_dir, where):
    shutil.copytree(tiny_llama_dir, where)
    model = AutoModelForCausalLM.from_pretrained(where)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] += 1e-2
    model.save_pretrained(where)
    return where


def test_the_notebook_refuses_another_models_attention_and_writes_into_no_run(
    edited_run, tiny_llama_dir, tmp_path
):
    run = attnprobe.Run(unswept_copy(edited_run, tmp_path))
    other = attnprobe.load_model(str(_other_weights(tiny_llama_dir, tmp_path / "other")))
    with pytest.raises(AnalysisError, match="the model is not the one this run was made with"):
        run.attention_matrix(0, 0, 0, model=other)
    own = run.attention_matrix(0, 0, 0, model=attnprobe.load_model(str(tiny_llama_dir)))
    assert len(own) == len(own.columns) and abs(own.sum(axis=1) - 1).max() < 1e-5
    manifest = (run.directory / "manifest.json").read_bytes()
    for path, phrase in [
        (run.directory / "manifest.json", "is a run directory, and the notebook never writes into one"),
        (run.directory / "figures" / "x.csv", "is a run directory"),
        (None, "give a file name"),
        (tmp_path / "missing" / "x.csv", "the folder .* does not exist"),
        (tmp_path, "it is a directory"),
    ]:
        with pytest.raises(AnalysisError, match=phrase):
            run.export("head_stats", path)
    (tmp_path / "innocent.csv").symlink_to(run.directory / "manifest.json")  # a link into the run
    with pytest.raises(AnalysisError, match="is a run directory"):
        run.export("head_stats", tmp_path / "innocent.csv")
    assert (run.directory / "manifest.json").read_bytes() == manifest
    written = run.export("head_stats", tmp_path / "head_stats.csv")
    assert len(pd.read_csv(written)) == len(run.head_stats)


def test_merge_of_shards_made_with_different_weights_is_refused(tiny_llama_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    suite = edit_suite(tmp_path)
    first = _invoke("-q", "run", suite, "--model", model, "--out", tmp_path / "a", "--shard", "1/2")
    assert first.exit_code == 0, first.output
    shutil.rmtree(model)
    _other_weights(tiny_llama_dir, model)  # other weights under the same path
    second = _invoke("-q", "run", suite, "--model", model, "--out", tmp_path / "b", "--shard", "2/2")
    assert second.exit_code == 0, second.output
    shards = (tmp_path / "a" / "shard-1-of-2", tmp_path / "b" / "shard-2-of-2")
    merged = _invoke("merge", tmp_path / "m", *shards, "--no-report")
    one_line_error(merged, "the shards were made with different weights under one model path")
    assert not (tmp_path / "m" / "logprobs.csv").exists()


@pytest.mark.parametrize(
    "also, phrase",
    [
        (["--also-k", "0"], "--also-k 0: the edits --also applies are those of the sweep's numbers"),
        (["--also-k", "3"], "--also-k 3: the edits --also applies"),
        (["--also", "SUITE"], "--also SUITE is given twice (suite 'e')"),
        (["--also", "COPY"], "--also SUITE and --also COPY are both (suite 'e')"),
        (["--also", "/dev/null"], "/dev/null: suite file is not a regular file"),
    ],
)
def test_also_misuse_is_refused_before_the_sweep(edited_run, tmp_path, also, phrase):
    run, suites = unswept_copy(edited_run, tmp_path), tmp_path / "suites"
    shutil.copytree(edited_run.parent, suites, ignore=shutil.ignore_patterns("run"))
    shutil.copy(suites / "e.yaml", suites / "copy.yaml")  # beside it: its data files resolve
    suite = suites / "e.yaml"
    names = {"SUITE": str(suite), "COPY": str(suites / "copy.yaml")}
    for name, path in names.items():
        phrase = phrase.replace(name, path)
    result = _invoke("edit", run, *SWEEP, "--also", suite, *(names.get(a, a) for a in also))
    one_line_error(result, phrase)
    assert "loading" not in result.output and not list((run / "chunks").glob("edits-*"))


def test_an_edits_folder_planted_as_a_link_is_refused_before_the_sweep(edited_run, tmp_path):
    run = unswept_copy(edited_run, tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (run / "edits").symlink_to(tmp_path / "elsewhere")
    result = _invoke("edit", run, *SWEEP)
    one_line_error(result, f"{run / 'edits'} is a symbolic link")
    assert "loading" not in result.output and list((tmp_path / "elsewhere").iterdir()) == []


def test_load_edit_of_nothing_is_one_line():
    for bad in (None, "", 3):
        with pytest.raises(AttnprobeError, match=r"load_edit\(.*\): give the path of a saved edit"):
            attnprobe.load_edit(bad)


def test_a_saved_edit_fitted_on_other_weights_of_the_same_shape_is_said(edited_run, tiny_llama_dir, tmp_path):
    other = _other_weights(tiny_llama_dir, tmp_path / "other")
    suite = edit_suite(tmp_path)
    out = tmp_path / "edited"
    args = [
        "run",
        suite,
        "--model",
        other,
        "--out",
        out,
        "--no-report",
        "--edit",
        edited_run / "edits" / "mean-k1.json",
    ]
    result = _invoke(*args)
    assert result.exit_code == 0, result.output
    assert "note: the edit mean-k1 was fitted on other weights" in result.output
    assert attnprobe.Run(out).manifest.edits[0]["same_weights"] is False


def test_stereoset_intersentence_only_and_float_ids_say_what_is_wrong(tmp_path):
    (tmp_path / "dev.json").write_text(json.dumps({"data": {"intersentence": EXAMPLES, "intrasentence": []}}))
    (tmp_path / "s.yaml").write_text(
        "name: s\nsentences:\n  - {id: intra, file: dev.json, columns: stereoset}\nlikelihood: {}\n"
    )
    with pytest.raises(
        SuiteError, match="data.intrasentence is empty; its examples are all data.intersentence"
    ):
        load_suite(tmp_path / "s.yaml")
    floats = json.loads(json.dumps(EXAMPLES))
    floats[1]["id"] = 2.5
    with pytest.raises(SuiteError, match=r"example 2 has the id 2.5, not a string"):
        _stereoset_suite(tmp_path, floats, None)


def test_a_tsv_cell_keeps_its_quotes(tmp_path):
    suite = edit_suite(tmp_path)
    (tmp_path / "jobs.tsv").write_text('occupation\tbls_pct_female\n"Weird Al" Yankovic\t10\nnurse\t88\n')
    texts = [p.text for p in load_suite(suite).prompts]
    assert any('The "Weird Al" Yankovic said that' in t for t in texts)


def test_an_edit_of_a_one_template_design_clusters_by_unit_alone(tiny_llama_dir, tmp_path):
    """Round 6: a ZeroDivisionError in the joint regression's template clustering (one cluster)."""
    suite = edit_suite(tmp_path)
    text = suite.read_text().replace(
        '  - {id: told, text: "The {occupation} told us that {pronoun} was tired."}\n', ""
    )
    suite.write_text(text)
    out = tmp_path / "run"
    assert _invoke("-q", "run", suite, "--model", tiny_llama_dir, "--out", out, "--no-report").exit_code == 0
    result = _invoke("edit", out, *SWEEP)
    assert result.exit_code == 0, result.output
    table = pd.read_csv(out / "edits.csv")
    assert table["gradient_removed"].notna().all() and table["definitional_gap_kept"].notna().all()


def test_the_joint_fit_of_one_template_is_the_one_way_fit_by_unit():
    from attnprobe.stats.keeping.joint import stacked_fit

    rng = np.random.default_rng(0)
    X, Y = np.c_[np.ones(40), rng.normal(size=40)], rng.normal(size=(40, 2))
    units = np.repeat(np.arange(10), 4)
    one = stacked_fit(X, Y, [units, np.zeros(40, dtype=int)])
    assert one["G"] == [10]
    np.testing.assert_allclose(one["cov"], one["one_way"][0], atol=1e-15)
    two = stacked_fit(X, Y, [units, np.tile([0, 1], 20)])
    assert two["G"] == [10, 2] and not np.allclose(two["cov_raw"], one["cov_raw"])


def test_a_link_planted_below_also_is_refused_before_the_sweep(edited_run, tmp_path):
    run = unswept_copy(edited_run, tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (run / "also").mkdir()
    (run / "also" / "e").symlink_to(tmp_path / "elsewhere")
    result = _invoke("edit", run, *SWEEP, "--also", edited_run.parent / "e.yaml")
    one_line_error(result, f"{run / 'also' / 'e'} is a symbolic link")
    assert "loading" not in result.output and list((tmp_path / "elsewhere").iterdir()) == []


def test_a_relative_model_path_read_from_another_folder_is_checked_by_its_weights(
    tiny_llama_dir, tmp_path, monkeypatch
):
    """Round 6: from another working directory, the manifest's relative model path named other
    weights, and attention_matrix recomputed the run's prompt with them."""
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
    shutil.copytree(tiny_llama_dir, tmp_path / "a" / "model")
    _other_weights(tiny_llama_dir, tmp_path / "b" / "model")
    suite = edit_suite(tmp_path)  # from the repository root: it copies the shipped control file
    monkeypatch.chdir(tmp_path / "a")
    assert (
        _invoke("-q", "run", suite, "--model", "model", "--out", tmp_path / "run", "--no-report").exit_code
        == 0
    )
    run = attnprobe.Run(tmp_path / "run")
    assert len(run.attention_matrix(0, 0, 0)) > 0  # from the folder it was made in: its own weights
    monkeypatch.chdir(tmp_path / "b")
    with pytest.raises(AnalysisError, match="the model is not the one this run was made with"):
        run.attention_matrix(0, 0, 0)
