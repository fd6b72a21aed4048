"""`attnprobe edit` interrupted (issue 40): Ctrl-C stops after the part in progress, SIGKILL at random
points, and the rerun gives tables identical to an uninterrupted sweep. Apart from the other hostile
edit tests so that the two lanes' workers share these two slow, subprocess-bound tests."""

import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import EDIT_SWEEP_NO_PATHS as SWEEP
from conftest import same_edit_tables, unswept_copy


@pytest.fixture(scope="module")
def edited_run(swept_run):
    """The edit suite's run on the tiny Llama and its uninterrupted sweep (the reference tables)."""
    return swept_run[2]


def _edit_process(run):
    args = [sys.executable, "-m", "attnprobe", "edit", str(run), *SWEEP]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), args


def _wait_for_kinds(run, n, process, timeout=300):
    deadline = time.time() + timeout
    while len(list((run / "chunks").glob("edits-*.done"))) < n and time.time() < deadline:
        if process.poll() is not None:
            break
        time.sleep(0.01)


def test_ctrl_c_during_edit_stops_after_the_kind_and_the_rerun_gives_identical_tables(edited_run, tmp_path):
    run = unswept_copy(edited_run, tmp_path)
    process, args = _edit_process(run)
    _wait_for_kinds(run, 1, process)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 130 and "Traceback" not in stderr, stderr
    # after the part in progress, or before the next when the signal came between two
    assert re.search(r"interrupted (after|before) edit \w+;", stderr.splitlines()[-1]), stderr
    kept = len(list((run / "chunks").glob("edits-*.done")))
    assert 1 <= kept < 4 and not (run / "edits.parquet").exists()
    resumed = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0 and resumed.stderr.count("read from an earlier session") == kept
    same_edit_tables(edited_run, run)


def test_a_killed_edit_reruns_to_identical_tables(edited_run, tmp_path):
    """SIGKILL at two random points of `attnprobe edit` (anywhere from start-up through recording and
    the kinds: the seed is in the message), then a rerun to the end: whatever was half-written is
    never read back as finished, and the tables equal the uninterrupted sweep's."""
    seed = int(os.environ.get("ATTNPROBE_KILL_SEED", time.time_ns() % 2**32))
    rng = random.Random(seed)
    run = unswept_copy(edited_run, tmp_path)
    for _ in range(2):
        process, args = _edit_process(run)
        deadline = time.time() + rng.uniform(1.0, 12.0)
        while time.time() < deadline and process.poll() is None:
            time.sleep(0.01)
        process.kill()
        process.communicate(timeout=60)
    resumed = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, (seed, resumed.stderr)
    try:
        same_edit_tables(edited_run, run)
    except AssertionError as error:
        raise AssertionError(f"ATTNPROBE_KILL_SEED={seed}: {error}") from None
