"""Statistics against hand-computed values on small synthetic run directories."""

import json

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from attnprobe import stats
from attnprobe import Run


def test_bh_on_a_known_vector():
    p = np.array([0.01, 0.04, 0.03, 0.005])
    # sorted 0.005, 0.01, 0.03, 0.04 -> x4/rank: 0.02, 0.02, 0.04, 0.04 (already monotone)
    assert np.allclose(stats.bh_qvalues(p), [0.02, 0.04, 0.04, 0.02])
    p = np.array([0.04, 0.041, 0.2, 0.001])  # needs the running minimum from the top: 0.004, 0.0547, 0.0547, 0.2
    assert np.allclose(stats.bh_qvalues(p), [0.041 * 4 / 3, 0.041 * 4 / 3, 0.2, 0.004])
    rng = np.random.default_rng(1)
    p = rng.uniform(size=50)
    assert np.allclose(stats.bh_qvalues(p), sps.false_discovery_control(p))


def test_exact_sign_flip_pvalues():
    # 3 items: 8 sign patterns; |sum| of 1, 2, 3 reaches 6 only with all + or all -: p = 2/8
    assert stats.sign_flip_pvalues(np.array([1.0, 2.0, 3.0])) == pytest.approx([0.25])
    # |sum| >= 2 for [1, -2, 3]: patterns with |s| in {6, 4, 2, 2, 4, 6, 0, 0} -> 6 of 8
    assert stats.sign_flip_pvalues(np.array([1.0, -2.0, 3.0])) == pytest.approx([0.75])
    # clusters: items (1, 1) form one unit of sum 2; units 2, 2, 3 -> |sum| 7 only twice of 8
    assert stats.sign_flip_pvalues(np.array([1.0, 1.0, 2.0, 3.0]), clusters=np.array(["a", "a", "b", "c"])) == pytest.approx([0.25])


def test_monte_carlo_sign_flip_is_calibrated_and_detects_effects():
    rng = np.random.default_rng(0)
    null = rng.normal(size=(40, 300))  # 300 null tests of 40 items
    p = stats.sign_flip_pvalues(null, n_perm=500)
    assert 0.02 <= (p < 0.05).mean() <= 0.09  # about 5% false positives
    assert stats.sign_flip_pvalues(rng.normal(1.0, 1.0, size=40), n_perm=500)[0] == pytest.approx(1 / 501)


def test_bootstrap_ci_coverage_on_simulated_data():
    rng = np.random.default_rng(0)
    samples = rng.normal(0.3, 1.0, size=(40, 400))  # 400 simulated studies, 40 items each
    low, high = stats.bootstrap_mean_ci(samples, n_boot=1000)
    coverage = ((low <= 0.3) & (0.3 <= high)).mean()
    assert 0.90 <= coverage <= 0.98  # percentile bootstrap at n = 40 slightly under-covers 95%


def test_correlation_matches_scipy():
    rng = np.random.default_rng(3)
    x = rng.normal(size=60)
    y = 0.5 * x + rng.normal(size=60)
    result = stats.correlation_with_ci(x, y, n_boot=500)
    r, p = sps.pearsonr(x, y)
    assert result["pearson_r"] == pytest.approx(r) and result["pearson_p"] == pytest.approx(p)
    assert result["spearman_r"] == pytest.approx(sps.spearmanr(x, y).statistic)
    assert result["pearson_ci_low"] < r < result["pearson_ci_high"]


def make_run(directory, n_occupations=4):
    """A real run directory: 1 template, n occupations, she/he, 2 layers x 2 heads, one target."""
    prompts, attention, logprobs = [], [], []
    bls = [10.0, 40.0, 60.0, 90.0, 20.0, 30.0][:n_occupations]
    pid = 0
    for i in range(n_occupations):
        for label in ("female", "male"):
            prompts.append({"prompt_id": pid, "item_id": f"t|o{i}", "template_id": "t", "text": f"x{i}",
                            "occupation": f"o{i}", "occupation_bls_pct_female": bls[i], "pronoun_label": label})
            for layer in range(2):
                for head in range(2):
                    # head (0, 0): female 0.5 + 0.1 (i + 1), male 0.5 -> d = 0.1, 0.2, 0.3, 0.4
                    weight = 0.5 + (0.1 * (i + 1) if (layer, head, label) == (0, 0, "female") else 0.0)
                    attention.append({"prompt_id": pid, "layer": layer, "head": head, "source": "pronoun",
                                      "target": "occupation", "weight": weight})
            for cand, lab, value in ((" she", "female", -2.0 + 0.01 * bls[i]), (" he", "male", -2.0)):
                logprobs.append({"prompt_id": pid, "cut": "pronoun", "candidate": cand, "candidate_label": lab, "logprob": value})
            pid += 1
    pd.DataFrame(prompts).to_csv(directory / "prompts.csv", index=False)
    pd.DataFrame(attention).to_parquet(directory / "attention.parquet", index=False)
    pd.DataFrame(logprobs).to_csv(directory / "logprobs.csv", index=False)
    (directory / "manifest.json").write_text(json.dumps({"suite": {"name": "s", "contrast": "pronoun"}, "n_prompts": pid}))
    return Run(directory)


def test_head_stats_by_hand(tmp_path):
    heads = stats.head_stats(make_run(tmp_path), n_boot=200)
    assert len(heads) == 4
    h = heads[(heads.layer == 0) & (heads["head"] == 0)].iloc[0]
    d = np.array([0.1, 0.2, 0.3, 0.4])
    assert h.effect == pytest.approx(0.25) and h.d_z == pytest.approx(d.mean() / d.std(ddof=1))
    assert h.share_positive == 1.0 and h.n_items == 4 and h.n_clusters == 4
    assert h.p == pytest.approx(2 / 16)  # exact: 4 clusters, all positive
    assert h.mean_female == pytest.approx(0.75) and h.mean_male == pytest.approx(0.5)
    assert h.bls_pearson_r == pytest.approx(np.corrcoef([10, 40, 60, 90], d)[0, 1])
    assert h.power_note.startswith("fewer than 30 items")
    null = heads[(heads.layer == 1) & (heads["head"] == 1)].iloc[0]
    assert null.effect == 0 and null.p == 1.0 and null.share_positive == 0
    assert np.allclose(heads["q"], stats.bh_qvalues(heads["p"].to_numpy()))


def test_behavior_by_hand(tmp_path):
    summary, per_occupation = stats.behavior(make_run(tmp_path), n_boot=200)
    overall = summary[summary.scope == "all"].iloc[0]
    # log p(she) - log p(he) = 0.01 x BLS exactly: r = 1
    assert overall.pearson_r == pytest.approx(1.0) and overall.n_items == 4 and overall.n_occupations == 4
    assert overall.mean_log_ratio == pytest.approx(0.01 * np.mean([10, 40, 60, 90]))
    assert set(summary.scope) == {"all", "t"}
    assert per_occupation.set_index(["template_id", "occupation"]).loc[("all", "o1"), "log_ratio"] == pytest.approx(0.4)


def test_layer_stats(tmp_path):
    layers = stats.layer_stats(stats.head_stats(make_run(tmp_path), n_boot=100))
    first = layers[layers.layer == 0].iloc[0]
    assert first.mean_effect == pytest.approx(0.25 / 2) and first.n_heads == 2 and first.n_significant == 0
