"""The report's first sentence: the run's main numbers with their units, the position they are read
at, each claim's interval (the strongest head's adjusted for being chosen) and what a test that does
not pass does not say."""

from __future__ import annotations

import math

import pandas as pd

from ..heads import HeadSet
from ..measures.sections import pooled_row, split_levels, strongest_head
from ..run.files.reader import RunFiles
from ..schema.analysis import BEFORE, few_levels_notes
from ..stats import ALPHA, held_out_interaction, run_analysis


def _fmt(value, digits=2) -> str:
    return (
        "nan" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"
    )


def _chosen_interval(row, column: str, m: int) -> tuple[float, float]:
    """The 95% interval of a value chosen as the largest of m, Bonferroni-adjusted: its t interval's
    standard error (from the unadjusted interval and df) times t at 1 - 0.025 / m."""
    from scipy.special import stdtrit  # t's quantile (scipy.stats is a slow import)

    df = float(row.get("interaction_df", float("nan")))
    half = (row[f"{column}_ci_high"] - row[f"{column}_ci_low"]) / 2
    if not df > 0 or m < 1:
        return float("nan"), float("nan")
    se = half / stdtrit(df, 0.975)
    wide = se * stdtrit(df, 1 - 0.025 / m)
    return row[column] - wide, row[column] + wide


def _not_absence(group: pd.DataFrame, test: str) -> str:
    """What "no head at q < 0.05" does not say, with the smallest q the heads had and the placebo's
    count beside the data's (stats.placebo)."""
    smallest = group[f"{test}_q"].min()
    shown = f"the smallest q is {smallest:.2g}; " if smallest == smallest else ""
    return f" ({shown}{_placebo(group, test)}not passing a test is not evidence that no head does)"


def _placebo(group: pd.DataFrame, test: str) -> str:
    """The heads at p < 0.05 beside the placebo's count, or nothing where it was not computed."""
    if f"{test}_placebo_p05_mean" not in group or group[f"{test}_placebo_p05_mean"].isna().all():
        return ""
    row = group.iloc[0]
    return (
        f"{int(row[f'{test}_p05'])} heads at p < 0.05 against {row[f'{test}_placebo_p05_mean']:.1f} on "
        f"average (95th percentile {row[f'{test}_placebo_p05_q95']:.0f}) with "
        f"the covariate permuted across units in {int(row[f'{test}_placebo_draws'])} draws, "
        f"which put a head at q < 0.05 in {100 * row[f'{test}_placebo_any_q05']:.0f}% of them; "
    )


def headline(run: RunFiles, tables: dict) -> str:
    """One sentence with the run's main numbers: behaviour, interaction heads, then the lexical difference."""
    analysis = run_analysis(run)
    if not analysis.paired:
        labels = ", ".join(analysis.labels) or "none"
        return (
            f"This suite compares no two labels (contrast labels: {labels}); declare analysis.positive and "
            "analysis.negative for paired statistics. Descriptive means are in condition_means.csv."
        )
    pos, neg = analysis.positive, analysis.negative
    parts = _behaviour(analysis, pooled_row(tables["behavior"]), run.manifest.model.spec)
    counts = {c: run.prompts[c].nunique() for c in analysis.clusters if c in run.prompts}
    parts += [f"note: {note}" for note in few_levels_notes(analysis, counts)]
    heads, levels = split_levels(tables["head_stats"])
    for target, group in heads.groupby("target", sort=False):
        if analysis.covariate:
            parts.append(_interaction(analysis, target, group))
        lexical = int((group["difference_q"] < ALPHA).sum())
        kind = "a token difference, not bias" if analysis.covariate else "the paired difference"
        parts.append(
            f"{lexical} of {len(group)} heads attend to the {target} differently from {pos} and {neg} "
            f"prompts ({kind})"
        )
    for (source, target), group in levels.groupby(["source", "target"], sort=False):
        if "level_q" in group:
            parts.append(_level(analysis, source, target, group))
    if not parts:
        return (
            f"Nothing here compares {pos} with {neg}: no attention measure has paired prompts and no "
            "next-token "
            f"candidates carry those labels; the raw tables are attention.parquet and logprobs.csv."
        )
    return "; ".join(parts) + "."


