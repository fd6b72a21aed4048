"""The tests and intervals every table uses, on plain numpy arrays. Columns are tests (heads).

Conventions: `d` is (n_obs, k) with NaN where an observation is missing for a column; `w` (n_obs,)
are observation weights (templates weighted equally by the caller); cluster labels are arrays of
(n_obs,). Every p-value is NaN-safe: a column without data gets p = NaN, never 0, and
Benjamini-Hochberg ignores NaN p-values instead of spreading them.

- `cluster_mean_test`: weighted mean with a one- or two-way cluster-robust variance (CR1; two-way
  by inclusion-exclusion, Cameron, Gelbach & Miller 2011, floored at the larger one-way variance),
  t with min(G) - 1 degrees of freedom.
- `slope_permutation_test`: slope and r of unit means on a covariate, p from permuting the
  covariate across units (every permutation when there are few units).
- `n_permutations`: enough permutations that p resolves 20x below the smallest BH threshold.
"""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
from scipy import stats as sps

ALPHA = 0.05
N_BOOT = 2000
N_PERM = 2000  # at least this many permutations; more when there are many tests


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


def n_permutations(n_tests: int, alpha: float = ALPHA) -> int:
    """Permutations needed for p to resolve 20x below the smallest BH threshold alpha / n_tests."""
    return max(N_PERM, math.ceil(20 * max(1, n_tests) / alpha))


def _weights(d: np.ndarray, w: np.ndarray) -> np.ndarray:
    """(n, k) weights: w where d is finite, renormalised to sum 1 per column."""
    W = np.where(np.isfinite(d), w[:, None], 0.0)
    total = W.sum(0)
    return np.divide(W, total, out=np.zeros_like(W), where=total > 0)


def _cr_variance(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, int]:
    """CR1 variance of a sum of scores (n, k) clustered by labels: G/(G-1) * sum_g (sum_{i in g} s_i)^2."""
    _, index = np.unique(labels, return_inverse=True)
    G = index.max() + 1
    sums = np.zeros((G, scores.shape[1]))
    np.add.at(sums, index, scores)
    return (G / (G - 1) if G > 1 else np.nan) * (sums**2).sum(0), G


def cluster_mean_test(d: np.ndarray, w: np.ndarray, clusters: list[np.ndarray], level: float = 0.95) -> dict:
    """Weighted mean of each column with its cluster-robust SE, CI, two-sided t p-value, df."""
    d = np.atleast_2d(np.asarray(d, dtype=float).T).T
    W = _weights(d, np.asarray(w, dtype=float))
    x = np.nan_to_num(d)
    mean = (W * x).sum(0)
    scores = W * (x - mean)  # each observation's contribution to the error of the weighted mean
    one_way = [_cr_variance(scores, np.asarray(c)) for c in clusters]
    variance = one_way[0][0]
    if len(clusters) == 2:  # V1 + V2 - V(1 and 2), never below the larger one-way variance
        both = np.array([f"{a}\x1f{b}" for a, b in zip(*clusters)])
        crossed = one_way[0][0] + one_way[1][0] - _cr_variance(scores, both)[0]
        variance = np.maximum(crossed, np.maximum(one_way[0][0], one_way[1][0]))
    n_clusters = [g for _, g in one_way]
    df = min(n_clusters) - 1
    se = np.sqrt(variance)
    has_data = W.sum(0) > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        t = np.where(has_data & (se > 0), mean / se, np.nan)
    t[has_data & (se == 0) & (mean != 0)] = np.inf  # no variation at all: the sign is certain
    t[has_data & (se == 0) & (mean == 0)] = 0.0
    p = 2 * sps.t.sf(np.abs(t), df) if df >= 1 else np.full(len(mean), np.nan)
    half = sps.t.ppf(0.5 + level / 2, df) * se if df >= 1 else np.full(len(mean), np.nan)
    mean = np.where(has_data, mean, np.nan)
    return {
        "mean": mean,
        "se": se,
        "ci_low": mean - half,
        "ci_high": mean + half,
        "t": t,
        "p": p,
        "df": df,
        "n_clusters": n_clusters,
    }


def ratio_test(
    num: np.ndarray, den: np.ndarray, w: np.ndarray, clusters: list[np.ndarray], level: float = 0.95
) -> dict:
    """Ratio of weighted means, sum w num / sum w den, per column of num (n, k) against den (n,)
    (e.g. the share of a total effect that a patch carries), over the observations where both are
    finite. CI by linearisation: the ratio's error is that of the mean of u = num - ratio den,
    divided by the mean of den, with the same cluster-robust variance and df as cluster_mean_test."""
    num = np.atleast_2d(np.asarray(num, dtype=float).T).T
    den = np.where(np.isfinite(num), np.asarray(den, dtype=float)[:, None], np.nan)
    num = np.where(np.isfinite(den), num, np.nan)
    W = _weights(num, np.asarray(w, dtype=float))
    mean_den = (W * np.nan_to_num(den)).sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = (W * np.nan_to_num(num)).sum(0) / mean_den
    u = cluster_mean_test(num - ratio * den, w, clusters, level)
    with np.errstate(invalid="ignore", divide="ignore"):
        se = u["se"] / np.abs(mean_den)
    half = sps.t.ppf(0.5 + level / 2, u["df"]) * se if u["df"] >= 1 else np.full(len(ratio), np.nan)
    return {
        "ratio": ratio,
        "se": se,
        "ci_low": ratio - half,
        "ci_high": ratio + half,
        "df": u["df"],
        "n_clusters": u["n_clusters"],
        "n": np.isfinite(num).sum(0),
    }


