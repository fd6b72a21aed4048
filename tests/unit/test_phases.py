"""The run engine's phases without a model: a sequence of phases (as `attnprobe edit` runs them)
stops on Ctrl-C after the chunk in progress, or before the next phase when the signal came between
two, and resumes from the chunks whose markers check out."""

import os
import signal

import pandas as pd
import pytest

from attnprobe.errors import RunInterrupted
from attnprobe.run.execute import deferred_interrupt
from attnprobe.run.options import RunOptions
from attnprobe.run.phases import Phase, run_phase

OPTIONS = RunOptions(log=lambda message: None, progress=False)


def _phase(name, computed, interrupt_at=None):
    def compute(k, advance):
        computed.append((name, k))
        if k == interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while this chunk is computed
        advance(1)
        return {"values": pd.DataFrame({"k": [k], "name": [name]})}

    return Phase(name, f"{name}-", "plan", 3, (0, 1, 2), compute, lambda k: 1, files=("values.parquet",))


def test_ctrl_c_stops_after_the_chunk_or_before_the_next_phase_and_nothing_is_recomputed(tmp_path):
    computed = []
    with deferred_interrupt(lambda message: None) as requested:
        with pytest.raises(RunInterrupted, match="interrupted after a chunk 2 of 3"):
            run_phase(tmp_path, _phase("a", computed, interrupt_at=1), OPTIONS, None)
    assert computed == [("a", 0), ("a", 1)]
    with deferred_interrupt(lambda message: None) as requested:
        assert run_phase(tmp_path, _phase("a", computed), OPTIONS, None) > 0  # resumes at chunk 3
        os.kill(os.getpid(), signal.SIGINT)  # between two phases of the sequence
        assert requested()
        with pytest.raises(RunInterrupted, match="interrupted before b;"):
            run_phase(tmp_path, _phase("b", computed), OPTIONS, None)
    assert computed == [("a", 0), ("a", 1), ("a", 2)]  # b never started
    assert run_phase(tmp_path, _phase("a", computed), OPTIONS, None) == 0  # every chunk kept
    assert not (tmp_path / "manifest.json").exists()  # a phase without a manifest records nothing
