"""The run directory: every file a run writes, how it is written, locked, resumed and merged.

  prompts.csv        one row per prompt: ids, text, slot values, metadata, spans (char and token)
  attention.parquet  prompt_id, layer, head, source, target, weight
  logprobs.csv       prompt_id, cut, candidate, candidate_label, logprob
  examples.json      full attention of a few prompts, for the report's attention view
  head_effects_*     per item and head, and per item totals, of the head_effects measure
  referent_choice.*  per prompt and referent: log p of the referent's words after the suite's question
  likelihood.*       per prompt: log p of the sentence and of the words it shares with its pair
  multiple_choice.*  per prompt and option: log p of the option after the context and question
  manifest.json      suite hash, model spec and weights hash, versions, dtype, seed, times, settings
  chunks/            the finished chunks; a chunk counts only once its `.done` marker exists, so a run
                     killed at any moment resumes from the last complete chunk.
Every write is atomic (a temporary sibling, then a rename). `--fresh` removes exactly ARTEFACTS
and the report's DERIVED files, never anything else.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ..bundled import files_sha256
from ..errors import RunError
from ..measures import BATCH_KINDS
from ..measures.attention import ATTENTION_SCHEMA
from ..models import ProbeModel
from ..tables import write_csv, write_parquet
from .manifest import check_format
from .plan import Encoded

ARTEFACTS = (
    "chunks",
    "attention.parquet",
    "logprobs.csv",
    "logprobs.parquet",
    "prompts.csv",
    "prompts.parquet",
    "examples.json",
    "head_effects_items.parquet",
    "head_effects_layers.parquet",
    "head_effects_totals.csv",
    "head_effects_totals.parquet",
    "referent_choice.csv",
    "referent_choice.parquet",
    "likelihood.csv",
    "likelihood.parquet",
    "multiple_choice.csv",
    "multiple_choice.parquet",
    "manifest.json",
)
# written from a run by the report: statistics tables (as <name>.csv), figures, the page
TABLES_KEY = "tables.json"  # which statistics version and analysis the cached tables were made with
STATS_TABLES = (
    "head_stats",
    "layer_stats",
    "behavior",
    "behavior_by_unit",
    "condition_means",
    "referent_accuracy",
    "referent_choice_accuracy",
    "sentence_preference",
    "choice_accuracy",
    "held_out",
)
HEAD_EFFECT_TABLES = ("head_effects", "head_effects_layer_shares", "head_effects_summary")
EDIT_TABLES = ("edits", "edits_draws", "edits_items")  # written by `attnprobe edit`
DERIVED = tuple(
    f"{name}.{ext}" for name in STATS_TABLES + HEAD_EFFECT_TABLES + EDIT_TABLES for ext in ("csv", "parquet")
) + ("behavior_by_occupation.csv", TABLES_KEY, "figures", "report.html")  # the first name of behavior_by_unit


def prompts_table(encoded: list[Encoded]) -> pd.DataFrame:
    records = []
    for e in encoded:
        p = e.prompt
        record = {
            "prompt_id": p.prompt_id,
            "item_id": p.item_id,
            "template_id": p.template_id,
            "text": p.text,
            "n_tokens": len(e.ids),
            **p.slots,
            **p.meta,
        }
        for name, (c0, c1) in p.spans.items():
            t0, t1 = e.spans.get(name, (None, None))  # None: left out (first_token: exclude)
            record.update(
                {
                    f"{name}_char_start": c0,
                    f"{name}_char_end": c1,
                    f"{name}_tok_start": t0,
                    f"{name}_tok_end": t1,
                }
            )
        records.append(record)
    table = pd.DataFrame.from_records(records)
    span_columns = [
        c for c in table.columns if c.endswith(("_char_start", "_char_end", "_tok_start", "_tok_end"))
    ]
    table[span_columns] = table[span_columns].astype("Int64")  # spans a template lacks stay empty
    return table


def atomic_write(path: Path, write) -> None:
    """Write to a temporary sibling, then rename: a reader never sees a half-written file. A failed
    write (disk full, permissions) leaves what was there before and says how to go on."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise RunError(
            f"cannot write {path}: {exc.strerror or exc}; results written so far are kept: "
            "free space or fix permissions, then rerun the same command to resume"
        ) from None


def write_table(directory: Path, name: str, table: pd.DataFrame) -> None:
    """`<name>.csv` (spreadsheet export), then `<name>.parquet` (the typed table readers use)."""
    atomic_write(directory / f"{name}.csv", lambda p: write_csv(table, p))
    atomic_write(directory / f"{name}.parquet", lambda p: write_parquet(table, p))


