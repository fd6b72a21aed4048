"""`attnprobe edit` interrupted (issue 40): Ctrl-C stops after the part in progress, SIGKILL at random
points, and the rerun gives tables identical to an uninterrupted sweep. Process-bound and slow
(about 20 s together): they run in the full lane (`make test`), not in the fast one.

The interrupted commands are processes of their own, forked from a server that imported attnprobe
once (conftest.forked_cli). The reruns that finish a sweep run in this process (CliRunner)."""

import os
import random
import re
import signal
import time

import pytest
from click.testing import CliRunner
from conftest import EDIT_SWEEP_NO_PATHS as SWEEP
from conftest import forked_cli, same_edit_tables, unswept_copy

from attnprobe.cli import main

pytestmark = pytest.mark.thorough


def _edit_process(run, log):
    return forked_cli(["edit", str(run), *SWEEP], log)


def _wait_for_parts(run, n, process, timeout=300):
    deadline = time.time() + timeout
    while len(list((run / "chunks").glob("edits-*.done"))) < n and time.time() < deadline:
        if not process.is_alive():
            break
        time.sleep(0.01)


def _finish(run):
    """The sweep rerun to the end in this process; returns its output."""
    result = CliRunner().invoke(main, ["edit", str(run), *SWEEP])
    assert result.exit_code == 0, result.output
    return result.output


def test_ctrl_c_during_edit_stops_after_the_kind_and_the_rerun_gives_identical_tables(edited_run, tmp_path):
    run, log = unswept_copy(edited_run, tmp_path), tmp_path / "edit.log"
    process = _edit_process(run, log)
    _wait_for_parts(run, 1, process)
    os.kill(process.pid, signal.SIGINT)
    process.join(timeout=300)
    stderr = log.read_text()
    assert process.exitcode == 130 and "Traceback" not in stderr, stderr
    # after the part in progress, or before the next when the signal came between two
    assert re.search(r"interrupted (after|before) edit \w+;", stderr.splitlines()[-1]), stderr
    kept = len(list((run / "chunks").glob("edits-*.done")))
    assert 1 <= kept < 4 and not (run / "edits.parquet").exists()
    assert _finish(run).count("read from an earlier session") == kept
    same_edit_tables(edited_run, run)


def test_a_killed_edit_reruns_to_identical_tables(edited_run, tmp_path):
    """SIGKILL at two random points of `attnprobe edit`, each uniform over its first 3 s (from its
    first line through loading, recording and the parts; on one thread here an uninterrupted sweep
    takes 4.6 s, and 2.6 s once its parts are done, so the second kill also falls in the tables
    written at the end; the seed is in the message), then a rerun to the end: whatever was
    half-written is never read back as finished, and the tables equal the uninterrupted sweep's."""
    seed = int(os.environ.get("ATTNPROBE_KILL_SEED", time.time_ns() % 2**32))
    rng = random.Random(seed)
    run = unswept_copy(edited_run, tmp_path)
    for attempt in range(2):
        process = _edit_process(run, tmp_path / f"killed-{attempt}.log")
        process.join(timeout=rng.uniform(0.0, 3.0))
        process.kill()
        process.join(timeout=60)
    try:
        _finish(run)
        same_edit_tables(edited_run, run)
    except AssertionError as error:
        raise AssertionError(f"ATTNPROBE_KILL_SEED={seed}: {error}") from None
