"""The joint regression of an edit, as DAMA scores (Limisiewicz, Marecek & Musil, ICLR 2024): the
occupation items and the control's gendered phrases in the same templates
(edits.inputs.template_prompts) in one least-squares fit

    y = a_s * covariate / PER + a_f * factual + template effects + phrase effect + e

`covariate` is the occupation's (0 for a phrase), `factual` the phrase's label sign (+1 for the
positive label, -1 for the negative; 0 for an occupation). The template effects are shared by the
occupations and the phrases (one intercept per template, estimated from both: X'X is not
block-diagonal) and one phrase effect moves the phrases' level from the occupations'; a_s is the
stereotype gradient (log-odds per PER covariate units) and a_f half the factual gap, each against
its template's mean. A row carries one term or the other: the control's gendered words have no
labour statistic, so the two terms are identified on different rows of one design (DAMA's
professions carry both of its scores; this is as close as the shipped control allows).
The fit is made to y before and y after the edit at once (one design, the two outcomes stacked), so
the four terms share one covariance: two-way cluster-robust by unit (occupation or word pair) and
template, Cameron, Gelbach & Miller (2011): V_unit + V_template - V_unit x template, each CR2 (Bell &
McCaffrey 2002), the small-sample rule of every slope the toolkit reports (stats.inference.
cluster_slope_test): a cluster's residuals e_g are replaced by (I - H_gg)^-1/2 e_g, H_gg its block of
the hat matrix, with the Moore-Penrose inverse root where the template effects make I - H_gg singular
(Pustejovsky & Tipton 2018). `rule="CR1"` gives statsmodels' OLS with cov_type="cluster" and two
groups instead (tests/unit/test_joint.py). Where the two-way sum is not positive semi-definite its
negative eigenvalues are set to 0 (CGM 2011, section 2.3). As in stats/inference.py, an interval is
the widest of those the two-way and each one-way covariance give. A suite of one template has no
template dimension: the covariance is then the one-way one by unit, and G counts the units.
Each term's t has min(G - 1, Satterthwaite df) degrees of freedom, as the slope test's: the df of a
term's variance under equal-variance cells, (sum_g l_g)^2 / sum_g l_g^2 with l_g the sum of the
term's squared row weights in cluster g (smallest over the clustering dimensions).

From it: the stereotype term removed, 1 - a_s' / a_s, and the factual term kept, a_f' / a_f, each
with the Fieller interval of its ratio (the CI that inverts the test of a_s' - r a_s = 0), and
specificity = removed - |1 - kept| (a factual gap amplified is as far from kept as one lost) with a
delta-method interval from the joint covariance: one fit, not two intervals in quadrature; where
either ratio's Fieller set is unbounded (its denominator not told from 0), so is specificity's
interval.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import special

from ..inference import _fieller, group_sums

PER = 10


def design(
    occupations: pd.DataFrame, phrases: pd.DataFrame
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """(X, Y, clusters) of the joint fit. Each frame has y0, y1, unit and template_id; occupations a
    covariate, phrases a sign. X's columns: one per template, the phrase effect, covariate / PER and
    factual (the last two)."""
    both = pd.concat(
        [
            occupations.assign(group="occupation", factual=0.0, x=occupations["covariate"] / PER),
            phrases.assign(group="phrase", factual=phrases["sign"], x=0.0),
        ],
        ignore_index=True,
    )
    templates = pd.get_dummies(both["template_id"].astype(str)).to_numpy(float)
    phrase = (both["group"] == "phrase").to_numpy(float)
    X = np.column_stack([templates, phrase, both["x"].to_numpy(float), both["factual"].to_numpy(float)])
    Y = both[["y0", "y1"]].to_numpy(float)
    clusters = [
        pd.factorize(both["group"] + "|" + both["unit"].astype(str))[0],
        pd.factorize(both["template_id"])[0],
    ]
    return X, Y, clusters


def _cr2_residuals(X: np.ndarray, bread: np.ndarray, E: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """E (n, m) with each cluster's rows replaced by (I - H_gg)^-1/2 e_g (pseudo-inverse root), H_gg =
    X_g (X'X)^-1 X_g'; clusters of one size at once."""
    out = np.empty_like(E)
    order = np.argsort(codes, kind="stable")
    sizes = np.bincount(codes)
    starts = np.r_[0, np.cumsum(sizes)[:-1]]
    for size in np.unique(sizes[sizes > 0]):
        rows = order[starts[sizes == size][:, None] + np.arange(size)]  # (G', s)
        Xg = X[rows]  # (G', s, k)
        values, vectors = np.linalg.eigh(np.eye(size) - Xg @ bread @ Xg.transpose(0, 2, 1))
        root = np.where(values > 1e-10, np.clip(values, 1e-10, None) ** -0.5, 0.0)
        A = (vectors * root[:, None, :]) @ vectors.transpose(0, 2, 1)
        out[rows] = A @ E[rows]
    return out


def _satterthwaite(weights: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Per term (rows of `weights`, k x n: each row's weight in the term's estimate) the df of its
    cluster-robust variance under equal-variance cells: (sum_g l_g)^2 / sum_g l_g^2."""
    loads = group_sums((weights**2).T, codes, codes.max() + 1).T
    return loads.sum(1) ** 2 / (loads**2).sum(1)


def stacked_fit(X: np.ndarray, Y: np.ndarray, clusters: list[np.ndarray], rule: str = "CR2") -> dict:
    """OLS of each column of Y (n, m) on X (n, k); `beta` (m k,) the outcomes' coefficients one after
    the other, `cov` their (m k, m k) two-way cluster-robust covariance (`rule` CR2 or CR1;
    unclipped: `cov_raw`) and each one-way covariance, `G` the clusters per dimension, `df` (k,) each
    column's degrees of freedom."""
    n, k = X.shape
    m = Y.shape[1]
    bread = np.linalg.pinv(X.T @ X)
    B = bread @ X.T @ Y  # (k, m)
    E = Y - X @ B
    full_bread = np.kron(np.eye(m), bread)

    def one_way(codes: np.ndarray) -> np.ndarray:
        adjusted = _cr2_residuals(X, bread, E, codes) if rule == "CR2" else E
        scores = np.concatenate([X * adjusted[:, [j]] for j in range(m)], axis=1)  # (n, m k)
        sums = group_sums(scores, codes, codes.max() + 1)
        g = len(sums)
        correction = g / (g - 1) * (m * n - 1) / (m * n - m * k) if rule == "CR1" else 1.0
        return correction * full_bread @ (sums.T @ sums) @ full_bread

    a, b = (np.unique(c, return_inverse=True)[1].ravel() for c in clusters)
    if min(a.max(), b.max()) == 0:  # one cluster in a dimension (a suite of one template): the other's
        kept = [c for c in (a, b) if c.max() > 0] or [a]
        ways = [one_way(kept[0])] * 2
        raw = ways[0]
        dimensions = [kept[0]]
    else:
        ways = [one_way(a), one_way(b)]
        raw = ways[0] + ways[1] - one_way(a * (b.max() + 1) + b)
        dimensions = [a, b]
    values, vectors = np.linalg.eigh((raw + raw.T) / 2)
    cov = (vectors * np.clip(values, 0, None)) @ vectors.T
    weights = bread @ X.T  # (k, n): each row's weight in each coefficient
    G = [int(c.max()) + 1 for c in dimensions]
    df = np.min([np.fmin(g - 1, _satterthwaite(weights, c)) for g, c in zip(G, dimensions)], axis=0)
    return {"beta": B.T.ravel(), "cov": cov, "cov_raw": raw, "one_way": ways, "G": G, "df": df}


def edit_terms(occupations: pd.DataFrame, phrases: pd.DataFrame, prefix: str, level: float = 0.95) -> dict:
    """One joint fit's columns (named with `prefix`): the stereotype and factual terms before and
    after, the share of the stereotype removed and of the factual term kept (Fieller CIs), and
    specificity with its delta-method CI."""
    X, Y, clusters = design(occupations, phrases)
    fit = stacked_fit(X, Y, clusters)
    k = X.shape[1]
    s0, f0, s1, f1 = k - 2, k - 1, 2 * k - 2, 2 * k - 1  # in beta: outcome 0's terms, then outcome 1's
    b, covs = fit["beta"], [fit["cov"], *fit["one_way"]]
    t_s, t_f = special.stdtrit(fit["df"][[k - 2, k - 1]], 0.5 + level / 2)  # t quantiles
    out = {f"{prefix}_stereotype_before": b[s0], f"{prefix}_stereotype_after": b[s1]}
    out[f"{prefix}_factual_before"], out[f"{prefix}_factual_after"] = b[f0], b[f1]
    removed = _ratio(b, covs, s1, s0, t_s)
    out[f"{prefix}_stereotype_removed"] = 1 - removed[0]
    out[f"{prefix}_stereotype_removed_ci_low"], out[f"{prefix}_stereotype_removed_ci_high"] = (
        1 - removed[2],
        1 - removed[1],
    )
    kept = _ratio(b, covs, f1, f0, t_f)
    out[f"{prefix}_factual_kept"] = kept[0]
    out[f"{prefix}_factual_kept_ci_low"], out[f"{prefix}_factual_kept_ci_high"] = kept[1], kept[2]
    spec = 1 - b[s1] / b[s0] - abs(1 - b[f1] / b[f0])
    side = np.sign(1 - b[f1] / b[f0])
    grad = np.zeros(len(b))
    grad[[s0, s1, f0, f1]] = b[s1] / b[s0] ** 2, -1 / b[s0], -side * b[f1] / b[f0] ** 2, side / b[f0]
    half = max(t_s, t_f) * np.sqrt(max(grad @ V @ grad for V in covs))
    if not np.isfinite([*removed, *kept]).all():  # a ratio's Fieller set unbounded: so is the difference
        half = np.inf
    out[f"{prefix}_specificity"] = spec
    out[f"{prefix}_specificity_ci_low"], out[f"{prefix}_specificity_ci_high"] = spec - half, spec + half
    out[f"{prefix}_n"] = f"{len(occupations)} + {len(phrases)}"
    return out


def _ratio(b: np.ndarray, covs: list, top: int, bottom: int, t: float) -> tuple[float, float, float]:
    """b[top] / b[bottom] and the union of its Fieller intervals under each covariance of `covs`."""
    A, B = np.array([b[top]]), np.array([b[bottom]])
    bounds = [
        _fieller(A, B, (V[[top], top], -2 * V[[top], bottom], V[[bottom], bottom]), np.array([t]))
        for V in covs
    ]
    low, high = min(lo[0] for lo, _ in bounds), max(hi[0] for _, hi in bounds)
    return float(A[0] / B[0]), float(low), float(high)