def weights_sha(pm: ProbeModel) -> str | None:
    if pm.info.source_sha256:
        return pm.info.source_sha256
    folder = Path(str(getattr(pm.model, "name_or_path", "")))
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    return files_sha256(files) if files else None


def content_sha(module) -> str:
    """SHA-256 of a module's weights as they are in memory (names, shapes, dtypes and bytes of every
    parameter and buffer, shared tensors once): what a cached result computed with them depends on,
    whatever file or object they came from."""
    sha, seen = hashlib.sha256(), set()
    for name, tensor in module.state_dict(keep_vars=False).items():
        if tensor.data_ptr() in seen and tensor.numel():
            continue
        seen.add(tensor.data_ptr())
        sha.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        sha.update(flat.view(torch.uint8).numpy() if flat.numel() else b"")
    return sha.hexdigest()


def write_manifest(directory: Path, manifest: dict) -> None:
    atomic_write(directory / "manifest.json", lambda p: p.write_text(json.dumps(manifest, indent=1)))


@contextmanager
def exclusive(directory: Path):
    """Hold an exclusive lock on the run directory (released by the OS even if we are killed)."""
    try:
        handle = open(directory / ".lock", "a+")
    except OSError as exc:
        raise RunError(
            f"cannot lock {directory / '.lock'} ({exc.strerror}); make the directory writable or choose "
            "another --out"
        ) from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise RunError(
            f"another attnprobe run is writing {directory}; wait for it to finish or choose --out"
        ) from None
    try:
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


# Chunk files per phase (run/phases.py), by file prefix: the prompts (every per-batch measure), the
# referent choice (chunks of prompts), the head-effect screen and selected heads (chunks of items).
CHUNK_FILES = {
    "": tuple(f"{kind.NAME}.parquet" for kind in BATCH_KINDS),
    "referent-choice-": ("referent_choice.parquet",),
    "likelihood-": ("likelihood.parquet",),
    "multiple-choice-": ("multiple_choice.parquet",),
    "effects-": ("items.parquet", "layers.parquet", "totals.parquet"),
    "selected-": ("items.parquet", "totals.parquet"),
}


def complete_chunks(chunk_dir: Path, n_chunks: int, log, kind: str = "", plan: str | None = None) -> set[int]:
    """Chunks with a marker whose files are byte for byte what was written (SHA-256 in the marker)
    and were made for this plan (phases that have one); a damaged or foreign chunk loses its marker
    and is redone."""
    done = set()
    for k in range(n_chunks):
        marker = chunk_dir / f"{kind}{k:05d}.done"
        if not marker.is_file():
            continue
        try:
            info = json.loads(marker.read_text())
            if plan is not None and info.get("plan") != plan:
                raise ValueError("made for another plan of items")
            files = {name: chunk_dir / f"{kind}{k:05d}.{name}" for name in CHUNK_FILES[kind]}
            for name, path in files.items():
                if digest(path) != info["sha256"].get(name):
                    raise ValueError(f"{path.name} differs from what was written")
            if pq.read_metadata(files[CHUNK_FILES[kind][0]]).num_rows != info["rows"]:
                raise ValueError(f"expected {info['rows']} rows")
        except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as exc:
            log(f"chunk {kind}{k} in {chunk_dir} is damaged or stale ({exc}); recomputing it")
            marker.unlink()
            continue
        done.add(k)
    return done


def read_manifest(path: Path, check: bool = True) -> dict:
    """An attnprobe manifest, or a RunError saying the file belongs to something else (or, with
    `check`, to another run format)."""
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RunError(
            f"{path}: cannot read it as an attnprobe manifest ({exc}); choose another --out"
        ) from None
    if not isinstance(manifest, dict) or not {"fingerprint", "settings", "versions"} <= set(manifest):
        raise RunError(f"{path} was not written by attnprobe; nothing was deleted: choose another --out")
    if check:
        check_format(manifest, path.parent)
    return manifest


def write_chunk(chunk_dir: Path, k: int, tables: dict, kind: str = "", plan: str | None = None) -> None:
    """One chunk of a phase (`kind`: its file prefix): a file per table (a pyarrow Table or a
    DataFrame), then the marker with the row count, the files' SHA-256 and the phase's plan."""
    for name in CHUNK_FILES[kind]:
        table = tables[name.removesuffix(".parquet")]
        write = (
            (lambda p, t=table: pq.write_table(t, p))
            if isinstance(table, pa.Table)
            else (lambda p, t=table: t.to_parquet(p, index=False))
        )
        atomic_write(chunk_dir / f"{kind}{k:05d}.{name}", write)
    rows = len(tables[CHUNK_FILES[kind][0].removesuffix(".parquet")])
    # the marker comes last: a chunk without it is recomputed on resume
    marker = {"rows": rows, "sha256": _digests(chunk_dir, f"{kind}{k:05d}.", CHUNK_FILES[kind])}
    if plan is not None:
        marker["plan"] = plan
    atomic_write(chunk_dir / f"{kind}{k:05d}.done", lambda p: p.write_text(json.dumps(marker)))


