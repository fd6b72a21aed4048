"""Reading a run directory: the manifest and the run's tables as DataFrames, read lazily. Reads
only; statistics and figures live downstream (attnprobe.stats, attnprobe.report, attnprobe.api)."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import pandas as pd
import pyarrow as pa

from ..errors import RunError
from ..tables import read_table
from .storage import HEAD_EFFECTS_FILES, has_head_effects, read_manifest


class RunFiles:
    """A run directory, read lazily into DataFrames."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not (self.directory / "manifest.json").is_file():
            raise RunError(f"{self.directory}: no manifest.json; not an attnprobe run directory")

    @cached_property
    def manifest(self) -> dict:
        return read_manifest(self.directory / "manifest.json")

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

    def _read(self, what: str, read) -> pd.DataFrame:
        """A table of the run; a missing or damaged file is one line saying how to rebuild it."""
        try:
            return read()
        except (OSError, ValueError, KeyError, pa.ArrowException) as exc:
            raise RunError(
                f"{self.directory}: {what} is missing or damaged ({type(exc).__name__}: {str(exc)[:120]}); "
                "rerun the same `attnprobe run` command, which rebuilds it from the finished chunks"
            ) from None

    @cached_property
    def prompts(self) -> pd.DataFrame:
        return self._read("prompts.parquet", lambda: read_table(self.directory, "prompts"))

    @cached_property
    def attention(self) -> pd.DataFrame:
        return self._read("attention.parquet", lambda: pd.read_parquet(self.directory / "attention.parquet"))

    @cached_property
    def logprobs(self) -> pd.DataFrame:
        return self._read("logprobs.parquet", lambda: read_table(self.directory, "logprobs"))

    @cached_property
    def referent_choice(self) -> pd.DataFrame | None:
        """Per prompt and referent: log p of the referent's words after the suite's question (None
        when the suite asks for no referent_choice)."""
        if not (self.directory / "referent_choice.parquet").is_file():
            return None
        return self._read("referent_choice.parquet", lambda: read_table(self.directory, "referent_choice"))

    @cached_property
    def likelihood(self) -> pd.DataFrame | None:
        """Per prompt: log p of the sentence and of its shared words (None without `likelihood:`)."""
        if not (self.directory / "likelihood.parquet").is_file():
            return None
        return self._read("likelihood.parquet", lambda: read_table(self.directory, "likelihood"))

    @cached_property
    def multiple_choice(self) -> pd.DataFrame | None:
        """Per prompt and option: log p of the option after the context and question (None
        without `multiple_choice:`)."""
        if not (self.directory / "multiple_choice.parquet").is_file():
            return None
        return self._read("multiple_choice.parquet", lambda: read_table(self.directory, "multiple_choice"))

    @property
    def has_head_effects(self) -> bool:
        """The run computed head effects (its manifest says so, or their tables are there): a damaged
        table is then an error when read, not a run without head effects."""
        return bool(self.manifest.get("head_effects")) or has_head_effects(self.directory)

    @cached_property
    def head_effect_items(self) -> pd.DataFrame:
        """Per item, counterfactual and head: patching and attribution effects (see
        attnprobe.patching)."""
        return self._read(
            HEAD_EFFECTS_FILES["items"], lambda: pd.read_parquet(self.directory / HEAD_EFFECTS_FILES["items"])
        )

    @cached_property
    def head_effect_totals(self) -> pd.DataFrame:
        """Per item and counterfactual: y, y', the total effect and the joint patches."""
        return self._read(
            "head_effects_totals.parquet", lambda: read_table(self.directory, "head_effects_totals")
        )

    @cached_property
    def head_effect_layers(self) -> pd.DataFrame:
        """Per item, counterfactual and layer: the attention and MLP output patches."""
        return self._read(
            HEAD_EFFECTS_FILES["layers"],
            lambda: pd.read_parquet(self.directory / HEAD_EFFECTS_FILES["layers"]),
        )

    def __repr__(self) -> str:
        m = self.manifest
        suite, model = m["suite"]["name"], m["model"]["spec"]
        return (
            f"{type(self).__name__}({self.directory}, suite={suite}, model={model}, prompts={m['n_prompts']})"
        )
