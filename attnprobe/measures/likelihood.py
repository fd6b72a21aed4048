"""The likelihood measure: which sentence of a pair (or set) does the model find more likely?

For each prompt, two scores from one scored pass over its tokens (scoring.token_logprobs: prefixes
shared, logits only where a scored token is read):

  logprob         log p(sentence): every token after the first, given those before it
  logprob_shared  log p(the `shared` span's tokens | everything before them): the words a row's
                  sentences have in common after the words that differ (suite/files/columns.py), so the
                  same tokens are scored under each group word, the causal-LM analogue of
                  CrowS-Pairs' score (Nangia et al. 2020, which scores the unmodified tokens with
                  a masked LM); NaN where the sentences differ at their end

Rows land in likelihood.parquet: (prompt_id, logprob, n_tokens, logprob_shared, n_shared). The
statistics (stats/kinds/likelihood.py) compare the analysis's positive and negative sentences of each item.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..schema.yamllines import line_of
from .base import Scored, ScoredMeasure

COLUMNS = ("prompt_id", "logprob", "n_tokens", "logprob_shared", "n_shared")
SHARED = "shared"


@dataclass(frozen=True)
class LikelihoodMeasure:
    by: str | None = None  # a prompt column whose values the statistics also report separately
    origin: str = ""

    KEY = "likelihood"

    @staticmethod
    def parse(ctx, doc, analysis, columns) -> LikelihoodMeasure | None:
        node = doc.get("likelihood")
        if node is None:
            return None
        if node is True or node == {}:
            node = {}
        if not isinstance(node, dict):
            ctx.fail(doc, "likelihood", "`likelihood` is a mapping, e.g. {by: bias_type}, or {}")
        ctx.check_keys(node, Likelihood.KEYS["likelihood"], " in likelihood")
        by = node.get("by")
        if by is not None and (not isinstance(by, str) or by not in columns):
            ctx.fail(node, "by", f"`by` names a column of the prompts ({', '.join(sorted(columns))})")
        if not analysis.paired:
            ctx.fail(
                doc,
                "likelihood",
                "likelihood compares each item's positive and negative sentence: declare "
                "`analysis: {contrast: ..., positive: ..., negative: ...}`",
            )
        return LikelihoodMeasure(by, f"{ctx.path}:{line_of(doc, 'likelihood')}")


def score(pm, encoded, batch_size: int = 256, progress=None) -> pd.DataFrame:
    """One row per prompt: the sentence's and its shared words' log-probabilities (NaN where there
    is nothing to score: a one-token sentence, no shared words). One scored pass per sentence: the
    shared words' values are a part of the sentence's (the same tokens after the same words)."""
    from ..forward.scoring import token_logprobs  # torch: not loaded by a suite's parse

    scored = [e for e in encoded if len(e.ids) > 1]
    values = dict(
        zip(
            (id(e) for e in scored),
            token_logprobs(pm, [(e.ids[:1], e.ids[1:]) for e in scored], batch_size, progress),
        )
    )
    rows = []
    for e in encoded:
        tokens, shared = values.get(id(e)), e.spans.get(SHARED)
        whole = np.nan if tokens is None else float(tokens.sum())
        part = shared is not None and shared[0] > 0 and tokens is not None
        # the tail starts at the sentence's second token: token k is tail position k - 1
        logprob_shared = float(tokens[shared[0] - 1 : shared[1] - 1].sum()) if part else np.nan
        rows.append(
            (e.prompt.prompt_id, whole, len(e.ids) - 1, logprob_shared, shared[1] - shared[0] if part else 0)
        )
    return pd.DataFrame(rows, columns=list(COLUMNS))


@dataclass(frozen=True)
class LikelihoodPlan(Scored):
    first_token: str = "bos"  # where each sentence's scored tokens start (the suite's first_token)


class Likelihood(ScoredMeasure):
    NAME = "likelihood"
    KEYS = {"likelihood": ("by",)}
    CONTRACT = ("pairs", 12)
    FIRST_TOKEN = "bos"  # a suite that declares it starts its sentences after BOS unless it says otherwise
    TABLES = ("sentence_preference",)
    STARTS = {
        "bos": "after the BOS (or end-of-text) token, as lm-eval's crows_pairs scores it",
        "keep": "from its second token (first_token: keep; the first is scored only if the tokenizer "
        "adds a BOS token)",
        "exclude": "from its second token (first_token: exclude)",
    }

    def parse(self, ctx, doc, scope) -> LikelihoodMeasure | None:
        return LikelihoodMeasure.parse(ctx, doc, scope.analysis, scope.columns)

    def sequences(self, declared, encoded, tokenizer, suite):
        return encoded.ids[:1], {0: ("", encoded.ids[1:])}

    def score(self, pm, declared, suite, prompts, batch_size, advance) -> pd.DataFrame:
        return score(pm, prompts, batch_size, advance)

    def count(self, declared, suite, encoded) -> int:
        return 1

    def plan(self, declared, scope) -> LikelihoodPlan:
        return LikelihoodPlan(super().plan(declared, scope).tokens, scope.suite.first_token)

    def describe(self, declared, part) -> list[str]:
        by = f", also by {declared.by}" if declared.by else ""
        return [
            f"likelihood: log p of each sentence {self.STARTS[part.first_token]}, and of its shared words{by}"
        ]

    def manifest(self, declared, part) -> dict:
        entry = {"by": declared.by, "first_token": part.first_token} if declared else None
        return {"likelihood": entry}

    def paired(self, a, b, scopes):
        from ..stats.compare import change_table
        from ..stats.kinds.likelihood import item_preferences

        values = [item_preferences(run) for run in (a, b)]
        if values[0] is None or values[1] is None:
            return {}
        return {"compare_likelihood": change_table(*values, a, scopes)}

    def statistics(self, run, tables: dict) -> dict:
        from ..stats.kinds.likelihood import sentence_preference

        return {"sentence_preference": sentence_preference(run)}

    def section(self, run, tables: dict, figures) -> dict | None:
        from .sections import records_section

        return records_section(self.NAME, tables, "sentence_preference")
