"""The run directory: --fresh, output names, options refused before anything runs, progress lines off a
terminal, tables that round-trip."""

import json
import re

import pandas as pd
import pytest
from conftest import EFFECT_SUITE, transformers_tokenizer

import attnprobe
from attnprobe.errors import RunError
from attnprobe.report import load_tables, write_report
from attnprobe.run import model_name
from attnprobe.run.files import fresh, layout

OLD_RUN = {"fingerprint": "old", "settings": {}, "versions": {}, "suite": {"name": "gender"}}


def test_fresh_removes_every_artefact_of_the_old_run_and_nothing_else(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps(OLD_RUN))
    for name in (
        "prompts.csv",
        "head_effects_items.parquet",
        "head_effects_totals.csv",
        "head_stats.csv",
        "report.html",
        "summary.json",
        # an old model's `attnprobe edit --paths` tables, which the new model's report would show
        "paths.csv",
        "paths_edges.parquet",
        "paths_items.parquet",
        "readout.csv",
        "readout_states.parquet",
    ):
        (tmp_path / name).write_text("old")
    (tmp_path / "chunks").mkdir()
    (tmp_path / "figures").mkdir()
    for name in (
        "00000.done",
        "00000.attention.parquet",
        "effects-00003.items.parquet",
        "selected-00000.done",
        ".00001.done.tmp",
    ):
        (tmp_path / "chunks" / name).write_text("{}")
    (tmp_path / "figures" / "difference_occupation.png").write_text("png")
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "chunks" / "my-notes.txt").write_text("mine too")  # another tool's file among the chunks
    kept = []
    assert (
        fresh.prepare_directory(tmp_path, "new", resume=False, suite_name="gender", log=kept.append) is None
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chunks", "notes.txt"]
    assert [p.name for p in (tmp_path / "chunks").iterdir()] == ["my-notes.txt"]
    kept_now = "notes.txt, chunks/my-notes.txt"  # the user's files, wherever they are, are named
    assert kept == [f"--fresh kept 2 files attnprobe did not write in {tmp_path}: {kept_now}"]


def test_fresh_refuses_another_tools_manifest_and_another_suites_run(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"name": "someone else's"}))
    (tmp_path / "prompts.csv").write_text("theirs")
    with pytest.raises(RunError, match="was not written by attnprobe; nothing was deleted"):
        fresh.prepare_directory(tmp_path, "new", resume=False, suite_name="gender")
    assert (tmp_path / "prompts.csv").read_text() == "theirs"
    (tmp_path / "manifest.json").write_text(json.dumps(OLD_RUN))
    with pytest.raises(
        RunError,
        match=f"{tmp_path} holds a run of suite 'gender', not 'coref'; --fresh replaces only a run "
        "of the same suite: choose another --out \\(nothing was deleted\\)",
    ):
        fresh.prepare_directory(tmp_path, "new", resume=False, suite_name="coref")
    assert (tmp_path / "prompts.csv").read_text() == "theirs"


def test_output_name_of_a_local_checkpoint(tmp_path, monkeypatch):
    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    assert model_name("./ckpt") == "ckpt" and model_name("ckpt/") == "ckpt"  # was '._ckpt'
    assert model_name("org/model") == "org_model" and model_name("/x/SmolLM2.Q4.gguf") == "SmolLM2.Q4"


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--shard", "3/2"],
            "Invalid value for '--shard': '3/2': K/N needs 1 <= K <= N; see `attnprobe run --help`",
        ),
        (["--shard", "x"], "Invalid value for '--shard': 'x': write K/N, e.g. 1/4"),
        (["--batch-size", "0"], "Invalid value for '--batch-size'"),
    ],
)
def test_bad_options_are_one_line_before_anything_runs(tmp_path, args, message):
    from click.testing import CliRunner

    from attnprobe.cli import main

    result = CliRunner().invoke(main, ["run", "probes/gender.yaml", "--out", str(tmp_path / "o"), *args])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert (
        result.output.startswith("attnprobe: error: ")
        and message in result.output
        and not (tmp_path / "o").exists()
    )


def test_a_run_off_a_terminal_logs_each_chunk(tiny_llama_dir, tmp_path):
    """Issue 17: with stderr not a terminal (notebooks, nohup, SLURM, CI) a run used to print nothing
    for minutes; now one line per finished chunk of prompts and of head-effects items."""
    from click.testing import CliRunner

    from attnprobe.cli import main

    (tmp_path / "fx.yaml").write_text(EFFECT_SUITE)
    result = CliRunner().invoke(
        main,
        [
            "run",
            str(tmp_path / "fx.yaml"),
            "--model",
            str(tiny_llama_dir),
            "--out",
            str(tmp_path / "out"),
            "--chunk-size",
            "8",
            "--batch-size",
            "4",
        ],
    )
    assert result.exit_code == 0, result.output
    assert re.search(
        r"attnprobe run: chunk 1 of 3 done, 8 of 20 prompts, \d+ s, about \d+ s left", result.output
    )
    assert "attnprobe run: chunk 3 of 3 done, 20 of 20 prompts" in result.output
    assert re.search(r"head effects: chunk 1 of 1 done, 10 of 10 items", result.output)
    assert re.search(r"selected heads: chunk 1 of 1 done, 10 of 10 items", result.output)


