"""The run's phases and the one engine that runs them.

A phase declares its chunk-file prefix, the hash of its plan (chunks of another plan are redone),
its chunks (which this process owns) and how to compute one chunk; the run joins the finished chunks
into its tables (storage.assemble*). `run_phase` owns everything else: resuming from the chunks whose
markers check out, progress (a bar on a terminal, a line per chunk elsewhere), the deferred Ctrl-C
(the chunk in progress finishes, then the run stops with its state recorded) and the time spent.

  prompts          ""          every per-batch measure (attention, next_token), one forward a batch
  referent choice  "referent-choice-"  the question's scored continuations of the prompts
  likelihood       "likelihood-"       every sentence, scored (its shared words are a part of it)
  multiple choice  "multiple-choice-"  every option after its context and question, scored
  head effects     "effects-"  the screen of every item (held-out items in their own chunks)
  selected heads   "selected-" the suite's heads and the cross-fitted sets, once every item is screened
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import RunInterrupted
from ..estimates import head_effects_text
from ..measures import BATCH_KINDS, likelihood, multiple_choice, referent_choice
from ..measures import head_effect_phases as effect_phases
from ..measures import head_effects as head_effects_measure
from ..patching.selection import select
from ..progress import Progress
from . import storage
from .execute import deferred_interrupt, ignored_interrupts, measure_batch
from .fresh import own_directory
from .options import RunOptions
from .plan import RunPlan


@dataclass(frozen=True)
class Phase:
    name: str  # in log lines: "<name> chunk 3 of 10" ("" for the prompts)
    prefix: str  # chunk files are chunks/<prefix><k>.*
    plan: str | None  # recorded in each chunk's marker; a chunk of another plan is redone
    n_chunks: int
    mine: tuple[int, ...]  # the chunks this process computes, in order
    compute: Callable  # (k, advance(n)) -> {table name: table} of chunk k
    size: Callable[[int], int]  # progress units of chunk k
    unit: str = "prompt"
    desc: str = "attnprobe run"  # the progress bar's and progress lines' label
    rate: bool = False  # after the first chunk, log the seconds per unit and the time left


def run_phase(directory: Path, phase: Phase, options: RunOptions, manifest: dict) -> float:
    """Compute the phase's chunks this process owns that are not done yet, each written before the
    next starts; returns the seconds spent (0 when every chunk was already done)."""
    chunk_dir, log = own_directory(directory / "chunks"), options.log
    done = storage.complete_chunks(chunk_dir, phase.n_chunks, log, phase.prefix, phase.plan)
    todo = [k for k in phase.mine if k not in done]
    if not todo:
        return 0.0
    if done:
        chunks = f"{phase.name} chunks".lstrip()
        log(f"resuming {directory}: {len(done)} of {phase.n_chunks} {chunks} already complete")
    total = sum(phase.size(k) for k in phase.mine)
    bar = Progress(
        total, total - sum(phase.size(k) for k in todo), options.progress, log, phase.unit, phase.desc
    )
    started = time.perf_counter()
    with deferred_interrupt(log) as interrupted:
        for k in todo:
            chunk_started = time.perf_counter()
            storage.write_chunk(chunk_dir, k, phase.compute(k, bar.update), phase.prefix, phase.plan)
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
                stop(directory, manifest, f"{phase.name} chunk {k + 1} of {phase.n_chunks}".lstrip())
    bar.close()
    return time.perf_counter() - started


def prompts_phase(pm, plan: RunPlan, options: RunOptions) -> Phase:
    """Every per-batch measure of every prompt: one forward pass a batch (prefixes shared in packs)."""

    def compute(k, advance):
        parts = {kind.NAME: [] for kind in BATCH_KINDS}
        for batch in plan.chunks[k]:
            packs = [len(pack) for pack in batch.packs] if batch.shared else None
            encoded = [plan.encoded[i] for i in batch]
            for name, part in measure_batch(pm, plan.suite, encoded, plan.context, packs).items():
                parts[name].append(part)
            advance(len(batch))
        return {kind.NAME: kind.chunk_table(parts[kind.NAME], pm) for kind in BATCH_KINDS}

    n = len(plan.chunks)
    mine = tuple(k for k in range(n) if options.owns(k))
    return Phase("", "", None, n, mine, compute, lambda k: sum(len(b) for b in plan.chunks[k]))


def scored_phase(
    name: str, table: str, plan: RunPlan, options: RunOptions, score, sequences, key: str
) -> Phase:
    """A scored-continuation phase (file prefix `<name>-`): `score(prompts, batch_size, advance)`
    gives the table of a chunk of prompts, `sequences(prompt)` how many sequences a prompt scores.
    Shard 1 computes it; `key` joins the run's plan in the phase's plan hash."""
    step = options.chunk_size
    parts = [plan.encoded[i : i + step] for i in range(0, len(plan.encoded), step)]
    size = lambda k: sum(sequences(e) for e in parts[k])

    def compute(k, advance):
        counted = []
        scored = score(parts[k], options.batch_size, lambda n: (counted.append(n), advance(n)))
        advance(size(k) - sum(counted))  # prompts that score nothing (no question's spans) are done too
        return {table: scored}

    mine = tuple(range(len(parts))) if options.shard is None or options.shard[0] == 1 else ()
    plan_hash = hashlib.sha256(f"{plan.settings['plan_sha256']}|{key}".encode()).hexdigest()
    desc = name.replace("-", " ")
    return Phase(name, f"{name}-", plan_hash, len(parts), mine, compute, size, "sequence", desc)


def referent_choice_phase(pm, plan: RunPlan, options: RunOptions) -> Phase:
    """The referent_choice question's scored continuations (prompts without the question's spans
    score nothing)."""
    measure, referents = plan.suite.referent_choice, plan.suite.analysis.referents
    score = lambda prompts, batch, advance: referent_choice.score(
        pm, measure, prompts, referents, batch, advance
    )
    return scored_phase(
        "referent-choice", "referent_choice", plan, options, score, lambda e: len(referents), measure.prompt
    )


def likelihood_phase(pm, plan: RunPlan, options: RunOptions) -> Phase:
    """Every prompt's sentence (its shared words are a part of it)."""
    score = lambda prompts, batch, advance: likelihood.score(pm, prompts, batch, advance)
    return scored_phase("likelihood", "likelihood", plan, options, score, lambda e: 1, "likelihood")


