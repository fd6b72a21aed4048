"""Running a suite on a model: options, plan (pure), phases (the engine), store (the run directory).

`run_suite` plans the run (every suite, token and head-effects problem surfaces before any weights
load), opens the run directory, loads the model, runs the phases and records the end in the
manifest; it returns the run directory. Reading a run: `reader.RunFiles`.
"""

from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

from ..attention.capture import active_model_edit
from ..errors import RunError
from ..forward.device import on_model_device
from ..measures import batch_kinds
from ..model import ProbeModel, load_model
from ..model.checks import check_device
from ..model.footprint import check_fits
from ..model.tokenizers import read_once
from ..progress import Progress
from ..store import write_table
from ..suite import Suite, load_suite
from .files import fresh
from .files.inventory import run_writes
from .files.layout import prompts_table, weight_hashes
from .files.manifest import Manifest, new_manifest
from .options import RunOptions
from .phases import Engine, prompts_phase, recorded_end, run_phase
from .plan import RunPlan, model_name, plan_run
from .resources import working_bytes

__all__ = ["RunOptions", "RunPlan", "model_name", "plan_run", "run_suite"]


def run_suite(
    suite: str | Path | Suite, model: str | ProbeModel | None = None, options: RunOptions | None = None
) -> Path:
    """Run `suite` on `model` (a spec, a loaded ProbeModel, or None: the suite's model, else the
    default) and return its run directory. A finished chunk is never recomputed when
    `options.resume` is on; `options.shard=(k, n)` computes only this process's chunks into its own
    directory (`merge.merge_shards` joins the n directories)."""
    with read_once():  # the plan's tokenizer is the one the model is loaded with
        return _run_suite(suite, model, options)


def _run_suite(suite, model, options: RunOptions | None) -> Path:
    options = options or RunOptions()
    if active_model_edit() is not None:
        raise RunError(
            "run_suite inside `attnprobe.edited(...)`: the run would not record the edit and could resume "
            "an unedited run; save the edit (attnprobe.edits.save_edit) and pass "
            "RunOptions(edits=(load_edit(path),))"
        )
    suite = suite if isinstance(suite, Suite) else load_suite(suite, data_roots=options.data_roots)
    plan = plan_run(suite, model, options)
    if options.device_map is None and not isinstance(model, ProbeModel):
        check_device(options.device)  # before the output directory is created
        check_fits(
            plan.config, plan.spec, plan.dtype, options.device, options.device_map, working_bytes(plan)
        )
    directory = _open(plan.directory)
    with run_writes(directory):
        previous = fresh.prepare_directory(
            directory, plan.fingerprint, options.resume, suite.name, options.log, plan.settings
        )
        pm, (files_sha, content) = _load(model, plan, options)
        manifest = new_manifest(plan, pm, options, files_sha, content)
        manifest.suite.copy = fresh.copy_suite(directory, suite)
        for applied in manifest.edits:  # recorded as same_weights: false, and said
            if applied.get("same_weights") is False:
                fitted = applied["fitted_on_model"]
                options.log(
                    f"note: the edit {applied['name']} was fitted on other weights ({fitted}) than "
                    f"{plan.spec}'s, of the same shape; its parameters are theirs"
                )
        _same_weights(previous, manifest, directory)
        for kind, declared, part in plan.kinds():  # what each measure keeps of a resumed run
            manifest.entries.update(kind.resumed(declared, part, previous, directory))
        manifest.write(directory)
        started = time.perf_counter()
        with recorded_end(directory, manifest), _edited(pm, options.edits), on_model_device(pm):
            write_table(directory, "prompts", prompts_table(plan.encoded))
            seconds = run_phase(directory, prompts_phase(pm, plan, options), options, manifest)
            manifest.prompt_phase = {"seconds": round(seconds, 4), "device": str(pm.device)}
            if options.shard is None:
                for kind in batch_kinds():
                    kind.assemble(directory, len(plan.chunks))
            engine = Engine(pm, plan, options, directory, manifest)
            for kind, declared, part in plan.kinds():  # each measure's own phases, in registry order
                kind.compute(declared, part, engine)
        manifest.status = "complete" if options.shard is None else "shard complete"
        manifest.finished = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        manifest.compute_seconds_this_session = round(time.perf_counter() - started, 3)
        manifest.write(directory)
    return directory


@contextmanager
def _edited(pm: ProbeModel, edits):
    """The run's saved edits applied to every forward pass (the measures see the edited model)."""
    with ExitStack() as stack:
        for edit in edits:
            stack.enter_context(edit.applied(pm))
        yield


def _same_weights(previous: Manifest | None, manifest: Manifest, directory: Path) -> None:
    """A resumed run continues only with the weights it began with: other weights under the same
    path would mix two models' chunks in one table."""
    before = previous and previous.model.weights_content
    if before and before != manifest.model.weights_content:
        raise RunError(
            f"{directory}: the weights of {manifest.model.spec} changed since this run began (their "
            "content hash differs); rerun with --fresh to start over on the new weights"
        )


def _open(directory: Path) -> Path:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunError(
            f"cannot create output directory {directory}: {exc.strerror}; choose another with --out"
        ) from None
    return directory


def _load(model, plan: RunPlan, options: RunOptions) -> tuple[ProbeModel, tuple[str | None, str]]:
    """The model (already loaded, or loaded now with its own progress) and its weights' hashes
    (weight_hashes: a model handed in is hashed as it is in memory)."""
    loaded = isinstance(model, ProbeModel)
    with Progress(
        2, enabled=False if loaded else options.progress, log=options.log, unit="step", desc="loading"
    ) as bar:
        if loaded:
            return model, weight_hashes(model)
        options.log(f"loading {plan.spec} ({plan.dtype})")
        pm = load_model(
            plan.spec,
            dtype=plan.dtype,
            device=options.device,
            device_map=options.device_map,
            trust_remote_code=options.trust_remote_code,
            allow_pickle=options.allow_pickle,
        )
        bar.step("model loaded")
        hashes = weight_hashes(pm, loaded_here=True)
        bar.step("weights hashed")
    return pm, hashes
