"""Reading a run directory: the manifest and the run's tables as DataFrames, read lazily. Reads
only; statistics and figures live downstream (attnprobe.stats, attnprobe.report, attnprobe.api)."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import pandas as pd

from ..errors import RunError
from ..tables import read_table
from .storage import HEAD_EFFECTS_FILES, has_head_effects


class RunFiles:
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
        return read_table(self.directory, "prompts")

    @cached_property
    def attention(self) -> pd.DataFrame:
        return pd.read_parquet(self.directory / "attention.parquet")

    @cached_property
    def logprobs(self) -> pd.DataFrame:
        return read_table(self.directory, "logprobs")

    @property
    def has_head_effects(self) -> bool:
        return has_head_effects(self.directory)

    @cached_property
    def head_effect_items(self) -> pd.DataFrame:
        """Per item, counterfactual and head: patching and attribution effects (see attnprobe.interventions)."""
        return pd.read_parquet(self.directory / HEAD_EFFECTS_FILES[0])

    @cached_property
    def head_effect_totals(self) -> pd.DataFrame:
        """Per item and counterfactual: y, y', the total effect and the joint patches."""
        return read_table(self.directory, "head_effects_totals")

    @cached_property
    def head_effect_layers(self) -> pd.DataFrame:
        """Per item, counterfactual and layer: the attention and MLP output patches."""
        return pd.read_parquet(self.directory / HEAD_EFFECTS_FILES[2])

    def __repr__(self) -> str:
        m = self.manifest
        return f"{type(self).__name__}({self.directory}, suite={m['suite']['name']}, model={m['model']['spec']}, prompts={m['n_prompts']})"
