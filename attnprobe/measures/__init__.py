"""Measures: what a suite asks of each prompt, one module per kind.

Each kind owns its YAML parsing (`parse`), the span names it reads (`spans`), the reason it is
left out of a template (`missing`), its tokenizer-level checks that run before any weights load,
its per-batch computation and its output schema:

  attention     weights from source spans to target spans     -> attention.parquet
  next_token    log-probabilities of candidates at a cut      -> logprobs.csv
  head_effects  head interventions on the next-token contrast -> head_effects_*.parquet/csv

`parse_all` builds every kind from a suite document; the suite loader calls it once.
"""

from __future__ import annotations

from .attention import AttentionMeasure
from .head_effects import HeadEffectsMeasure
from .next_token import NextTokenMeasure

KINDS = {"attention": AttentionMeasure, "next_token": NextTokenMeasure, "head_effects": HeadEffectsMeasure}

__all__ = ["KINDS", "AttentionMeasure", "HeadEffectsMeasure", "NextTokenMeasure"]