def test_tables_round_trip_as_computed(tiny_llama_dir, tmp_path):
    """Issue 17: tables came back from CSV with spreadsheet quote prefixes ('-...) and dtypes that
    depended on the cache. Parquet is now what readers read; the CSV stays a safe export."""
    from attnprobe.run import plan
    from attnprobe.suite import load_suite as load

    (tmp_path / "s.yaml").write_text(
        "name: s\nslots:\n  x: ['-minus', '=sum(1)', plain]\n"
        "  p: {values: [{label: a, value: she}, {label: b, value: he}]}\ncontrast: p\n"
        "templates:\n  - {id: t, text: 'The {x} said that {p} left.'}\n"
        "attention: [{source: p, targets: x}]\n"
    )
    run = attnprobe.run_suite(
        tmp_path / "s.yaml",
        model=str(tiny_llama_dir),
        out=tmp_path / "out",
        progress=False,
        log=lambda m: None,
    )
    suite = load(tmp_path / "s.yaml")
    tokenizer = transformers_tokenizer(tiny_llama_dir)
    expected = layout.prompts_table(plan.encode_prompts(suite, list(suite.prompts), tokenizer, 10_000))
    pd.testing.assert_frame_equal(attnprobe.Run(run.directory).prompts, expected)
    assert "'-minus" in (run.directory / "prompts.csv").read_text()  # the spreadsheet export is neutralised
    first = attnprobe.Run(run.directory).condition_means  # computed
    attnprobe.Run(run.directory).report()
    pd.testing.assert_frame_equal(
        attnprobe.Run(run.directory).condition_means, first
    )  # from the cache, same dtypes
    (run.directory / "head_effects.csv").write_text("stale")  # left by an earlier run with head effects
    load_tables(attnprobe.Run(run.directory), refresh=True)
    assert not (run.directory / "head_effects.csv").exists()  # removed, never linked as this run's
    (tmp_path / "afile").write_text("x")  # report --out under a file: one line, before any statistics
    with pytest.raises(RunError, match="afile is a file, not a directory; choose another place"):
        write_report(run.directory, tmp_path / "afile" / "deeper" / "report.html")
    with pytest.raises(RunError, match="is a directory; give a file name"):
        write_report(run.directory, tmp_path)


def test_out_at_the_suites_data_is_refused_before_anything_is_written(tmp_path, tiny_llama_dir):
    """A sentence file named prompts.csv beside the suite, and --out the suite's directory: the run
    used to overwrite the user's data with its own prompts.csv."""
    from click.testing import CliRunner

    from attnprobe.cli import main

    data = tmp_path / "prompts.csv"
    data.write_text("text\n[The nurse] said that [she] left.\n[The mechanic] said that [he] left.\n")
    (tmp_path / "s.yaml").write_text(
        "name: s\nsentences:\n  - {id: b, file: prompts.csv, spans: [occupation, pronoun]}\n"
        "attention:\n  - {source: pronoun, targets: occupation}\n"
    )
    before = sorted(p.name for p in tmp_path.iterdir())
    result = CliRunner().invoke(
        main, ["run", str(tmp_path / "s.yaml"), "--model", str(tiny_llama_dir), "--out", str(tmp_path)]
    )
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    line = result.output.strip().splitlines()[-1]
    assert f"--out {tmp_path} is the directory of the suite's s.yaml" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == before and data.read_text().startswith("text\n[The")


def test_a_planted_lock_link_is_refused_without_touching_its_target(tmp_path):
    from attnprobe.store import exclusive

    target = tmp_path / "elsewhere" / "target"
    target.parent.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").symlink_to(target)
    with pytest.raises(RunError, match="is a symbolic link; attnprobe writes only inside the run directory"):
        with exclusive(run):
            pass
    assert not target.exists()


