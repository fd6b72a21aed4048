"""Faults during a run leave computed results intact and resumable."""

import errno
import json
import os
import signal
import time
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from conftest import forked_cli, one_line_error

import attnprobe
from attnprobe.errors import RunError
from attnprobe.store import exclusive

pytestmark = pytest.mark.slow
GENDER = "probes/gender.yaml"
SKIP = ("head_effects", "direct_attribution")  # phases of their own these tests do not read
SETTINGS = dict(limit=60, batch_size=4, chunk_size=8, progress=False, skip=SKIP)


@pytest.fixture(scope="module")
def whole(smollm, tmp_path_factory):
    return attnprobe.run_suite(GENDER, model=smollm, out=tmp_path_factory.mktemp("whole"), **SETTINGS)


def same_results(a: Path, b: Path):
    for name in ("prompts.csv", "logprobs.csv"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    pd.testing.assert_frame_equal(
        pd.read_parquet(a / "attention.parquet"), pd.read_parquet(b / "attention.parquet"), check_exact=True
    )


def test_output_directory_that_cannot_be_created(smollm, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(
        RunError,
        match=r"cannot create output directory .*file/out: Not a directory; choose another with --out",
    ):
        attnprobe.run_suite(GENDER, model=smollm, out=tmp_path / "file" / "out", **SETTINGS)


def test_an_output_directory_that_cannot_be_locked(smollm, tmp_path):
    (tmp_path / ".lock").mkdir()  # as good as read-only, even for root
    with pytest.raises(
        RunError,
        match=r"cannot lock .*\.lock \(Is a directory\); make the directory writable or choose another --out",
    ):
        attnprobe.run_suite(GENDER, model=smollm, out=tmp_path, **SETTINGS)
    assert [p.name for p in tmp_path.iterdir()] == [".lock"]


def test_disk_full_keeps_finished_chunks_and_resumes(smollm, whole, tmp_path, monkeypatch):
    calls = {"n": 0}
    original = pq.write_table  # under both pyarrow's and pandas' parquet writers

    def fill_up(table, where, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 1 + 6:  # prompts.parquet and three chunks (two files each) fit, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(table, where, *args, **kwargs)

    monkeypatch.setattr(pq, "write_table", fill_up)
    with pytest.raises(
        RunError,
        match=r"cannot write .*00003.attention.parquet: No space left on device; results written so far are "
        r"kept",
    ):
        attnprobe.run_suite(GENDER, model=smollm, out=tmp_path, **SETTINGS)
    chunks = tmp_path / "chunks"
    assert sorted(p.name for p in chunks.glob("*.done")) == ["00000.done", "00001.done", "00002.done"]
    assert not list(chunks.glob(".*.tmp"))  # no half-written file left behind
    monkeypatch.setattr(pq, "write_table", original)
    messages = []
    attnprobe.run_suite(GENDER, model=smollm, out=tmp_path, log=messages.append, **SETTINGS)
    assert messages == [f"resuming {tmp_path}: 3 of 8 chunks already complete"]
    same_results(whole.directory, tmp_path)


def test_corrupted_and_truncated_chunks_are_recomputed(smollm, whole, tmp_path):
    attnprobe.run_suite(GENDER, model=smollm, out=tmp_path, **SETTINGS)
    chunks = tmp_path / "chunks"
    data = (chunks / "00002.attention.parquet").read_bytes()
    (chunks / "00002.attention.parquet").write_bytes(data[: len(data) // 2])  # truncated by a crash
    (chunks / "00005.logprobs.parquet").write_bytes(b"garbage")  # corrupted
    (tmp_path / "attention.parquet").unlink()
    messages = []
    attnprobe.run_suite(GENDER, model=smollm, out=tmp_path, log=messages.append, **SETTINGS)
    assert any(m.startswith("chunk 2 in") and "is damaged" in m for m in messages)
    assert any(m.startswith("chunk 5 in") and "is damaged" in m for m in messages)
    assert messages[-1] == f"resuming {tmp_path}: 6 of 8 chunks already complete"
    same_results(whole.directory, tmp_path)


def test_two_runs_in_one_directory_are_refused(smollm, tmp_path):
    with exclusive(tmp_path):  # another run holds the directory
        with pytest.raises(
            RunError,
            match=f"another attnprobe command \\(a run, an edit or a compare\\) is using {tmp_path}; "
            "wait for it to finish or choose --out",
        ):
            attnprobe.run_suite(GENDER, model=smollm, out=tmp_path, **SETTINGS)
    assert not (tmp_path / "manifest.json").exists()  # the refused run wrote nothing


def test_ctrl_c_finishes_the_chunk_writes_the_manifest_and_exits_130(whole, tmp_path):
    repo = Path(__file__).resolve().parents[2]
    out, log = tmp_path / "out", tmp_path / "run.log"
    args = ["run", repo / GENDER, "--limit", "60", "--batch-size", "4", "--chunk-size", "8", "--out", out]
    args += ["--no-report", "--no-head-effects", "--skip", "direct_attribution"]
    process = forked_cli(args, log)
    deadline = time.time() + 300
    while not list((out / "chunks").glob("*.done")) and time.time() < deadline and process.is_alive():
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGINT)
    process.join(timeout=300)
    stderr = log.read_text()
    assert process.exitcode == 130, stderr
    assert (
        "Traceback" not in stderr
        and "interrupted after chunk" in stderr
        and "rerun the same command to resume" in stderr
    )
    manifest = json.loads((out / "manifest.json").read_text())
    done = len(list((out / "chunks").glob("*.done")))
    assert manifest["status"] == "interrupted" and 1 <= done < 8
    resumed = forked_cli(args, tmp_path / "resumed.log")
    resumed.join(timeout=300)
    assert (
        resumed.exitcode == 0
        and f"{done} of 8 chunks already complete" in (tmp_path / "resumed.log").read_text()
    )
    same_results(whole.directory, out)


def test_a_second_ctrl_c_stops_at_once_and_the_manifest_says_so(tmp_path):
    repo = Path(__file__).resolve().parents[2]
    args = [
        "run",
        str(repo / GENDER),
        "--limit",
        "200",
        "--batch-size",
        "2",
        "--chunk-size",
        "200",
        "--out",
        str(tmp_path),
        "--no-report",
        "--no-head-effects",
        "--skip",
        "direct_attribution",
    ]  # one long chunk
    process = forked_cli(args, tmp_path / "run.log")
    deadline = time.time() + 300
    while not (tmp_path / "chunks").is_dir() and time.time() < deadline and process.is_alive():
        time.sleep(0.02)
    for _ in range(2):  # the first asks to finish the chunk, the second stops at once
        time.sleep(0.5)
        os.kill(process.pid, signal.SIGINT)
    process.join(timeout=300)
    stderr = (tmp_path / "run.log").read_text()
    assert process.exitcode == 130 and "Traceback" not in stderr, stderr
    assert "interrupted after a second Ctrl-C" in stderr.splitlines()[-1]
    assert json.loads((tmp_path / "manifest.json").read_text())["status"] == "interrupted"
    assert not list((tmp_path / "chunks").glob("*.done"))  # the chunk in progress was dropped, not half-kept


def _report(directory):
    from click.testing import CliRunner

    from attnprobe.cli import main

    return CliRunner().invoke(main, ["report", str(directory)])


def test_report_on_an_unfinished_shard_or_damaged_run_is_one_line(whole, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(whole.directory, run)
    manifest = json.loads((run / "manifest.json").read_text())
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.suffix != ".json"}
    for status, phrase in (
        ("running", "is not finished (status: running)"),
        ("interrupted", "rerun the same `attnprobe run`"),
        ("failed", "is not finished (status: failed)"),
        ("shard complete", "attnprobe merge"),
    ):
        (run / "manifest.json").write_text(json.dumps(dict(manifest, status=status)))
        one_line_error(_report(run), phrase)
    (run / "manifest.json").write_text("{not json")
    one_line_error(_report(run), "cannot read it as an attnprobe manifest")
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert {p: p.read_bytes() for p in before} == before  # nothing was touched by the refusals
    attention = run / "attention.parquet"
    attention.write_bytes(attention.read_bytes()[:100])
    (run / "tables.json").unlink(missing_ok=True)
    one_line_error(
        _report(run), "attention.parquet is missing or damaged", "rebuilds it from the finished chunks"
    )


def test_a_truncated_table_cache_is_recomputed(whole, tmp_path):
    import shutil

    from attnprobe.report import load_tables
    from attnprobe.run.files.reader import RunFiles

    run = tmp_path / "run"
    shutil.copytree(whole.directory, run)
    first = load_tables(RunFiles(run))
    cached = run / "condition_means.parquet"
    cached.write_bytes(cached.read_bytes()[:-200])  # a report killed, or a full disk, mid-write
    again = load_tables(RunFiles(run))
    pd.testing.assert_frame_equal(again["condition_means"], first["condition_means"])
    pd.testing.assert_frame_equal(pd.read_parquet(cached), first["condition_means"])  # and rewritten whole


def test_merge_into_one_of_its_own_shards_is_refused(smollm, tmp_path):
    small = dict(SETTINGS, limit=16)
    shards = [
        attnprobe.run_suite(GENDER, model=smollm, out=tmp_path / "s", shard=(k, 2), **small).directory
        for k in (1, 2)
    ]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for target in shards:
        with pytest.raises(
            RunError, match=f"{target} is one of the shard directories; merge into a new directory"
        ):
            attnprobe.merge_shards(shards, target)
    other = attnprobe.run_suite(
        GENDER, model=smollm, out=tmp_path / "other", **dict(small, limit=8)
    ).directory
    before.update({p: p.read_bytes() for p in other.rglob("*") if p.is_file()})
    with pytest.raises(
        RunError, match=f"{other} holds a run with other settings; merge into a new directory"
    ):
        attnprobe.merge_shards(shards, other)
    assert {p: p.read_bytes() for p in before} == before
    merged = attnprobe.merge_shards(shards, tmp_path / "merged")
    assert merged.manifest.status == "complete" and len(merged.prompts) == merged.manifest.n_prompts


def test_a_planted_chunks_link_is_refused_and_nothing_is_written_outside(smollm, tmp_path):
    """Issue 32: a `chunks` symbolic link in --out made the run write wherever it pointed."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "chunks").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RunError, match=r"out/chunks is a symbolic link; attnprobe writes only inside"):
        attnprobe.run_suite(GENDER, model=smollm, out=tmp_path / "out", **SETTINGS)
    assert not list((tmp_path / "elsewhere").iterdir())


def test_a_full_disk_or_read_only_directory_during_the_report_is_one_line(whole, tmp_path, monkeypatch):
    """Issue 32: the figures ended in a traceback; the run's results must stay as they were."""
    import shutil

    import matplotlib.figure

    run = tmp_path / "run"
    shutil.copytree(whole.directory, run)
    results = {p: p.read_bytes() for p in run.iterdir() if p.is_file()}
    original = matplotlib.figure.Figure.savefig

    def full(self, where, *args, **kwargs):
        if not hasattr(where, "write"):  # the inline PNG goes to memory; files hit the full disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(self, where, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    one_line_error(_report(run), "cannot write the figure", "No space left on device", "attnprobe report")
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", original)
    monkeypatch.setattr(  # a read-only directory (tests run as root, where chmod does not stop a write)
        os, "replace", lambda *a: (_ for _ in ()).throw(OSError(errno.EROFS, os.strerror(errno.EROFS)))
    )
    one_line_error(_report(run), "Read-only file system")
    assert {p: p.read_bytes() for p in results} == results
    monkeypatch.undo()
    assert _report(run).exit_code == 0  # and once there is room, the same command writes the report
    assert (run / "report.html").is_file() and list((run / "figures").glob("*.png"))