def _behaviour(analysis, b, model: str) -> list[str]:
    """The pooled behaviour: its gradient on the covariate, else its mean log-ratio."""
    pos, neg = analysis.positive, analysis.negative
    if b is not None and analysis.covariate:
        per = f"per 10 {analysis.name(analysis.covariate)} points"
        return [
            f"Across {int(b['n_units'])} {analysis.name(analysis.unit)}s, {model}'s log p({pos}) - log "
            f"p({neg}) at the token before '{b['cut']}' changes by {_fmt(b['slope_per10'], 3)} nats {per} "
            f"(95% CI [{_fmt(b['slope_per10_ci_low'], 3)}, {_fmt(b['slope_per10_ci_high'], 3)}], "
            f"cluster-robust by {b['clusters']}, p = {b['slope_p']:.2g}; Pearson r of the "
            f"{analysis.name(analysis.unit)} means {_fmt(b['pearson_r'])})"
        ]
    if b is not None:
        return [
            f"{model}'s mean log p({pos}) - log p({neg}) at the token before '{b['cut']}' is "
            f"{_fmt(b['mean_log_ratio'], 3)} nats (95% CI [{_fmt(b['mean_ci_low'], 3)}, "
            f"{_fmt(b['mean_ci_high'], 3)}], clusters: {b['clusters']})"
        ]
    return []


def _interaction(analysis, target: str, group) -> str:
    """The heads whose attention difference to `target` changes with the covariate, the strongest with
    its selection-adjusted interval, and the held-out check."""
    pos, neg = analysis.positive, analysis.negative
    hits = group[group["interaction_q"] < ALPHA]
    held = held_out_interaction(group)
    check = (
        f"; held out ({held['split']}), the top {held['k']} heads chosen on one half keep their "
        f"sign on the other in {held['n_same_sign']} of {held['n_selected']} (random heads of "
        f"the same layers: {_fmt(held['n_same_sign_null'], 1)}), mean r there "
        f"{_fmt(held['mean_held_out_r'])} against {_fmt(held['mean_held_out_r_null'])} "
        f"(p = {held['held_out_p']:.2g})"
    )
    if not len(hits):
        note = group["interaction_power_note"].iloc[0]
        return (
            f"no head's {pos} - {neg} attention to the {target} changes with "
            f"{analysis.name(analysis.covariate)} at q < {ALPHA}"
            + _not_absence(group, "interaction")
            + (f" ({note})" if note else "")
            + check
        )
    top = strongest_head(group, covariate=True)
    low, high = _chosen_interval(top, "interaction_per10", len(group))
    return (
        f"in {len(hits)} of {len(group)} heads the {pos} - {neg} attention to the {target} "
        f"changes with {analysis.name(analysis.covariate)} (q < {ALPHA}, cluster-robust by "
        f"{top['clusters']}), most strongly {HeadSet.name(top['layer'], top['head'])} "
        f"({_fmt(top['interaction_per10'], 4)} attention weight per 10 points "
        f"[{_fmt(top['interaction_per10_ci_low'], 4)}, "
        f"{_fmt(top['interaction_per10_ci_high'], 4)}]; chosen as the largest of {len(group)}, "
        f"its interval adjusted for that choice (Bonferroni) is [{_fmt(low, 4)}, "
        f"{_fmt(high, 4)}]; r = {_fmt(top['interaction_r'])}){check}"
    )


def _level(analysis, source: str, target: str, group) -> str:
    """The heads whose attention itself (not the difference) changes with the covariate."""
    hits = group[group["level_q"] < ALPHA]
    where = source.removeprefix(BEFORE)
    text = f"at the token before the {where}, " if where != source else ""
    if len(hits):
        top = strongest_head(group, covariate=True, level=True)
        return (
            f"{text}the attention to the {target} changes with {analysis.name(analysis.covariate)} in "
            f"{len(hits)} of {len(group)} heads (q < {ALPHA}), most strongly "
            f"{HeadSet.name(top['layer'], top['head'])} ({_fmt(top['level_per10'], 4)} attention weight "
            "per 10 points)"
        )
    return (
        f"{text}no head's attention to the {target} changes with "
        f"{analysis.name(analysis.covariate)} at q < {ALPHA}" + _not_absence(group, "level")
    )
