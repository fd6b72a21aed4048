"""The joint regression of an edit (stats/joint.py) against statsmodels, and on planted terms."""

import numpy as np
import pandas as pd
import pytest
import statsmodels.api as sm

from attnprobe.stats.keeping.joint import design, edit_terms, stacked_fit


def _frames(seed: int, removed: float = 0.5, kept: float = 1.0):
    """Occupations (20 x 6 templates) whose y has a stereotype gradient of 0.3 per 10 units, phrases
    (10 word pairs x 2 labels x 6 templates) with a factual term of 1.5; after the edit the gradient
    is (1 - removed) of it and the factual term `kept` of it; template and unit noise."""
    rng = np.random.default_rng(seed)
    templates = [f"t{j}" for j in range(6)]
    shift = dict(zip(templates, rng.normal(0, 0.5, 6)))
    jobs = pd.DataFrame([(f"o{u}", t) for u in range(20) for t in templates], columns=["unit", "template_id"])
    jobs["covariate"] = jobs["unit"].str[1:].astype(int) * 5.0
    unit_noise = dict(zip(jobs["unit"].unique(), rng.normal(0, 0.2, 20)))
    base = jobs["template_id"].map(shift) + jobs["unit"].map(unit_noise) + rng.normal(0, 0.1, len(jobs))
    jobs["y0"] = 0.03 * jobs["covariate"] + base
    jobs["y1"] = (1 - removed) * 0.03 * jobs["covariate"] + base + rng.normal(0, 0.05, len(jobs))
    words = pd.DataFrame(
        [(f"p{u}", s, t) for u in range(10) for s in (1.0, -1.0) for t in templates],
        columns=["unit", "sign", "template_id"],
    )
    noise = words["template_id"].map(shift) + rng.normal(0, 0.3, len(words))
    words["y0"] = 1.5 * words["sign"] + noise
    words["y1"] = kept * 1.5 * words["sign"] + noise + rng.normal(0, 0.05, len(words))
    return jobs, words


def test_the_joint_fit_matches_statsmodels_two_way_clustered_ols():
    jobs, words = _frames(0)
    X, Y, clusters = design(jobs, words)
    fit = stacked_fit(X, Y, clusters)
    stacked = np.block([[X, np.zeros_like(X)], [np.zeros_like(X), X]])
    groups = np.column_stack([np.r_[clusters[0], clusters[0]], np.r_[clusters[1], clusters[1]]])
    theirs = sm.OLS(np.r_[Y[:, 0], Y[:, 1]], stacked).fit(cov_type="cluster", cov_kwds={"groups": groups})
    assert np.allclose(fit["beta"], theirs.params, rtol=0, atol=1e-10)
    scale = np.abs(theirs.cov_params()).max()
    assert np.abs(fit["cov_raw"] - theirs.cov_params()).max() <= 1e-8 * scale


def test_the_joint_terms_find_a_planted_half_removed_and_a_kept_factual_term():
    jobs, words = _frames(1, removed=0.5, kept=1.0)
    out = edit_terms(jobs, words, "nouns")
    assert out["nouns_stereotype_before"] == pytest.approx(0.3, abs=0.05)  # per 10 covariate units
    assert out["nouns_stereotype_removed_ci_low"] < 0.5 < out["nouns_stereotype_removed_ci_high"]
    assert out["nouns_factual_kept_ci_low"] < 1.0 < out["nouns_factual_kept_ci_high"]
    assert out["nouns_specificity_ci_low"] < 0.5 < out["nouns_specificity_ci_high"]
    # an amplified factual gap counts against specificity as a lost one does
    amplified = edit_terms(*_frames(1, removed=0.5, kept=1.4), "nouns")
    assert amplified["nouns_specificity"] == pytest.approx(0.5 - 0.4, abs=0.06)
    assert amplified["nouns_specificity_ci_high"] < out["nouns_specificity_ci_low"]
