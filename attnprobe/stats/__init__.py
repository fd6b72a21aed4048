"""Statistics of a run: pandas in, pandas out, driven by the suite's declared analysis.

Rooms: inference (the tests: cluster-robust t and slope, BH, bootstrap), design (paired
differences averaged into cells; templates weighted equally), held_out (every held-out claim beside
its null), placebo, compare (two runs paired), edits (the edit sweep), effect_checks; keeping/ (what
an edit keeps of the factual contrast: the control, the joint regression); analyses/ (the analyses'
statistics: the one ridge readout rule, the path tables and parts); and kinds/, one room per
measure named after it (attention, next_token, head_effects, referents, likelihood,
multiple_choice, direct_attribution).
Each registered measure's `statistics` (attnprobe.measures) calls its room; `measures.analyse`
gathers every table the report writes.
"""

from __future__ import annotations

from .design import run_analysis
from .held_out import held_out_summary
from .inference import (
    ALPHA,
    N_BOOT,
    bh_qvalues,
    cluster_mean_test,
    cluster_slope_test,
    split_halves,
)
from .kinds.attention import condition_means, head_stats, held_out_interaction, layer_stats
from .kinds.head_effects import head_effects
from .kinds.likelihood import sentence_preference
from .kinds.multiple_choice import choice_accuracy
from .kinds.next_token import behavior, correlation_with_ci, log_ratios
from .kinds.referents import referent_accuracy, referent_choice

# bump when a table's columns or meaning change: cached tables are recomputed (21: layer_stats'
# count of heads passing a test not run at a source is <NA>, not 0)
TABLES_VERSION = 21

__all__ = [
    "TABLES_VERSION",
    "ALPHA",
    "N_BOOT",
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