def _rowwise_r(a: np.ndarray, b: np.ndarray) -> np.ndarray:
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
    return _rowwise_r(np.asarray(x, float)[None], np.asarray(y, float).T)


def _permutations(n_units: int, n_perm: int, rng) -> tuple[np.ndarray, bool]:
    """(P, n) index permutations: all of them when n! <= n_perm (exact test), else random ones."""
    if math.factorial(n_units) <= n_perm:
        return np.array(list(itertools.permutations(range(n_units)))), True
    return rng.permuted(np.tile(np.arange(n_units), (n_perm, 1)), axis=1), False


def slope_permutation_test(
    x: np.ndarray, y: np.ndarray, n_perm: int = N_PERM, n_boot: int = N_BOOT, seed: int = 0
) -> dict:
    """Per column of y (units, k): least-squares slope and Pearson r on x (units,), a two-sided
    permutation p-value (x permuted across units; slope and r share it), a percentile bootstrap CI
    of r over units, the smallest p the test can give, and whether every permutation was used. Units with
    NaN y are dropped per column."""
    x, y = np.asarray(x, float), np.atleast_2d(np.asarray(y, float).T).T
    k = y.shape[1]
    out = {name: np.full(k, np.nan) for name in ("slope", "r", "r_ci_low", "r_ci_high", "p")}
    out.update(min_p=np.nan, n_draws=0, exact=False)
    rng = np.random.default_rng(seed)
    complete = np.isfinite(y).all(0)
    patterns = [(complete, np.isfinite(x))] + [
        (np.eye(k, dtype=bool)[j], np.isfinite(x) & np.isfinite(y[:, j])) for j in np.flatnonzero(~complete)
    ]
    for columns, rows in patterns:
        if not columns.any() or rows.sum() < 3 or np.std(x[rows]) == 0:
            continue
        xs, ys = x[rows], y[rows][:, columns]
        xc, yc = xs - xs.mean(), ys - ys.mean(0)
        sxx = (xc**2).sum()
        observed = xc @ yc / sxx  # (k',)
        order, exact = _permutations(len(xs), n_perm, rng)
        exceed = np.zeros(len(observed))
        for start in range(0, len(order), 5000):  # blocks bound the memory
            null = xc[order[start : start + 5000]] @ yc / sxx  # (block, k')
            exceed += (np.abs(null) >= np.abs(observed) - 1e-12).sum(0)
        out["p"][columns] = exceed / len(order) if exact else (1 + exceed) / (1 + len(order))
        out.update(min_p=1 / len(order) if exact else 1 / (1 + len(order)), n_draws=len(order), exact=exact)
        out["slope"][columns] = observed
        out["r"][columns] = _rowwise_r(xs[None], ys.T)
        low, high = _bootstrap_r(xs, ys, n_boot, rng)
        out["r_ci_low"][columns], out["r_ci_high"][columns] = low, high
    return out


def _bootstrap_r(x: np.ndarray, y: np.ndarray, n_boot: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Percentile 95% CI of Pearson r per column of y, resampling units with replacement."""
    if n_boot < 1:
        return np.full(y.shape[1], np.nan), np.full(y.shape[1], np.nan)
    draws = []
    for start in range(0, n_boot, 250):
        idx = rng.integers(0, len(x), size=(min(250, n_boot - start), len(x)))  # (b, n)
        draws.append(_rowwise_r(x[idx][:, None, :], np.moveaxis(y[idx], 2, 1)))  # (b, k)
    boot = np.concatenate(draws)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a constant resample gives NaN r
        return np.nanquantile(boot, 0.025, axis=0), np.nanquantile(boot, 0.975, axis=0)


def correlation_with_ci(x: np.ndarray, y: np.ndarray, n_boot: int = N_BOOT, seed: int = 0) -> dict:
    """Pearson and Spearman r of paired vectors with percentile bootstrap CIs (resampling pairs)
    and the usual t-based p-values."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    n = len(x)
    names = [f"{kind}_{part}" for kind in ("pearson", "spearman") for part in ("r", "ci_low", "ci_high", "p")]
    if n < 3 or np.std(x) == 0 or np.std(y) == 0:
        return {"n": n, **dict.fromkeys(names, np.nan)}
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n))
    out = {"n": n}
    for name, transform in (("pearson", lambda v: v), ("spearman", lambda v: sps.rankdata(v, axis=-1))):
        r = _rowwise_r(transform(x)[None], transform(y)[None])[0]
        boot = _rowwise_r(transform(x[idx]), transform(y[idx]))
        t = r * math.sqrt((n - 2) / max(1e-300, 1 - r * r))
        out.update(
            {
                f"{name}_r": r,
                f"{name}_ci_low": np.nanquantile(boot, 0.025),
                f"{name}_ci_high": np.nanquantile(boot, 0.975),
                f"{name}_p": 2 * sps.t.sf(abs(t), n - 2),
            }
        )
    return out


def power_note(
    n_clusters: list[int], cluster_text: str, min_p: float = np.nan, n_tests: int = 1, alpha: float = ALPHA
) -> str:
    """What the design lets a test conclude: no test, approximate p, or no single test can pass BH."""
    notes = []
    if min(n_clusters) < 2:
        notes.append(f"one cluster of {cluster_text}: no test")
    elif min(n_clusters) < 10:
        notes.append(f"{' x '.join(map(str, n_clusters))} clusters ({cluster_text}): p is approximate")
    if np.isfinite(min_p) and min_p > alpha / n_tests:
        notes.append(
            f"smallest attainable p {min_p:.2g} > {alpha}/{n_tests}: no single test can pass BH, only a "
            "broad effect"
        )
    return "; ".join(notes)
