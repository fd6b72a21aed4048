"""The run directory: every file a run writes, how it is written, locked, resumed and merged.

  prompts.csv        one row per prompt: ids, text, slot values, metadata, spans (char and token)
  manifest.json      suite hash, model spec and weights hash, versions, dtype, seed, times, settings
  chunks/            the finished chunks; a chunk counts only once its `.done` marker exists, so a run
                     killed at any moment resumes from the last complete chunk.
  suite/             a copy of the suite and its data files (fresh.copy_suite; RunFiles.reopen reads it)
  the measures' own files: each registered kind's ARTEFACTS (attnprobe.measures, e.g.
  attention.parquet, logprobs.csv, likelihood.parquet, head_effects_*).
Every write is atomic (attnprobe.store). Every file a command writes here is declared once
(run.files.inventory): `--fresh` removes exactly those, never anything else.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pandas as pd
import torch

from ... import store
from ...errors import RunError
from ...measures import MEASURES, batch_kinds
from ...model import ProbeModel
from ...model.bundled import files_sha256
from ...store import atomic_write, write_table
from ..plan import Encoded


def artefacts() -> tuple[str, ...]:
    """What a run writes: its prompts, manifest and chunks, and every registered measure's files."""
    own = (name for kind in MEASURES.values() for name in kind.ARTEFACTS)
    return ("chunks", "prompts.csv", "prompts.parquet", *own, "manifest.json")


TABLES_KEY = "tables.json"  # which statistics version and analysis the cached tables were made with


def chunk_files() -> dict[str, tuple[str, ...]]:
    """Chunk files per phase, by file prefix: the prompts (every per-batch kind, the first names the
    row count) and each kind's own phases."""
    return {
        "": tuple(name for kind in batch_kinds() for name in kind.CHUNKS[""]),
        **{prefix: files for kind in MEASURES.values() for prefix, files in kind.CHUNKS.items() if prefix},
    }


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
        sha.update(flat.view(torch.uint8).cpu().numpy() if flat.numel() else b"")
    return sha.hexdigest()


def same_weights(manifest, model, what: str, error=RunError) -> str:
    """The content hash of `model`'s weights (a ProbeModel), refused in one line (`error`) unless the
    run's manifest records these very weights: values computed with the model are compared with the
    run's, so they must come from the weights the run was made with, whatever path or object holds
    them now (a relative path read from another folder, say)."""
    found, expected = content_sha(model.model), manifest.model.weights_content
    if found != expected:
        recorded = f"the run's {expected[:12]}" if expected else "a run that recorded no content hash"
        raise error(
            f"{what}: the model is not the one this run was made with (weights {found[:12]} against "
            f"{recorded}); use the run's model ({manifest.model.spec}, {manifest.dtype}, loaded from the "
            "folder the run was made in) or run the suite on this model first"
        )
    return found


def assemble_phase(directory: Path, kind: str, n_chunks: int, table: str, csv: bool = True) -> None:
    """Join a phase's one-table chunks (`kind`: its file prefix) into the run's table `table` (as
    Parquet, and as CSV unless `csv` is off: a table of millions of rows is Parquet only)."""
    files = chunk_files()[kind]
    joined = store.read_chunks(directory, n_chunks, files, kind)[files[0].removesuffix(".parquet")]
    if csv:
        write_table(directory, table, joined)
    else:
        atomic_write(directory / f"{table}.parquet", lambda p: store.write_parquet(joined, p))