def _edit(run):
    """A small sweep of `run` through the real CLI."""
    from click.testing import CliRunner

    from attnprobe.cli import main
    from attnprobe.stats.edits import edit_tables

    args = ["edit", str(run), "--kinds", "zero", "--k", "1", "--draws", "2", "--texts", "8", "--alone", "0"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    # with no head alone, the item file still types its numbers (it held strings), and the edits
    # table recomputes from it alone
    raw = pd.read_parquet(run / "edits_items.parquet")
    assert all(pd.api.types.is_numeric_dtype(raw[c]) for c in ("k", "draw", "index", "y", "kl", "loss"))
    again, _ = edit_tables(raw[raw["kind"].isin(["none", "zero"])], 2)  # 2 heads per layer
    pd.testing.assert_frame_equal(
        again.drop(columns="note"), pd.read_parquet(run / "edits.parquet")[again.columns.drop("note")]
    )
    return run


def _run(suite, model_dir, out, *extra):
    from click.testing import CliRunner

    from attnprobe.cli import main

    args = ["run", str(suite), "--model", str(model_dir), "--out", str(out), "--no-report", *extra]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return out


def test_a_run_moved_away_from_its_suite_is_edited_from_its_own_copy(tiny_llama_dir, tmp_path):
    """attnprobe edit reopens a run wherever it is (RunFiles.reopen): the run keeps a copy of its
    suite and data files, so a run moved elsewhere, its suite deleted, edits to the same tables."""
    import shutil

    from conftest import edit_suite, same_edit_tables

    made = tmp_path / "made"
    made.mkdir()
    run = _run(edit_suite(made), tiny_llama_dir, made / "run")
    assert sorted(p.name for p in (run / "suite").iterdir()) == [
        "definitional.tsv",
        "e.yaml",
        "files.json",
        "jobs.tsv",
    ]
    shutil.copytree(run, tmp_path / "in-place")
    moved = tmp_path / "elsewhere" / "run"
    shutil.move(run, moved)
    shutil.rmtree(made)  # the suite and its data files are gone
    same_edit_tables(_edit(tmp_path / "in-place"), _edit(moved))
    reopened = attnprobe.Run(moved).reopen()
    assert reopened.suite.sha256 == attnprobe.Run(moved).manifest.suite.sha256
    assert reopened.dtype == "float32"  # the one load option taken: never remote code or pickles


def test_a_run_whose_suite_read_through_a_data_root_is_edited(tiny_llama_dir, tmp_path):
    """A suite reading `../data/jobs.tsv` needs --data-root; attnprobe edit reloaded it without one
    and was refused. From the run's copy, and (a run without a copy) with the recorded data roots."""
    from conftest import edit_suite

    suites, data = tmp_path / "suites", tmp_path / "data"
    suites.mkdir(), data.mkdir()
    suite = edit_suite(suites)
    (suites / "jobs.tsv").rename(data / "jobs.tsv")
    suite.write_text(suite.read_text().replace("table: jobs.tsv", "table: ../data/jobs.tsv"))
    run = _run(suite, tiny_llama_dir, tmp_path / "run", "--data-root", str(data))
    assert (run / "suite" / "data" / "jobs.tsv").is_file() and (run / "suite" / "suites" / "e.yaml").is_file()
    _edit(run)
    manifest = json.loads((run / "manifest.json").read_text())  # as a run made before runs kept a copy
    del manifest["suite"]["copy"]
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert manifest["suite"]["data_roots"] == [str(data.resolve())]
    assert attnprobe.Run(run).reopen().suite.sha256 == manifest["suite"]["sha256"]
    (data / "jobs.tsv").write_text((data / "jobs.tsv").read_text() + "welder\t5\n")
    with pytest.raises(RunError, match="changed since the run .* was made; rerun the suite first"):
        attnprobe.Run(run).reopen()


def test_a_link_planted_in_the_suite_copy_is_refused_and_its_target_untouched(tiny_llama_dir, tmp_path):
    from conftest import edit_suite

    suite = edit_suite(tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    (tmp_path / "run" / "suite").mkdir(parents=True)
    (tmp_path / "run" / "suite" / "e.yaml").symlink_to(outside)
    with pytest.raises(RunError, match="e.yaml is a symbolic link; attnprobe writes only inside the run"):
        attnprobe.run_suite(suite, str(tiny_llama_dir), out=tmp_path / "run", progress=False)
    assert outside.read_text() == "keep me"


def test_a_run_resumed_with_another_batch_names_it_and_how_to_continue(tiny_llama_dir, tmp_path):
    """A run planned on a GPU (a chunk a pass) and resumed on a CPU (256 prompts a pass) has other
    batches: the refusal names the setting that differs and the --batch-size that continues it."""
    from click.testing import CliRunner

    from attnprobe.cli import main

    args = ["run", "probes/gender.yaml", "--model", str(tiny_llama_dir), "--limit", "40", "--no-report"]
    out = ["--out", str(tmp_path / "run"), "--no-head-effects"]
    assert CliRunner().invoke(main, [*args, *out, "--batch-size", "8"]).exit_code == 0
    result = CliRunner().invoke(main, [*args, *out])
    assert result.exit_code != 0
    assert "batch_size 8 there, 256 here (to continue it: --batch-size 8)" in result.output
    assert CliRunner().invoke(main, [*args, *out, "--batch-size", "8"]).exit_code == 0
