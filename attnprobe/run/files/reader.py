"""Reading a run directory: the manifest and the run's tables as DataFrames, read lazily. Reads
only; statistics and figures live downstream (attnprobe.stats, attnprobe.report, attnprobe.notebook.api)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pandas as pd
import pyarrow as pa

from ...errors import RunError
from ...measures import MEASURES
from ...store import read_table
from .manifest import Manifest


@dataclass(frozen=True)
class Reopened:
    """A finished run's inputs, reopened (RunFiles.reopen)."""

    suite: object  # the Suite, loaded from the run's copy
    model: str  # what load_model is given: the local path the model was loaded from, else the spec
    dtype: str  # the dtype the run loaded it in (remote code and pickles stay off)
    settings: dict  # the recorded plan's settings

    def load_model(self, device: str = "cpu"):
        from ...model import load_model

        return load_model(self.model, dtype=self.dtype, device=device)

    def plan(self, model, directory: Path, log=lambda message: None):
        """The run's plan rebuilt with its recorded settings, checked against the recorded one (the
        same prompts, tokens and chunks) before anything is measured on it."""
        from ..options import RunOptions
        from ..plan import plan_run

        keys = ("limit", "batch_size", "chunk_size", "max_batch_tokens", "share_prefixes")
        options = RunOptions(
            out=directory, log=log, **{k: self.settings[k] for k in keys if k in self.settings}
        )
        plan = plan_run(self.suite, model, options)
        if plan.settings["plan_sha256"] != self.settings.get("plan_sha256"):
            raise RunError(
                f"{directory}: the run's plan cannot be rebuilt (its prompts or tokens differ with this "
                "model's tokenizer or this attnprobe); rerun the suite"
            )
        return plan


class RunFiles:
    """A run directory, read lazily into DataFrames."""

    def __init__(self, directory: str | Path):
        if not isinstance(directory, (str, os.PathLike)):
            raise RunError(f"{directory!r} is not a run directory; give its path")
        self.directory = Path(directory)
        if not (self.directory / "manifest.json").is_file():
            raise RunError(f"{self.directory}: no manifest.json; not an attnprobe run directory")

    @cached_property
    def manifest(self) -> Manifest:
        return Manifest.read(self.directory / "manifest.json")

    def require(self, *dotted: str) -> None:
        """The manifest's fields a reader is about to use (dotted: "suite.sha256"), each set, or one
        line saying the manifest is damaged."""
        self.manifest.require(*dotted, where=self.directory)

    def reopen(self) -> Reopened:
        """What the run was made from, to work on it again from wherever its directory now is: its
        suite (the run's own copy, else the file the manifest names, with the run's data roots;
        refused if it changed), the model's source and dtype, the recorded plan's settings."""
        from ...suite import load_suite

        self.require("suite.path", "suite.sha256", "model.spec", "dtype")
        recorded = self.manifest.suite
        own = (self.directory / "suite").resolve()
        copy = (self.directory / str(recorded.copy or "-")).resolve()
        if copy.is_relative_to(own) and copy.is_file():  # never a file outside the run's own copy
            path, roots = copy, (own,)
        else:  # a run made before runs kept a copy of their suite
            roots = tuple(str(r) for r in recorded.data_roots or ())
            path = Path(recorded.path)
            if not path.is_file():
                raise RunError(
                    f"{self.directory}: the run's suite {path} is not there and the run holds no copy of it; "
                    "run the command from the directory the run was made in, or rerun the suite"
                )
        suite = load_suite(path, data_roots=roots)
        if suite.sha256 != recorded.sha256:
            raise RunError(
                f"{path} changed since the run in {self.directory} was made; rerun the suite first (the "
                "run's tables are of the suite as it was)"
            )
        # the dtype only: a manifest (perhaps someone else's) never turns on remote code or pickles
        model = self.manifest.model
        return Reopened(suite, model.source or model.spec, self.manifest.dtype, self.manifest.settings)

    def require_complete(self) -> None:
        """Statistics need every prompt: refuse an unfinished run or a lone shard in one line."""
        status = self.manifest.status
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
        return (
            f"{type(self).__name__}({self.directory}, suite={m.suite.name}, model={m.model.spec}, "
            f"prompts={m.n_prompts})"
        )
