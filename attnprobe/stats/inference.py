"""The tests and intervals every table uses, on plain numpy arrays. Columns are tests (heads).

Conventions: `d` is (n_obs, k) with NaN where an observation is missing for a column; `w` (n_obs,)
are observation weights (templates weighted equally by the caller); cluster labels are arrays of
(n_obs,). Every p-value is NaN-safe: a column without data gets p = NaN, never 0, and
Benjamini-Hochberg ignores NaN p-values instead of spreading them.

- `cluster_mean_test`: weighted mean with a one- or two-way cluster-robust variance (CR1; two-way
  by inclusion-exclusion, Cameron, Gelbach & Miller 2011, floored at the larger one-way variance),
  t with min(G) - 1 degrees of freedom.
- `cluster_slope_test`: weighted least-squares slope on a covariate with the same variance: the
  interaction test at the declared design.
- `ratio_test`, `slope_ratio_test`: a share (of weighted means or of slopes) with the CI that inverts
  its numerator's test (Fieller): it excludes 0 exactly when the numerator's p < 1 - level.

Cluster counts and df are per column, from the clusters that have data in that column.
"""

from __future__ import annotations

import numpy as np
from scipy import special

ALPHA = 0.05
N_BOOT = 2000


def holm(p: np.ndarray) -> np.ndarray:
    """Holm's step-down adjustment of p-values over the rows of one table."""
    p = np.asarray(p, dtype=float)
    order = np.argsort(p)
    adjusted = np.minimum(1, np.maximum.accumulate((len(p) - np.arange(len(p))) * p[order]))
    out = np.empty_like(adjusted)
    out[order] = adjusted
    return out


def bh_qvalues(p: np.ndarray) -> np.ndarray:
    """Benjamini-Hochberg q-values in the input order, over the finite p-values only (NaN stays NaN)."""
    p = np.asarray(p, dtype=float)
    out = np.full(len(p), np.nan)
    finite = np.flatnonzero(np.isfinite(p))
    n = len(finite)
    if n == 0:
        return out
    order = finite[np.argsort(p[finite])]
    ranked = p[order] * n / np.arange(1, n + 1)
    out[order] = np.minimum(np.minimum.accumulate(ranked[::-1])[::-1], 1.0)  # monotone from the top
    return out


def _weights(d: np.ndarray, w: np.ndarray) -> np.ndarray:
    """(n, k) weights: w where d is finite, renormalised to sum 1 per column."""
    W = np.where(np.isfinite(d), w[:, None], 0.0)
    total = W.sum(0)
    return np.divide(W, total, out=np.zeros_like(W), where=total > 0)


SPARSE_FROM = 20_000  # summed elements from which the sparse product is faster (2x here; 0.08 ms to build)


def group_sums(values: np.ndarray, index: np.ndarray, n_groups: int, weights=None) -> np.ndarray:
    """(n_groups, ...) sums of the rows of values (n, ...) by group (index (n,) in 0..n_groups-1), each
    group's rows added in their order as np.add.at adds them (bit for bit; it and reduceat take 20x as
    long on 3,420 x 1,100 values); weights (n, m) give (n_groups, m, ...): sums of weights[:, a] * row."""
    rows = np.asarray(values, dtype=float)
    n, m = len(rows), 1 if weights is None else weights.shape[1]
    w = np.ones((n, 1)) if weights is None else np.asarray(weights, dtype=float)
    if rows.size * m < SPARSE_FROM:  # small: np.add.at itself, without the product's set-up
        out = np.zeros((n_groups, m, *rows.shape[1:]))
        np.add.at(out, np.asarray(index), w.reshape(n, m, *[1] * (rows.ndim - 1)) * rows[:, None])
    else:
        from scipy import sparse  # imported by transformers already in a run; not at a stats import

        where = (np.repeat(np.asarray(index) * m, m) + np.tile(np.arange(m), n), np.repeat(np.arange(n), m))
        indicator = sparse.csr_array((w.ravel(), where), shape=(n_groups * m, n))
        out = (indicator @ rows.reshape(n, -1)).reshape(n_groups, m, *rows.shape[1:])
    return out[:, 0] if weights is None else out


