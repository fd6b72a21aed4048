"""Statistics against hand-computed and scipy values, and their error rates on simulated designs."""

import itertools
import json

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps
from scipy.linalg import sqrtm

from attnprobe import AnalysisError, Run, stats

GENDER = {
    "contrast": "pronoun_label",
    "positive": "female",
    "negative": "male",
    "labels": ["female", "male"],
    "clusters": ["occupation"],
    "covariate": "occupation_bls_pct_female",
    "unit": "occupation",
    "names": {"occupation": "occupation", "occupation_bls_pct_female": "occupation.bls_pct_female"},
}

RUN_KEYS = {
    "format": 2,
    "fingerprint": "synthetic",
    "settings": {},
    "versions": {},
    "status": "complete",
}  # what every run manifest holds


def test_bh_on_a_known_vector_and_nan():
    assert np.allclose(stats.bh_qvalues(np.array([0.01, 0.04, 0.03, 0.005])), [0.02, 0.04, 0.04, 0.02])
    p = np.random.default_rng(0).uniform(size=50)
    assert np.allclose(stats.bh_qvalues(p), sps.false_discovery_control(p))
    q = stats.bh_qvalues(np.array([0.01, np.nan, 0.04]))  # NaN stays NaN and does not count as a test
    assert np.isnan(q[1]) and np.allclose(q[[0, 2]], [0.02, 0.04])


def test_one_way_cluster_t_equals_scipy_t_test_on_cluster_means():
    rng = np.random.default_rng(1)
    d = rng.normal(0.3, 1, size=20)
    result = stats.cluster_mean_test(d, np.ones(20), [np.arange(20)])
    t = sps.ttest_1samp(d, 0)
    assert result["p"][0] == pytest.approx(t.pvalue) and result["t"][0] == pytest.approx(t.statistic)
    ci = t.confidence_interval()
    assert (result["ci_low"][0], result["ci_high"][0]) == pytest.approx((ci.low, ci.high))


def test_two_way_cluster_variance_by_hand():
    rng = np.random.default_rng(2)
    a, b = np.repeat(np.arange(5), 4), np.tile(np.arange(4), 5)  # 5 x 4 crossed cells
    d = rng.normal(size=20) + a * 0.3 + b * 0.5
    e = (d - d.mean()) / 20  # scores of the equally weighted mean

    def cr1(labels):
        groups = np.unique(labels)
        return len(groups) / (len(groups) - 1) * sum(e[labels == g].sum() ** 2 for g in groups)

    v = max(cr1(a) + cr1(b) - cr1(a * 10 + b), cr1(a), cr1(b))
    result = stats.cluster_mean_test(d, np.ones(20), [a, b])
    assert result["se"][0] == pytest.approx(np.sqrt(v)) and result["df"] == 3
    assert result["p"][0] == pytest.approx(2 * sps.t.sf(abs(d.mean() / np.sqrt(v)), 3))


def test_nan_columns_get_nan_p_not_zero():
    d = np.array([[0.1, np.nan], [0.2, np.nan], [0.3, np.nan]])
    result = stats.cluster_mean_test(d, np.ones(3), [np.arange(3)])
    assert np.isfinite(result["p"][0]) and np.isnan(result["p"][1]) and np.isnan(result["mean"][1])
    slope = stats.cluster_slope_test(
        np.arange(5.0),
        np.array([[1, np.nan], [2, 1], [2, np.nan], [4, np.nan], [5, 2]]),
        np.ones(5),
        [np.arange(5)],
    )
    assert np.isnan(slope["p"][1]) and slope["p"][0] > 0  # two cells left: no test, not p = 0


def _cr2_by_hand(x, y, w, labels):
    """CR2 variance of the slope from the full matrices (X = [1, x], bread (X'WX)^-1), its
    Satterthwaite df and the cluster count: an implementation apart from the code's centred one."""
    W = w / w.sum()
    X = np.column_stack([np.ones_like(x), x])
    bread = np.linalg.inv(X.T @ (W[:, None] * X))
    e = y - X @ (bread @ X.T @ (W * y))
    xc = x - (W * x).sum()
    variance, loads = 0.0, []
    for g in np.unique(labels):
        i = labels == g
        root = np.sqrt(W[i])
        M = np.eye(i.sum()) - root[:, None] * (X[i] @ bread @ X[i].T) * root[None]
        adjusted = np.linalg.inv(np.real(sqrtm(M))) @ (root * e[i]) / root
        variance += (bread @ X[i].T @ (W[i] * adjusted))[1] ** 2
        loads.append(((W[i] * xc[i]) ** 2).sum())
    return variance, np.sum(loads) ** 2 / np.sum(np.square(loads)), len(np.unique(labels))


