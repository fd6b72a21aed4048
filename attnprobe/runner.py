"""Run a suite on a model: length-sorted batches, row capture, chunks streamed to disk, resume.

The run directory holds the contract other tools read:
  prompts.csv        one row per prompt: ids, text, slot values, metadata, spans (char and token)
  attention.parquet  prompt_id, layer, head, source, target, weight
  logprobs.csv       prompt_id, cut, candidate, candidate_label, logprob
  manifest.json      suite hash, model spec and weights hash, versions, dtype, seed, times, settings
  chunks/            the finished chunks; a chunk counts only once its `.done` marker exists, so a run
                     killed at any moment resumes from the last complete chunk.
The batch plan depends only on the suite, tokenizer and settings, so a resumed run recomputes the
same batches and ends with results identical to an uninterrupted one.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import platform
import shutil
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from . import __version__
from .capture import pad_right, run_with_capture
from .errors import AttnprobeError, RunInterrupted
from .models import DEFAULT_MODEL, ProbeModel, files_sha256, load_model, load_tokenizer
from .suite import Prompt, Suite, SuiteError, load_suite, spread_key, token_spans
from .tables import write_csv

SEED = 0  # nothing in a run is random; recorded so statistics that resample can say what they used


class RunError(AttnprobeError):
    """A run directory that cannot be used as asked."""


@dataclass(frozen=True)
class Encoded:
    prompt: Prompt
    ids: tuple[int, ...]
    spans: dict[str, tuple[int, int]]  # token ranges [start, end) in the unpadded prompt
    n_forward: int  # leading tokens the run forwards (see forward_length)

    @property
    def forward_ids(self) -> tuple[int, ...]:
        return self.ids[: self.n_forward]


# ------------------------------------------------------------------------------ preparation


def select_prompts(prompts: tuple[Prompt, ...], limit: int | None) -> list[Prompt]:
    """About `limit` prompts taken as whole items (all contrast variants), one item per template in
    turn, so a small run still spans every template; within a template items come in a fixed
    pseudo-random order (by a hash of the item id), so they spread over slot values such as
    occupations. Original prompt ids are kept."""
    if limit is None or limit >= len(prompts):
        return list(prompts)
    items: dict[str, dict[str, list[Prompt]]] = {}
    for prompt in prompts:
        items.setdefault(prompt.template_id, {}).setdefault(prompt.item_id, []).append(prompt)
    queues = [[by_item[k] for k in sorted(by_item, key=spread_key)] for by_item in items.values()]
    chosen: list[Prompt] = []
    for round_ in range(max(len(q) for q in queues)):
        for queue in queues:
            if round_ < len(queue):
                if chosen and len(chosen) + len(queue[round_]) > limit:
                    return sorted(chosen, key=lambda p: p.prompt_id)
                chosen.extend(queue[round_])
    return sorted(chosen, key=lambda p: p.prompt_id)


def encode_prompts(suite: Suite, prompts: list[Prompt], tokenizer, max_positions: int | None) -> list[Encoded]:
    """Tokenise once and map spans to tokens; every problem is a `file:line:` SuiteError."""
    encodings = tokenizer([p.text for p in prompts], return_offsets_mapping=True, add_special_tokens=True)
    encoded = []
    for prompt, ids, offsets in zip(prompts, encodings["input_ids"], encodings["offset_mapping"]):
        if max_positions is not None and len(ids) > max_positions:
            raise SuiteError(f"{prompt.origin}: prompt {prompt.prompt_id} has {len(ids)} tokens, more than the model's "
                             f"context of {max_positions}; shorten the template or its slot values")
        spans = token_spans([tuple(o) for o in offsets], prompt.spans)
        for name, (start, _) in spans.items():
            if start < 0:
                raise SuiteError(f"{prompt.origin}: span '{name}' covers no token in {prompt.text!r}; give the slot visible text")
        for cut in prompt.candidates:
            if spans[cut][0] == 0:
                raise SuiteError(f"{prompt.origin}: next_token cut at '{cut}' leaves no tokens before it in {prompt.text!r}")
        encoded.append(Encoded(prompt, tuple(ids), spans, forward_length(suite, prompt, spans)))
    return encoded


def forward_length(suite: Suite, prompt: Prompt, spans: dict[str, tuple[int, int]]) -> int:
    """How many leading tokens of a prompt a run must forward. The models are causal: the attention
    row of a query and the logits at a position depend only on the tokens up to that position. So
    everything after the last span an attention measure reads (source or target) and after the last
    next-token cut is left out without changing any result (the gender suite: 63% of its tokens)."""
    ends = [spans[name][1] for m in suite.attention for name in (m.source, *m.targets) if name in spans]
    ends += [spans[cut][0] for cut in prompt.candidates]
    return max(ends, default=1)


def candidate_ids(suite: Suite, prompts: list[Prompt], tokenizer) -> dict[str, tuple[int, ...]]:
    """Token ids of every candidate string, tokenised as a continuation (no special tokens)."""
    origins = {m.cut: m.origin for m in suite.next_token}
    table = {}
    for prompt in prompts:
        for cut, candidates in prompt.candidates.items():
            for text, _ in candidates:
                if text not in table:
                    ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
                    if not ids:
                        raise SuiteError(f"{origins.get(cut, prompt.origin)}: candidate {text!r} tokenises to nothing; "
                                         "give a visible word such as \" she\"")
                    table[text] = ids
    return table


def plan_batches(encoded: list[Encoded], batch_size: int, max_batch_tokens: int | None = None) -> list[list[int]]:
    """Indices into `encoded`, sorted by forwarded length (then prompt id) and cut into batches of at
    most `batch_size` prompts and, if given, at most `max_batch_tokens` padded tokens."""
    order = sorted(range(len(encoded)), key=lambda i: (encoded[i].n_forward, encoded[i].prompt.prompt_id))
    batches, current = [], []
    for i in order:
        longest = encoded[i].n_forward  # sorted: the newest prompt is the longest of its batch
        too_many_tokens = max_batch_tokens is not None and current and (len(current) + 1) * longest > max_batch_tokens
        if len(current) == batch_size or too_many_tokens:
            batches.append(current)
            current = []
        current.append(i)
    return batches + ([current] if current else [])


def plan_chunks(batches: list[list[int]], chunk_size: int) -> list[list[list[int]]]:
    """Consecutive batches grouped into chunks of at least `chunk_size` prompts (the last may be smaller)."""
    chunks, current = [], []
    for batch in batches:
        current.append(batch)
        if sum(len(b) for b in current) >= chunk_size:
            chunks.append(current)
            current = []
    return chunks + ([current] if current else [])


# ------------------------------------------------------------------------------ one batch


def _aggregate(w: torch.Tensor, how: str, dim: int) -> torch.Tensor:
    if how == "mean":
        return w.mean(dim)
    if how == "sum":
        return w.sum(dim)
    if how == "max":
        return w.amax(dim)
    return w.select(dim, 0 if how == "first" else -1)


def measure_batch(pm: ProbeModel, suite: Suite, batch: list[Encoded], cand_ids: dict) -> tuple[list, dict]:
    """Attention blocks (prompt_id, source, target, L*H weights) and log-probability rows (as
    column lists) for one batch."""
    pad_id = pm.tokenizer.pad_token_id
    ids, mask = pad_right([e.forward_ids for e in batch], pad_id)

    # Rows to capture: the tokens of every source span, per prompt; padded by repeating the first.
    rows_per_prompt = []
    for e in batch:
        wanted = sorted({t for m in suite.attention if m.source in e.spans for t in range(*e.spans[m.source])})
        rows_per_prompt.append(wanted or [0])
    R = max(len(r) for r in rows_per_prompt)
    rows = torch.tensor([r + [r[0]] * (R - len(r)) for r in rows_per_prompt])  # (B, R)

    # Next-token logits: at the token before each cut.
    positions = sorted({e.spans[cut][0] - 1 for e in batch for cut in e.prompt.candidates})
    captured = run_with_capture(pm, ids, mask, rows=rows, layers=None if suite.attention else [],
                                logit_positions=torch.tensor(positions) if positions else None)

    blocks = []  # (prompt_id, source, target, (L*H,) weights, layer-major)
    if suite.attention:
        W = torch.stack([captured.weights[layer] for layer in sorted(captured.weights)])  # (L, B, H, R, S)
        for b, e in enumerate(batch):
            for m in suite.attention:
                if m.source not in e.spans:
                    continue
                src = [rows_per_prompt[b].index(t) for t in range(*e.spans[m.source])]
                for target in m.targets:
                    if target not in e.spans:
                        continue
                    t0, t1 = e.spans[target]
                    w = W[:, b, :, src, t0:t1]  # (L, H, source tokens, target tokens)
                    value = _aggregate(_aggregate(w, m.target_agg, -1), m.source_agg, -1)  # (L, H)
                    blocks.append((e.prompt.prompt_id, m.source, target, value.reshape(-1).numpy().astype(np.float32)))
    return blocks, _logprobs(pm, batch, captured.logits, positions, cand_ids)


def _logprobs(pm, batch, logits, positions, cand_ids) -> dict:
    out = {"prompt_id": [], "cut": [], "candidate": [], "candidate_label": [], "logprob": []}
    if logits is None:
        return out
    logp = torch.log_softmax(logits.float(), dim=-1)  # (B, P, V)
    continuations = []  # candidates of several tokens need their own forward pass
    for b, e in enumerate(batch):
        for cut, candidates in e.prompt.candidates.items():
            p = positions.index(e.spans[cut][0] - 1)
            for text, label in candidates:
                tokens = cand_ids[text]
                value = logp[b, p, tokens[0]].item()
                if len(tokens) > 1:
                    continuations.append((len(out["logprob"]), e.ids[: e.spans[cut][0]], tokens))
                for key, item in zip(out, (e.prompt.prompt_id, cut, text, label, value)):
                    out[key].append(item)
    if continuations:
        _add_continuations(pm, out["logprob"], continuations)
    return out


@torch.inference_mode()
def _add_continuations(pm, logprobs: list, continuations: list) -> None:
    """log p(c1..cn | prefix) = sum_i log p(c_i | prefix, c_<i); the first term is already in place."""
    ids, mask = pad_right([prefix + tokens for _, prefix, tokens in continuations], pm.tokenizer.pad_token_id)
    logp = torch.log_softmax(pm.model(input_ids=ids.to(pm.device), attention_mask=mask.to(pm.device)).logits.float(), -1)
    for b, (slot, prefix, tokens) in enumerate(continuations):
        logprobs[slot] += sum(logp[b, len(prefix) + i - 1, tokens[i]].item() for i in range(1, len(tokens)))


# ------------------------------------------------------------------------------ run directory


class Run:
    """A run directory, read lazily into DataFrames."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not (self.directory / "manifest.json").is_file():
            raise RunError(f"{self.directory}: no manifest.json; not an attnprobe run directory")

    @cached_property
    def manifest(self) -> dict:
        return json.loads((self.directory / "manifest.json").read_text())

    @cached_property
    def prompts(self) -> pd.DataFrame:
        return pd.read_csv(self.directory / "prompts.csv", keep_default_na=False, na_values=[""])

    @cached_property
    def attention(self) -> pd.DataFrame:
        return pd.read_parquet(self.directory / "attention.parquet")

    @cached_property
    def logprobs(self) -> pd.DataFrame:
        return pd.read_csv(self.directory / "logprobs.csv", keep_default_na=False, na_values=[""])

    # Statistics, computed on first use and cached as CSV in the run directory (see attnprobe.stats).
    @property
    def head_stats(self) -> pd.DataFrame:
        return self._tables()["head_stats"]

    @property
    def layer_stats(self) -> pd.DataFrame:
        return self._tables()["layer_stats"]

    @property
    def behavior(self) -> pd.DataFrame:
        return self._tables()["behavior"]

    def _tables(self) -> dict:
        from .report import load_tables

        if "_stats" not in self.__dict__:
            self.__dict__["_stats"] = load_tables(self)
        return self.__dict__["_stats"]

    def plot_heads(self, target: str | None = None, value: str = "d_z"):
        """Layer x head heatmap of the bias effect (non-significant heads masked); a matplotlib Figure."""
        from .report.plots import head_heatmap

        heads = self.head_stats
        return head_heatmap(heads, target or heads["target"].iloc[0], value)

    def report(self) -> Path:
        """Write report.html (and the CSV tables and figures) into the run directory."""
        from .report import write_report

        return write_report(self.directory)

    def _repr_html_(self) -> str:
        from html import escape

        from .report import headline

        m = self.manifest
        return (f"<div><b>attnprobe run</b> {escape(m['suite']['name'])} on {escape(m['model']['spec'])}: "
                f"{m['n_prompts']} prompts, {escape(m['dtype'])}, <code>{escape(str(self.directory))}</code>"
                f"<p>{escape(headline(self, self._tables()))}</p></div>")

    def __repr__(self) -> str:
        m = self.manifest
        return f"Run({self.directory}, suite={m['suite']['name']}, model={m['model']['spec']}, prompts={m['n_prompts']})"


