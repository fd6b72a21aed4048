"""Placebo counts: what a head-wise test finds when the covariate means nothing, printed beside what it
finds (and beside every "no head" sentence: a bound, not an absence).

The covariate is permuted across units (each unit keeps one value, the units' values are shuffled,
so every template and cell structure stays), the same slope test is rerun on every head, and per
draw the heads at p < 0.05 are counted and whether any head reaches q < 0.05 (BH over the heads) is
noted. PLACEBO_DRAWS draws (seeded): the mean and 95th percentile of the count, and the share of draws
with a head at q < 0.05 (the test's family-wise false-positive rate at this design).

placebo_table does the same for an edit: the gradient it removes against the same edit refitted on
permuted covariates (`attnprobe edit --placebo N`).
"""

from __future__ import annotations

import numpy as np

from .edits import share_removed
from .inference import bh_qvalues, cluster_slope_test

PLACEBO_DRAWS = 40
ALPHA = 0.05


def placebo_counts(
    design,
    cells: np.ndarray,
    observed: np.ndarray,
    unit: str,
    covariate: str,
    prefix: str,
    draws=PLACEBO_DRAWS,
) -> dict:
    """{prefix}placebo_p05_mean, _p05_q95, _any_q05 and {prefix}p05 (the count in the data: `observed`,
    the p of each head's slope test the caller ran) for the slope test of the cells (n cells, heads)
    on the covariate."""
    w = design.cells["weight"].to_numpy()
    per_unit = design.cells.groupby(unit)[covariate].first()
    rng = np.random.default_rng(0)
    counts, any_q = [], []
    for _ in range(draws):
        shuffled = dict(zip(per_unit.index, rng.permutation(per_unit.to_numpy())))
        p = cluster_slope_test(
            design.cells[unit].map(shuffled).to_numpy(dtype=float), cells, w, design.clusters
        )["p"]
        counts.append(int(np.sum(p < ALPHA)))
        any_q.append(bool((bh_qvalues(p) < ALPHA).any()))
    return {
        f"{prefix}p05": int(np.sum(observed < ALPHA)),
        f"{prefix}placebo_p05_mean": float(np.mean(counts)) if draws else np.nan,
        f"{prefix}placebo_p05_q95": float(np.quantile(counts, 0.95)) if draws else np.nan,
        f"{prefix}placebo_any_q05": float(np.mean(any_q)) if draws else np.nan,
        f"{prefix}placebo_draws": draws,
    }


PLACEBO_PREFIX = "placebo-"  # the kind of an edit's placebo rows in edits_items (edits.sweep.placebo)


def gradient_removal(bias):
    """rows -> the share of the gradient `rows` (an edit's bias rows, one per item) remove: 1 - slope
    after / slope before over every item of `bias`'s clean rows (kind none)."""
    before = bias[bias["kind"] == "none"].set_index("index").sort_index()
    x, y0, every = before["covariate"].to_numpy(dtype=float), before["y"].to_numpy(), before.index
    after = lambda rows: rows.set_index("index")["y"].reindex(every).to_numpy()
    return lambda rows: share_removed(x, y0, after(rows), every, every)


def placebo_columns(real: float, null: np.ndarray) -> dict:
    """The refits' mean and 99th percentile of the share removed, p = (1 + #null >= real) / (1 + N),
    its floor 1 / (1 + N) and N."""
    return {
        "placebo_removed_mean": float(null.mean()),
        "placebo_removed_q99": float(np.quantile(null, 0.99)),
        "placebo_p": float((1 + (null >= real).sum()) / (1 + len(null))),
        "placebo_p_floor": 1 / (1 + len(null)),
        "n_placebo": len(null),
    }


def placebo_table(raw):
    """Per edit kind refitted on permuted covariates (edits_items rows of kind placebo-KIND) and k: the
    real edit's share of the gradient removed (1 - slope after / slope before, every item edited by
    its quarter's edit), the placebo refits' mean and 99th percentile of it, p = (1 + #placebo >=
    real) / (1 + N) and its floor 1 / (1 + N)."""
    import pandas as pd

    bias = raw[raw["target"] == "bias"]
    removed = gradient_removal(bias)
    out = []
    for kind in (k for k in bias["kind"].unique() if str(k).startswith(PLACEBO_PREFIX)):
        real_kind = kind[len(PLACEBO_PREFIX) :]
        for k, rows in bias[bias["kind"] == kind].groupby("k"):
            real = removed(bias[(bias["kind"] == real_kind) & (bias["k"] == k) & (bias["draw"] == -1)])
            null = np.array([removed(draw) for _, draw in rows.groupby("draw")])
            row = {"kind": real_kind, "k": int(k), "gradient_removed": real}
            out.append({**row, **placebo_columns(real, null)})
    return pd.DataFrame(out)