def test_cluster_slope_by_hand():
    """Weighted least-squares slope; two-way CR2 by inclusion-exclusion; df the smaller of
    (fewest clusters - 1) and each dimension's Satterthwaite df."""
    rng = np.random.default_rng(7)
    a, b = np.repeat(np.arange(6), 5), np.tile(np.arange(5), 6)  # 6 x 5 crossed cells
    x = rng.uniform(0, 100, 6)[a]
    y = 0.01 * x + rng.normal(size=30) + 0.5 * rng.normal(size=5)[b] * (x - 50) / 50
    w = rng.uniform(0.5, 1.5, 30)
    (va, dfa, ga), (vb, dfb, gb) = _cr2_by_hand(x, y, w, a), _cr2_by_hand(x, y, w, b)
    vab = _cr2_by_hand(x, y, w, a * 10 + b)[0]
    v, df = max(va + vb - vab, va, vb), min(ga - 1, gb - 1, dfa, dfb)
    slope = np.polyfit(x, y, 1, w=np.sqrt(w))[0]
    out = stats.cluster_slope_test(x, y, w, [a, b])
    assert out["slope"][0] == pytest.approx(slope)
    assert out["se"][0] == pytest.approx(np.sqrt(v)) and out["df"][0] == pytest.approx(df)
    assert out["p"][0] == pytest.approx(2 * sps.t.sf(abs(slope / np.sqrt(v)), df))
    # a column observed in 3 of the 5 template clusters counts 3 clusters (df at most 2), not 5
    holes = np.where(b < 3, y, np.nan)
    partial = stats.cluster_slope_test(x, holes, w, [a, b])
    assert partial["df"][0] <= 2 and list(partial["n_clusters_used"][1]) == [3]


def test_slope_test_tails_with_one_cell_per_cluster():
    """30 units, one cell each, a uniform covariate, no slope: CR1 with n - 2 df rejects about 2.7x
    too often at p < 0.001 (leverage); CR2 with Satterthwaite df holds 0.05, 0.01 and 0.001."""
    rng = np.random.default_rng(4)
    x = rng.uniform(0, 100, size=30)
    p = stats.cluster_slope_test(x, rng.normal(size=(30, 20_000)), np.ones(30), [np.arange(30)])["p"]
    for level in (0.05, 0.01, 0.001):  # binomial SE at 0.001 over 20,000 draws: 0.00022
        assert (p < level).mean() == pytest.approx(level, rel=0.5 if level == 0.001 else 0.15)


def test_cluster_counts_only_clusters_with_data():
    """A mean over 6 of 60 x 8 cells gets df from the clusters that hold them."""
    occ, tpl = np.repeat(np.arange(60), 8), np.tile(np.arange(8), 60)
    d = np.where((occ < 6) & (tpl < 4), np.random.default_rng(8).normal(size=480), np.nan)
    out = stats.cluster_mean_test(d, np.ones(480), [occ, tpl])
    assert out["df"][0] == 3 and out["n_clusters"] == [60, 8]


@pytest.mark.parametrize("sparse_from", [0, 10**9])  # the sparse product, and np.add.at for small sums
def test_group_sums_add_each_groups_rows_in_order_as_add_at_does(monkeypatch, sparse_from):
    """inference.group_sums (one sparse product) equals np.add.at bit for bit, groups of one row and
    of many, an empty group, 3-d rows; with weights, the sums of each weight column times the rows."""
    from attnprobe.stats import inference
    from attnprobe.stats.inference import group_sums

    monkeypatch.setattr(inference, "SPARSE_FROM", sparse_from)

    rng = np.random.default_rng(3)
    values = rng.normal(size=(500, 7, 3)) * 10.0 ** rng.integers(-8, 8, size=(500, 1, 1))
    index = np.r_[rng.integers(0, 40, 499), 41]  # group 40 is empty, 41 holds one row
    expected = np.zeros((42, 7, 3))
    np.add.at(expected, index, values)
    assert np.array_equal(group_sums(values, index, 42), expected)
    weights = rng.normal(size=(500, 2))
    weighted = np.zeros((42, 2, 7, 3))
    np.add.at(weighted, index, weights[:, :, None, None] * values[:, None])
    assert np.array_equal(group_sums(values, index, 42, weights=weights), weighted)
    assert np.array_equal(
        group_sums(values[:, 0, 0] > 0, index, 42), np.bincount(index, values[:, 0, 0] > 0, 42)
    )


def test_interaction_test_holds_its_level_under_template_heterogeneity():
    """Calibration at the declared design: 60 occupations x 8 templates, each template with its own
    slope on the covariate (between-template slope SD twice a template slope's sampling SE: I^2 about
    0.8, as in the gender suite) around a true average slope of 0, plus occupation and cell noise.
    Over 400 simulated heads the two-way test rejects at most 7% at nominal 5%; clustering by
    occupation alone (templates treated as fixed, as a permutation across occupations does) rejects
    several times too often, so the simulation can tell the two apart."""
    rng = np.random.default_rng(9)
    n_occ, n_tpl, heads = 60, 8, 400
    x_occ = rng.uniform(0, 100, n_occ)
    occ, tpl = np.repeat(np.arange(n_occ), n_tpl), np.tile(np.arange(n_tpl), n_occ)
    x = x_occ[occ]
    se_template_slope = 1 / np.sqrt(((x_occ - x_occ.mean()) ** 2).sum())
    slopes = rng.normal(0, 2 * se_template_slope, size=(n_tpl, heads))
    y = (
        rng.normal(size=(n_tpl, heads))[tpl]
        + rng.normal(0, 0.5, size=(n_occ, heads))[occ]
        + slopes[tpl] * (x - x.mean())[:, None]
        + rng.normal(size=(n_occ * n_tpl, heads))
    )
    w = np.ones(len(x))
    two_way = (stats.cluster_slope_test(x, y, w, [occ, tpl])["p"] < 0.05).mean()
    by_occupation = (stats.cluster_slope_test(x, y, w, [occ])["p"] < 0.05).mean()
    assert two_way <= 0.07 and by_occupation > 0.15, (two_way, by_occupation)