def prompts_table(encoded: list[Encoded]) -> pd.DataFrame:
    records = []
    for e in encoded:
        p = e.prompt
        record = {"prompt_id": p.prompt_id, "item_id": p.item_id, "template_id": p.template_id, "text": p.text,
                  "n_tokens": len(e.ids), **p.slots, **p.meta}
        for name, (c0, c1) in p.spans.items():
            t0, t1 = e.spans[name]
            record.update({f"{name}_char_start": c0, f"{name}_char_end": c1, f"{name}_tok_start": t0, f"{name}_tok_end": t1})
        records.append(record)
    table = pd.DataFrame.from_records(records)
    span_columns = [c for c in table.columns if c.endswith(("_char_start", "_char_end", "_tok_start", "_tok_end"))]
    table[span_columns] = table[span_columns].astype("Int64")  # spans a template lacks stay empty
    return table


def _atomic_write(path: Path, write) -> None:
    """Write to a temporary sibling, then rename: a reader never sees a half-written file. A failed
    write (disk full, permissions) leaves what was there before and says how to go on."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise RunError(f"cannot write {path}: {exc.strerror or exc}; results written so far are kept: "
                       "free space or fix permissions, then rerun the same command to resume") from None


def _versions() -> dict:
    import transformers

    return {"attnprobe": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "pandas": pd.__version__, "numpy": np.__version__}


def _weights_sha(pm: ProbeModel) -> str | None:
    if pm.info.source_sha256:
        return pm.info.source_sha256
    folder = Path(str(getattr(pm.model, "name_or_path", "")))
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    return files_sha256(files) if files else None


def run_suite(
    suite: str | Path | Suite,
    model: str | ProbeModel | None = None,
    out: str | Path | None = None,
    batch_size: int = 32,
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
) -> Run:
    """Run `suite` and return the Run. Validation (suite, tokens, candidates, context) happens before
    the model's weights load; a finished chunk is never recomputed when `resume` is on.

    `shard=(k, n)` computes only chunks k-1, k-1+n, ... (one shard per process or GPU rank) into
    its own directory; `merge_shards` joins the n directories into the unsharded result. The
    suite's head_effects measure runs in unsharded runs unless `head_effects=False`."""
    suite = suite if isinstance(suite, Suite) else load_suite(suite)
    log = log or (lambda message: print(message, file=sys.stderr))
    if batch_size < 1 or chunk_size < 1:
        raise RunError("batch size and chunk size must be at least 1")
    spec = model.info.spec if isinstance(model, ProbeModel) else (model or suite.model or DEFAULT_MODEL)
    if isinstance(model, ProbeModel):
        tokenizer, max_positions = model.tokenizer, model.info.max_positions
        dtype = str(model.dtype).removeprefix("torch.")  # a loaded model runs in its own dtype
    else:
        tokenizer, max_positions = load_tokenizer(spec, trust_remote_code=trust_remote_code)
    prompts = select_prompts(suite.prompts, limit)
    encoded = encode_prompts(suite, prompts, tokenizer, max_positions)
    cand_ids = candidate_ids(suite, prompts, tokenizer)
    chunks = plan_chunks(plan_batches(encoded, batch_size, max_batch_tokens), chunk_size)
    if shard is not None and not (len(shard) == 2 and 1 <= shard[0] <= shard[1]):
        raise RunError(f"shard must be K/N with 1 <= K <= N, got {shard}")
    mine = [k for k in range(len(chunks)) if shard is None or k % shard[1] == shard[0] - 1]

    model_name = model.info.name if isinstance(model, ProbeModel) else Path(spec).stem if spec.endswith(".gguf") else spec.replace("/", "_")
    directory = Path(out) if out else Path("reports") / suite.name / model_name
    if shard is not None:  # every rank may be given the same --out
        directory = directory / f"shard-{shard[0]}-of-{shard[1]}"
    settings = {"suite_sha256": suite.sha256, "model": spec, "dtype": dtype, "batch_size": batch_size,
                "chunk_size": chunk_size, "limit": limit, "max_batch_tokens": max_batch_tokens, "attnprobe": __version__,
                "plan_sha256": plan_sha256(chunks, encoded)}
    fingerprint = _fingerprint(settings, shard)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunError(f"cannot create output directory {directory}: {exc.strerror}; choose another with --out") from None
    with _exclusive(directory):
        _prepare_directory(directory, fingerprint, resume)
        pm = model if isinstance(model, ProbeModel) else load_model(
            spec, dtype=dtype, device=device, device_map=device_map, trust_remote_code=trust_remote_code,
            allow_pickle=allow_pickle)
        manifest = {
            "fingerprint": fingerprint,
            "status": "running",
            "shard": list(shard) if shard else None,
            "suite": {"name": suite.name, "path": suite.path, "sha256": suite.sha256, "description": suite.description,
                      "contrast": suite.contrast},
            "model": {"spec": spec, "name": model_name, "family": pm.info.family, "weights_sha256": _weights_sha(pm),
                      "n_layers": pm.info.n_layers, "n_heads": pm.info.n_heads, "n_kv_heads": pm.info.n_kv_heads},
            "dtype": str(pm.dtype).removeprefix("torch."),
            "seed": SEED,
            "settings": settings,
            "versions": _versions(),
            "n_prompts": len(encoded),
            "n_chunks": len(chunks),
            "skipped": list(suite.skipped),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        _write_manifest(directory, manifest)
        _atomic_write(directory / "prompts.csv", lambda p: write_csv(prompts_table(encoded), p))

        chunk_dir = directory / "chunks"
        chunk_dir.mkdir(exist_ok=True)
        done = _complete_chunks(chunk_dir, len(chunks), log)
        if done:
            log(f"resuming {directory}: {len(done)} of {len(chunks)} chunks already complete")
        started = time.perf_counter()
        bar = _progress(sum(len(b) for k in mine for b in chunks[k]), sum(len(b) for k in done for b in chunks[k]), progress)
        with _deferred_interrupt(log) as interrupted:
            for k in mine:
                chunk = chunks[k]
                if k in done:
                    continue
                blocks, logprob_parts = [], []
                for batch in chunk:
                    attention, logprobs = measure_batch(pm, suite, [encoded[i] for i in batch], cand_ids)
                    blocks += attention
                    logprob_parts.append(pd.DataFrame(logprobs))
                    bar.update(len(batch))
                _write_chunk(chunk_dir, k, attention_table(blocks, pm.info.n_layers, pm.info.n_heads), logprob_parts)
                if interrupted():
                    bar.close()
                    manifest.update(status="interrupted", interrupted=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
                    _write_manifest(directory, manifest)
                    raise RunInterrupted(f"interrupted after chunk {k + 1} of {len(chunks)}; the finished chunks are kept "
                                         f"in {chunk_dir}: rerun the same command to resume")
        bar.close()
        if shard is None:
            _assemble(directory, len(chunks))
        if shard is None or shard[0] == 1:
            _atomic_write(directory / "examples.json", lambda p: p.write_text(json.dumps(example_attention(pm, encoded, suite.contrast))))
        if shard is None and suite.head_effects is not None and head_effects:
            manifest["head_effects"] = _run_head_effects(pm, suite, encoded, directory, progress, log)
        manifest.update(status="complete" if shard is None else "shard complete", finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                        compute_seconds_this_session=round(time.perf_counter() - started, 3))
        _write_manifest(directory, manifest)
    return Run(directory)


def _run_head_effects(pm, suite, encoded, directory: Path, progress, log) -> dict:
    """Head interventions for every item of the suite's head_effects measure (written at the end,
    recomputed whole if the run is killed during this phase)."""
    from .interventions import effect_items, head_means, item_effects

    if (directory / "head_effects_items.parquet").is_file() and (directory / "head_effects_totals.csv").is_file():
        return json.loads((directory / "manifest.json").read_text()).get("head_effects", {})
    started = time.perf_counter()
    items, dropped = effect_items(pm, suite, encoded)
    for line in dropped:
        log(f"head_effects: dropped {line}")
    L, H = pm.info.n_layers, pm.info.n_heads
    means = head_means(pm, [item["x"] for item in items], L) if items else {}
    measure = suite.head_effects
    rows, totals = [], []
    bar = _progress(len(items), 0, progress)
    for item in items:
        effects = item_effects(pm, item["x"], item["x_cf"], item["positive"], item["negative"], L, H, means,
                               top_k=None if measure.exact == "all" else measure.exact)
        totals.append({"item_id": item["item_id"], "template_id": item["template_id"], "occupation": item["occupation"],
                       "y": effects["y"], "y_cf": effects["y_cf"], "te": effects["te"]})
        frame = pd.DataFrame({"item_id": item["item_id"], "layer": np.repeat(np.arange(L), H), "head": np.tile(np.arange(H), L)})
        for mode in ("pattern", "zero", "mean", "attribution"):
            frame[mode] = effects[mode].reshape(-1).numpy() if mode in effects else np.nan
        rows.append(frame)
        bar.update(1)
    bar.close()
    table = pd.concat(rows, ignore_index=True) if rows else pd.DataFrame(columns=["item_id", "layer", "head"])
    _atomic_write(directory / "head_effects_items.parquet", lambda p: table.to_parquet(p, index=False))
    _atomic_write(directory / "head_effects_totals.csv", lambda p: write_csv(pd.DataFrame(totals), p))
    return {"n_items": len(items), "dropped": dropped, "seconds": round(time.perf_counter() - started, 3),
            "counterfactual": {measure.slot: measure.replacement}, "exact": measure.exact}


def plan_sha256(chunks: list[list[list[int]]], encoded: list[Encoded]) -> str:
    """What every chunk forwards (prompt ids and forwarded token ids, batch by batch): a resumed run
    or a shard continues only a run that planned the very same batches, which another tokenizer or
    another attnprobe version may not."""
    plan = [[[(encoded[i].prompt.prompt_id, encoded[i].forward_ids) for i in batch] for batch in chunk] for chunk in chunks]
    return hashlib.sha256(json.dumps(plan).encode()).hexdigest()


def _fingerprint(settings: dict, shard) -> str:
    """What a resumed run must share with the run it continues."""
    keyed = dict(settings, shard=list(shard)) if shard else settings
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()


def merge_shards(shard_dirs: list[str | Path], out: str | Path) -> Run:
    """Join the directories of a sharded run (`--shard K/N`, all N of them) into one run directory
    identical to an unsharded run with the same settings."""
    shard_dirs = [Path(d) for d in shard_dirs]
    manifests = []
    for d in shard_dirs:
        path = d / "manifest.json"
        if not path.is_file():
            raise RunError(f"{d}: no manifest.json; give the directories written by `attnprobe run --shard K/N`")
        manifests.append(json.loads(path.read_text()))
    for d, m in zip(shard_dirs, manifests):
        if not m.get("shard") or m.get("status") != "shard complete":
            raise RunError(f"{d} is not a finished shard (status: {m.get('status')}); finish it by rerunning its command")
    n = manifests[0]["shard"][1]
    ks = sorted(m["shard"][0] for m in manifests)
    if ks != list(range(1, n + 1)) or any(m["shard"][1] != n for m in manifests):
        raise RunError(f"shards {ks} of {n} given; give each of the {n} shard directories exactly once")
    if len({json.dumps(m["settings"], sort_keys=True) for m in manifests}) != 1:
        raise RunError("the shards were run with different settings (suite, model, dtype, batch, chunk, limit or tokenisation)")
    by_k = {m["shard"][0]: (d, m) for d, m in zip(shard_dirs, manifests)}
    out = Path(out)
    (out / "chunks").mkdir(parents=True, exist_ok=True)
    with _exclusive(out):
        n_chunks = manifests[0]["n_chunks"]
        for k in range(n_chunks):
            source_dir = by_k[k % n + 1][0] / "chunks"
            if k not in _complete_chunks(source_dir, n_chunks, lambda m: None):
                raise RunError(f"{source_dir} lacks chunk {k} (or it is damaged); rerun that shard's command to finish it")
            for suffix in ("attention.parquet", "logprobs.parquet", "done"):
                shutil.copyfile(source_dir / f"{k:05d}.{suffix}", out / "chunks" / f"{k:05d}.{suffix}")
        first_dir, first = by_k[1]
        for name in ("prompts.csv", "examples.json"):
            shutil.copyfile(first_dir / name, out / name)
        _assemble(out, n_chunks)
        merged = dict(first, shard=None, status="complete", merged_from=[str(d) for d in shard_dirs],
                      fingerprint=_fingerprint(first["settings"], None), finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        _write_manifest(out, merged)
    return Run(out)


def _write_manifest(directory: Path, manifest: dict) -> None:
    _atomic_write(directory / "manifest.json", lambda p: p.write_text(json.dumps(manifest, indent=1)))


@contextmanager
def _exclusive(directory: Path):
    """Hold an exclusive lock on the run directory (released by the OS even if we are killed)."""
    handle = open(directory / ".lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise RunError(f"another attnprobe run is writing {directory}; wait for it to finish or choose --out") from None
    try:
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


@contextmanager
def _deferred_interrupt(log):
    """The first Ctrl-C asks the loop to stop after the current chunk; a second one stops at once."""
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
    try:
        yield lambda: bool(requested)
    finally:
        signal.signal(signal.SIGINT, previous)


def _complete_chunks(chunk_dir: Path, n_chunks: int, log) -> set[int]:
    """Chunks with a marker whose files read back whole; a damaged chunk loses its marker and is redone."""
    done = set()
    for k in range(n_chunks):
        marker = chunk_dir / f"{k:05d}.done"
        if not marker.is_file():
            continue
        try:
            rows = json.loads(marker.read_text())["rows"]
            if pq.read_metadata(chunk_dir / f"{k:05d}.attention.parquet").num_rows != rows:
                raise ValueError(f"expected {rows} rows")
            pq.read_metadata(chunk_dir / f"{k:05d}.logprobs.parquet")
        except (OSError, ValueError, KeyError, pa.ArrowException) as exc:
            log(f"chunk {k} in {chunk_dir} is damaged ({exc}); recomputing it")
            marker.unlink()
            continue
        done.add(k)
    return done


def _prepare_directory(directory: Path, fingerprint: str, resume: bool) -> None:
    manifest = directory / "manifest.json"
    if manifest.is_file():
        previous = json.loads(manifest.read_text()).get("fingerprint")
        if not resume or previous != fingerprint:
            if resume:
                raise RunError(f"{directory} holds a run with other settings (suite, model, dtype, batch or chunk size, "
                               "limit, tokenisation); rerun with --fresh to replace it, or choose --out")
            for name in ("chunks", "attention.parquet", "logprobs.csv", "prompts.csv", "manifest.json"):
                target = directory / name
                shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)


ATTENTION_SCHEMA = pa.schema([("prompt_id", pa.int32()), ("layer", pa.int16()), ("head", pa.int16()),
                              ("source", pa.large_string()), ("target", pa.large_string()), ("weight", pa.float32())])


def attention_table(blocks: list, n_layers: int, n_heads: int) -> pa.Table:
    """The long attention table of a chunk, sorted by prompt, source, target, layer, head. Each block
    is one (prompt, source, target) with its L*H weights already in (layer, head) order, so sorting
    the blocks sorts the rows: no sort over millions of rows with string keys."""
    blocks = sorted(blocks, key=lambda block: block[:3])  # stable: repeated keys keep measure order
    n, per_block = len(blocks), n_layers * n_heads
    if n == 0:
        return ATTENTION_SCHEMA.empty_table()

    def labels(i):
        return pa.array(np.repeat(np.array([block[i] for block in blocks], dtype=object), per_block), pa.large_string())

    return pa.table({
        "prompt_id": np.repeat(np.array([block[0] for block in blocks], dtype=np.int32), per_block),
        "layer": np.tile(np.repeat(np.arange(n_layers, dtype=np.int16), n_heads), n),
        "head": np.tile(np.arange(n_heads, dtype=np.int16), n * n_layers),
        "source": labels(1),
        "target": labels(2),
        "weight": np.concatenate([block[3] for block in blocks]),
    }, schema=ATTENTION_SCHEMA)


def _write_chunk(chunk_dir: Path, k: int, attention: pa.Table, logprob_parts: list) -> None:
    logprobs = pd.concat(logprob_parts, ignore_index=True).sort_values(["prompt_id", "cut"], kind="stable", ignore_index=True)
    _atomic_write(chunk_dir / f"{k:05d}.attention.parquet", lambda p: pq.write_table(attention, p))
    _atomic_write(chunk_dir / f"{k:05d}.logprobs.parquet", lambda p: logprobs.to_parquet(p, index=False))
    # the marker comes last: a chunk without it is recomputed on resume
    _atomic_write(chunk_dir / f"{k:05d}.done", lambda p: p.write_text(json.dumps({"rows": attention.num_rows})))


def _assemble(directory: Path, n_chunks: int) -> None:
    """Stream chunk files into attention.parquet (one chunk in memory at a time) and logprobs.csv."""
    chunk_dir = directory / "chunks"

    def write_attention(path):
        with pq.ParquetWriter(path, ATTENTION_SCHEMA) as writer:
            for k in range(n_chunks):
                writer.write_table(pq.read_table(chunk_dir / f"{k:05d}.attention.parquet", schema=ATTENTION_SCHEMA))

    _atomic_write(directory / "attention.parquet", write_attention)
    logprobs = [pd.read_parquet(chunk_dir / f"{k:05d}.logprobs.parquet") for k in range(n_chunks)]
    table = pd.concat(logprobs, ignore_index=True) if logprobs else pd.DataFrame()
    if len(table):
        table = table.sort_values(["prompt_id", "cut"], kind="stable", ignore_index=True)
    _atomic_write(directory / "logprobs.csv", lambda p: write_csv(table, p))


def example_attention(pm: ProbeModel, encoded: list[Encoded], contrast: str | None, n_items: int = 2) -> list[dict]:
    """Full attention (every layer, head, row) of a few prompts, for the report's attention view:
    every variant of the first item of the first and of the last template."""
    templates = list(dict.fromkeys(e.prompt.template_id for e in encoded))
    wanted_templates = list(dict.fromkeys([templates[0], templates[-1]]))[:n_items]
    chosen = []
    for template in wanted_templates:
        first_item = next(e.prompt.item_id for e in encoded if e.prompt.template_id == template)
        chosen += [e for e in encoded if e.prompt.item_id == first_item]
    ids, mask = pad_right([e.ids for e in chosen], pm.tokenizer.pad_token_id)
    captured = run_with_capture(pm, ids, mask)  # one batch, every row
    weights = torch.stack([captured.weights[layer] for layer in sorted(captured.weights)], dim=1)  # (B, L, H, T, T)
    examples = []
    for b, e in enumerate(chosen):
        T = len(e.ids)
        # weights in [0, 1] quantised to uint16 (error <= 8e-6) and base64-encoded: compact and quick to write
        quantised = torch.round(weights[b, :, :, :T, :T].clamp(0, 1) * 65535).to(torch.int32).numpy().astype("<u2")
        examples.append({
            "prompt_id": e.prompt.prompt_id, "text": e.prompt.text, "label": str(e.prompt.meta.get(f"{contrast}_label", "")),
            "tokens": [pm.tokenizer.decode([i]) for i in e.ids], "spans": e.spans,
            "shape": list(quantised.shape), "weights_u16_base64": base64.b64encode(quantised.tobytes()).decode(),
        })
    return examples


def _progress(total: int, initial: int, enabled: bool | None):
    from tqdm import tqdm

    if enabled is None:
        enabled = sys.stderr.isatty() and not os.environ.get("CI")
    return tqdm(total=total, initial=initial, disable=not enabled, unit="prompt", desc="attnprobe run",
                dynamic_ncols=True, smoothing=0.1)
