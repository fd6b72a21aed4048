"""Measures: what a suite asks of each prompt, one module per kind.

Each kind owns its YAML parsing (`parse`, called once by the suite loader), its tokenizer-level
checks that run before any weights load, its computation and its output schema; the per-prompt
kinds (attention, next_token) also name the spans they read (`spans`) and why a template is left
out (`missing`). The per-batch kinds are read from one forward pass through one protocol, which
the run loops over (BATCH_KINDS): `request(suite, batch)` -> (capture keywords, state),
`read(pm, suite, batch, captured, state, context)` -> this batch's part, `chunk_table(parts, pm)`
-> the chunk file `<k>.<NAME>.parquet`. Head effects run per item, in their own chunks.

  attention     weights from source spans to target spans     -> attention.parquet
  next_token    log-probabilities of candidates at a cut      -> logprobs.csv
  head_effects  activation patching of the next-token contrast -> head_effects_*.parquet/csv
  referent_choice  log p of each referent after a question       -> referent_choice.parquet/csv
  likelihood    log p of each sentence and of its shared words  -> likelihood.parquet/csv
  multiple_choice  log p of each option after context + question  -> multiple_choice.parquet/csv
"""

from __future__ import annotations

from . import attention, next_token
from .attention import AttentionMeasure
from .head_effects import HeadEffectsMeasure, PairSwap, SlotSwap
from .head_effects import parse as parse_head_effects
from .likelihood import LikelihoodMeasure
from .multiple_choice import MultipleChoiceMeasure
from .next_token import NextTokenMeasure
from .referent_choice import ReferentChoiceMeasure

BATCH_KINDS = (attention, next_token)  # the first names the chunk's row count

__all__ = [
    "AttentionMeasure",
    "BATCH_KINDS",
    "HeadEffectsMeasure",
    "LikelihoodMeasure",
    "MultipleChoiceMeasure",
    "PairSwap",
    "SlotSwap",
    "parse_head_effects",
    "NextTokenMeasure",
    "ReferentChoiceMeasure",
]
