"""An outside package's measure, edit kind and site mode, registered through entry points
(docs/extending.md)."""

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pandas as pd
import torch

from attnprobe.edits.kinds import HeadEdit
from attnprobe.edits.layers.modes import SiteMode
from attnprobe.measures import PromptsMeasure
from attnprobe.measures.base import Scored


class PromptLength(PromptsMeasure):
    NAME = "prompt_length"
    TABLES = ("prompt_length_stats",)

    def parse(self, ctx, doc, scope):
        return doc.get(self.NAME)

    def plan(self, declared, scope):
        return Scored(tokens=sum(len(e.ids) for e in scope.encoded))

    def describe(self, declared, part):
        return ["prompt_length: the tokens of each prompt"]

    def manifest(self, declared, part):
        return {}

    def count(self, declared, suite, encoded):
        return 1

    def score(self, pm, declared, suite, prompts, batch_size, advance):
        advance(len(prompts))
        ids = [e.prompt.prompt_id for e in prompts]
        return pd.DataFrame({"prompt_id": ids, "n_tokens": [len(e.ids) for e in prompts]})

    def statistics(self, run, tables):
        table = run.prompt_length
        return {} if table is None else {"prompt_length_stats": table[["n_tokens"]].describe().T}


@dataclass(frozen=True)
class Negate(HeadEdit):
    kind: ClassVar[str] = "negate"

    def replacement(self, layer, z):
        return -z


class MeanGap(SiteMode):
    """Projects out the gap between the mean vectors of the items above and below the covariate's median."""

    mode = "mean_gap"

    @classmethod
    def fit(cls, z, x, control, sign):
        above = torch.as_tensor(x > np.median(x), device=z.device)
        gap = z[above].mean(0) - z[~above].mean(0)
        u = gap / gap.norm()
        return u, u, torch.zeros_like(u)