def multiple_choice_phase(pm, plan: RunPlan, options: RunOptions) -> Phase:
    """Every prompt's options, scored after its context and question."""
    measure = plan.suite.multiple_choice
    score = lambda prompts, batch, advance: multiple_choice.score(pm, measure, prompts, batch, advance)
    sequences = lambda e: len(multiple_choice.options_of(e.prompt))
    return scored_phase("multiple-choice", "multiple_choice", plan, options, score, sequences, measure.prompt)


def screen_phases(pm, plan: RunPlan, options: RunOptions) -> list[Phase]:
    """The head-effect screen: held-out items (every head patched exactly, ~60x the cost of another
    item) in their own chunks and progress, then the others."""
    effects, chunks = plan.effects, plan.effect_chunks
    held_out = effects.held_out_ids(plan.effect_items)

    def compute(k, advance):
        tables = effect_phases.screen(pm, effects, chunks[k], held_out, plan.blocker is None)
        advance(len(chunks[k]))
        return tables

    mine = [k for k in range(len(chunks)) if options.owns(k)]
    held = tuple(k for k in mine if any(i.item_id in held_out for i in chunks[k]))
    others = tuple(k for k in mine if k not in held)
    args = ("effects-", plan.effects_plan, len(chunks))
    size = lambda k: len(chunks[k])
    return [
        Phase("head-effects", *args, held, compute, size, unit="item", desc="held-out items"),
        Phase("head-effects", *args, others, compute, size, unit="item", desc="head effects", rate=True),
    ]


