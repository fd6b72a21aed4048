"""Measures: what a suite asks of each prompt, one kind per module (or folder), in one registry.

Each kind is a `Measure` (base.py: the protocol, and what the run gives it); MEASURES lists them
by YAML key in the order the suite loader parses them and the statistics compute them. Adding a
kind is its module plus one line here.

  attention        weights from source spans to target spans        -> attention.parquet
  next_token       log-probabilities of candidates at a cut         -> logprobs.csv
  referent_choice  log p of each referent after a question          -> referent_choice.parquet/csv
  likelihood       log p of each sentence and of its shared words   -> likelihood.parquet/csv
  multiple_choice  log p of each option after context + question    -> multiple_choice.parquet/csv
  head_effects     activation patching of the next-token contrast    -> head_effects_*.parquet/csv
  direct_attribution  the logit difference split over heads and MLPs -> direct_attribution.parquet
"""

from __future__ import annotations

import pandas as pd

from ..errors import AnalysisError
from ..registry import Registry
from .attention import Attention, AttentionMeasure
from .base import (
    BatchMeasure,
    Measure,
    ParseScope,
    Phase,
    PlanScope,
    PromptsMeasure,
    ScoredMeasure,
)
from .direct_attribution import DirectAttribution
from .head_effects import HeadEffects, HeadEffectsMeasure, PairSwap, SlotSwap
from .likelihood import Likelihood, LikelihoodMeasure
from .multiple_choice import MultipleChoice, MultipleChoiceMeasure
from .next_token import NextToken, NextTokenMeasure
from .referent_choice import ReferentChoice, ReferentChoiceMeasure


def _files(kind) -> set[str]:
    """Every file a kind writes into a run (its own, its chunks', its statistics tables') and the run
    attributes it reads them as."""
    chunks = {f"chunks/{prefix}*.{name}" for prefix, names in kind.CHUNKS.items() for name in names}
    tables = {f"{table}.{ext}" for table in kind.TABLES for ext in ("csv", "parquet")}
    return {*kind.ARTEFACTS, *chunks, *tables, *(f"Run.{attribute}" for attribute in kind.READS)}


def _clash(kind, others) -> str | None:
    """A kind may not write a file (or read a run attribute) another kind already does."""
    for other in others:
        shared = sorted(_files(kind) & _files(other))
        if shared:
            return f"writes {shared[0]}, as the measure {other.NAME} ({type(other).__module__}) does"
    return None


# the built-in kinds in order, then those other packages register (entry points "attnprobe.measures",
# read when the registry is first used; docs/extending.md)
MEASURES: dict[str, Measure] = Registry(
    "attnprobe.measures", Measure, "NAME", lambda kind: kind() if isinstance(kind, type) else kind, _clash
)
for _kind in (
    Attention(),
    NextToken(),
    ReferentChoice(),
    Likelihood(),
    MultipleChoice(),
    HeadEffects(),
    DirectAttribution(),
):
    MEASURES.register(_kind)


def batch_kinds() -> tuple[BatchMeasure, ...]:
    """The kinds read from the prompts' one forward pass, in registry order (the first names a
    prompts chunk's row count)."""
    return tuple(kind for kind in MEASURES.values() if isinstance(kind, BatchMeasure))


def analyse(run, step=None) -> dict:
    """Every statistics table of a run, keyed by the CSV name it is written as: each measure's
    `statistics` in registry order, then the held-out summary. `step(name)`, when given, is called
    as each measure's tables are done (`len(MEASURES) + 1` calls: the caller's progress)."""
    from ..stats import held_out_summary

    step = step or (lambda name: None)
    tables = {}
    for name, kind in MEASURES.items():
        tables.update(_statistics(kind, run, tables))
        step(name)
    tables["held_out"] = held_out_summary(tables["head_stats"], tables.get("head_effects_summary"))
    step("held_out")
    return tables


def _statistics(kind, run, tables: dict) -> dict:
    """A kind's statistics tables, checked before anything is written: {one of its TABLES: DataFrame}
    (a plug-in's that returns anything else, or a table it does not declare, is one line naming it)."""
    out = kind.statistics(run, tables)
    wrong = (
        f"gave {type(out).__name__}"
        if not isinstance(out, dict)
        else next(
            (
                f"gave {type(t).__name__} for {name!r}"
                if name in kind.TABLES
                else f"gave {name!r}, not in its TABLES"
                for name, t in out.items()
                if name not in kind.TABLES or not isinstance(t, pd.DataFrame)
            ),
            None,
        )
    )
    if wrong:
        raise AnalysisError(
            f"the measure {kind.NAME} ({type(kind).__module__}) statistics {wrong}; it must return "
            f"{{table: DataFrame}} for its TABLES {list(kind.TABLES)} (the run's own files are kept)"
        )
    return out


def paired(a, b) -> dict:
    """{table: rows}: each measure's paired change B - A between two finished runs (their readers,
    run.files.reader.RunFiles), its empty tables left out; refused in one line when their items cannot be
    paired or a run has random weights."""
    from ..model.shapes import refuse_random
    from ..stats.compare import check_comparable

    check_comparable(a, b)
    for run in (a, b):
        refuse_random(run.manifest.model.spec, f"attnprobe compare ({run.directory})")
    scopes = comparison_scopes(a, b)
    tables = {}
    for kind in MEASURES.values():
        tables.update({name: t for name, t in kind.paired(a, b, scopes).items() if not t.empty})
    return tables


def comparison_scopes(a, b) -> dict:
    """The scopes each kind's `paired` compares over (name -> item ids, stats.compare.scopes_of),
    from run A's items in their order."""
    from ..stats.compare import scopes_of, templates_of

    items = list(dict.fromkeys(a.prompts["item_id"]))
    return scopes_of(a, b, items, templates_of(a, items))


def table_names(run) -> tuple[str, ...]:
    """The statistics tables `analyse` writes for this run."""
    return (*(name for kind in MEASURES.values() for name in kind.tables(run)), "held_out")


__all__ = [
    "MEASURES",
    "analyse",
    "paired",
    "table_names",
    "AttentionMeasure",
    "BatchMeasure",
    "HeadEffectsMeasure",
    "LikelihoodMeasure",
    "Measure",
    "MultipleChoiceMeasure",
    "NextTokenMeasure",
    "PairSwap",
    "ParseScope",
    "Phase",
    "PlanScope",
    "PromptsMeasure",
    "ReferentChoiceMeasure",
    "ScoredMeasure",
    "SlotSwap",
    "batch_kinds",
]