def digest(path: Path) -> str:
    """SHA-256 of a file, read in blocks."""
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def _digests(chunk_dir: Path, prefix: str, names) -> dict[str, str]:
    return {name: digest(chunk_dir / f"{prefix}{name}") for name in names}


def read_effect_chunks(directory: Path, n_chunks: int, kind: str = "effects-") -> dict[str, pd.DataFrame]:
    """The tables of head-effects chunks, joined: name -> DataFrame."""
    chunk_dir = directory / "chunks"
    out = {}
    for name in CHUNK_FILES[kind]:
        parts = [pd.read_parquet(chunk_dir / f"{kind}{k:05d}.{name}") for k in range(n_chunks)]
        out[name.removesuffix(".parquet")] = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    return out


def assemble_head_effects(directory: Path, n_chunks: int, selected_plan: str | None = None) -> None:
    """Join the head-effects chunks into head_effects_items/layers.parquet and head_effects_totals,
    with the selected-heads phase merged in when it is complete for `selected_plan`: the cross-fitted
    sets' columns join the totals, the suite's exactly patched heads fill the per-head table."""
    tables = read_effect_chunks(directory, n_chunks)
    if (
        selected_plan
        and len(complete_chunks(directory / "chunks", n_chunks, lambda m: None, "selected-", selected_plan))
        == n_chunks
    ):
        selected = read_effect_chunks(directory, n_chunks, "selected-")
        keys = ["item_id", "counterfactual"]
        tables["totals"] = tables["totals"].merge(selected["totals"], on=keys, how="left")
        head_keys = [*keys, "layer", "head"]
        items = tables["items"].set_index(head_keys)
        items.update(selected["items"].set_index(head_keys))
        tables["items"] = items.reset_index()
    write_head_effects(directory, tables)


def assemble(directory: Path, n_chunks: int) -> None:
    """Stream chunk files into attention.parquet (one chunk in memory at a time) and logprobs.csv."""
    chunk_dir = directory / "chunks"

    def write_attention(path):
        with pq.ParquetWriter(path, ATTENTION_SCHEMA) as writer:
            for k in range(n_chunks):
                writer.write_table(
                    pq.read_table(chunk_dir / f"{k:05d}.attention.parquet", schema=ATTENTION_SCHEMA)
                )

    atomic_write(directory / "attention.parquet", write_attention)
    logprobs = [pd.read_parquet(chunk_dir / f"{k:05d}.logprobs.parquet") for k in range(n_chunks)]
    table = pd.concat(logprobs, ignore_index=True) if logprobs else pd.DataFrame()
    if len(table):
        table = table.sort_values(["prompt_id", "cut"], kind="stable", ignore_index=True)
    write_table(directory, "logprobs", table)


# the head-effects tables a run writes, by table: items (per pair and head), layers, totals (also as CSV)
HEAD_EFFECTS_FILES = {
    "items": "head_effects_items.parquet",
    "layers": "head_effects_layers.parquet",
    "totals": "head_effects_totals.parquet",
}


def has_head_effects(directory: Path) -> bool:
    """The assembled head-effect tables exist and their Parquet footers read (a truncated file is
    assembled again from the chunks instead of failing every later report)."""
    try:
        return all(pq.read_metadata(directory / name).num_rows >= 0 for name in HEAD_EFFECTS_FILES.values())
    except (OSError, pa.ArrowException):
        return False


def write_head_effects(directory: Path, tables: dict[str, pd.DataFrame]) -> None:
    for table in ("items", "layers"):
        atomic_write(
            directory / HEAD_EFFECTS_FILES[table], lambda p, t=tables[table]: t.to_parquet(p, index=False)
        )
    write_table(directory, "head_effects_totals", tables["totals"])


def assemble_phase(directory: Path, kind: str, n_chunks: int, table: str) -> None:
    """Join a phase's one-table chunks (`kind`: its file prefix) into the run's table `table`."""
    parts = read_effect_chunks(directory, n_chunks, kind)
    write_table(directory, table, parts[CHUNK_FILES[kind][0].removesuffix(".parquet")])
