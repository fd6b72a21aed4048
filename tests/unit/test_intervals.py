"""Every bootstrap interval resamples the estimator that gives its point (issue 53, item 6): on data
symmetric about the point, the point lies inside its interval and near its centre; the readout's
refitted interval, whose draws sit below the point by construction, holds the point at every noise
level."""

import numpy as np
import pandas as pd
import pytest

from attnprobe.stats.kinds.next_token import correlation_with_ci


def _near_centre(point: float, low: float, high: float) -> bool:
    return low < point < high and abs(point - (low + high) / 2) < 0.25 * (high - low)


@pytest.mark.parametrize("seed", range(5))
def test_a_correlation_sits_near_the_centre_of_its_bootstrap_interval(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=200)
    found = correlation_with_ci(x, 0.1 * x + rng.normal(size=200), seed=seed)
    for kind in ("pearson", "spearman"):
        assert _near_centre(found[f"{kind}_r"], found[f"{kind}_ci_low"], found[f"{kind}_ci_high"]), kind


@pytest.mark.parametrize("seed", range(5))
def test_the_bias_score_sits_near_the_centre_of_its_cluster_bootstrap(seed):
    """BBQ's s_DIS over 40 question clusters answered at random between the target, the other
    group and "unknown": the point and its pigeonhole bootstrap over the same clusters."""
    from attnprobe.stats.kinds.multiple_choice import _bias

    rng = np.random.default_rng(seed)
    n = 400
    part = pd.DataFrame(
        {
            "chosen": rng.integers(0, 3, n),
            "answer": rng.integers(0, 3, n),
            "target": np.zeros(n, dtype=int),
            "unknown": np.full(n, 2),
            "polarity": rng.choice(["neg", "nonneg"], n),
        }
    )
    labels = [np.repeat(np.arange(40), 10)]
    point, low, high, _ = _bias(part, False, True, labels)
    assert _near_centre(point, low, high)


@pytest.mark.parametrize("noise", [0.3, 1.0, 3.0])
def test_the_readout_holds_its_point_inside_its_refitted_interval(noise):
    from attnprobe.stats.analyses.ridge import crossfit_r2

    rng = np.random.default_rng(4)
    X = rng.normal(size=(40, 20))
    found = crossfit_r2(X, X[:, 0] + noise * rng.normal(size=40), folds=5, permutations=0, refits=100)
    assert found["ci_low"] < found["r2"] < found["ci_high"]


def test_edits_quarters_weighs_a_quarter_as_compare_does():
    """An unbalanced quarter (one template with 8 occupations, one with 3): edits_quarters' row gives
    the gradient change and CI that compare's cells give (stats.design, every template weighing the
    same; written out here as compare.change_table does), to 1e-12; every item weighing the same
    would not."""
    from attnprobe.schema.analysis import TEMPLATE, Analysis
    from attnprobe.stats.design import Design
    from attnprobe.stats.edits import PER, quarter_table
    from attnprobe.stats.inference import cluster_slope_test

    rng = np.random.default_rng(0)
    units = [f"o{i}" for i in range(8)]
    on = pd.DataFrame(
        [("t0", u) for u in units] + [("t1", u) for u in units[:3]], columns=[TEMPLATE, "unit"]
    ).rename_axis("index")
    on["covariate"] = on["unit"].str[1:].astype(float) * 10
    before, after = rng.normal(size=len(on)), on["covariate"].to_numpy() * 0.01 + rng.normal(size=len(on))
    common = dict(target="bias", draw=-1, quarter=0)
    raw = pd.concat(
        [
            on.reset_index().assign(kind="none", k=0, y=before, **common),
            on.reset_index().assign(kind="zero", k=1, y=after, **common),
        ]
    )
    (row,) = quarter_table(raw).itertuples()
    analysis = Analysis(clusters=("unit", TEMPLATE), covariate="covariate", unit="unit")
    design = Design.build(on.index, on, analysis)
    cells = design.cell_means(np.column_stack([after - before]))
    x = design.cells["covariate"].to_numpy(dtype=float)
    theirs = cluster_slope_test(x, cells, design.cells["weight"].to_numpy(), design.clusters)
    found = [row.gradient_change, row.gradient_change_ci_low, row.gradient_change_ci_high]
    wanted = [PER * theirs[key][0] for key in ("slope", "ci_low", "ci_high")]
    np.testing.assert_allclose(found, wanted, rtol=1e-12, atol=1e-12)
    equal = cluster_slope_test(
        on["covariate"].to_numpy(), (after - before)[:, None], np.ones(len(on)), design.clusters
    )
    assert abs(PER * equal["slope"][0] - row.gradient_change) > 1e-2
