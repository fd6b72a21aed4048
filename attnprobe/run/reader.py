"""Reading a run directory: the manifest and the run's tables as DataFrames, read lazily. Reads
only; statistics and figures live downstream (attnprobe.stats, attnprobe.report, attnprobe.api)."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import pandas as pd

from ..errors import RunError
from .storage import HEAD_EFFECTS_FILES, has_head_effects


def read_csv(path: Path) -> pd.DataFrame:
    """A CSV written by attnprobe: only empty cells are missing values; an empty file (a table a
    suite's measures never filled) is an empty DataFrame."""
    try:
        return pd.read_csv(path, keep_default_na=False, na_values=[""])
    except pd.errors.EmptyDataError:
        return pd.DataFrame()


class RunFiles:
    """A run directory, read lazily into DataFrames."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not (self.directory / "manifest.json").is_file():
            raise RunError(f"{self.directory}: no manifest.json; not an attnprobe run directory")

    @cached_property
    def manifest(self) -> dict:
        return json.loads((self.directory / "manifest.json").read_text())

    def _csv(self, name: str) -> pd.DataFrame:
        """A CSV of the run; only empty cells are missing values (a slot value "NA" stays text)."""
        return read_csv(self.directory / name)

    @cached_property
    def prompts(self) -> pd.DataFrame:
        return self._csv("prompts.csv")

    @cached_property
    def attention(self) -> pd.DataFrame:
        return pd.read_parquet(self.directory / "attention.parquet")

    @cached_property
    def logprobs(self) -> pd.DataFrame:
        return self._csv("logprobs.csv")

    @property
    def has_head_effects(self) -> bool:
        return has_head_effects(self.directory)

    @cached_property
    def head_effect_items(self) -> pd.DataFrame:
        """Per item and head: the effect of each intervention (see attnprobe.interventions)."""
        return pd.read_parquet(self.directory / HEAD_EFFECTS_FILES[0])

    @cached_property
    def head_effect_totals(self) -> pd.DataFrame:
        """Per item: y, y' and the total effect of the counterfactual."""
        return self._csv(HEAD_EFFECTS_FILES[1])

    def __repr__(self) -> str:
        m = self.manifest
        return f"{type(self).__name__}({self.directory}, suite={m['suite']['name']}, model={m['model']['spec']}, prompts={m['n_prompts']})"
