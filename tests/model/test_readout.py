"""The linear readout (attnprobe.analyses.readout): cross-fitted ridge R2 over units, its
bootstrap CI and permutation null, on planted data (it finds a signal and does not find noise) and end
to end."""

import numpy as np
import pytest

import attnprobe
from attnprobe.stats.analyses.ridge import crossfit_r2


def test_a_planted_readout_is_found_and_noise_is_not():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(60, 30))  # 60 units, as the gender suite's occupations
    signal = X[:, :3] @ np.array([1.0, -0.5, 0.8])
    found = crossfit_r2(X, signal + 0.3 * rng.normal(size=60), permutations=99)
    assert found["r2"] > 0.6 and found["ci_low"] > 0.3 and found["p_permutation"] == 0.01
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
    equals ridge written out plainly: per fold and penalty the hat matrix from (X'X + aI)^-1 (the
    intercept's 11'/n added), the exact leave-one-out error mean ((y - Hy)_i / (1 - H_ii))^2, the best
    penalty's fit predicting the held-out units."""
    from attnprobe.stats.analyses.ridge import _fold_fits, _predict

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
            a = _plain_penalty(A, y[train])
            coef = np.linalg.solve(A.T @ A + a * np.eye(6), A.T @ yc)
            assert np.allclose(row[test], y[train].mean() + B @ coef, atol=1e-10)


def _plain_ridge(A: np.ndarray, y: np.ndarray, a: float) -> np.ndarray:
    return np.linalg.solve(A.T @ A + a * np.eye(A.shape[1]), A.T @ (y - y.mean()))


def _plain_penalty(A: np.ndarray, y: np.ndarray) -> float:
    """The penalty of the grid with the least exact leave-one-out error: the ridge with an intercept
    refitted without each row in turn, written out (no shortcut), A's columns centred as given."""
    from attnprobe.stats.analyses.ridge import ALPHAS

    n, scores = len(y), []
    s2 = np.linalg.svd(A - A.mean(0), compute_uv=False) ** 2
    for a in ALPHAS * np.mean(s2[s2 > s2.max() * 1e-12]):
        errors = []
        for i in range(n):
            keep = np.arange(n) != i
            Ak, yk = A[keep], y[keep]
            Ac = Ak - Ak.mean(0)
            coef = np.linalg.solve(Ac.T @ Ac + a * np.eye(A.shape[1]), Ac.T @ (yk - yk.mean()))
            errors.append(y[i] - yk.mean() - (A[i] - Ak.mean(0)) @ coef)
        scores.append((np.mean(np.square(errors)), a))
    return min(scores)[1]


def _plain_oof(X: np.ndarray, y: np.ndarray, folds: np.ndarray, copies: np.ndarray | None = None):
    """Out-of-fold ridge predictions written from the definition: per fold, X scaled by the training
    rows, the penalty by leave-one-out (with `copies`, each row's unit: on the training units once each, then
    scaled by rows per unit), the held-out rows predicted."""
    out = np.empty(len(y))
    for f in np.unique(folds):
        train, test = folds != f, folds == f
        mean, scale = X[train].mean(0), X[train].std(0) + 1e-8
        A, B = (X[train] - mean) / scale, (X[test] - mean) / scale
        if copies is None:
            a = _plain_penalty(A, y[train])
        else:
            once = np.unique(copies[train], return_index=True)[1]
            a = _plain_penalty(A[once], y[train][once]) * train.sum() / len(once)
        out[test] = y[train].mean() + B @ _plain_ridge(A, y[train], a)
    return out


def test_the_readout_point_is_a_median_over_fold_draws_and_its_ci_refits_every_resample():
    """crossfit_r2 recomputed plainly with the same draws: R2 the median over fold assignments; the
    CI the percentiles of R2 over bootstrap resamples of the units, each cross-fitted afresh (a unit
    drawn twice in one fold), moved so their median is the point; not a resample of fixed predictions."""
    from attnprobe.stats.analyses.ridge import crossfit_r2

    rng = np.random.default_rng(7)
    X = rng.normal(size=(16, 5))
    y = X[:, 0] + 0.8 * rng.normal(size=16)
    found = crossfit_r2(X, y, folds=4, permutations=3, assignments=5, refits=40, seed=2)
    draws = np.random.default_rng(2)
    for _ in range(3):
        draws.permutation(y)
    r2 = lambda t, p: 1 - np.sum((t - p) ** 2) / np.sum((t - t.mean()) ** 2)
    assignments = [draws.permutation(np.arange(16) % 4) for _ in range(5)]
    point = np.median([r2(y, _plain_oof(X, y, f)) for f in assignments])
    assert found["r2"] == pytest.approx(point, abs=1e-8)
    refits = []
    for _ in range(40):
        drawn = draws.integers(0, 16, 16)
        units, unit_of = np.unique(drawn, return_inverse=True)
        fold = draws.permutation(np.arange(len(units)) % 4)[unit_of]
        refits.append(r2(y[drawn], _plain_oof(X[drawn], y[drawn], fold, copies=drawn)))
    low, high = point + np.percentile(refits, [2.5, 97.5]) - np.median(refits)
    assert (found["ci_low"], found["ci_high"]) == pytest.approx((low, high), abs=1e-8)
    assert low < point < high


def test_the_penalty_is_chosen_by_the_data_where_the_rows_can_be_fitted_exactly():
    """More features than training rows (SmolLM2's stream: 576 for 54 units): a criterion that leaves
    the intercept's leverage out (round 6's GCV) falls to 0 at the least penalty whatever the data.
    The closed form's choice equals refitting without each row in turn; the signal's is not the least
    (noise may take any: every penalty predicts it about as badly)."""
    from attnprobe.stats.analyses.ridge import ALPHAS, _basis, _loo_penalties

    rng = np.random.default_rng(3)
    X = rng.normal(size=(30, 120))
    Z = (X - X.mean(0)) / X.std(0)
    U, S, _ = _basis(Z, Z[:0])
    outcomes = [rng.normal(size=30), Z[:, :3].sum(1) + 0.1 * rng.normal(size=30)]  # noise, a signal
    chosen = _loo_penalties(U, S, np.stack([y - y.mean() for y in outcomes]))
    assert chosen == pytest.approx([_plain_penalty(Z, y) for y in outcomes], rel=1e-9)
    assert chosen[1] / np.mean(S**2) > ALPHAS[0], chosen
