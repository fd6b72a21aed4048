"""The linear readout (attnprobe.edits.analyses.readout): cross-fitted ridge R2 over units, its
bootstrap CI and permutation null, on planted data (it finds a signal and does not find noise) and end
to end."""

import numpy as np

import attnprobe
from attnprobe.edits.analyses.readout import crossfit_r2


def test_a_planted_readout_is_found_and_noise_is_not():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(60, 30))  # 60 units, as the gender suite's occupations
    signal = X[:, :3] @ np.array([1.0, -0.5, 0.8])
    found = crossfit_r2(X, signal + 0.3 * rng.normal(size=60), permutations=99)
    assert found["r2"] > 0.6 and found["ci_low"] > 0.5 and found["p_permutation"] == 0.01
    noise = crossfit_r2(X, rng.normal(size=60), permutations=99)
    assert noise["r2"] < noise["null_r2_q95"] and noise["p_permutation"] > 0.05 and noise["ci_low"] < 0


def test_linear_readout_end_to_end_per_layer(tiny_llama_dir, tmp_path):
    from conftest import edit_suite

    table = attnprobe.linear_readout(str(tiny_llama_dir), edit_suite(tmp_path), folds=4, permutations=19)
    assert list(table["layer"]) == [0, 1, 2] and (table["n_units"] == 12).all()
    assert table[["r2", "ci_low", "ci_high", "p_permutation"]].notna().all().all()
    assert (table["ci_low"] <= table["ci_high"]).all() and table["p_permutation"].between(0.05, 1).all()


def test_holm_adjusts_over_the_layers():
    from attnprobe.stats.inference import holm

    p = np.array([0.01, 0.04, 0.03, 0.5])
    assert np.allclose(holm(p), [0.04, 0.09, 0.09, 0.5])  # 4 x 0.01; max(3 x 0.03, .); 2 x 0.04 -> 0.09


def test_the_batched_ridge_equals_the_normal_equations_outcome_by_outcome():
    """Every row of the batched out-of-fold predictions (the covariate and its permutations at once)
    equals ridge written out plainly: per fold and penalty the hat matrix from (X'X + aI)^-1, GCV
    = mean squared residual / (1 - tr(H) / n)^2, the best penalty's fit predicting the held-out units."""
    from attnprobe.edits.analyses.readout import ALPHAS, _fold_fits, _predict

    rng = np.random.default_rng(5)
    X, folds = rng.normal(size=(14, 6)), np.arange(14) % 4
    Y = rng.normal(size=(5, 14))
    batched = _predict(_fold_fits(X, folds), Y)
    for y, row in zip(Y, batched):
        for f in range(4):
            train, test = folds != f, folds == f
            mean, scale = X[train].mean(0), X[train].std(0) + 1e-8
            A, B = (X[train] - mean) / scale, (X[test] - mean) / scale
            yc = y[train] - y[train].mean()
            scores = []
            for a in ALPHAS * np.mean(np.linalg.svd(A, compute_uv=False) ** 2):
                H = A @ np.linalg.solve(A.T @ A + a * np.eye(6), A.T)
                scores.append((np.mean((yc - H @ yc) ** 2) / (1 - np.trace(H) / len(yc)) ** 2, a))
            a = min(scores)[1]
            coef = np.linalg.solve(A.T @ A + a * np.eye(6), A.T @ yc)
            assert np.allclose(row[test], y[train].mean() + B @ coef, atol=1e-10)
