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
    templates = X[:, :-3]  # one intercept per template, fitted on the occupations and the phrases alike
    assert templates[: len(jobs)].all(0).sum() == 0 and templates[: len(jobs)].any(0).all()
    assert templates[len(jobs) :].any(0).all()
    stacked = np.block([[X, np.zeros_like(X)], [np.zeros_like(X), X]])
    groups = np.column_stack([np.r_[clusters[0], clusters[0]], np.r_[clusters[1], clusters[1]]])
    theirs = sm.OLS(np.r_[Y[:, 0], Y[:, 1]], stacked).fit(cov_type="cluster", cov_kwds={"groups": groups})
    fit = stacked_fit(X, Y, clusters, rule="CR1")
    assert np.allclose(fit["beta"], theirs.params, rtol=0, atol=1e-10)
    scale = np.abs(theirs.cov_params()).max()
    assert np.abs(fit["cov_raw"] - theirs.cov_params()).max() <= 1e-8 * scale
    assert np.allclose(stacked_fit(X, Y, clusters)["beta"], theirs.params, rtol=0, atol=1e-10)


def test_cr2_of_one_row_clusters_is_statsmodels_hc2():
    jobs, words = _frames(3)
    X, Y, _ = design(jobs, words)
    rows = np.arange(len(X))
    fit = stacked_fit(X, Y[:, :1], [rows, np.zeros(len(X), dtype=int)])
    theirs = sm.OLS(Y[:, 0], X).fit(cov_type="HC2")
    scale = np.abs(theirs.cov_params()).max()
    assert np.abs(fit["one_way"][0] - theirs.cov_params()).max() <= 1e-8 * scale


def test_cr2_of_a_slope_is_the_slope_tests_variance_and_wider_than_cr1():
    """The joint fit's CR2 is the rule of every slope the toolkit reports (cluster_slope_test), and
    widens CR1's small-sample intervals where a few units carry the slope."""
    from attnprobe.stats.inference import cluster_slope_test

    rng = np.random.default_rng(4)
    units = np.repeat(np.arange(12), 5)
    x = rng.exponential(size=12)[units]
    y = 0.4 * x + rng.normal(0, 1, 12)[units] + rng.normal(0, 0.5, len(x))
    X = np.c_[np.ones(len(x)), x]
    one_template = np.zeros(len(x), dtype=int)
    cr2 = stacked_fit(X, y[:, None], [units, one_template])
    slope = cluster_slope_test(x, y, np.ones(len(x)), [units])
    assert np.sqrt(cr2["cov"][1, 1]) == pytest.approx(slope["se"][0], rel=1e-9)
    assert cr2["df"][1] == pytest.approx(slope["df"][0], rel=1e-9)
    assert cr2["cov"][1, 1] > stacked_fit(X, y[:, None], [units, one_template], rule="CR1")["cov"][1, 1]


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


def test_specificity_is_unbounded_where_a_ratio_is():
    """No stereotype gradient before the edit (its term cannot be told from 0): the share removed has
    no bounded Fieller interval, and specificity, a difference built on it, gets none either (round
    5's delta method gave it a finite one)."""
    jobs, words = _frames(2)
    jobs["y0"] = jobs["y0"] - 0.03 * jobs["covariate"]  # no gradient to remove
    out = edit_terms(jobs, words, "nouns")
    removed = (out["nouns_stereotype_removed_ci_low"], out["nouns_stereotype_removed_ci_high"])
    assert not np.isfinite(removed).all()
    assert out["nouns_specificity_ci_low"] == -np.inf and out["nouns_specificity_ci_high"] == np.inf
    assert np.isfinite(out["nouns_specificity"])


def test_the_goal_names_each_condition_an_edit_misses():
    from attnprobe.stats.keeping.goal import failures, goal_table

    met = {
        "nouns_templates_stereotype_removed": 0.6,
        "nouns_templates_stereotype_removed_ci_low": 0.3,
        "nouns_templates_stereotype_removed_ci_high": 0.9,
        "definitional_accuracy_after": 0.995,
        "definitional_offset": -0.05,
        "placebo_p": 0.005,
        "kl_ci_high": 0.0008,
        **{
            f"{s}_factual_kept{e}": v
            for s in ("nouns_templates", "names_templates")
            for e, v in (("", 1.0), ("_ci_low", 0.85), ("_ci_high", 1.15))
        },
    }
    assert failures(pd.Series(met)) == []
    misses = {
        "nouns_templates_stereotype_removed_ci_low": (0.2, "stereotype removed"),
        "nouns_templates_stereotype_removed_ci_high": (1.6, "stereotype removed"),  # over-removal: no credit
        "names_templates_factual_kept_ci_high": (1.25, "names kept"),
        "nouns_templates_factual_kept": (1.12, "nouns kept"),
        "definitional_accuracy_after": (0.98, "accuracy"),
        "definitional_offset": (0.15, "offset"),
        "placebo_p": (0.02, "placebo p"),
        "kl_ci_high": (0.002, "KL upper"),
    }
    for column, (value, words) in misses.items():
        (fail,) = failures(pd.Series({**met, column: value}))
        assert fail.startswith(words), (column, fail)
    assert failures(pd.Series({k: v for k, v in met.items() if k != "placebo_p"})) == ["placebo not run"]
    table = goal_table(
        pd.DataFrame([met, {**met, "kl_ci_high": 0.01}]).assign(kind=["leace", "zero"], k=1), pd.DataFrame()
    )
    assert list(table["goal_met"]) == [True, False] and table["fails"].iloc[1].startswith("KL upper")