def _cr_variance(
    scores: np.ndarray, labels: np.ndarray, present: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """CR1 variance of a sum of scores (n, k) clustered by labels, G/(G-1) * sum_g (sum_{i in g} s_i)^2,
    where G counts, per column, only the clusters with data in that column (`present`, (n, k) bool):
    a column observed in 4 of 60 clusters has 4 clusters, not 60."""
    index = np.unique(labels, return_inverse=True)[1].ravel()
    sums = group_sums(scores, index, index.max() + 1)
    G = (group_sums(present, index, index.max() + 1) > 0).sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        factor = np.where(G > 1, G / np.maximum(G - 1, 1), np.nan)
    return factor * (sums**2).sum(0), G


def robust_variance(
    scores: np.ndarray, present: np.ndarray, clusters: list[np.ndarray]
) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """(variance (k,), clusters with data per dimension [(k,) ...], df (k,)) of a sum of scores (n, k):
    one-way CR1, or two-way by inclusion-exclusion (V1 + V2 - V12, Cameron, Gelbach & Miller 2011),
    floored at the larger one-way variance. df = (fewest clusters with data) - 1, per column."""
    one_way = [_cr_variance(scores, np.asarray(c), present) for c in clusters]
    variance = one_way[0][0]
    if len(clusters) == 2:
        a, b = (np.unique(np.asarray(c), return_inverse=True)[1].ravel() for c in clusters)
        both = a * (b.max() + 1) + b  # the crossed cells
        crossed = one_way[0][0] + one_way[1][0] - _cr_variance(scores, both, present)[0]
        variance = np.maximum(crossed, np.maximum(one_way[0][0], one_way[1][0]))
    counts = [g for _, g in one_way]
    return variance, counts, np.min(counts, axis=0) - 1


def _t_test(estimate: np.ndarray, se: np.ndarray, df: np.ndarray, has_data: np.ndarray, level: float):
    """(t, two-sided p, CI half-width) with per-column df; NaN where df < 1 or there is no data."""
    with np.errstate(invalid="ignore", divide="ignore"):
        t = np.where(has_data & (se > 0), estimate / se, np.nan)
    t[has_data & (se == 0) & (estimate != 0)] = np.inf  # no variation at all: the sign is certain
    t[has_data & (se == 0) & (estimate == 0)] = 0.0
    ok = df >= 1
    safe = np.where(ok, df, 1)
    # Student's t tail and quantile as scipy.stats.t computes them (its _sf and _ppf), without its
    # argument checks: 2 and 3 us a call against 33 and 71
    p = np.where(ok, 2 * special.stdtr(safe, -np.abs(t)), np.nan)
    half = np.where(ok, special.stdtrit(safe, 0.5 + level / 2) * se, np.nan)
    return t, p, half


def cluster_mean_test(d: np.ndarray, w: np.ndarray, clusters: list[np.ndarray], level: float = 0.95) -> dict:
    """Weighted mean of each column with its cluster-robust SE, CI, two-sided t p-value and df (per
    column: the clusters that have data in it). `n_clusters` are the design's counts per dimension."""
    d = np.atleast_2d(np.asarray(d, dtype=float).T).T
    W = _weights(d, np.asarray(w, dtype=float))
    x = np.nan_to_num(d)
    mean = (W * x).sum(0)
    scores = W * (x - mean)  # each observation's contribution to the error of the weighted mean
    variance, counts, df = robust_variance(scores, W > 0, clusters)
    se = np.sqrt(variance)
    has_data = W.sum(0) > 0
    t, p, half = _t_test(mean, se, df, has_data, level)
    mean = np.where(has_data, mean, np.nan)
    return {
        "mean": mean,
        "se": se,
        "ci_low": mean - half,
        "ci_high": mean + half,
        "t": t,
        "p": p,
        "df": df,
        "n_clusters": [len(np.unique(c)) for c in clusters],
        "n_clusters_used": counts,
    }


def _cr2_slope_variance(
    e: np.ndarray, w: np.ndarray, xc: np.ndarray, sxx: float, group: np.ndarray
) -> tuple[np.ndarray, int, float]:
    """CR2 (Bell & McCaffrey 2002) variance of the weighted least-squares slopes of the columns of one
    pattern of missing values (their residuals e (n, c) on the same rows, weights w summing to 1,
    covariate xc centred, Sxx = sum w xc^2), clustered by group (n,: 0..G-1); with the clusters'
    count and the variance's Satterthwaite df. Residuals at high-leverage covariate values are shrunk
    by the fit, which makes CR1 reject too often in the tails with few clusters (p < 0.001 about 2.7x
    too often with 30 units); CR2 undoes the shrinkage per cluster: e~_g = W_g^-1/2 (I - Hs_gg)^-1/2
    W_g^1/2 e_g, Hs = W^1/2 X (X'WX)^-1 X' W^1/2, X = [1, xc] (X'WX = diag(1, Sxx)); the slope's error
    is sum_g sum_{i in g} w_i xc_i e~_i / Sxx. The df is that of the variance under equal-variance
    cells, (sum l_g)^2 / sum l_g^2 with l_g = sum_{i in g} (w_i xc_i)^2: a few extreme covariate values
    carry most of a slope's variance, so it has fewer effective df than clusters (about 0.56 n for a
    uniform covariate with one cell per cluster); without this the tails stay about 2x too liberal."""
    n_groups = group.max() + 1
    # Hs_gg = U U' with U = W^1/2 [1, xc / sqrt(Sxx)] (rank 2), so (I - U U')^-1/2 = I + U h(U'U) U',
    # h(l) = ((1 - l)^-1/2 - 1) / l on the eigenvalues of the 2 x 2 Gram U'U: every cluster at once
    root = np.sqrt(w)
    U = np.stack([root, root * xc / np.sqrt(sxx)], 1)  # (n, 2)
    values, vectors = np.linalg.eigh(group_sums(U[:, :, None] * U[:, None, :], group, n_groups))
    with np.errstate(invalid="ignore", divide="ignore"):
        h = np.where(values > 1e-9, (np.clip(1 - values, 1e-12, None) ** -0.5 - 1) / values, 0.5)
    Hg = np.einsum("gik,gk,gjk->gij", vectors, h, vectors)
    # the slope's score of cluster g: b' (I + U h U') z = c_g' U'z with b = W^1/2 xc / Sxx = U[:, 1] /
    # sqrt(Sxx), z = W^1/2 e, c_g = (0, 1 / sqrt(Sxx)) + Hg b'U; U'z: the sums of e weighted by W^1/2 U
    uz = group_sums(e, group, n_groups, weights=U * root[:, None])  # (G, 2, c)
    coefficients = np.einsum("gi,gij->gj", group_sums(U[:, 1:] * U, group, n_groups), Hg) / np.sqrt(sxx)
    coefficients[:, 1] += 1 / np.sqrt(sxx)
    sums = np.einsum("gj,gjc->gc", coefficients, uz)
    loads = group_sums((w * xc) ** 2, group, n_groups)
    return (sums**2).sum(0), n_groups, np.sum(loads) ** 2 / np.sum(np.square(loads))


def _patterns(present: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """(rows, columns) per distinct column of `present` (n, k, bool): the rows with data and the columns
    that have them (grouped by their packed bits: np.unique over columns is 5x slower on short ones)."""
    if present[:, :1].all() and present.all():  # the usual case: every column has every row
        return [(present[:, 0], np.arange(present.shape[1]))]
    packed, groups = np.packbits(present, axis=0), {}
    for j in range(present.shape[1]):
        groups.setdefault(packed[:, j].tobytes(), []).append(j)
    return [(present[:, columns[0]], np.asarray(columns)) for columns in groups.values()]


def _pattern_fits(x: np.ndarray, y: np.ndarray, w: np.ndarray, codes: list[np.ndarray]):
    """Per column of y: the slope, the rows used, and per clustering of `codes` (3, len(codes), k): the
    CR2 variance, the clusters and the df. Columns missing the same rows share their weights, xc and
    Sxx, so each pattern of missing values is fitted at once (slopes and means as matrix products)."""
    k = y.shape[1]
    slope, used, fits = np.full(k, np.nan), np.zeros(k, dtype=int), np.full((3, len(codes), k), np.nan)
    fits[1] = 0  # clusters with data
    present = np.isfinite(y) & (np.isfinite(x) & (w > 0))[:, None]
    for rows, columns in _patterns(present):
        r = np.flatnonzero(rows)
        wr = w[r] / max(w[r].sum(), 1e-300)
        xc = x[r] - wr @ x[r]
        sxx = wr @ xc**2
        used[columns] = len(r)
        if not len(r) or sxx <= 0:
            continue
        Y = y if len(r) == len(y) and len(columns) == k else y[np.ix_(r, columns)]
        slope[columns] = fitted = (wr * xc) @ Y / sxx
        residual = Y - np.column_stack([np.ones(len(r)), xc]) @ np.stack([wr @ Y, fitted])  # e = y - a - b xc
        for a, code in enumerate(codes):
            group = np.unique(code[r], return_inverse=True)[1].ravel()  # clusters in sorted order
            fits[0, a, columns], fits[1, a, columns], fits[2, a, columns] = _cr2_slope_variance(
                residual, wr, xc, sxx, group
            )
    return slope, used, fits


def cluster_slope_test(
    x: np.ndarray, y: np.ndarray, w: np.ndarray, clusters: list[np.ndarray], level: float = 0.95
) -> dict:
    """Weighted least-squares slope of each column of y (n, k) on x (n,), with the cluster-robust
    variance of the declared clusters (two-way when two are given) and t with (fewest clusters) - 1
    df: the interaction test at the declared design. Templates whose own slopes scatter around the
    pooled one make the template-clustered variance large, so a slope carried by one template does
    not pass as general (an occupation-only test would treat templates as fixed).
    The slope's error is sum_i W_i xc_i e_i / Sxx (xc: x centred at its weighted mean, e: residual)."""
    y = np.atleast_2d(np.asarray(y, dtype=float).T).T
    k = y.shape[1]
    codes = [np.unique(np.asarray(c), return_inverse=True)[1].ravel() for c in clusters]
    if len(clusters) == 2:  # the crossed cells
        codes.append(codes[0] * (codes[1].max() + 1) + codes[1])
    slope, used, (variances, G, dfs) = _pattern_fits(np.asarray(x, float), y, np.asarray(w, float), codes)
    variance, floored = variances[0], np.zeros(k, dtype=bool)
    if len(clusters) == 2:
        crossed = variances[0] + variances[1] - variances[2]
        floored = crossed < np.maximum(variances[0], variances[1])  # the larger one-way variance binds
        variance = np.maximum(crossed, np.maximum(variances[0], variances[1]))
    counts = list(G[: len(clusters)].astype(int))
    df = np.minimum(np.min(counts, axis=0) - 1, np.min(dfs[: len(clusters)], axis=0))
    se = np.sqrt(variance)
    has_data = (used >= 3) & np.isfinite(slope)
    t, p, half = _t_test(np.nan_to_num(slope), se, df, has_data, level)
    slope = np.where(has_data, slope, np.nan)
    return {
        "slope": slope,
        "se": np.where(has_data, se, np.nan),
        "ci_low": slope - half,
        "ci_high": slope + half,
        "t": t,
        "p": np.where(has_data, p, np.nan),
        "df": df,
        "floored": floored,
        "df_is_clusters": df == np.min(counts, axis=0) - 1,  # else the Satterthwaite df is smaller
        "n_clusters": [len(np.unique(c)) for c in clusters],
        "n_clusters_used": counts,
    }


def _fieller(A: np.ndarray, B: np.ndarray, q: tuple, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """{s : (A - s B)^2 <= t^2 (q0 + q1 s + q2 s^2)} per column, as (low, high): an interval where B
    is distinguishable from 0, (-inf, inf) where every s is, NaN where the set is two rays."""
    a = B**2 - t**2 * q[2]
    b = -2 * A * B - t**2 * q[1]
    c = A**2 - t**2 * q[0]
    disc = b**2 - 4 * a * c
    with np.errstate(invalid="ignore", divide="ignore"):
        root = np.sqrt(np.where(disc > 0, disc, 0.0))
        lows, highs = (-b - root) / (2 * a), (-b + root) / (2 * a)
    every = (a < 0) & (disc < 0)
    low = np.where(a > 0, lows, np.where(every, -np.inf, np.nan))
    high = np.where(a > 0, highs, np.where(every, np.inf, np.nan))
    return low, high


def _critical(df, level: float) -> np.ndarray:
    """The two-sided t quantile of `level` at each df, NaN where df < 1."""
    ok = df >= 1
    return np.where(ok, special.stdtrit(np.where(ok, df, 1), 0.5 + level / 2), np.nan)


def _inverted_ci(se, num, den, A, B, clusters: list[np.ndarray], t):
    """The shares s the test of num - s den = 0 (estimate A - s B, critical value `t`: the numerator
    test's) does not reject, NaN where A / B is not finite. `se(u, clustering)`: the test's SE of
    each column of u under one clustering; its square is quadratic in s, so three values of s (one
    stacked test) give it. Two-way, the larger of the crossed (V1 + V2 - V12) and each one-way
    variance: the union."""
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = A / B
    parts = [[c] for c in clusters]
    if len(clusters) == 2:
        parts.append([np.array([f"{a}\x1f{b}" for a, b in zip(*clusters)])])
    quadratics = []
    for part in parts:
        stacked = np.hstack([num - s * den for s in (0.0, 1.0, -1.0)])
        v0, v1, v_1 = se(stacked, part).reshape(3, -1) ** 2
        quadratics.append((v0, (v1 - v_1) / 2, (v1 + v_1) / 2 - v0))
    if len(clusters) == 2:  # the crossed variance's quadratic from the three one-way ones
        quadratics[2] = tuple(x + y - z for x, y, z in zip(*quadratics))
    bounds = [_fieller(A, B, q, t) for q in quadratics]
    ends = np.min([low for low, _ in bounds], 0), np.max([high for _, high in bounds], 0)
    return tuple(np.where(np.isfinite(ratio), end, np.nan) for end in ends)


def ratio_test(
    num: np.ndarray, den: np.ndarray, w: np.ndarray, clusters: list[np.ndarray], level: float = 0.95
) -> dict:
    """Ratio of weighted means, sum w num / sum w den, per column of num (n, k) against den (n,), or
    against den's own column (n, k) (the share of a total effect a patch carries), where both are
    finite. CI: the s the test of the mean of num - s den = 0 keeps (Fieller; at s = 0
    cluster_mean_test of num). `se`: the linearised one."""
    num = np.atleast_2d(np.asarray(num, dtype=float).T).T
    den = np.asarray(den, dtype=float)
    den = np.where(np.isfinite(num), den if den.ndim == 2 else den[:, None], np.nan)
    num = np.where(np.isfinite(den), num, np.nan)
    W = _weights(num, np.asarray(w, dtype=float))
    mean_num, mean_den = (W * np.nan_to_num(num)).sum(0), (W * np.nan_to_num(den)).sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = mean_num / mean_den
    u = cluster_mean_test(num - ratio * den, w, clusters, level)
    with np.errstate(invalid="ignore", divide="ignore"):
        se = u["se"] / np.abs(mean_den)
    se_of = lambda u, part: cluster_mean_test(u, w, part, level)["se"]
    df = cluster_mean_test(num, w, clusters, level)["df"]
    low, high = _inverted_ci(se_of, num, den, mean_num, mean_den, clusters, _critical(df, level))
    out = {"ratio": ratio, "se": se, "ci_low": low, "ci_high": high, "df": u["df"]}
    return {**out, "n_clusters": u["n_clusters"], "n": np.isfinite(num).sum(0)}


def slope_ratio_test(
    x: np.ndarray, num: np.ndarray, den: np.ndarray, w: np.ndarray, clusters: list[np.ndarray], level=0.95
) -> dict:
    """Ratio of slopes on x, slope(num) / slope(den), per column of num (n, k) against den (n,): the
    share of a covariate gradient (how the total effect changes with the covariate) that a patch
    carries. Over the rows where both are finite. CI by inverting the test of the slope of
    num - s den = 0 (Fieller, as ratio_test), which at s = 0 is cluster_slope_test of num: the CI
    excludes 0 exactly when that p < 1 - level. `se` is the linearised one."""
    num = np.atleast_2d(np.asarray(num, dtype=float).T).T
    den = np.where(np.isfinite(num), np.asarray(den, dtype=float)[:, None], np.nan)
    num = np.where(np.isfinite(den), num, np.nan)
    slope_den = cluster_slope_test(x, den, w, clusters, level)["slope"]
    numerator = cluster_slope_test(x, num, w, clusters, level)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = numerator["slope"] / slope_den
    u = cluster_slope_test(x, num - ratio * den, w, clusters, level)
    with np.errstate(invalid="ignore", divide="ignore"):
        se = u["se"] / np.abs(slope_den)
    se_of = lambda u, part: cluster_slope_test(x, u, w, part, level)["se"]
    A, B = numerator["slope"], slope_den
    low, high = _inverted_ci(se_of, num, den, A, B, clusters, _critical(numerator["df"], level))
    return {"ratio": ratio, "se": se, "ci_low": low, "ci_high": high, "df": u["df"]}


def rowwise_r(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a - a.mean(-1, keepdims=True)
    b = b - b.mean(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (a * b).sum(-1) / np.sqrt((a * a).sum(-1) * (b * b).sum(-1))


def split_halves(x: np.ndarray) -> np.ndarray:
    """A fixed split of units into two halves that both span the covariate: sorted by x, alternately
    assigned. True marks half A. Used to select heads on one half and test them on the other."""
    half = np.zeros(len(x), dtype=bool)
    half[np.argsort(x, kind="stable")[::2]] = True
    return half


def pearson_columns(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson r of x (n,) with every column of y (n, k); NaN where undefined."""
    return rowwise_r(np.asarray(x, float)[None], np.asarray(y, float).T)
