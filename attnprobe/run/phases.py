"""The run's phases and the one engine that runs them.

A phase (measures.base.Phase) declares its chunk-file prefix, the hash of its plan (chunks of another
plan are redone), its chunks (which this process owns) and how to compute one chunk; the run joins
the finished chunks into its tables. `run_phase` owns everything else: resuming from the chunks whose
markers check out, progress (a bar on a terminal, a line per chunk elsewhere), the deferred Ctrl-C
(the chunk in progress finishes, then the run stops with its state recorded) and the time spent.

  prompts  ""  every per-batch measure (measures.batch_kinds), one forward a batch
  then each declared measure's own phases (`compute(declared, part, engine)`): a scored measure's
  continuations (`<name>-`, engine.scored), head effects' screen and selected heads.
"""

from __future__ import annotations

import hashlib
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa

from .. import store
from ..errors import RunError, RunInterrupted
from ..measures import Phase, PromptsMeasure, batch_kinds
from ..progress import Progress
from ..store import own_directory
from .execute import deferred_interrupt, ignored_interrupts, measure_batch
from .files.layout import assemble_phase, chunk_files
from .files.manifest import Manifest
from .options import RunOptions
from .plan import RunPlan

__all__ = ["Engine", "Phase", "prompts_phase", "recorded_end", "run_phase", "stop"]


def _tables(phase: Phase, computed, files) -> dict:
    """A chunk's tables as the phase declares them ({file stem: a DataFrame or an Arrow table}),
    checked before anything is written: a measure (a plug-in's, say) that returns anything else is
    one line naming it."""
    stems = [name.removesuffix(".parquet") for name in files]
    bad = next((s for s in stems if not isinstance(computed, dict) or not _is_table(computed.get(s))), None)
    if bad is not None:
        got = type(computed.get(bad) if isinstance(computed, dict) else computed).__name__
        raise RunError(
            f"the phase {phase.name or 'of the prompts'} ({phase.desc or phase.prefix}) gave {got} for its "
            f"table {bad}, not a pandas DataFrame; fix the measure that computes it (chunks done are kept)"
        )
    return computed


def _is_table(value) -> bool:
    return isinstance(value, (pd.DataFrame, pa.Table))


def run_phase(directory: Path, phase: Phase, options: RunOptions, manifest: Manifest | None) -> float:
    """Compute the phase's chunks this process owns that are not done yet, each written before the
    next starts; returns the seconds spent (0 when every chunk was already done). `manifest`: the
    run's, where an interruption is recorded (None: a phase run on a finished run, `attnprobe edit`'s,
    records nothing there)."""
    chunk_dir, log = own_directory(directory / "chunks"), options.log
    files = phase.files or chunk_files()[phase.prefix]
    done = store.complete_chunks(chunk_dir, phase.n_chunks, log, files, phase.prefix, phase.plan)
    todo = [k for k in phase.mine if k not in done]
    if not todo:
        return 0.0
    resumed = [k for k in phase.mine if k in done]  # not another phase's chunks done by this process
    if resumed:
        chunks = f"{phase.name} chunks".lstrip()
        log(f"resuming {directory}: {len(resumed)} of {len(phase.mine)} {chunks} already complete")
    total = sum(phase.size(k) for k in phase.mine)
    bar = Progress(
        total, total - sum(phase.size(k) for k in todo), options.progress, log, phase.unit, phase.desc
    )
    started = time.perf_counter()
    with deferred_interrupt(log) as interrupted:
        for k in todo:
            if interrupted():  # asked between two phases of a sequence (a nested deferral)
                bar.close()
                stop(directory, manifest, f"before {phase.name or 'the prompts'}")
            chunk_started = time.perf_counter()
            tables = _tables(phase, phase.compute(k, bar.update), files)
            store.write_chunk(chunk_dir, k, tables, files, phase.prefix, phase.plan)
            bar.chunk_done(k, phase.n_chunks)
            later = sum(phase.size(j) for j in todo if j > k)
            if k == todo[0] and later and phase.rate:
                each = (time.perf_counter() - chunk_started) / phase.size(k)
                log(
                    f"{phase.desc}: {each:.2f} s per item, about {each * later / 60:.1f} min for the other "
                    f"{later} items"
                )
            if interrupted():
                bar.close()
                where = (
                    f"{phase.name} chunk {k + 1} of {phase.n_chunks}" if phase.n_chunks > 1 else phase.name
                )
                stop(directory, manifest, f"after {where.lstrip()}")
    bar.close()
    return time.perf_counter() - started


