"""`attnprobe edit RUN_DIR`: load what the run found, measure every edit kind (a phase of the run engine
each: a chunk per kind whose marker holds the settings hash of the run, the options and the weights;
resumed, Ctrl-C stopping after the current kind), write edits_items, edits and edits_draws (the
report draws their frontier)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ...analyses.circuits import CIRCUITS_VERSION, hypotheses, measure_run_circuits, write_circuits
from ...analyses.paths import PATHS_VERSION, HeadChoice, measure_run_paths, write_paths
from ...analyses.readout import write_readout
from ...analyses.tracing import measure_tracing, tracing_table
from ...errors import RunError
from ...forward.device import on_model_device
from ...run.execute import deferred_interrupt
from ...run.files.inventory import run_writes
from ...run.files.layout import hashes_known, same_weights
from ...run.files.reader import RunFiles
from ...run.options import RunOptions
from ...run.phases import Phase, run_phase
from ...stats.edits import MLP, STREAM, edit_tables, head_table, quarter_table
from ...stats.keeping.goal import goal_table
from ...stats.keeping.layers import layer_tables
from ...stats.placebo import PLACEBO_PREFIX, placebo_table
from ...store import atomic_write, read_chunks, write_parquet, write_table
from ..inputs import Texts, record_inputs
from ..layers.asked import asked
from .fitted import save_chosen, save_circuits, save_layers
from .measure import SINGLE, GradientScores, clean_values, found_sets, measure_kind, measure_single
from .options import EditOptions, Sweep, checked_options, head_kinds, run_and_suite, settings_hash
from .permuted import PLACEBO_CHOICES, layer_placebo, measure_placebo, placebo_kinds
from .transfer import ALSO_K, transfer, transfer_suites

LAYER_PARTS = "readout"  # the stream's and the MLPs' parts hold the readout after the edit


@dataclass(frozen=True)
class Opened:
    """A run as `attnprobe edit` reads it, once: its files, the run reopened (its own copy of its
    suite), the heads listed with --heads (or None), the reference word, and the manifest's bytes (read
    again under the run's lock: a run changed while the edit waited is read anew)."""

    run: RunFiles
    reopened: object
    listed: tuple | None
    word: str
    manifest: bytes


def _open(directory: Path, options: EditOptions) -> Opened:
    """The run and the options checked (one AttnprobeError otherwise), before any weights load."""
    run, reopened = run_and_suite(directory)
    listed, word = checked_options(options, run.manifest, reopened.suite)
    return Opened(run, reopened, listed, word, (directory / "manifest.json").read_bytes())


def run_edits(
    directory,
    options: EditOptions | None = None,
    model=None,
    log=print,
    also=(),
    also_ks=ALSO_K,
    device: str = "cpu",
) -> pd.DataFrame:
    """Measure `options` (default EditOptions()) on the run in `directory` (its model loaded on
    `device` unless `model` is given); returns the edits table.
    `also`: other suites each chosen edit (k in `also_ks`) is applied to (edits.sweep.transfer).
    Holds the run directory's lock: a `run --fresh` or a second edit on it waits its turn (refused)."""
    directory, options = Path(directory), options or EditOptions()
    suites = transfer_suites(
        tuple(also), tuple(also_ks), None if options.heads else options.ks
    )  # before work
    opened = _open(directory, options)  # the run and the options, before taking the lock
    with run_writes(directory):
        if (directory / "manifest.json").read_bytes() != opened.manifest:  # changed while it waited
            opened = _open(directory, options)
        m = opened.run.manifest
        if loaded_here := model is None:  # its weights' hashes may come from the cache
            log(f"loading {m.model.spec} ({m.dtype})")
            model = opened.reopened.load_model(device)
        weights = same_weights(m, model, str(directory), loaded_here=loaded_here)
        with on_model_device(model):  # the passes' index tensors where the activations are
            summary = _run_edits(directory, opened, options, model, log, weights)
            if suites:
                ks = [k for k in also_ks if k in set(summary["k"])]
                chosen = [(kind, k) for kind in head_kinds(options) for k in ks]
                chosen += [(kind.name, 0) for kind in asked(options)]  # those saved, at either position
                with hashes_known(model, (m.model.weights_sha256, weights)):  # checked above
                    write_table(directory, "edits_transfer", transfer(directory, suites, chosen, model, log))
                log(f"edit: edits_transfer.csv in {directory} ({len(suites)} suites, k {ks})")
        return summary


