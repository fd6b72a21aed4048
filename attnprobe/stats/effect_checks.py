"""Checks of the head effects against other evidence: attention (do heads whose attention follows
the covariate carry the gradient?) and exact patching (does attribution rank heads like it?)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..heads import HeadSet


def attention_agreement(rows: pd.DataFrame, head_table: pd.DataFrame) -> dict:
    """Across every head: Spearman of |attention's covariate effect| (the interaction where the
    attention is read at the contrast, e.g. the pronoun; the level's slope where it is read before it,
    e.g. at the token the prediction is made from) with |the head's share of TE's gradient| (by
    attribution, known for every head). Does where heads look track what carries the stereotype?"""
    if "gradient_share_attribution_output" not in head_table:
        return {}
    index = pd.MultiIndex.from_frame(head_table[["layer", "head"]])
    causal = np.abs(head_table["gradient_share_attribution_output"].to_numpy())
    out = {}
    for source, group in rows.groupby("source", sort=False):
        column = next(
            (c for c in ("interaction_per10", "level_per10") if c in group and group[c].notna().any()), None
        )
        if column:
            effect = group.set_index(["layer", "head"])[column].reindex(index).to_numpy()
            out[f"spearman_gradient_attention_{source}"] = spearman(causal, np.abs(effect))
    return out


def attribution_check(head_table: pd.DataFrame, n_held: int, info: dict, te: float) -> dict:
    """Attribution against exact patching. With held-out items (exact: k): on them, Spearman of
    attribution against exact over every head; Spearman of the ranking the suite's heads were chosen
    by (attribution on the other items) against exact on the held-out items; and how many of the
    suite's k heads are among the k largest exact effects there (in the direction of TE). With
    exact: all, Spearman over every head on every item."""
    if not n_held:
        tested = head_table["output_in_p"].notna()
        return {
            "n_held_out": 0,
            "spearman_attribution_exact": spearman(
                head_table.loc[tested, "mean_attribution_output"], head_table.loc[tested, "mean_output_in"]
            ),
        }
    exact = head_table["heldout_output_in"].to_numpy()
    out = {
        "n_held_out": n_held,
        "spearman_attribution_exact": spearman(head_table["heldout_attribution_output"], exact),
        "spearman_heldout_ranking": spearman(head_table["choosing_attribution_output"], exact),
    }
    suite = set((info.get("exact_heads") or "").split()) - {"all"}
    if suite:
        names = pd.Series([HeadSet.name(*pair) for pair in zip(head_table["layer"], head_table["head"])])
        score = np.where(np.isfinite(exact), (1.0 if te >= 0 else -1.0) * exact, -np.inf)
        top = set(names.to_numpy()[np.argsort(-score, kind="stable")[: len(suite)]])
        out["heldout_top_overlap"] = len(top & suite)
    return out


def spearman(a, b) -> float:
    a, b = np.asarray(a, float), np.asarray(b, float)
    ok = np.isfinite(a) & np.isfinite(b)
    from scipy.stats import spearmanr  # a slow import: only here

    return float(spearmanr(a[ok], b[ok]).statistic) if ok.sum() > 2 else float("nan")