def prompts_phase(pm, plan: RunPlan, options: RunOptions) -> Phase:
    """Every per-batch measure of every prompt: one forward pass a batch (prefixes shared in packs)."""
    kinds = batch_kinds()

    def compute(k, advance):
        parts = {kind.NAME: [] for kind in kinds}
        for batch in plan.chunks[k]:
            packs = [len(pack) for pack in batch.packs] if batch.shared else None
            encoded = [plan.encoded[i] for i in batch]
            for name, part in measure_batch(pm, plan, encoded, packs).items():
                parts[name].append(part)
            advance(len(batch))
        return {
            kind.CHUNKS[""][0].removesuffix(".parquet"): kind.chunk_table(parts[kind.NAME], pm)
            for kind in kinds
        }

    n = len(plan.chunks)
    mine = tuple(k for k in range(n) if options.owns(k))
    return Phase("", "", None, n, mine, compute, lambda k: sum(len(b) for b in plan.chunks[k]))


@dataclass
class Engine:
    """What a measure's `compute` is given: the model, the plan, the options, the run directory and
    its manifest, and the engine's services (run a phase, the complete chunks of one, a scored phase)."""

    pm: object
    plan: RunPlan
    options: RunOptions
    directory: Path
    manifest: Manifest

    @property
    def shared(self) -> bool:
        """Prefixes are shared (the model and prompts allow it and it is switched on)."""
        return self.plan.blocker is None

    def run(self, phase: Phase) -> float:
        return run_phase(self.directory, phase, self.options, self.manifest)

    def complete(self, prefix: str, n_chunks: int, plan: str | None) -> set[int]:
        chunks = self.directory / "chunks"
        return store.complete_chunks(chunks, n_chunks, self.options.log, chunk_files()[prefix], prefix, plan)

    def scored(self, kind: PromptsMeasure, declared) -> None:
        """A scored-continuation phase (file prefix `<name>-`, computed by shard 1): chunks of
        prompts scored by the kind, joined into its table."""
        plan, options, suite = self.plan, self.options, self.plan.suite
        step = options.chunk_size
        parts = [plan.encoded[i : i + step] for i in range(0, len(plan.encoded), step)]
        size = lambda k: sum(kind.count(declared, suite, e) for e in parts[k])

        def compute(k, advance):
            counted = []
            scored = kind.score(
                self.pm,
                declared,
                suite,
                parts[k],
                plan.settings["batch_size"],
                lambda n: (counted.append(n), advance(n)),
            )
            advance(size(k) - sum(counted))  # prompts that score nothing (no question's spans) are done too
            return {kind.NAME: scored}

        mine = tuple(range(len(parts))) if options.shard is None or options.shard[0] == 1 else ()
        key = f"{plan.settings['plan_sha256']}|{kind.plan_key(declared)}"
        prefix = kind.prefix()
        name = prefix.removesuffix("-")
        phase = Phase(
            name,
            prefix,
            hashlib.sha256(key.encode()).hexdigest(),
            len(parts),
            mine,
            compute,
            size,
            "sequence",
            name.replace("-", " "),
        )
        self.run(phase)
        if phase.mine:
            assemble_phase(self.directory, prefix, phase.n_chunks, kind.NAME, kind.CSV)


@contextmanager
def recorded_end(directory: Path, manifest: Manifest):
    """However the computation ends early, the manifest says so: a second Ctrl-C (which drops the
    chunk in progress) is recorded as an interruption, any other error as `failed`."""
    try:
        yield
    except RunInterrupted:
        raise
    except KeyboardInterrupt:
        stop(directory, manifest, "after a second Ctrl-C (the chunk in progress was dropped)")
    except BaseException as exc:
        manifest.status, manifest.error = "failed", f"{type(exc).__name__}: {str(exc)[:300]}"
        with suppress(Exception):  # the error that stopped us (a full disk, say) may stop this write too
            manifest.write(directory)
        raise


def stop(directory: Path, manifest: Manifest | None, where: str) -> None:
    """After Ctrl-C: record the interruption in the manifest (if given) and stop; every finished
    chunk is kept."""
    if manifest is not None:
        manifest.status, manifest.interrupted = "interrupted", time.strftime("%Y-%m-%dT%H:%M:%S%z")
        with ignored_interrupts():  # a further Ctrl-C cannot cut this write short
            manifest.write(directory)
    raise RunInterrupted(
        f"interrupted {where}; the finished chunks are kept in {directory / 'chunks'}: "
        "rerun the same command to resume"
    )
