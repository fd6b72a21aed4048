"""Faults during a run leave computed results intact and resumable."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

import attnprobe
from attnprobe.run import storage
from attnprobe.errors import RunError

pytestmark = pytest.mark.slow
GENDER = "probes/gender.yaml"
SETTINGS = dict(limit=60, batch_size=4, chunk_size=8, progress=False, head_effects=False)


@pytest.fixture(scope="module")
def whole(smollm, tmp_path_factory):
    return attnprobe.run_suite(GENDER, model=smollm, out=tmp_path_factory.mktemp("whole"), **SETTINGS)


def same_results(a: Path, b: Path):
    for name in ("prompts.csv", "logprobs.csv"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    pd.testing.assert_frame_equal(pd.read_parquet(a / "attention.parquet"), pd.read_parquet(b / "attention.parquet"), check_exact=True)


def test_output_directory_that_cannot_be_created(smollm, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunError, match=r"cannot create output directory .*file/out: Not a directory; choose another with --out"):
        attnprobe.run_suite(GENDER, model=smollm, out=tmp_path / "file" / "out", **SETTINGS)


def test_disk_full_keeps_finished_chunks_and_resumes(smollm, whole, tmp_path, monkeypatch):
    calls = {"n": 0}
    original = pq.write_table  # under both pyarrow's and pandas' parquet writers

    def fill_up(table, where, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 1 + 6:  # prompts.parquet and three chunks (two files each) fit, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(table, where, *args, **kwargs)

    monkeypatch.setattr(pq, "write_table", fill_up)
    with pytest.raises(RunError, match=r"cannot write .*00003.attention.parquet: No space left on device; results written so far are kept"):
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
    with storage.exclusive(tmp_path):  # another run holds the directory
        with pytest.raises(RunError, match=f"another attnprobe run is writing {tmp_path}; wait for it to finish or choose --out"):
            attnprobe.run_suite(GENDER, model=smollm, out=tmp_path, **SETTINGS)
    assert not (tmp_path / "manifest.json").exists()  # the refused run wrote nothing


def test_ctrl_c_finishes_the_chunk_writes_the_manifest_and_exits_130(whole, tmp_path):
    repo = Path(__file__).resolve().parents[1]
    args = [sys.executable, "-m", "attnprobe", "run", str(repo / GENDER), "--limit", "60", "--batch-size", "4",
            "--chunk-size", "8", "--out", str(tmp_path), "--no-report", "--no-head-effects"]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not list((tmp_path / "chunks").glob("*.done")) and time.time() < deadline and process.poll() is None:
        time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "interrupted after chunk" in stderr and "rerun the same command to resume" in stderr
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    done = len(list((tmp_path / "chunks").glob("*.done")))
    assert manifest["status"] == "interrupted" and 1 <= done < 8
    resumed = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0 and f"{done} of 8 chunks already complete" in resumed.stderr
    same_results(whole.directory, tmp_path)
