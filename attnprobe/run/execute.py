"""Executing a plan: the per-batch kernel (one forward, every measure read from it) and the
deferred Ctrl-C. Returns data; writes nothing.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager

from ..attention.capture import run_with_capture
from ..forward.device import on_host
from ..forward.packing import pad_right, run_with_shared_prefixes
from ..measures import batch_kinds
from ..model import ProbeModel
from .plan import Encoded, RunPlan


def measure_batch(
    pm: ProbeModel, plan: RunPlan, batch: list[Encoded], packs: list[int] | None = None
) -> dict:
    """Every per-batch measure kind's part for one batch ({kind name: part}), from a single
    forward pass that captures what all of them asked for. `packs`: the sizes of the packs of
    consecutive prompts forwarded as one row each, every shared prefix once (see plan.Batch)."""
    asked, states, measures = {}, {}, plan.suite.measures
    with on_host():  # what the kinds ask for and the padded ids: built on the CPU, copied once
        for kind in batch_kinds():
            keywords, states[kind.NAME] = kind.request(measures[kind.NAME], batch)
            assert not set(keywords) & set(asked), f"{kind.NAME} asks for capture arguments another kind sets"
            asked.update(keywords)
        if not packs:
            ids, mask = pad_right([e.forward_ids for e in batch], pm.tokenizer.pad_token_id)
    if packs:
        prompts = iter(batch)
        rows = [[next(prompts).forward_ids for _ in range(size)] for size in packs]
        captured = run_with_shared_prefixes(pm, rows, pm.tokenizer.pad_token_id, **asked)
    else:
        captured = run_with_capture(pm, ids, mask, **asked)
    on_cpu = None  # copied once, for the kinds that read on the CPU (a plug-in's, unless it says)
    parts = {}
    for kind in batch_kinds():
        if not kind.ON_DEVICE and on_cpu is None:
            on_cpu = captured.cpu()
        seen = captured if kind.ON_DEVICE else on_cpu
        parts[kind.NAME] = kind.read(
            pm, measures[kind.NAME], plan.parts[kind.NAME], batch, seen, states[kind.NAME]
        )
    return parts


_REQUESTS: list = []  # the request list of the active deferred_interrupt (the outermost one)


@contextmanager
def deferred_interrupt(log):
    """The first Ctrl-C asks the loop to stop after the current chunk; a second one stops at once.
    Nested inside another (a sequence of phases, each deferring on its own), it shares the outer
    one's handler: a Ctrl-C between two phases stops the sequence after the phase in progress."""
    if _REQUESTS:
        outer = _REQUESTS[-1]
        yield lambda: bool(outer)
        return
    requested = []

    def handler(signum, frame):
        if requested:
            raise KeyboardInterrupt
        requested.append(signum)
        log("interrupt: finishing the current chunk, then stopping (Ctrl-C again to stop at once)")

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: no handler, Ctrl-C behaves as usual
        yield lambda: False
        return
    _REQUESTS.append(requested)
    try:
        yield lambda: bool(requested)
    finally:
        _REQUESTS.pop()
        signal.signal(signal.SIGINT, previous)


@contextmanager
def ignored_interrupts():
    """Ctrl-C does nothing inside (main thread only): for the last write before stopping."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
