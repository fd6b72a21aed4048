"""Reading a run directory: the manifest and the run's tables as DataFrames, read lazily. Reads
only; statistics and figures live downstream (attnprobe.stats, attnprobe.report, attnprobe.notebook.api)."""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path

import pandas as pd
import pyarrow as pa

from ..errors import RunError
from ..measures import MEASURES
from ..store import read_table
from .storage import read_manifest


class RunFiles:
    """A run directory, read lazily into DataFrames."""

    def __init__(self, directory: str | Path):
        if not isinstance(directory, (str, os.PathLike)):
            raise RunError(f"{directory!r} is not a run directory; give its path")
        self.directory = Path(directory)
        if not (self.directory / "manifest.json").is_file():
            raise RunError(f"{self.directory}: no manifest.json; not an attnprobe run directory")

    @cached_property
    def manifest(self) -> dict:
        return read_manifest(self.directory / "manifest.json")

    def require_keys(self, **wanted: type) -> None:
        """The manifest's keys a reader is about to index (dotted: suite__sha256=str), each of its type,
        or one line saying the manifest is damaged."""
        for dotted, kind in wanted.items():
            value = self.manifest
            for key in dotted.split("__"):
                value = value.get(key) if isinstance(value, dict) else None
            if not isinstance(value, kind):
                raise RunError(
                    f"{self.directory}/manifest.json: {dotted.replace('__', '.')} is missing or not a "
                    f"{kind.__name__}; the manifest is damaged: rerun the run's command with --fresh"
                )

    def require_complete(self) -> None:
        """Statistics need every prompt: refuse an unfinished run or a lone shard in one line."""
        status = self.manifest["status"]
        if status == "shard complete":
            raise RunError(
                f"{self.directory} is one shard of a run; join all shards with `attnprobe merge OUT "
                "SHARD_DIR ...` "
                "and report on OUT"
            )
        if status != "complete":
            raise RunError(
                f"the run in {self.directory} is not finished (status: {status}); rerun the same "
                "`attnprobe run` command to finish it, then report"
            )

    def _read(self, what: str, read, command: str = "attnprobe run") -> pd.DataFrame:
        """A table of the run; a missing or damaged file is one line saying how to rebuild it."""
        try:
            return read()
        except (OSError, ValueError, KeyError, pa.ArrowException) as exc:
            raise RunError(
                f"{self.directory}: {what} is missing or damaged ({type(exc).__name__}: {str(exc)[:120]}); "
                f"rerun the same `{command}` command, which rebuilds it from the finished chunks"
            ) from None

    @cached_property
    def prompts(self) -> pd.DataFrame:
        return self._read("prompts.parquet", lambda: read_table(self.directory, "prompts"))

    def has(self, measure: str) -> bool:
        """The run computed this measure (its files are there, or its manifest entry says so): a
        damaged table is then an error when read, not a run without it."""
        return MEASURES[measure].present(self.directory, self.manifest)

    def __getattr__(self, name: str):
        """A measure's table by the name its kind reads it as (`run.attention`, `run.logprobs`,
        `run.likelihood`, `run.head_effect_items`, ...; measures.MEASURES[...].READS), read once;
        None for an optional measure the run does not have."""
        kinds = [kind for kind in MEASURES.values() if name in kind.READS]
        if not kinds:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        kind, file = kinds[0], kinds[0].READS[name]
        stem = file.removesuffix(".parquet")
        if kind.OPTIONAL and not (self.directory / f"{stem}.parquet").is_file():
            table = None
        elif file.endswith(".parquet"):
            table = self._read(file, lambda: pd.read_parquet(self.directory / file))
        else:
            table = self._read(f"{stem}.parquet", lambda: read_table(self.directory, stem))
        self.__dict__[name] = table  # read once
        return table

    def __repr__(self) -> str:
        m = self.manifest
        suite, model = m["suite"]["name"], m["model"]["spec"]
        return (
            f"{type(self).__name__}({self.directory}, suite={suite}, model={model}, prompts={m['n_prompts']})"
        )