def test_two_way_clustering_holds_type_one_error_where_one_way_does_not():
    """Crossed occupation x template data under the null, with template effects: occupation-only
    clustering rejects far too often; the two-way test stays at the nominal 5%."""
    rng = np.random.default_rng(3)
    n_occ, n_tpl, sims = 60, 14, 4000
    occ, tpl = np.repeat(np.arange(n_occ), n_tpl), np.tile(np.arange(n_tpl), n_occ)
    d = (
        rng.normal(size=(n_occ, 1, sims))
        + rng.normal(size=(1, n_tpl, sims))
        + rng.normal(size=(n_occ, n_tpl, sims))
    )
    d = d.reshape(n_occ * n_tpl, sims)
    one_way = (stats.cluster_mean_test(d, np.ones(len(d)), [occ])["p"] < 0.05).mean()
    two_way = (stats.cluster_mean_test(d, np.ones(len(d)), [occ, tpl])["p"] < 0.05).mean()
    assert one_way > 0.3 and two_way <= 0.06, (one_way, two_way)


def test_interaction_finds_planted_heads_at_the_stated_fdr():
    """200 simulated designs, 40 heads each, an interaction planted in 3: BH at 0.05 over the
    interaction p-values keeps the average false discovery proportion at 0.05 and finds the 3
    (1,000 simulations x 4 seeds gave 0.042-0.049)."""
    rng = np.random.default_rng(4)
    units, heads, sims = 30, 40, 200
    x = rng.uniform(0, 100, size=units)
    y = rng.normal(size=(units, sims, heads)) + 5.0  # a large lexical difference everywhere
    y[:, :, :3] += 0.04 * (x - 50)[:, None, None]  # the planted interaction in heads 0-2
    p = stats.cluster_slope_test(x, y.reshape(units, -1), np.ones(units), [np.arange(units)])["p"]
    q = np.array([stats.bh_qvalues(row) for row in p.reshape(sims, heads)])
    found = q < 0.05
    false = found[:, 3:].sum(1) / np.maximum(found.sum(1), 1)
    # BH's expected FDP is 0.05 x 37/40 = 0.046; 200 simulations estimate it to within 2 standard errors
    assert false.mean() <= 0.05 + 2 * false.std() / np.sqrt(sims) and found[:, :3].mean() > 0.95
    assert (p.reshape(sims, heads)[:, 3:] < 0.05).mean() == pytest.approx(0.05, abs=0.01)  # calibrated null p


def make_run(directory, n_occupations=4, analysis=GENDER, templates=("t",), extra=()):
    """A real run directory: templates x n occupations, she/he, 2 layers x 2 heads, one target.
    Head (0, 0) attends from she with 0.5 + 0.1 (i + 1) and from he with 0.5: d = 0.1 (i + 1)."""
    prompts, attention, logprobs = [], [], []
    bls = [10.0, 40.0, 60.0, 90.0, 20.0, 30.0][:n_occupations]
    pid = 0
    for t in templates:
        for i in range(n_occupations):
            for label in ("female", "male", *extra):
                prompts.append(
                    {
                        "prompt_id": pid,
                        "item_id": f"{t}|o{i}",
                        "template_id": t,
                        "text": f"x{i}",
                        "occupation": f"o{i}",
                        "occupation_bls_pct_female": bls[i],
                        "pronoun_label": label,
                    }
                )
                for layer in range(2):
                    for head in range(2):
                        weight = 0.5 + (0.1 * (i + 1) if (layer, head, label) == (0, 0, "female") else 0.0)
                        weight += 0.2 if t == "u" and (layer, head) == (1, 0) and label == "female" else 0.0
                        attention.append(
                            {
                                "prompt_id": pid,
                                "layer": layer,
                                "head": head,
                                "source": "pronoun",
                                "target": "occupation",
                                "weight": weight,
                            }
                        )
                for cand, lab, value in ((" she", "female", -2.0 + 0.01 * bls[i]), (" he", "male", -2.0)):
                    logprobs.append(
                        {
                            "prompt_id": pid,
                            "cut": "pronoun",
                            "candidate": cand,
                            "candidate_label": lab,
                            "logprob": value,
                        }
                    )
                pid += 1
    pd.DataFrame(prompts).to_csv(directory / "prompts.csv", index=False)
    pd.DataFrame(attention).to_parquet(directory / "attention.parquet", index=False)
    pd.DataFrame(logprobs).to_csv(directory / "logprobs.csv", index=False)
    manifest = {"suite": {"name": "s", "contrast": "pronoun"}, "n_prompts": pid, **RUN_KEYS}
    if analysis is not None:
        manifest["analysis"] = analysis
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return Run(directory)


def test_head_stats_by_hand(tmp_path):
    heads = stats.head_stats(make_run(tmp_path))
    assert len(heads) == 4 and set(heads.scope) == {"all"}
    h = heads[(heads.layer == 0) & (heads["head"] == 0)].iloc[0]
    d, bls = np.array([0.1, 0.2, 0.3, 0.4]), np.array([10.0, 40, 60, 90])
    assert h.difference == pytest.approx(0.25) and h.d_z == pytest.approx(d.mean() / d.std(ddof=1))
    assert h.difference_p == pytest.approx(sps.ttest_1samp(d, 0).pvalue)  # 4 occupation clusters of one item
    assert h.mean_female == pytest.approx(0.75) and h.mean_male == pytest.approx(0.5)
    assert h.n_items == 4 and h.n_clusters == "4" and h.clusters == "occupation"
    assert h.interaction_r == pytest.approx(np.corrcoef(bls, d)[0, 1])
    slope, intercept = np.polyfit(bls, d, 1)
    assert h.interaction_per10 == pytest.approx(10 * slope)
    variance, df, _ = _cr2_by_hand(bls, d, np.ones(4), np.arange(4))  # one cell per occupation
    se = np.sqrt(variance)
    assert h.interaction_p == pytest.approx(2 * sps.t.sf(abs(slope) / se, df)) and h.interaction_df == df
    assert h.interaction_per10_ci_high == pytest.approx(10 * (slope + sps.t.ppf(0.975, df) * se))
    assert "occupation has 4 levels" in h.interaction_power_note and "add levels" in h.difference_power_note
    null = heads[(heads.layer == 1) & (heads["head"] == 1)].iloc[0]
    assert null.difference == 0 and null.difference_p == 1.0 and np.isnan(null.interaction_r)
    assert np.allclose(
        heads["difference_q"], stats.bh_qvalues(heads["difference_p"].to_numpy()), equal_nan=True
    )


