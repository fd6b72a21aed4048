"""Statistics of a run: pandas in, pandas out, driven by the suite's declared analysis.

Rooms: inference (the tests: cluster-robust t and slope, BH, bootstrap), design
(paired differences averaged into cells; templates weighted equally), heads (attention: the
interaction with the covariate and the plain difference), behavior (next-token log-ratios),
effects (head interventions), referents (referent accuracy), likelihood (sentence preference),
choices (multiple choice), held_out (every held-out claim beside its null). `analyse` returns
every table the report writes, keyed by CSV name.
"""

from __future__ import annotations

import pandas as pd

from .behavior import behavior, log_ratios
from .choices import choice_accuracy
from .effects import head_effects
from .heads import condition_means, head_stats, held_out_interaction, layer_stats, run_analysis
from .held_out import held_out_summary
from .inference import (
    ALPHA,
    N_BOOT,
    bh_qvalues,
    cluster_mean_test,
    cluster_slope_test,
    correlation_with_ci,
    split_halves,
)
from .likelihood import sentence_preference
from .referents import referent_accuracy, referent_choice

TABLES_VERSION = 16  # bump when a table's columns or meaning change: cached tables are recomputed

__all__ = [
    "TABLES_VERSION",
    "ALPHA",
    "N_BOOT",
    "analyse",
    "behavior",
    "bh_qvalues",
    "choice_accuracy",
    "cluster_mean_test",
    "cluster_slope_test",
    "condition_means",
    "correlation_with_ci",
    "head_effects",
    "head_stats",
    "held_out_interaction",
    "held_out_summary",
    "layer_stats",
    "log_ratios",
    "referent_accuracy",
    "referent_choice",
    "run_analysis",
    "sentence_preference",
    "split_halves",
]


def analyse(run, n_boot: int = N_BOOT, seed: int = 0, step=None) -> dict[str, pd.DataFrame]:
    """Every table the report needs, keyed by the CSV name it is written as. `step(name)`, when
    given, is called as each table is done (the caller's progress; `table_steps` counts the calls)."""
    step = step or (lambda name: None)
    heads = head_stats(run)
    step("head_stats")
    tables = {"head_stats": heads, "layer_stats": layer_stats(heads)}
    step("layer_stats")
    tables["behavior"], tables["behavior_by_unit"] = behavior(run, n_boot=n_boot, seed=seed)
    step("behavior and behavior_by_unit")
    for name, compute in (
        ("condition_means", condition_means),
        ("referent_accuracy", referent_accuracy),
        ("referent_choice_accuracy", referent_choice),
        ("sentence_preference", sentence_preference),
        ("choice_accuracy", choice_accuracy),
    ):
        tables[name] = compute(run)
        step(name)
    if run.has_head_effects:
        tables.update(head_effects(run, heads))
        step("head_effects")
    tables["held_out"] = held_out_summary(heads, tables.get("head_effects_summary"))
    step("held_out")
    return tables


def table_steps(run) -> int:
    """How many times `analyse` calls `step` for this run."""
    return 9 + bool(run.has_head_effects)