def _run_edits(directory: Path, opened: Opened, options: EditOptions, model, log, weights) -> pd.DataFrame:
    """The sweep; returns the edits table. `weights`: the model's content hash (same_weights)."""
    run, reopened, listed, word = opened.run, opened.reopened, opened.listed, opened.word
    suite, m = reopened.suite, run.manifest
    started = time.monotonic()
    L, H = m.model.n_layers, m.model.n_heads
    plan = reopened.plan(model, directory, log)
    effects = plan.parts["head_effects"]
    items, measure = effects.items, effects.measure
    log(f"edit: recording {len(items)} items, their {word!r} versions, the control prompts and texts")
    labels = (measure.positive, measure.negative)
    texts = Texts(options.seed, options.texts, options.text)
    inputs = record_inputs(model, items, word, suite.control, labels, texts)
    scores, quarter_scores = _gradient_scores(run, items, inputs, word, L, H)
    sets = found_sets(inputs, scores, options.ks, listed, H)
    key = settings_hash(m.fingerprint, options, weights, str(inputs.control.ids.tolist()))
    sweep = Sweep(directory, m, model, weights, inputs, options, log)
    part = lambda name, measure, plan=key, described=True: _part(
        directory, RunOptions(out=directory, log=log), name, plan, measure, inputs, described
    )
    frames = [inputs.describe(clean_values(model, inputs))]
    with deferred_interrupt(log):  # one Ctrl-C stops the sequence after the part in progress
        frames += _head_parts(part, key, sweep, (sets, scores["all"], quarter_scores))
        frames += _layer_parts(part, key, sweep, frames[0])
        if options.trace:
            traced = part("trace", lambda: measure_tracing(model, inputs, word, log), described=False)
        if options.paths:
            choice = HeadChoice(scores, quarter_scores, listed, H)
            measure = lambda: measure_run_paths(model, inputs, word, choice, log)
            paths = part("paths", measure, f"{key}:paths{PATHS_VERSION}", described=False)
        if options.circuits:  # beside the circuits found: the top 5 heads, and the movers with --paths
            given = hypotheses(scores, H, paths if options.paths else None)
            grain, movers = options.circuit_grain, ":movers" if options.paths else ""
            measure = lambda: measure_run_circuits(model, inputs, word, log, given, grain)
            circuit_plan = f"{key}:circuits{CIRCUITS_VERSION}:{grain}{movers}"
            circuits = part("circuits", measure, circuit_plan, described=False)
    raw = pd.concat([f for f in frames if len(f)], ignore_index=True)  # an empty part would untype columns
    summary, stream, mlp = _write_sweep(directory, raw, options, H, word, started)
    if options.trace:
        atomic_write(directory / "tracing_items.parquet", lambda p: write_parquet(traced, p))
        write_table(directory, "tracing", tracing_table(traced))
    if options.paths:
        write_paths(directory, paths)
        log("paths: the covariate's linear readout per layer at the unit (readout.csv)")
        write_readout(directory, model, suite)
    source = {"reference": word}
    saved = save_chosen(sweep, sets, source) + save_layers(sweep, (stream, mlp), raw, source)
    if options.circuits:
        for line in write_circuits(directory, circuits):
            log(line)
        saved += save_circuits(sweep, source)
    for note in dict.fromkeys(n for n in summary.get("note", []) if n):
        log(f"note: {note}")
    log(
        f"edit: edits.csv and edits_draws.csv in {directory}; {saved} fitted "
        "edits in edits/ (apply one with `attnprobe run SUITE --edit FILE`)"
    )
    return summary


def _head_parts(part, key: str, sweep: Sweep, ranked: tuple) -> list[pd.DataFrame]:
    """The head edits' parts: each kind, the top heads alone, the covariate-fitted kinds' placebo
    (the last two with a plan key of their own: adding them keeps the kinds measured). `ranked`: the
    found sets, every item's head scores, the quarters' scores of any covariate (the placebo's)."""
    sets, scores, rescore = ranked
    model, options, inputs, H, log = sweep.model, sweep.options, sweep.inputs, sweep.n_heads, sweep.log
    subkey = lambda *more: hashlib.sha256(" ".join(map(str, (key, *more))).encode()).hexdigest()[:16]
    frames = [
        part(kind, lambda k=kind: _kind_values(model, sweep.head_fit(k), options, inputs, sets, H, log))
        for kind in head_kinds(options)
    ]
    single = lambda: measure_single(model, inputs, scores, H, options.alone, log)
    frames.append(part(SINGLE, single, subkey(options.alone)))
    if options.placebo and (refit := placebo_kinds(head_kinds(options))):
        rescore = None if options.heads else rescore  # heads the user listed are not chosen again
        placebo = lambda: measure_placebo(sweep, refit, sets, rescore)
        frames.append(part("placebo", placebo, subkey(refit, options.placebo, PLACEBO_CHOICES)))
    return frames


def _layer_parts(part, key: str, sweep: Sweep, clean: pd.DataFrame) -> list[pd.DataFrame]:
    """The per-layer edits' parts (layers.asked: the stream's, each MLP mode's, those of several layers),
    each with its placebo where it is fitted on the covariate (--placebo; a refit of several layers
    costs a pass per layer and fold)."""
    frames = [clean]
    for kind in asked(sweep.options, sweep.inputs):  # the MLPs' outputs recorded once (Sweep.recorded)
        frames.append(part(kind.name, lambda kind=kind: kind.measure(sweep), f"{key}:{LAYER_PARTS}"))
        if kind.covariate:
            frames += layer_placebo(part, key, sweep, frames, kind.name, kind.fit(sweep))
    return frames[1:]


