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
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path

import pandas as pd
import torch

from ... import store
from ...errors import RunError
from ...measures import MEASURES, batch_kinds
from ...model import ProbeModel
from ...model.bundled import cache_dir, files_sha256
from ...model.shapes import SEED
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


HASH_CACHE = 1  # the cache's scheme: bump when what a key covers or a hash's definition changes
HASHES_KEPT = 64  # the newest entries the hash cache keeps


_KNOWN: dict[int, tuple[str | None, str]] = {}  # id(ProbeModel) -> its hashes, within hashes_known


@contextmanager
def hashes_known(pm: ProbeModel, hashes: tuple[str | None, str]):
    """Within the block weight_hashes(pm) is `hashes`: a command's own runs of a model it checked and
    holds to itself (the suites of `edit --also`), without a copy of every weight per run."""
    _KNOWN[id(pm)] = hashes
    try:
        yield
    finally:
        _KNOWN.pop(id(pm), None)


def weight_hashes(pm: ProbeModel, loaded_here: bool = False) -> tuple[str | None, str]:
    """(the weight files' SHA-256 or None, content_sha of the weights in memory). A model this process
    has just loaded (`loaded_here`; not one handed in, which may have been changed in memory) takes
    both from the hash cache where every file of its folder is the very file an earlier run hashed
    (inode, size, modification and change times), or its random weights were drawn from the same
    config on the same kind of device, under the same dtype, torch and transformers: hashing an 8B
    model's weights copies 16 GB to the CPU on every run otherwise."""
    if id(pm) in _KNOWN:
        return _KNOWN[id(pm)]
    key = _files_key(pm) if loaded_here else None
    path = cache_dir() / "hashes" / f"{key}.json" if key else None
    if path is not None and path.is_file():
        try:
            found = json.loads(path.read_text())
            if isinstance(found, dict) and re.fullmatch(r"[0-9a-f]{64}", str(found.get("content"))):
                os.utime(path)  # the newest are kept
                return found.get("files"), found["content"]
        except (OSError, ValueError):
            pass  # a damaged entry is computed again
    hashes = _both_hashes(pm)
    if path is not None:
        with suppress(OSError):  # a read-only cache costs the next run the hashing, nothing else
            path.parent.mkdir(parents=True, exist_ok=True)
            text = json.dumps({"files": hashes[0], "content": hashes[1]})
            atomic_write(path, lambda p: p.write_text(text))
            entries = sorted(path.parent.glob("*.json"), key=lambda p: p.stat().st_mtime_ns)
            for old in entries[:-HASHES_KEPT]:  # folders long gone (a test's, say) leave no trail
                old.unlink(missing_ok=True)
    return hashes


def _both_hashes(pm: ProbeModel) -> tuple[str | None, str]:
    """(weights_sha, content_sha) at once: the files read and hashed in a thread beside the weights in
    memory (hashlib lets go of the interpreter while it hashes, so the two take the time of one where
    there are two cores: 1.1 s, not 2.0, for a 1.4 GB checkpoint on 2 cores)."""
    with ThreadPoolExecutor(1) as pool:
        files = pool.submit(weights_sha, pm)
        content = content_sha(pm.model)
        return files.result(), content


def _files_key(pm: ProbeModel) -> str | None:
    """What the in-memory weights of a model loaded from a folder are a function of, hashed: every
    file there as the file system knows it (a file replaced or written to has a new change time,
    whatever its name, size and modification time), the GGUF source, dtype and the loaders' versions;
    for `random:` weights, their config, seed and device type (model.shapes.random_model); None for
    anything else (an object built in memory)."""
    import transformers

    source = str(getattr(pm.model, "name_or_path", ""))
    first = next(pm.model.parameters())
    versions = [
        HASH_CACHE,
        torch.__version__,
        transformers.__version__,
        pm.info.source_sha256,
        str(first.dtype),
    ]
    if source.startswith("random:"):
        drawn = [source, SEED, first.device.type, pm.model.config.to_json_string()]
        return hashlib.sha256(json.dumps([versions, drawn]).encode()).hexdigest()
    folder = Path(source)
    if not folder.is_dir():
        return None
    files = []
    for entry in sorted(folder.iterdir()):
        if entry.is_file():
            st = entry.stat()
            files.append([entry.name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns])
    return hashlib.sha256(json.dumps([str(folder.resolve()), versions, files]).encode()).hexdigest()


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


def same_weights(manifest, model, what: str, error=RunError, loaded_here: bool = False) -> str:
    """The content hash of `model`'s weights (a ProbeModel), refused in one line (`error`) unless the
    run's manifest records these very weights: values computed with the model are compared with the
    run's, so they must come from the weights the run was made with, whatever path or object holds
    them now (a relative path read from another folder, say). `loaded_here`: weight_hashes's."""
    found = weight_hashes(model, True)[1] if loaded_here else content_sha(model.model)
    expected = manifest.model.weights_content
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
