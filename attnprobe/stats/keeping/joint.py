"""The joint regression of an edit, as DAMA measures (Limisiewicz, Marecek & Musil, ICLR 2024): the
occupation items and the control's gendered phrases in the same templates
(edits.inputs.template_prompts) in one least-squares fit

    y = a_s * covariate / PER + a_f * factual + (group x template) effects + e

`covariate` is the occupation's (0 for a phrase), `factual` the phrase's label sign (+1 for the
positive label, -1 for the negative; 0 for an occupation), and the group separates occupations from
phrases, so a_s is the stereotype gradient within the occupations (log-odds per PER covariate
units) and a_f half the factual gap within the phrases, each against its own template's mean.
The fit is made to y before and y after the edit at once (one design, the two outcomes stacked), so
the four terms share one covariance: two-way cluster-robust by unit (occupation or word pair) and
template, Cameron, Gelbach & Miller (2011): V_unit + V_template - V_unit x template, each CR1 with
G / (G - 1) * (N - 1) / (N - K) of the stacked system (N, K its rows and columns), as statsmodels'
OLS with cov_type="cluster" and two groups computes it (tests/unit/test_joint.py); where the sum is
not positive semi-definite its negative eigenvalues are set to 0 (CGM 2011, section 2.3). As in
stats/inference.py, an interval is the widest of those the two-way and each one-way covariance
give (the two-way variance floored at the larger one-way one). A suite of one template has no
template dimension: the covariance is then the one-way one by unit, and G counts the units.

From it: the stereotype term removed, 1 - a_s' / a_s, and the factual term kept, a_f' / a_f, each
with the Fieller interval of its ratio (the CI that inverts the test of a_s' - r a_s = 0), and
specificity = removed - |1 - kept| (a factual gap amplified is as far from kept as one lost) with a
delta-method interval from the joint covariance: one fit, not two intervals in quadrature; where
either ratio's Fieller set is unbounded (its denominator not told from 0), so is specificity's
interval (round 5 gave it a finite one there). t has min(G) - 1 degrees of freedom.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import stats as sps

from ..inference import _fieller

PER = 10


def design(
    occupations: pd.DataFrame, phrases: pd.DataFrame
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """(X, Y, clusters) of the joint fit. Each frame has y0, y1, unit and template_id; occupations a
    covariate, phrases a sign. X's last two columns are covariate / PER and factual; the others the
    group x template effects."""
    both = pd.concat(
        [
            occupations.assign(group="occupation", factual=0.0, x=occupations["covariate"] / PER),
            phrases.assign(group="phrase", factual=phrases["sign"], x=0.0),
        ],
        ignore_index=True,
    )
    cells = pd.get_dummies(both["group"] + "|" + both["template_id"].astype(str)).to_numpy(float)
    X = np.column_stack([cells, both["x"].to_numpy(float), both["factual"].to_numpy(float)])
    Y = both[["y0", "y1"]].to_numpy(float)
    clusters = [
        pd.factorize(both["group"] + "|" + both["unit"].astype(str))[0],
        pd.factorize(both["template_id"])[0],
    ]
    return X, Y, clusters


def stacked_fit(X: np.ndarray, Y: np.ndarray, clusters: list[np.ndarray]) -> dict:
    """OLS of each column of Y (n, m) on X (n, k); `beta` (m k,) the outcomes' coefficients one after
    the other, `cov` their (m k, m k) two-way cluster-robust covariance (unclipped: `cov_raw`) and
    each one-way covariance, `G` the clusters per dimension."""
    n, k = X.shape
    m = Y.shape[1]
    bread = np.linalg.pinv(X.T @ X)
    B = bread @ X.T @ Y  # (k, m)
    scores = np.concatenate([X * (Y - X @ B)[:, [j]] for j in range(m)], axis=1)  # (n, m k)
    full_bread = np.kron(np.eye(m), bread)

    def one_way(labels: np.ndarray) -> np.ndarray:
        _, codes = np.unique(labels, return_inverse=True)
        sums = np.zeros((codes.max() + 1, m * k))
        np.add.at(sums, codes, scores)
        g = len(sums)
        correction = g / (g - 1) * (m * n - 1) / (m * n - m * k)
        return correction * full_bread @ (sums.T @ sums) @ full_bread

    a, b = (np.unique(c, return_inverse=True)[1].ravel() for c in clusters)
    if min(a.max(), b.max()) == 0:  # one cluster in a dimension (a suite of one template): the other's
        kept = [c for c in (a, b) if c.max() > 0] or [a]
        ways = [one_way(kept[0])] * 2
        raw = ways[0]
        clusters = [kept[0]]
    else:
        ways = [one_way(a), one_way(b)]
        raw = ways[0] + ways[1] - one_way(a * (b.max() + 1) + b)
    values, vectors = np.linalg.eigh((raw + raw.T) / 2)
    cov = (vectors * np.clip(values, 0, None)) @ vectors.T
    return {
        "beta": B.T.ravel(),
        "cov": cov,
        "cov_raw": raw,
        "one_way": ways,
        "G": [len(np.unique(c)) for c in clusters],
    }


def edit_terms(occupations: pd.DataFrame, phrases: pd.DataFrame, prefix: str, level: float = 0.95) -> dict:
    """One joint fit's columns (named with `prefix`): the stereotype and factual terms before and
    after, the share of the stereotype removed and of the factual term kept (Fieller CIs), and
    specificity with its delta-method CI."""
    X, Y, clusters = design(occupations, phrases)
    fit = stacked_fit(X, Y, clusters)
    k = X.shape[1]
    s0, f0, s1, f1 = k - 2, k - 1, 2 * k - 2, 2 * k - 1  # in beta: outcome 0's terms, then outcome 1's
    b, covs = fit["beta"], [fit["cov"], *fit["one_way"]]
    t = sps.t.ppf(0.5 + level / 2, min(fit["G"]) - 1)
    out = {f"{prefix}_stereotype_before": b[s0], f"{prefix}_stereotype_after": b[s1]}
    out[f"{prefix}_factual_before"], out[f"{prefix}_factual_after"] = b[f0], b[f1]
    removed = _ratio(b, covs, s1, s0, t)
    out[f"{prefix}_stereotype_removed"] = 1 - removed[0]
    out[f"{prefix}_stereotype_removed_ci_low"], out[f"{prefix}_stereotype_removed_ci_high"] = (
        1 - removed[2],
        1 - removed[1],
    )
    kept = _ratio(b, covs, f1, f0, t)
    out[f"{prefix}_factual_kept"] = kept[0]
    out[f"{prefix}_factual_kept_ci_low"], out[f"{prefix}_factual_kept_ci_high"] = kept[1], kept[2]
    spec = 1 - b[s1] / b[s0] - abs(1 - b[f1] / b[f0])
    side = np.sign(1 - b[f1] / b[f0])
    grad = np.zeros(len(b))
    grad[[s0, s1, f0, f1]] = b[s1] / b[s0] ** 2, -1 / b[s0], -side * b[f1] / b[f0] ** 2, side / b[f0]
    half = t * np.sqrt(max(grad @ V @ grad for V in covs))
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