def _gradient_scores(run, items, inputs, word: str, L: int, H: int) -> tuple[dict, object]:
    """The heads' gradient scores on every item ("all") and on each quarter's training items (the
    scores the heads tested on quarter f are chosen by), and the function giving the quarters' scores
    for another covariate (the paths' placebo)."""
    gradient = GradientScores(run.head_effect_items, run.head_effect_totals, word, L, H)
    fold_of = dict(zip([i.item_id for i in items], inputs.fold))
    training = {f: [i for i, g in fold_of.items() if g in inputs.training(f)] for f in range(4)}
    quarter_scores = lambda covariate: {f: gradient.of(covariate, ids) for f, ids in training.items()}
    covariate = {i.item_id: i.covariate for i in items}
    return {"all": gradient.of(covariate), **quarter_scores(covariate)}, quarter_scores


def _write_sweep(
    directory: Path, raw: pd.DataFrame, options: EditOptions, H: int, word: str, started
) -> tuple:
    """The sweep's tables from its raw values: edits, draws, quarters, the stream's and the heads'
    alone, the MLPs', the placebo, the goal; returns (the edits table, the stream's, the MLPs')."""
    write_table(directory, "edits_items", raw)
    sweep = raw[(raw["kind"] != SINGLE) & ~raw["kind"].str.startswith((PLACEBO_PREFIX, MLP, STREAM))]
    summary, draws = edit_tables(sweep, H)
    summary = summary.assign(reference=word, seconds=round(time.monotonic() - started, 1))
    (stream, chosen), (mlp, mlp_chosen) = layer_tables(raw, STREAM), layer_tables(raw, MLP)
    chosen = pd.concat([chosen, mlp_chosen])
    placebo = placebo_table(pd.concat([raw, chosen], ignore_index=True))
    if len(placebo):  # each refit kind's row (and each per-layer edit's chosen row) gets its placebo p
        write_table(directory, "edits_placebo", placebo)
        p = placebo.drop(columns="gradient_removed")
        summary = summary.merge(p, on=["kind", "k"], how="left")
        # each per-layer edit's chosen row (kind stream-chosen, mlp-MODE-chosen, ...)
        mine = lambda t, at: t.merge(p[p.kind.str.startswith(at)].drop(columns="k"), on="kind", how="left")
        stream, mlp = (mine(t, at) if len(t) else t for t, at in ((stream, STREAM), (mlp, MLP)))
    write_table(directory, "edits", summary)
    write_table(directory, "edits_goal", goal_table(summary, stream, mlp, pd.concat([raw, chosen])))
    write_table(directory, "edits_draws", draws)
    chosen = pd.concat([raw[raw["kind"] == "none"], chosen])  # the stream's chosen rows and the clean ones
    write_table(directory, "edits_quarters", pd.concat([quarter_table(sweep), quarter_table(chosen)]))
    if len(stream):
        write_table(directory, "edits_stream", stream)
    if len(mlp):
        write_table(directory, "edits_mlp", mlp)
    if options.alone:
        write_table(directory, "edits_heads", head_table(raw[raw["kind"].isin(["none", SINGLE])], H))
    return summary, stream, mlp


def _kind_values(model, fit, *args) -> pd.DataFrame:
    """measure_kind; a kind another package registered that fails is one line naming it (its
    values are not written; the kinds before it keep theirs)."""
    try:
        return measure_kind(model, fit, *args)
    except Exception as exc:
        kind, module = fit.name, fit.kind.__module__
        if module.startswith("attnprobe."):  # attnprobe's own: its traceback
            raise
        raise RunError(
            f"edit kind {kind!r} ({module}) failed: {type(exc).__name__}: {str(exc)[:200]}; "
            "check it with attnprobe.testing.check_edit_kind"
        ) from None


def _part(directory: Path, options: RunOptions, name: str, plan: str, measure, inputs, described: bool):
    """One part of the sweep (an edit kind, the heads alone, the stream, tracing, paths) as a phase of
    the run engine: one chunk (chunks/edits-NAME-00000.*, its marker holding `plan`, the settings
    hash), measured by `measure()` unless an earlier session wrote it for the same plan; Ctrl-C stops
    after it. Returns its raw values (with the items' columns when `described`)."""

    def compute(k, advance):
        frame = measure()
        advance(1)
        return {"edits": inputs.describe(frame) if described and len(frame) else frame}

    phase = Phase(
        f"edit {name}",
        f"edits-{name}-",
        plan,
        1,
        (0,),
        compute,
        lambda k: 1,
        "part",
        f"attnprobe edit {name}",
        files=("edits.parquet",),
    )
    if not run_phase(directory, phase, options, None):
        options.log(f"edit: {name} read from an earlier session")
    return read_chunks(directory, 1, phase.files, phase.prefix)["edits"]
