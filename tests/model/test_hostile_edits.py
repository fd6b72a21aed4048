"""Hostile input to `attnprobe edit` (issue 40): every cached edit value keyed by the model's weights
and checked against its hash, damaged or missing edit artefacts recomputed or refused in one line,
options validated before weights load, --text read only as far as needed (the interruptions, Ctrl-C
and kill, are in test_edit_interruptions.py)."""

import functools
import shutil
import tracemalloc

import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from conftest import (
    EDIT_SWEEP_NO_PATHS,
    FUZZ_EXAMPLES,
    edit_suite,
    one_line_error,
    same_edit_tables,
    unswept_copy,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

import attnprobe
from attnprobe.cli import main
from attnprobe.edits.inputs import TEXT_BYTES, user_text
from attnprobe.errors import RunError

SWEEP = EDIT_SWEEP_NO_PATHS


def test_the_manifest_records_the_weights_and_another_models_edit_is_refused(
    edited_run, tiny_llama_dir, tmp_path
):
    manifest = attnprobe.Run(edited_run).manifest
    assert len(manifest.model.weights_content) == 64
    other = tmp_path / "other"
    shutil.copytree(tiny_llama_dir, other)
    model = AutoModelForCausalLM.from_pretrained(other)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-3  # one weight of one layer
    model.save_pretrained(other)
    run = unswept_copy(edited_run, tmp_path)
    with pytest.raises(RunError, match="the model is not the one this run was made with"):
        attnprobe.Run(run).edit(
            kinds=("zero",), ks=(1,), draws=2, texts=8, model=attnprobe.load_model(str(other))
        )
    assert not list((run / "chunks").glob("edits-*"))  # nothing measured, nothing cached
    # the run's own model given in the notebook is accepted and gives the command's values
    table = attnprobe.Run(run).edit(
        kinds=("zero",), ks=(1, 2), draws=3, texts=8, model=attnprobe.load_model(str(tiny_llama_dir))
    )
    reference = pd.read_parquet(edited_run / "edits.parquet")
    own = ["seconds", "random_p_holm"]  # Holm adjusts over the rows of the table a call writes
    pd.testing.assert_frame_equal(
        table.drop(columns=own).reset_index(drop=True),
        reference[reference.kind == "zero"].drop(columns=own).reset_index(drop=True),
    )


@pytest.mark.parametrize("damage", ["alter", "truncate"])
def test_an_altered_or_damaged_edit_chunk_is_measured_again(edited_run, tmp_path, damage):
    run = tmp_path / "run"
    shutil.copytree(edited_run, run)
    (chunk,) = (run / "chunks").glob("edits-mean-00000.edits.parquet")
    if damage == "alter":  # valid parquet, other numbers
        frame = pd.read_parquet(chunk)
        frame["y"] = frame["y"] + 1.0
        frame.to_parquet(chunk)
    else:
        chunk.write_bytes(chunk.read_bytes()[:100])
    result = CliRunner().invoke(main, ["edit", str(run), *SWEEP])
    assert result.exit_code == 0, result.output
    assert (
        "is damaged or stale" in result.output and result.output.count("read from an earlier session") == 16
    )
    same_edit_tables(edited_run, run)


def test_missing_edit_tables_are_one_line_naming_the_command(edited_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(edited_run, run)
    (run / "edits_draws.parquet").unlink()
    one_line_error(
        CliRunner().invoke(main, ["report", str(run)]), "edit tables are missing", "attnprobe edit"
    )


def test_a_truncated_edits_table_read_by_run_is_one_error(edited_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(edited_run, run)
    data = (run / "edits.parquet").read_bytes()
    (run / "edits.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(RunError, match="edits.parquet is missing or damaged .* `attnprobe edit` command"):
        _ = attnprobe.Run(run).edits


@pytest.mark.parametrize(
    "extra, phrase",
    [
        (["--factor", "nan"], "--factor nan: the scale edit's factor must be a finite number"),
        (["--factor", "inf"], "--factor inf"),
        (["--factor", "1e308"], "between -100 and 100"),
        (["--k", "4"], "k 4 leaves none of this model's 4 heads"),
    ],
)
def test_bad_edit_options_are_one_line_before_weights_load(edited_run, extra, phrase):
    result = CliRunner().invoke(main, ["edit", str(edited_run), "--kinds", "scale", *extra])
    one_line_error(result, phrase)
    assert "loading" not in result.output


def test_a_suite_without_a_covariate_is_refused_by_edit_before_weights_load(tiny_llama_dir, tmp_path):
    suite, out = edit_suite(tmp_path), tmp_path / "run"
    suite.write_text(suite.read_text().replace("  covariate: occupation.bls_pct_female\n", ""))
    args = ["run", str(suite), "--model", str(tiny_llama_dir), "--out", str(out), "--no-report"]
    assert CliRunner().invoke(main, args).exit_code == 0
    result = CliRunner().invoke(main, ["edit", str(out)])
    one_line_error(result, "this suite declares none", "covariate")
    assert "loading" not in result.output


def test_a_large_text_is_read_only_as_far_as_needed(tiny_llama_dir, tmp_path):
    """--text of 100 MB costs what 1 MB does: only its first TEXT_BYTES are read and tokenised."""
    pm = attnprobe.load_model(str(tiny_llama_dir))
    line = "The weather was mild and the market opened early on the square. " * 16 + "\n"
    peaks = {}
    for megabytes in (1, 100):
        path = tmp_path / f"{megabytes}.txt"
        with open(path, "w") as handle:
            for _ in range(megabytes * 2**20 // len(line)):
                handle.write(line)
        tracemalloc.start()
        pieces = user_text(pm, str(path))
        peaks[megabytes] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert sum(len(p) for p in pieces) == 1024
    assert peaks[100] <= 1.5 * peaks[1], peaks
    assert peaks[100] < 20 * TEXT_BYTES  # far below the file's 100 MB


def test_an_edit_and_a_run_on_one_directory_exclude_each_other(edited_run, tmp_path):
    """The edit holds the run directory's lock, as a run does: while one holds it the other is one
    line (an edit racing `run --fresh` once measured a run that was being deleted)."""
    from attnprobe.store import exclusive

    run = unswept_copy(edited_run, tmp_path)
    with exclusive(run):  # a run (e.g. --fresh) writing the directory
        result = CliRunner().invoke(main, ["edit", str(run), "--kinds", "zero", "--k", "1"])
    one_line_error(result, "another attnprobe command (a run, an edit or a compare) is using")
    assert "loading" not in result.output and not list((run / "chunks").glob("edits-*"))


@settings(
    max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kinds=st.lists(
        st.sampled_from(["zero", "mean", "project", "scale", "resample", "melt", "", "Zero"]), max_size=3
    ),
    ks=st.lists(st.integers(-3, 10**12), max_size=3),
    heads=st.none() | st.text(alphabet="LHlh0123456789, .-x", max_size=12),
    draws=st.integers(0, 10**6),
    factor=st.floats(allow_nan=True, allow_infinity=True),
    reference=st.none() | st.sampled_from(["person", "woman", "man", "robot", "", "{occupation.x}"]),
    text=st.none() | st.sampled_from(["missing.txt", "empty.txt", "text.txt"]),
)
def test_fuzzed_edit_options_are_accepted_or_one_line_before_weights(
    edited_run, tmp_path, kinds, ks, heads, draws, factor, reference, text
):
    """1,000 option sets as the command line could give them: each is accepted, or refused as one
    AttnprobeError line before any weights load (never another exception)."""
    from attnprobe.edits import EditOptions
    from attnprobe.edits.sweep.options import checked_options
    from attnprobe.errors import AttnprobeError

    (tmp_path / "empty.txt").write_text(" \n")
    (tmp_path / "text.txt").write_text("The market opened early.")
    manifest = attnprobe.Run(edited_run).manifest
    suite = _suite_of(manifest.suite.path)
    try:
        options = EditOptions(
            kinds=tuple(kinds),
            ks=tuple(ks),
            heads=heads,
            draws=draws,
            factor=factor,
            reference=reference,
            text=None if text is None else str(tmp_path / text),
        )
        listed, word = checked_options(options, manifest, suite)
    except AttnprobeError as error:
        assert "\n" not in str(error) and str(error)
        return
    assert word in suite.head_effects.replacements and (listed is None or len(listed) >= 1)


@functools.cache
def _suite_of(path: str):
    from attnprobe.suite import load_suite

    return load_suite(path)


def test_too_few_items_for_the_random_comparison_give_a_note_not_a_floor_p(tiny_llama_dir, tmp_path):
    """Issue 40: with a handful of items the sampled slope is undefined; random_p was then reported
    at its floor. Now it is empty, and the table and the log say why."""
    suite, out = edit_suite(tmp_path), tmp_path / "run"
    # four occupations, two covariate values: each half of the units has both (edits need that), and
    # the few items the random sets are sampled on share one
    rows = "".join(f"{o}\t{p}\n" for o, p in (("nurse", 88), ("pilot", 9), ("chef", 88), ("baker", 9)))
    (tmp_path / "jobs.tsv").write_text("occupation\tbls_pct_female\n" + rows)
    args = ["run", str(suite), "--model", str(tiny_llama_dir), "--out", str(out), "--no-report"]
    assert CliRunner().invoke(main, args).exit_code == 0
    result = CliRunner().invoke(
        main, ["edit", str(out), "--kinds", "zero", "--k", "1", "--draws", "3", "--texts", "8"]
    )
    assert result.exit_code == 0, result.output
    table = pd.read_csv(out / "edits.csv")
    assert table["n_sampled"].iloc[0] < 3 and table["random_p"].isna().all()
    assert (
        "no p against random heads" in table["note"].iloc[0]
        and "note: the random-set comparison" in result.output
    )


def _degenerate_run(tmp_path, model_dir, rows):
    """The edit suite run with its occupation table replaced by `rows` (occupation, % female)."""
    path = edit_suite(tmp_path)
    (tmp_path / "jobs.tsv").write_text(
        "occupation\tbls_pct_female\n" + "".join(f"{o}\t{p}\n" for o, p in rows)
    )
    out = tmp_path / "run"
    args = ["-q", "run", str(path), "--model", str(model_dir), "--out", str(out), "--no-report"]
    assert CliRunner().invoke(main, args).exit_code == 0
    return path, out


@pytest.mark.parametrize(
    "rows, message",
    [
        ([("nurse", 88)], "this run has 1 occupation(s) with a value of occupation.bls_pct_female: give"),
        ([(o, 50) for o in ("nurse", "pilot", "chef", "baker", "lawyer")], "every occupation has the same"),
    ],
)
def test_a_design_edits_cannot_measure_is_refused_before_the_model_loads(
    tiny_llama_dir, tmp_path, rows, message
):
    path, out = _degenerate_run(tmp_path, tiny_llama_dir, rows)
    result = CliRunner().invoke(
        main, ["edit", str(out), "--k", "1", "--draws", "2", "--texts", "8", "--alone", "0"]
    )
    one_line_error(result, f"{path}: ", message)
    assert "loading" not in result.output and not (out / "edits.csv").exists()


def test_a_model_whose_outputs_never_vary_is_refused(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: every candidate log(1 / V) in every prompt
    flat = tmp_path / "flat"
    model.save_pretrained(flat)
    shutil.copy(tiny_llama_dir / "tokenizer.json", flat)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_llama_dir / name).is_file():
            shutil.copy(tiny_llama_dir / name, flat)
    _, out = _degenerate_run(tmp_path, flat, [("nurse", 88), ("pilot", 9), ("chef", 22), ("baker", 60)])
    result = CliRunner().invoke(
        main, ["edit", str(out), "--k", "1", "--draws", "2", "--texts", "8", "--alone", "0"]
    )
    one_line_error(result, "the model scores every candidate the same in every prompt")


def test_no_random_draws_still_write_a_table_with_its_columns(edited_run, tmp_path):
    run = unswept_copy(edited_run, tmp_path)
    result = CliRunner().invoke(
        main,
        [
            "-q",
            "edit",
            str(run),
            "--kinds",
            "zero",
            "--k",
            "1",
            "--draws",
            "0",
            "--texts",
            "8",
            "--alone",
            "0",
        ],
    )
    assert result.exit_code == 0, result.output
    draws = pd.read_csv(run / "edits_draws.csv")  # a 1-byte file once: no header to read
    assert draws.empty and list(draws.columns)[:5] == [
        "kind",
        "k",
        "draw",
        "heads",
        "gradient_removed_sampled",
    ]
