"""Running a suite on a model: plan (pure), execute (the batch kernel), store (the run directory).

`run_suite` validates the suite against the tokenizer, plans the batches, checks every measure
(head effects included) before any weights load, then computes the chunks this process owns and
writes them through `storage`; it returns the run directory. Reading a run: `reader.RunFiles`.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from contextlib import contextmanager, suppress
from pathlib import Path


from ..errors import RunError, RunInterrupted
from ..measures import head_effect_phases as phases
from ..measures import head_effects as head_effects_measure
from ..measures import BATCH_KINDS, referent_choice
from ..measures.next_token import candidate_ids
from ..modelchecks import check_device
from ..models import DEFAULT_MODEL, ProbeModel, load_model, load_tokenizer, routes_attention
from ..suite import Suite, load_suite
from ..version import __version__
from . import storage
from ..progress import Progress
from .execute import deferred_interrupt, ignored_interrupts, example_attention, measure_batch
from ..sharing import prefix_sharing_blocker
from .plan import (DEFAULT_BATCH_SIZE, encode_prompts, fingerprint, plan_batches, plan_chunks, plan_sha256,
                   select_prompts, sharing_summary, sink_notes)

SEED = 0  # nothing in a run is random; recorded so statistics that resample can say what they used
EFFECT_CHUNK_ITEMS = 32  # head-effects items per chunk: at most this many items are redone after a kill
HELD_OUT_CHUNK_ITEMS = 2  # held-out items (every head patched exactly, ~60x the cost of another) per chunk

__all__ = ["SEED", "model_name", "run_suite"]


def model_name(spec: str) -> str:
    """The directory name of a model spec: a path's last part (without .gguf), a hub id with '_' for '/'."""
    path = Path(spec)
    if spec.endswith(".gguf"):
        return path.stem
    if path.exists():
        return path.resolve().name or "model"
    return spec.replace("/", "_")