def test_templates_weigh_the_same_and_groups_are_scopes(tmp_path):
    analysis = dict(GENDER, clusters=["occupation", "template_id"], groups={"second": ["u"]})
    heads = stats.head_stats(make_run(tmp_path, templates=("t", "u"), analysis=analysis))
    h = heads.set_index(["scope", "layer", "head"])
    assert h.loc[("all", 1, 0), "difference"] == pytest.approx(
        0.1
    )  # 0 in t, 0.2 in u: templates weigh the same
    assert (
        h.loc[("second", 1, 0), "difference"] == pytest.approx(0.2)
        and h.loc[("second", 1, 0), "clusters"] == "occupation"
    )
    assert (
        h.loc[("all", 1, 0), "clusters"] == "occupation x template"
        and h.loc[("all", 1, 0), "n_clusters"] == "4 x 2"
    )


def test_duplicate_labels_are_refused(tmp_path):
    run = make_run(tmp_path)
    prompts = pd.read_csv(tmp_path / "prompts.csv")
    prompts.loc[prompts.pronoun_label == "male", "pronoun_label"] = "female"
    prompts.to_csv(tmp_path / "prompts.csv", index=False)
    with pytest.raises(AnalysisError, match="two prompts labelled 'female'"):
        stats.head_stats(Run(tmp_path))
    assert len(run.prompts)  # the run itself is untouched


