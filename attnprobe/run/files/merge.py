"""Joining the directories of a sharded run into one, identical to an unsharded run."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

from ... import store
from ...errors import RunError
from ...measures import MEASURES, batch_kinds
from ...store import own_directory
from ..plan import fingerprint
from .fresh import SUITE_COPY
from .inventory import run_writes
from .layout import chunk_files
from .manifest import Manifest


def merge_shards(shard_dirs: list[str | Path], out: str | Path) -> Path:
    """Join the directories of a sharded run (`--shard K/N`, all N of them) into one run directory
    identical to an unsharded run with the same settings."""
    shard_dirs = [Path(d) for d in shard_dirs]
    manifests = _shard_manifests(shard_dirs)
    n = manifests[0].shard[1]
    by_k = {m.shard[0]: (d, m) for d, m in zip(shard_dirs, manifests)}
    out = Path(out)
    if any(out.resolve() == d.resolve() for d in shard_dirs):
        raise RunError(f"{out} is one of the shard directories; merge into a new directory")
    settings = manifests[0].settings
    if (out / "manifest.json").is_file() and Manifest.read(out / "manifest.json").settings != settings:
        raise RunError(f"{out} holds a run with other settings; merge into a new directory")
    own_directory(out / "chunks")
    with run_writes(out):
        n_chunks = manifests[0].n_chunks
        for k in range(n_chunks):
            source_dir = by_k[k % n + 1][0] / "chunks"
            if k not in store.complete_chunks(
                source_dir, n_chunks, lambda m: None, chunk_files()[""], "", None
            ):
                raise RunError(
                    f"{source_dir} lacks chunk {k} (or it is damaged); "
                    "rerun that shard's command to finish it"
                )
            _copy_chunk(source_dir, out / "chunks", k, "")
        first_dir, first = by_k[1]
        for name in ("prompts.csv", "prompts.parquet"):
            shutil.copyfile(first_dir / name, out / name)
        copy = first_dir / SUITE_COPY  # the shards' copy of the suite (each rank wrote the same)
        if copy.is_dir() and not copy.is_symlink() and not (out / SUITE_COPY).exists():
            shutil.copytree(copy, out / SUITE_COPY, symlinks=True)
        for kind in batch_kinds():
            kind.assemble(out, n_chunks)
        merged = dataclasses.replace(
            first,
            shard=None,
            status="complete",
            merged_from=[str(d) for d in shard_dirs],
            fingerprint=fingerprint(first.settings, None),
            finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        )
        shards = [by_k[k] for k in range(1, n + 1)]  # (directory, manifest) in shard order
        for kind in MEASURES.values():  # each measure's own files (a scored phase: shard 1's)
            kind.merge(shards, out, merged)
        merged.write(out)
    return out


def _shard_manifests(shard_dirs: list[Path]) -> list:
    """The manifests of N finished shards of one run, each given once, or one line saying what is wrong."""
    manifests = []
    for d in shard_dirs:
        path = d / "manifest.json"
        if not path.is_file():
            raise RunError(
                f"{d}: no manifest.json; give the directories written by `attnprobe run --shard K/N`"
            )
        manifests.append(Manifest.read(path))
    for d, m in zip(shard_dirs, manifests):
        if not m.shard or m.status != "shard complete":
            raise RunError(
                f"{d} is not a finished shard (status: {m.status}); finish it by rerunning its command"
            )
    n = manifests[0].shard[1]
    ks = sorted(m.shard[0] for m in manifests)
    if ks != list(range(1, n + 1)) or any(m.shard[1] != n for m in manifests):
        raise RunError(f"shards {ks} of {n} given; give each of the {n} shard directories exactly once")
    if len({json.dumps(m.settings, sort_keys=True) for m in manifests}) != 1:
        raise RunError(
            "the shards were run with different settings (suite, model, dtype, batch, chunk, limit or "
            "tokenisation)"
        )
    weights = {m.model.weights_content for m in manifests}
    if len(weights) != 1 or None in weights:
        found = ", ".join(
            f"{d.name}: {(m.model.weights_content or 'none recorded')[:12]}"
            for d, m in zip(shard_dirs, manifests)
        )
        raise RunError(
            f"the shards were made with different weights under one model path ({found}); rerun every "
            "shard with the same weights and merge those"
        )
    return manifests


def _copy_chunk(source: Path, target: Path, k: int, kind: str) -> None:
    for suffix in (*chunk_files()[kind], "done"):
        shutil.copyfile(source / f"{kind}{k:05d}.{suffix}", target / f"{kind}{k:05d}.{suffix}")