def run_suite(
    suite: str | Path | Suite,
    model: str | ProbeModel | None = None,
    out: str | Path | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    limit: int | None = None,
    dtype: str = "float32",
    resume: bool = True,
    chunk_size: int = 512,
    progress: bool | None = None,
    trust_remote_code: bool = False,
    log=None,
    max_batch_tokens: int | None = None,
    shard: tuple[int, int] | None = None,
    device: str = "cpu",
    device_map: str | None = None,
    head_effects: bool = True,
    allow_pickle: bool = False,
    data_roots=(),
    share_prefixes: bool = True,
) -> Path:
    """Run `suite` and return its run directory. Validation (suite, tokens, candidates, context,
    head-effects items) happens before the model's weights load; a finished chunk is never
    recomputed when `resume` is on.

    `shard=(k, n)` computes only chunks k-1, k-1+n, ... (one shard per process or GPU rank) into
    its own directory; `storage.merge_shards` joins the n directories into the unsharded result.
    The suite's head_effects measure runs (in chunks of items, split over shards the same way)
    unless `head_effects=False`. `data_roots`: directories besides the suite's own that its data
    files may come from. `share_prefixes`: forward the prompts' shared token prefixes once (packed
    with their suffixes, see capture.run_with_shared_prefixes) where the model allows it (the manifest's `prefix_sharing` says why not)."""
    suite = suite if isinstance(suite, Suite) else load_suite(suite, data_roots=data_roots)
    log = log or (lambda message: print(message, file=sys.stderr))
    if batch_size < 1 or chunk_size < 1:
        raise RunError("batch size and chunk size must be at least 1")
    if shard is not None and not (len(shard) == 2 and 1 <= shard[0] <= shard[1]):
        raise RunError(f"shard must be K/N with 1 <= K <= N, got {shard}")
    spec = model.info.spec if isinstance(model, ProbeModel) else (model or suite.model or DEFAULT_MODEL)
    if isinstance(model, ProbeModel):
        tokenizer, max_positions, config = model.tokenizer, model.info.max_positions, model.model.config
        dtype = str(model.dtype).removeprefix("torch.")  # a loaded model runs in its own dtype
    else:
        tokenizer, max_positions, config = load_tokenizer(spec, trust_remote_code=trust_remote_code)
    routes = routes_attention(config)
    prompts = select_prompts(suite.prompts, limit)
    encoded = encode_prompts(suite, prompts, tokenizer, max_positions)
    context = {"candidate_ids": candidate_ids(suite.next_token, prompts, tokenizer)}  # what every batch reads
    blocker = prefix_sharing_blocker(config, max((e.n_forward for e in encoded), default=0)) if share_prefixes else "switched off"
    chunks = plan_chunks(plan_batches(encoded, batch_size, max_batch_tokens, share_prefixes=blocker is None), chunk_size)
    mine = [k for k in range(len(chunks)) if shard is None or k % shard[1] == shard[0] - 1]
    effects = suite.head_effects.for_prompts(len(encoded), len(suite.prompts)) if head_effects and suite.head_effects else None
    effect_items, dropped, effect_chunks = [], [], []
    if effects is not None:  # every head-effects problem surfaces now, before any weights load
        effects.check_family(routes, spec)
        effect_items, dropped = effects.items(tokenizer, encoded)
        effect_chunks = _effect_chunks(effect_items, effects.held_out_ids(effect_items))
    effects_plan = head_effects_measure.plan_sha256(effect_items, effects) if effects is not None else None
    mine_effects = [k for k in range(len(effect_chunks)) if shard is None or k % shard[1] == shard[0] - 1]

    name = model.info.name if isinstance(model, ProbeModel) else model_name(spec)
    directory = Path(out) if out else Path("reports") / suite.name / name
    if shard is not None:  # every rank may be given the same --out
        directory = directory / f"shard-{shard[0]}-of-{shard[1]}"
    settings = {"suite_sha256": suite.sha256, "model": spec, "dtype": dtype, "batch_size": batch_size,
                "chunk_size": chunk_size, "limit": limit, "max_batch_tokens": max_batch_tokens, "attnprobe": __version__,
                "share_prefixes": blocker is None,
                "plan_sha256": plan_sha256(chunks, encoded)}
    expected = fingerprint(settings, shard)
    if device_map is None and not isinstance(model, ProbeModel):
        check_device(device)  # before the output directory is created
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunError(f"cannot create output directory {directory}: {exc.strerror}; choose another with --out") from None
    with storage.exclusive(directory):
        previous = storage.prepare_directory(directory, expected, resume, suite.name, log) or {}
        with Progress(2, enabled=progress if not isinstance(model, ProbeModel) else False, log=log, unit="step", desc="loading") as bar:
            if not isinstance(model, ProbeModel):
                log(f"loading {spec} ({dtype})")
            pm = model if isinstance(model, ProbeModel) else load_model(
                spec, dtype=dtype, device=device, device_map=device_map, trust_remote_code=trust_remote_code,
                allow_pickle=allow_pickle)
            bar.step("model loaded")
            weights_sha = storage.weights_sha(pm)
            bar.step("weights hashed")
        manifest = {
            "fingerprint": expected,
            "status": "running",
            "shard": list(shard) if shard else None,
            "suite": {"name": suite.name, "path": suite.path, "sha256": suite.sha256, "description": suite.description,
                      "contrast": suite.contrast, "templates": {t.id: t.text for t in suite.templates}},
            "analysis": suite.analysis.to_dict(),
            "model": {"spec": spec, "name": name, "family": pm.info.family, "weights_sha256": weights_sha,
                      "n_layers": pm.info.n_layers, "n_heads": pm.info.n_heads, "n_kv_heads": pm.info.n_kv_heads},
            "dtype": str(pm.dtype).removeprefix("torch."),
            "seed": SEED,
            "settings": settings,
            "versions": storage.versions(),
            "n_prompts": len(encoded),
            "n_chunks": len(chunks),
            "n_effect_chunks": len(effect_chunks),
            "prefix_sharing": sharing_summary(chunks, encoded, blocker),
            "effects_plan": effects_plan,
            "skipped": list(suite.skipped),
            "notes": list(suite.notes) + sink_notes(suite, encoded),
            "referent_choice": suite.referent_choice.prompt if suite.referent_choice else None,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        same_effects = effects is None or previous.get("effects_plan") == effects_plan
        if "head_effects" in previous and same_effects and storage.has_head_effects(directory):  # a re-run keeps them
            manifest.update(head_effects=previous["head_effects"], effects_plan=previous.get("effects_plan"))
        storage.write_manifest(directory, manifest)
        with recorded_end(directory, manifest):
            storage.write_table(directory, "prompts", storage.prompts_table(encoded))

            chunk_dir = directory / "chunks"
            chunk_dir.mkdir(exist_ok=True)
            done = storage.complete_chunks(chunk_dir, len(chunks), log)
            if done:
                log(f"resuming {directory}: {len(done)} of {len(chunks)} chunks already complete")
            started = time.perf_counter()
            bar = Progress(sum(len(b) for k in mine for b in chunks[k]), sum(len(b) for k in done for b in chunks[k]), progress, log)
            with deferred_interrupt(log) as interrupted:
                for k in mine:
                    if k in done:
                        continue
                    parts = {kind.NAME: [] for kind in BATCH_KINDS}
                    for batch in chunks[k]:
                        for name, part in measure_batch(pm, suite, [encoded[i] for i in batch], context, _packs(batch)).items():
                            parts[name].append(part)
                        bar.update(len(batch))
                    storage.write_chunk(chunk_dir, k, {kind.NAME: kind.chunk_table(parts[kind.NAME], pm) for kind in BATCH_KINDS})
                    bar.chunk_done(k, len(chunks))
                    if interrupted():
                        bar.close()
                        _stop(directory, manifest, f"chunk {k + 1} of {len(chunks)}")
            bar.close()
            if shard is None:
                storage.assemble(directory, len(chunks))
            if shard is None or shard[0] == 1:
                examples = example_attention(pm, encoded, suite.contrast)
                storage.atomic_write(directory / "examples.json", lambda p: p.write_text(json.dumps(examples)))
                if suite.referent_choice is not None and not (previous and (directory / "referent_choice.parquet").is_file()):
                    _referent_choice(pm, suite, encoded, directory, batch_size, progress, log)
            if effects is not None:
                _head_effects(pm, effects, effect_items, dropped, effect_chunks, mine_effects, effects_plan, directory, manifest,
                              progress, log, shard, share_prefixes)
        manifest.update(status="complete" if shard is None else "shard complete", finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                        compute_seconds_this_session=round(time.perf_counter() - started, 3))
        storage.write_manifest(directory, manifest)
    return directory


def _packs(batch) -> list[int] | None:
    """The size of each pack of a batch that shares prefixes, None for a batch of whole prompts."""
    return [len(pack) for pack in batch.packs] if batch.shared else None


def _referent_choice(pm, suite, encoded, directory, batch_size, progress, log) -> None:
    """The scored continuations of every prompt (two short forwards each), written as one table."""
    bar = Progress(2 * len(encoded), 0, progress, log, desc="referent choice")
    table = referent_choice.score(pm, suite.referent_choice, encoded, suite.analysis.referents, batch_size, bar.update)
    bar.close()
    storage.write_table(directory, "referent_choice", table)


def _effect_chunks(items: list[dict], held_out: set[str]) -> list[list[dict]]:
    """The held-out items first, HELD_OUT_CHUNK_ITEMS per chunk, then the others, EFFECT_CHUNK_ITEMS per chunk."""
    def split(part, size):
        return [part[i:i + size] for i in range(0, len(part), size)]
    return (split([i for i in items if i["item_id"] in held_out], HELD_OUT_CHUNK_ITEMS)
            + split([i for i in items if i["item_id"] not in held_out], EFFECT_CHUNK_ITEMS))


def _head_effects(pm, effects, items, dropped, chunks, mine, plan, directory, manifest, progress, log, shard, share) -> None:
    """Both phases of the head effects (see measures.head_effects): the screen chunks this process
    owns, then, once every item is screened (unsharded runs, or a merged directory run again), the
    selected heads, chunk by chunk; the tables are assembled and the manifest records the summary.
    `share`: passes leave out the clean prefix of x and x' where that is exact (patching.patched)."""
    held_out = effects.held_out_ids(items)
    seconds = _run_effect_chunks(pm, effects, chunks, mine, plan, directory, manifest, progress, log, held_out, share)
    chunk_dir = directory / "chunks"
    if shard is not None or len(storage.complete_chunks(chunk_dir, len(chunks), log, "effects-", plan)) < len(chunks):
        if seconds or "head_effects" not in manifest:
            manifest["head_effects"] = head_effects_measure.summary(effects, items, dropped, seconds)
        return
    L, H = pm.info.n_layers, pm.info.n_heads
    first = storage.read_effect_chunks(directory, len(chunks))
    selection = phases.select(effects, items, first["totals"], first["items"], L, H)
    selected_plan = hashlib.sha256(f"{plan}|{selection['crossfit']}|{selection['suite']}".encode()).hexdigest()
    done = storage.complete_chunks(chunk_dir, len(chunks), log, "selected-", selected_plan)
    if len(done) < len(chunks):
        heads = "cross-fitted sets" if effects.exact == "all" else f"the suite's top {effects.exact} one by one and cross-fitted sets"
        log(f"head effects: patching the selected heads ({heads}) on {len(items)} items")
        started = time.perf_counter()
        bar = Progress(len(items), sum(len(chunks[k]) for k in done), progress, log, unit="item", desc="selected heads")
        with deferred_interrupt(log) as interrupted:
            for k in range(len(chunks)):
                if k in done:
                    continue
                storage.write_effect_chunk(chunk_dir, k, phases.selected(pm, effects, chunks[k], selection, bar, share), selected_plan, "selected-")
                bar.chunk_done(k, len(chunks))
                if interrupted():
                    bar.close()
                    _stop(directory, manifest, f"selected-heads chunk {k + 1} of {len(chunks)}")
        bar.close()
        seconds += time.perf_counter() - started
    if seconds or not storage.has_head_effects(directory) or "crossfit_heads" not in manifest.get("head_effects", {}):
        before = manifest.get("head_effects", {}).get("seconds", 0.0)  # e.g. the shards' time in a merged directory
        manifest["head_effects"] = head_effects_measure.summary(effects, items, dropped, before + seconds, selection, H)
        storage.assemble_head_effects(directory, len(chunks), selected_plan)


def _estimate(pm, effects, items) -> str:
    """The expected time of the head effects, from SmolLM2's measured speed on 2 CPU cores scaled by
    the model's size (on another device: unknown until the first chunk)."""
    module = pm.model
    if next(module.parameters()).device.type != "cpu":
        return "time unknown on this device"
    embeddings = {id(m.weight): m.weight.numel() for m in (module.get_input_embeddings(), module.get_output_embeddings())
                  if m is not None}  # tied: one tensor, as parameters() counts it
    parameters = sum(p.numel() for p in module.parameters()) - sum(embeddings.values())
    return f"{effects.estimate_seconds(items, max(parameters, 1)) / 60:.1f} min on 2 CPU cores"


def _run_effect_chunks(pm, effects, chunks, mine, plan, directory, manifest, progress, log, held_out, share) -> float:
    """Screen this process's head-effects chunks that are not done yet, one chunk of items at a
    time, each written before the next starts (Ctrl-C finishes the chunk, then stops); returns the
    seconds spent (0 when every chunk was already done)."""
    chunk_dir = directory / "chunks"
    done = storage.complete_chunks(chunk_dir, len(chunks), log, "effects-", plan)
    todo = [k for k in mine if k not in done]
    if not todo:
        return 0.0
    started = time.perf_counter()
    n_items = sum(len(chunks[k]) for k in todo)
    n_held = sum(i["item_id"] in held_out for k in todo for i in chunks[k])
    log(f"head effects: {n_items} items ({sum(len(i['counterfactuals']) for k in todo for i in chunks[k])} counterfactual pairs"
        f"{f', {n_held} items held out: every head and layer patched exactly' if n_held else ''}) in {len(todo)} "
        f"chunk{'s' * (len(todo) > 1)}; about {_estimate(pm, effects, [i for k in todo for i in chunks[k]])}, "
        "the time per item is known after the first chunk")
    held = {k for k in mine if any(i["item_id"] in held_out for i in chunks[k])}
    bars = {}  # one bar for the held-out chunks, one for the others (an item costs ~60x more held out)

    def bar_of(kind: bool) -> Progress:
        if kind not in bars:
            for other in bars.values():
                other.close()
            ks = [k for k in mine if (k in held) == kind]
            bars[kind] = Progress(sum(len(chunks[k]) for k in ks), sum(len(chunks[k]) for k in ks if k in done), progress, log,
                                  unit="item", desc="held-out items" if kind else "head effects")
        return bars[kind]

    told = False
    with deferred_interrupt(log) as interrupted:
        for k in todo:
            chunk_started, bar = time.perf_counter(), bar_of(k in held)
            storage.write_effect_chunk(chunk_dir, k, phases.screen(pm, effects, chunks[k], held_out, bar, share), plan)
            bar.chunk_done(k, len(chunks))
            later = [j for j in todo if j > k and j not in held]
            if not told and later and k not in held:  # the time of a chunk of screened items only
                told = True
                per_item, n_later = (time.perf_counter() - chunk_started) / len(chunks[k]), sum(len(chunks[j]) for j in later)
                log(f"head effects: {per_item:.2f} s per item, about {per_item * n_later / 60:.1f} min for the other {n_later} items")
            if interrupted():
                bar.close()
                _stop(directory, manifest, f"head-effects chunk {k + 1} of {len(chunks)}")
    for bar in bars.values():
        bar.close()
    return time.perf_counter() - started


@contextmanager
def recorded_end(directory: Path, manifest: dict):
    """However the computation ends early, the manifest says so: a second Ctrl-C (which drops the
    chunk in progress) is recorded as an interruption, any other error as `failed`."""
    try:
        yield
    except RunInterrupted:
        raise
    except KeyboardInterrupt:
        _stop(directory, manifest, "a second Ctrl-C (the chunk in progress was dropped)")
    except BaseException as exc:
        manifest.update(status="failed", error=f"{type(exc).__name__}: {str(exc)[:300]}")
        with suppress(Exception):  # the error that stopped us (a full disk, say) may stop this write too
            storage.write_manifest(directory, manifest)
        raise


def _stop(directory: Path, manifest: dict, where: str) -> None:
    """After Ctrl-C: record the interruption and stop; every finished chunk is kept."""
    manifest.update(status="interrupted", interrupted=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    with ignored_interrupts():  # a further Ctrl-C cannot cut this write short
        storage.write_manifest(directory, manifest)
    raise RunInterrupted(f"interrupted after {where}; the finished chunks are kept in {directory / 'chunks'}: "
                         "rerun the same command to resume")