def selected_phase(pm, plan: RunPlan, directory: Path) -> tuple[Phase, object]:
    """The selected heads on every item, once every item is screened; and the selection."""
    chunks, info = plan.effect_chunks, pm.info
    first = storage.read_effect_chunks(directory, len(chunks))
    selection = select(
        plan.effects, plan.effect_items, first["totals"], first["items"], info.n_layers, info.n_heads
    )
    key = f"{plan.effects_plan}|{selection.crossfit}|{selection.suite}|{selection.random}"
    selected_plan = hashlib.sha256(key.encode()).hexdigest()

    def compute(k, advance):
        tables = effect_phases.selected(pm, chunks[k], selection, plan.blocker is None)
        advance(len(chunks[k]))
        return tables

    n = len(chunks)
    size = lambda k: len(chunks[k])
    phase = Phase("selected-heads", "selected-", selected_plan, n, tuple(range(n)), compute, size, "item")
    return replace(phase, desc="selected heads"), selection


def screened(directory: Path, plan: RunPlan, options: RunOptions) -> bool:
    """Every item screened (an unsharded run, or a merged directory run again)."""
    n, chunk_dir = len(plan.effect_chunks), directory / "chunks"
    return (
        options.shard is None
        and len(storage.complete_chunks(chunk_dir, n, options.log, "effects-", plan.effects_plan)) == n
    )


def run_head_effects(pm, plan: RunPlan, options: RunOptions, directory: Path, manifest: dict) -> None:
    """Both head-effect phases; the tables are assembled and the manifest records the summary."""
    effects, items, log = plan.effects, plan.effect_items, options.log
    summary = lambda seconds, *selection: head_effects_measure.summary(
        effects, items, plan.dropped, seconds, *selection
    )
    if not screened(directory, plan, options):
        pairs, held = sum(len(i.counterfactuals) for i in items), len(effects.held_out_ids(items))
        n = len(plan.effect_chunks)
        held_text = f", {held} items held out: every head and layer patched exactly" if held else ""
        log(
            f"head effects: {len(items)} items ({pairs} counterfactual pairs{held_text}) in {n} "
            f"chunk{'s' * (n > 1)}; about {head_effects_text(effects, items, pm.model)}, "
            "the time per item is known after the first chunk"
        )
    seconds = sum(
        run_phase(directory, phase, options, manifest) for phase in screen_phases(pm, plan, options)
    )
    if not screened(directory, plan, options):
        if seconds or "head_effects" not in manifest:
            manifest["head_effects"] = summary(seconds)
        return
    phase, selection = selected_phase(pm, plan, directory)
    what = (
        "cross-fitted sets"
        if effects.exact == "all"
        else f"the suite's top {effects.exact} one by one and cross-fitted sets"
    )
    if (
        len(storage.complete_chunks(directory / "chunks", phase.n_chunks, log, phase.prefix, phase.plan))
        < phase.n_chunks
    ):
        log(f"head effects: patching the selected heads ({what}) on {len(items)} items")
    seconds += run_phase(directory, phase, options, manifest)
    previous = manifest.get("head_effects", {})
    if seconds or not storage.has_head_effects(directory) or "crossfit_heads" not in previous:
        before = previous.get("seconds", 0.0)  # e.g. the shards' time in a merged directory
        manifest["head_effects"] = summary(before + seconds, selection, pm.info.n_heads)
        storage.assemble_head_effects(directory, phase.n_chunks, phase.plan)


@contextmanager
def recorded_end(directory: Path, manifest: dict):
    """However the computation ends early, the manifest says so: a second Ctrl-C (which drops the
    chunk in progress) is recorded as an interruption, any other error as `failed`."""
    try:
        yield
    except RunInterrupted:
        raise
    except KeyboardInterrupt:
        stop(directory, manifest, "a second Ctrl-C (the chunk in progress was dropped)")
    except BaseException as exc:
        manifest.update(status="failed", error=f"{type(exc).__name__}: {str(exc)[:300]}")
        with suppress(Exception):  # the error that stopped us (a full disk, say) may stop this write too
            storage.write_manifest(directory, manifest)
        raise


def stop(directory: Path, manifest: dict, where: str) -> None:
    """After Ctrl-C: record the interruption and stop; every finished chunk is kept."""
    manifest.update(status="interrupted", interrupted=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    with ignored_interrupts():  # a further Ctrl-C cannot cut this write short
        storage.write_manifest(directory, manifest)
    raise RunInterrupted(
        f"interrupted after {where}; the finished chunks are kept in {directory / 'chunks'}: "
        "rerun the same command to resume"
    )