def test_a_run_without_an_analysis_uses_two_labels_and_not_three(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert stats.head_stats(make_run(tmp_path / "a", analysis=None))["difference"].notna().all()
    three = make_run(tmp_path / "b", analysis=None, extra=("neutral",))
    assert (
        stats.head_stats(three).empty and stats.behavior(three)[0].empty
    )  # nothing declared: descriptive only
    assert len(stats.condition_means(three)) == 4 * 3  # heads x labels (no unit declared)


def test_behavior_by_hand(tmp_path):
    summary, per_unit = stats.behavior(make_run(tmp_path), n_boot=200)  # y = 0.01 x BLS exactly
    overall = summary[summary.scope == "all"].iloc[0]
    # log p(she) - log p(he) = 0.01 x BLS exactly: r = 1
    assert overall.pearson_r == pytest.approx(1.0) and overall.n_items == 4 and overall.n_units == 4
    assert overall.mean_log_ratio == pytest.approx(0.01 * np.mean([10, 40, 60, 90]))
    assert overall.comparison == "she vs he" and overall.slope_per10 == pytest.approx(0.1)
    assert overall.slope_p < 1e-12 and overall.slope_per10_ci_low == pytest.approx(0.1)  # no residual
    assert set(summary.scope) == {"all", "t"}
    assert per_unit.set_index(["scope", "unit"]).loc[("all", "o1"), "log_ratio"] == pytest.approx(0.4)


def test_behavior_sums_an_ambiguous_form(tmp_path):
    make_run(tmp_path)
    logprobs = pd.read_csv(tmp_path / "logprobs.csv")
    extra = logprobs[logprobs.candidate_label == "male"].assign(candidate=" his", logprob=-3.0)
    pd.concat([logprobs, extra]).to_csv(tmp_path / "logprobs.csv", index=False)
    summary, _ = stats.behavior(Run(tmp_path), n_boot=50)
    overall = summary[summary.scope == "all"].iloc[0]
    expected = np.mean([-2.0 + 0.01 * b - np.logaddexp(-2.0, -3.0) for b in (10, 40, 60, 90)])
    assert overall.mean_log_ratio == pytest.approx(expected) and overall.comparison == "she vs he+his"


def test_layer_stats(tmp_path):
    layers = stats.layer_stats(stats.head_stats(make_run(tmp_path)))
    first = layers[layers.layer == 0].iloc[0]
    assert (
        first.mean_difference == pytest.approx(0.25 / 2)
        and first.n_heads == 2
        and first.n_interaction_q05 == 1  # head (0, 0): d is nearly linear in BLS (r = 0.997)
    )


def test_a_layer_count_of_a_test_not_run_is_empty_not_zero():
    # source "before" is read before the contrast (a level, no difference); "pronoun" the reverse
    heads = pd.DataFrame(
        {
            "scope": "all",
            "layer": [0, 0, 0, 0],
            "head": [0, 1, 0, 1],
            "source": ["before", "before", "pronoun", "pronoun"],
            "target": "occupation",
            "difference": [np.nan, np.nan, 0.1, 0.2],
            "d_z": [np.nan, np.nan, 1.0, 2.0],
            "difference_q": [np.nan, np.nan, 0.01, 0.5],
            "interaction_r": [np.nan, np.nan, 0.1, 0.9],
            "interaction_q": [np.nan, np.nan, 0.5, 0.02],
            "level_q": [0.01, 0.03, np.nan, np.nan],
        }
    )
    layers = stats.layer_stats(heads).set_index("source")
    assert layers.loc["pronoun", ["n_difference_q05", "n_interaction_q05"]].tolist() == [1, 1]
    assert layers.loc["before", "n_level_q05"] == 2
    assert layers.loc["before", ["n_difference_q05", "n_interaction_q05"]].isna().all()
    assert pd.isna(layers.loc["pronoun", "n_level_q05"]) and layers["n_level_q05"].dtype == "Int64"


def test_planted_interaction_in_a_run_directory(tmp_path):
    """30 occupations x 4 templates, 30 heads; she attends more than he in every head (lexical),
    and in heads (0, 1), (2, 3), (4, 0) the difference grows with the covariate (interaction)."""
    rng = np.random.default_rng(5)
    n_occ, n_tpl, L, H = 30, 4, 6, 5
    bls = rng.uniform(0, 100, size=n_occ)
    planted = {(0, 1), (2, 3), (4, 0)}
    prompts, attention = [], []
    template_effect = rng.normal(0, 0.02, size=(n_tpl, L, H))
    for t in range(n_tpl):
        for o in range(n_occ):
            noise = rng.normal(0, 0.02, size=(L, H))
            for label in ("female", "male"):
                pid = len(prompts)
                prompts.append(
                    {
                        "prompt_id": pid,
                        "item_id": f"t{t}|o{o}",
                        "template_id": f"t{t}",
                        "text": "x",
                        "occupation": f"o{o}",
                        "occupation_bls_pct_female": bls[o],
                        "pronoun_label": label,
                    }
                )
                for layer, head in itertools.product(range(L), range(H)):
                    weight = 0.3
                    if label == "female":
                        weight += 0.2 + template_effect[t, layer, head] + noise[layer, head]
                        weight += 0.002 * (bls[o] - 50) if (layer, head) in planted else 0.0
                    attention.append(
                        {
                            "prompt_id": pid,
                            "layer": layer,
                            "head": head,
                            "source": "pronoun",
                            "target": "occupation",
                            "weight": weight,
                        }
                    )
    pd.DataFrame(prompts).to_csv(tmp_path / "prompts.csv", index=False)
    pd.DataFrame(attention).to_parquet(tmp_path / "attention.parquet", index=False)
    pd.DataFrame(columns=["prompt_id", "cut", "candidate", "candidate_label", "logprob"]).to_csv(
        tmp_path / "logprobs.csv", index=False
    )
    analysis = dict(GENDER, clusters=["occupation", "template_id"])
    (tmp_path / "manifest.json").write_text(
        json.dumps({"suite": {"name": "s"}, "analysis": analysis, "n_prompts": len(prompts), **RUN_KEYS})
    )
    heads = stats.head_stats(Run(tmp_path))
    found = {(r.layer, r.head) for r in heads[heads.interaction_q < 0.05].itertuples()}
    assert found == planted and (heads.difference_q < 0.05).all()
    held = stats.held_out_interaction(heads, k=3)  # chosen on half the occupations and templates
    assert held["n_same_sign"] == held["n_selected"] == 6 and held["mean_held_out_r"] > 0.5
    # the null: random heads of the same layers (27 of 30 have no interaction) do far worse
    assert held["mean_held_out_r_null"] < 0.3 and held["held_out_p"] < 0.01
    table = stats.held_out_summary(heads, None)  # the same claims as a table, each beside its null
    r_row = table[table.statistic == "mean held-out r"].iloc[0]
    top5 = stats.held_out_interaction(heads[heads.scope == "all"])  # the table's claim: the top 5
    assert (
        len(table) == 2
        and r_row.value == top5["mean_held_out_r"]
        and r_row.null == top5["mean_held_out_r_null"]
        and r_row.p == top5["held_out_p"]
    )
    assert list(stats.split_halves(np.array([5.0, 1, 3, 2]))) == [False, True, True, False]
    assert set(heads.interaction_test) == {"cluster-robust slope, CR2 by occupation x template"}


def test_template_heterogeneity_by_hand():
    """I^2 from Cochran's Q over the per-template OLS slopes, each weighted by 1 / its variance."""
    from attnprobe.stats.design import Design, template_heterogeneity

    rng = np.random.default_rng(6)
    x = np.tile(np.linspace(0, 100, 10), 3)
    templates = np.repeat(["a", "b", "c"], 10)
    y = np.where(templates == "c", 0.03, 0.01) * x + rng.normal(0, 0.2, size=30)
    cells = pd.DataFrame({"template_id": templates, "covariate": x})
    design = Design(np.arange(30), cells, [templates], 30, "template")
    slopes, variances = [], []
    for t in "abc":
        xs, ys = x[templates == t], y[templates == t]
        b, a = np.polyfit(xs, ys, 1)
        slopes.append(b)
        variances.append(((ys - a - b * xs) ** 2).sum() / 8 / ((xs - xs.mean()) ** 2).sum())
    w = 1 / np.array(variances)
    q = (w * (np.array(slopes) - (w * slopes).sum() / w.sum()) ** 2).sum()
    i2, same = template_heterogeneity(design, y[:, None], "covariate", np.array([0.02]))
    assert i2[0] == pytest.approx(max(0, (q - 2) / q)) and i2[0] > 0.9 and same[0] == 1.0


def test_ratio_test_is_the_linearised_cluster_robust_ratio():
    """Share of a total effect: sum w num / sum w den, its SE from u = num - ratio den (CR1), by hand."""
    from attnprobe.stats.inference import ratio_test

    rng = np.random.default_rng(3)
    n, G = 40, 8
    groups = np.repeat(np.arange(G), n // G).astype(str)
    den = 2 + rng.normal(size=n) + np.repeat(rng.normal(size=G), n // G)
    num = 0.3 * den + rng.normal(0, 0.2, size=n)
    w = rng.uniform(0.5, 1.5, size=n)
    out = ratio_test(num, den, w, [groups])
    W = w / w.sum()
    ratio = (W * num).sum() / (W * den).sum()
    u = W * (num - ratio * den)
    sums = np.array([u[groups == g].sum() for g in np.unique(groups)])
    se = np.sqrt(G / (G - 1) * (sums**2).sum()) / (W * den).sum()
    assert abs(out["ratio"][0] - ratio) <= 1e-12 and abs(out["se"][0] - se) <= 1e-12
    # the CI inverts the test of num - s den (Fieller), each variance part by hand: CR1 cluster sums
    A, B, c, t = (W * num).sum(), (W * den).sum(), G / (G - 1), sps.t.ppf(0.975, G - 1)
    S = [
        np.array([(W * (v - m))[groups == g].sum() for g in np.unique(groups)])
        for v, m in ((num, A), (den, B))
    ]
    Va, Vb, Cab = c * (S[0] ** 2).sum(), c * (S[1] ** 2).sum(), c * (S[0] * S[1]).sum()
    ends = np.sort(np.roots([B**2 - t**2 * Vb, -2 * (A * B - t**2 * Cab), A**2 - t**2 * Va]))
    assert np.allclose([out["ci_low"][0], out["ci_high"][0]], ends, atol=1e-10) and out["df"] == G - 1
    # a column with missing values uses the denominator on its own observations only
    holes = num.copy()
    holes[:5] = np.nan
    partial = ratio_test(holes, den, w, [groups])
    assert (
        abs(partial["ratio"][0] - (w[5:] * num[5:]).sum() / (w[5:] * den[5:]).sum()) <= 1e-12
        and partial["n"][0] == n - 5
    )


def test_ratio_test_covers_the_true_share():
    """Coverage of the 95% CI over 400 simulated clustered designs (20 clusters): 0.95 within noise."""
    from attnprobe.stats.inference import ratio_test

    rng = np.random.default_rng(0)
    hits, sims, G, per = 0, 400, 20, 5
    groups = np.repeat(np.arange(G), per).astype(str)
    for _ in range(sims):
        den = 1 + np.repeat(rng.normal(0, 0.5, G), per) + rng.normal(0, 0.5, G * per)
        num = 0.4 * den + np.repeat(rng.normal(0, 0.2, G), per) + rng.normal(0, 0.2, G * per)
        out = ratio_test(num, den, np.ones(G * per), [groups])
        hits += out["ci_low"][0] <= 0.4 <= out["ci_high"][0]
    assert abs(hits / sims - 0.95) <= 3 * np.sqrt(0.95 * 0.05 / sims)


def test_gradient_share_is_a_ratio_of_slopes_with_an_inverted_interval():
    """slope(num) / slope(den) on the covariate; SE from the slope of u = num - ratio den; the CI's
    ends are where the two-way test of the slope of num - s den reaches the critical t."""
    from attnprobe.stats.inference import slope_ratio_test

    rng = np.random.default_rng(10)
    occ, tpl = np.repeat(np.arange(20), 6), np.tile(np.arange(6), 20)
    x = rng.uniform(0, 100, 20)[occ]
    den = 0.05 * x + rng.normal(size=120)
    num = 0.4 * den + rng.normal(0, 0.3, size=120)
    w = np.ones(120)
    out = slope_ratio_test(x, num, den, w, [occ, tpl])
    ratio = np.polyfit(x, num, 1)[0] / np.polyfit(x, den, 1)[0]
    u = stats.cluster_slope_test(x, num - ratio * den, w, [occ, tpl])
    se = u["se"][0] / abs(np.polyfit(x, den, 1)[0])
    assert out["ratio"][0] == pytest.approx(ratio) and out["se"][0] == pytest.approx(se)
    critical = sps.t.ppf(0.975, stats.cluster_slope_test(x, num, w, [occ, tpl])["df"][0])
    for end in (out["ci_low"][0], out["ci_high"][0]):
        at = stats.cluster_slope_test(x, num - end * den, w, [occ, tpl])
        assert abs(at["slope"][0] / at["se"][0]) == pytest.approx(critical, abs=1e-6)
    assert out["ci_low"][0] < 0.4 < out["ci_high"][0]


def test_held_out_p_values_carry_their_floor_and_a_holm_adjustment():
    """Every p of held_out.csv is a share of random draws: printed beside its floor 1 / (1 + draws),
    and Holm-adjusted over the table's rows with each p taken at least at its floor."""
    from attnprobe.stats.held_out import held_out_summary
    from attnprobe.stats.kinds.attention import HELD_OUT_DRAWS

    rng = np.random.default_rng(3)
    heads = pd.DataFrame(
        [
            {"scope": "all", "source": "pronoun", "target": "occupation", "layer": layer, "head": head}
            for layer in range(3)
            for head in range(4)
        ]
    )
    heads["interaction_r_half_a"] = rng.normal(size=len(heads))
    heads["interaction_r_half_b"] = heads["interaction_r_half_a"] + rng.normal(0, 0.1, len(heads))
    effects = pd.DataFrame(
        [
            {
                "counterfactual": "woman",
                "n_random_draws": 20,
                "share_crossfit_random_p": 1 / 21,
                "share_crossfit_in_null_items": 0.9,
                "share_random_in_mean": 0.1,
            }
        ]
    )
    table = held_out_summary(heads, effects)
    tested = table[table["p"].notna()]
    assert list(tested["p_floor"]) == [1 / (1 + HELD_OUT_DRAWS), 1 / 21]
    assert (tested["p"] >= tested["p_floor"] - 1e-12).all()
    at_floor = np.maximum(tested["p"], tested["p_floor"]).to_numpy()
    expected = np.minimum(1, np.maximum.accumulate(np.sort(at_floor) * [2, 1]))[
        np.argsort(np.argsort(at_floor))
    ]
    np.testing.assert_allclose(tested["p_holm"], expected)
    assert (tested["p_holm"] >= tested["p"]).all()


@pytest.mark.parametrize("signal", [1.0, 0.0])
def test_the_held_out_claim_over_random_splits_can_say_yes_and_no(signal):
    """Over 100 random unit x template splits: heads whose d follows the covariate (one per layer)
    are chosen on one half and confirmed on the other (median p small); without a signal the
    median p is not small. Either outcome is possible, so the check can fail."""
    from attnprobe.schema.analysis import Analysis
    from attnprobe.stats.design import Design
    from attnprobe.stats.kinds.attention import HELD_OUT_SPLITS, held_out_splits

    rng = np.random.default_rng(5)
    n_units, templates = 40, ["t0", "t1", "t2", "t3"]
    items = pd.DataFrame(
        [
            {
                "item_id": f"{t}|o{u}",
                "template_id": t,
                "occupation": f"o{u}",
                "bls": float(rng.uniform(0, 100)),
            }
            for t in templates
            for u in range(n_units)
        ]
    )
    items["bls"] = items["occupation"].map(items.groupby("occupation")["bls"].first())
    items = items.set_index("item_id", drop=False)
    items.index.name = None
    analysis = Analysis(
        contrast="c",
        positive="a",
        negative="b",
        labels=("a", "b"),
        clusters=("occupation", "template_id"),
        covariate="bls",
        unit="occupation",
    )
    design = Design.build(items.index, items, analysis)
    layers = np.repeat([0, 1, 2], 4)  # 3 layers x 4 heads; head 0 of each layer carries the signal
    x = design.cells["bls"].to_numpy()
    cells = rng.normal(size=(len(design.cells), 12))
    cells[:, ::4] += signal * (x[:, None] - 50) / 25
    out = held_out_splits(design, cells, analysis, layers)
    assert out["held_out_splits"] == HELD_OUT_SPLITS
    if signal:
        assert out["held_out_splits_median_p"] < 0.05 and out["held_out_splits_share_p05"] > 0.5
    else:
        assert out["held_out_splits_median_p"] > 0.1 and out["held_out_splits_share_p05"] < 0.5


def test_the_two_way_variance_floor_is_reported_where_it_binds():
    """Issue 38: the df and the floor described as they are: `floored` marks the columns whose
    two-way variance fell below the larger one-way variance and was raised to it."""
    from attnprobe.stats.inference import cluster_slope_test

    rng = np.random.default_rng(3)
    unit, template = np.repeat(np.arange(12), 6), np.tile(np.arange(6), 12)
    x = rng.normal(size=12)[unit]
    y = rng.normal(size=(72, 300)) + rng.normal(size=(12, 300))[unit] + rng.normal(size=(6, 300))[template]
    w = np.ones(72)
    two = cluster_slope_test(x, y, w, [unit, template])
    larger = np.maximum(
        cluster_slope_test(x, y, w, [unit])["se"], cluster_slope_test(x, y, w, [template])["se"]
    )
    floored = two["floored"]
    assert floored.any() and (~floored).any()
    assert np.allclose(two["se"][floored], larger[floored])
    assert (two["se"][~floored] > larger[~floored] - 1e-12).all()
    assert set(two["df_is_clusters"]) <= {True, False} and (two["df"] <= 5).all()


def test_placebo_counts_bound_a_no_head_sentence():
    """Issue 38: beside "no head passes", what the same test finds with the covariate permuted across
    units: about 5% of heads at p < 0.05 when nothing is there, many more when a slope is planted,
    and the placebo's count does not move with the data's."""
    from types import SimpleNamespace

    from attnprobe.stats.inference import cluster_slope_test
    from attnprobe.stats.placebo import placebo_counts

    rng = np.random.default_rng(5)
    unit, template = np.repeat(np.arange(30), 8), np.tile(np.arange(8), 30)
    cells = pd.DataFrame(
        {"unit": unit, "template_id": template, "x": rng.uniform(0, 100, 30)[unit], "weight": 1 / 240}
    )
    design = SimpleNamespace(cells=cells, clusters=[unit.astype(str), template.astype(str)])
    noise = rng.normal(size=(240, 200)) + rng.normal(size=(30, 200))[unit]
    p_of = lambda y: cluster_slope_test(
        cells["x"].to_numpy(), y, cells["weight"].to_numpy(), design.clusters
    )["p"]
    null = placebo_counts(design, noise, p_of(noise), "unit", "x", "t_")
    assert null["t_placebo_draws"] == 40 and 3 <= null["t_placebo_p05_mean"] <= 20 and null["t_p05"] <= 25
    planted = noise + 0.05 * cells["x"].to_numpy()[:, None]
    found = placebo_counts(design, planted, p_of(planted), "unit", "x", "t_")
    assert found["t_p05"] > 150 and found["t_placebo_p05_mean"] < 30


@pytest.mark.parametrize("two_way", [False, True])
@pytest.mark.parametrize("slope", [False, True])
def test_a_share_ci_inverts_its_numerators_test(two_way, slope):
    """Issue 53: a share's CI and its numerator's p agree on whether the share is 0 (in 6 of 19 path
    rows they did not: a symmetric linearised CI beside a p of the numerator). The CI is every s the
    test of num - s den = 0 does not reject; at its ends that test's |t| is the critical value."""
    from scipy import stats as sps

    from attnprobe.stats.inference import cluster_mean_test, cluster_slope_test, ratio_test, slope_ratio_test

    rng = np.random.default_rng(3)
    units, templates = np.repeat(np.arange(12), 6), np.tile(np.arange(6), 12)
    clusters = [units, templates] if two_way else [units]
    x = np.repeat(rng.normal(size=12), 6)
    den = 3.0 + 0.8 * x + rng.normal(size=72)  # a mean and a slope both clear of 0
    # columns from no share to a clear one: some near the 5% boundary
    num = np.column_stack([s * den + rng.normal(scale=1.5, size=72) for s in np.linspace(0, 0.6, 40)])
    w = np.ones(72)
    if slope:
        share, test = (
            slope_ratio_test(x, num, den, w, clusters),
            lambda u: cluster_slope_test(x, u, w, clusters),
        )
        estimate = lambda r: r["slope"]
    else:
        share, test = ratio_test(num, den, w, clusters), lambda u: cluster_mean_test(u, w, clusters)
        estimate = lambda r: r["mean"]
    p = test(num)["p"]
    bounded = np.isfinite(share["ci_low"]) & np.isfinite(share["ci_high"])
    excludes_zero = (share["ci_low"] > 0) | (share["ci_high"] < 0)
    defined = ~np.isnan(share["ci_low"])  # NaN: two rays, no interval
    assert bounded.sum() >= 30 and ((p < 0.05) != excludes_zero)[defined].sum() == 0
    assert (p < 0.05).any() and (p >= 0.05).any()  # both sides of the boundary are checked
    assert np.all(share["ci_low"][bounded] <= share["ratio"][bounded])
    assert np.all(share["ratio"][bounded] <= share["ci_high"][bounded])
    for end in ("ci_low", "ci_high"):  # the test of num - s den at each end sits at the critical t
        for j in np.flatnonzero(bounded)[::7]:
            s = share[end][j]
            r = test(num[:, j] - s * den)
            critical = sps.t.ppf(0.975, test(num[:, j])["df"][0])
            assert abs(abs(estimate(r)[0] / r["se"][0]) - critical) < 1e-6


def test_paired_wide_is_the_pairs_grouped_and_pivoted():
    """design.paired_wide (the attention's per-head tables from the pairs' codes) against paired()'s
    long table grouped by (source, target) in the order they first come and pivoted: the same frames,
    index and dtype, the heads in (layer, head) order (a pivot's columns may come out of order where a
    value is missing); an item with one label, a missing value and a head one source lacks are left
    out as the pivot leaves them; no pair at all gives no group."""
    from attnprobe.schema.analysis import ITEM, Analysis
    from attnprobe.stats.design import paired, paired_wide

    rng = np.random.default_rng(0)
    prompts = pd.DataFrame(
        {
            "prompt_id": [f"p{i}" for i in range(10)],
            ITEM: [f"i{i // 2}" for i in range(8)] + ["i9", "i9"],
            "label": ["female", "male"] * 4 + ["female", "female"],  # i9: one label twice would raise
        }
    ).iloc[:9]  # i9 keeps one prompt: no pair
    rows = [
        (p, s, t, layer, head)
        for p in prompts["prompt_id"]
        for s, t in (("pronoun", "occupation"), ("before", "occupation"))
        for layer in (1, 0)
        for head in range(3)
        if not (s == "before" and head == 2)  # a head this source does not read
    ]
    long = pd.DataFrame(rows, columns=["prompt_id", "source", "target", "layer", "head"])
    long["weight"] = rng.random(len(long)).astype(np.float32)
    long.loc[5, "weight"] = np.nan
    analysis = Analysis(contrast="label", positive="female", negative="male")
    keys = ["source", "target", "layer", "head"]
    wide = paired_wide(long, prompts, analysis, ["source", "target"], "weight")
    pairs = paired(long, prompts, analysis, keys, "weight")
    expected = list(pairs.groupby(["source", "target"], sort=False))
    assert (
        [key for key, _ in wide]
        == [key for key, _ in expected]
        == [("before", "occupation"), ("pronoun", "occupation")]
    )
    for (_, frames), (_, group) in zip(wide, expected):
        for value in ("d", "positive", "negative"):
            pd.testing.assert_frame_equal(
                frames[value],
                group.pivot(index=ITEM, columns=["layer", "head"], values=value).sort_index(axis=1),
            )
    assert wide[0][1]["d"].shape == (4, 4) and wide[1][1]["d"].isna().sum().sum() == 1
    long["weight"] = np.nan
    assert paired_wide(long, prompts, analysis, ["source", "target"], "weight") == []
