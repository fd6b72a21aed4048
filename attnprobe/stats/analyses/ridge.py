"""Ridge readouts of a covariate, one rule wherever attnprobe reads one: features centred and scaled by
the training rows, the penalty chosen on them by exact leave-one-out error (closed form, the
intercept's leverage counted) over ALPHAS times the mean squared singular value. The readout per
layer (analyses.readout) cross-fits it over units with a bootstrap CI and a permutation null
(crossfit_r2); the check after an erasure (edits.sweep.erased) fits it once on rows the edit was not
fitted on (ridge_predict).

Shapes: N rows (units), E features, K folds, P outcomes (the covariate and its permutations).
"""

from __future__ import annotations

import numpy as np

ALPHAS = np.logspace(-3, 5, 17)  # ridge penalties tried, relative to the mean squared singular value
ASSIGNMENTS = 20  # fold assignments; the reported R2 is the median over them
REFITS = 200  # bootstrap resamples of the units for the CI, each cross-fitted afresh


def _basis(train: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What ridge on the training rows A (n, E) needs, from the n x n Gram matrix (n << E: faster
    than the SVD of A): A = U S V' (singular values above 1e-6 of the largest), and the held-out
    rows B in that basis, T = B V (n_test, r)."""
    values, U = np.linalg.eigh(train @ train.T)
    S, keep = _singular(values)
    U, S = U[:, keep], S[keep]
    return U, S, (test @ train.T) @ U / S


def _singular(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(singular values, kept) from a Gram matrix's eigenvalues (last axis, stacked or not): a value
    not above 1e-12 of the largest is no component (0, not kept), none where the rows do not vary."""
    keep = values > values.max(-1, keepdims=True, initial=0.0) * 1e-12
    return np.sqrt(np.where(keep, values, 0)), keep


def _fold_fits(X: np.ndarray, folds: np.ndarray):
    """Per fold: the held-out mask and what predicting any y needs: U, S of the scaled training X and
    the scaled held-out X in its basis (_basis), X centred and scaled by the training rows."""
    fits = []
    for f in np.unique(folds):
        test = folds == f
        train = ~test
        mean, scale = X[train].mean(0), X[train].std(0) + 1e-8
        fits.append((test, *_basis((X[train] - mean) / scale, (X[test] - mean) / scale)))
    return fits


def _loo_penalties(U: np.ndarray, S: np.ndarray, centred: np.ndarray) -> np.ndarray:
    """Per row of `centred` (..., B, n) training outcomes: the penalty of ALPHAS (times the mean
    squared singular value) with the least exact leave-one-out error, the first of equal minima;
    (..., B). With the SVD X = U S V' of the centred rows, the fit's hat matrix is 11'/n + U diag(h) U'
    with h = S^2 / (S^2 + a): row i's left-out residual is its residual / (1 - H_ii), H_ii =
    1/n + sum_j h_j U_ij^2 (the intercept's leverage counted: without it the criterion falls to 0
    wherever the rows can be fitted exactly, E >= n, and picks the least penalty whatever the data).
    Stacked fits (leading axes): a singular value of 0 is no component."""
    n = centred.shape[-1]
    S2 = S**2
    alphas = ALPHAS * (S2.sum(-1) / (S2 > 0).sum(-1))[..., None]  # (..., A)
    shrink = S2[..., None, :] / (S2[..., None, :] + alphas[..., None])  # (..., A, r)
    if U.ndim == 2:  # one fit, many outcomes: the error as a quadratic form, |D M y|^2 = y' Q y
        H = 1 / n + (U * shrink[:, None, :]) @ U.T  # (A, n, n)
        W = (np.eye(n) - H) / (1 - np.diagonal(H, axis1=1, axis2=2))[:, :, None]  # D M: left-out residuals
        error = ((centred @ (W.swapaxes(1, 2) @ W)) * centred).sum(-1).T / n  # (B, A)
    else:  # stacked fits, one outcome each: the residuals themselves
        leverage = 1 / n + (U**2) @ shrink.swapaxes(-1, -2)  # (..., n, A)
        fitted = (shrink[..., None, :, :] * (centred @ U)[..., None, :]) @ U.swapaxes(-1, -2)[..., None, :, :]
        left_out = (centred[..., None, :] - fitted) / (1 - leverage.swapaxes(-1, -2))[..., None, :, :]
        error = (left_out**2).mean(-1)  # (..., B, A)
    best = np.argmin(error, axis=-1)  # (..., B)
    return np.take_along_axis(alphas, best, axis=-1)


def _fitted(U: np.ndarray, S: np.ndarray, T: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """(P, n_test) ridge predictions of each row of Y (P, n) training outcomes, in the training rows'
    basis (_basis: U, S, the held-out rows T), the penalty of each outcome chosen by leave-one-out."""
    offset = Y.mean(1, keepdims=True)
    centred = Y - offset
    best = _loo_penalties(U, S, centred)  # (P,)
    coef = S / (S**2 + best[:, None]) * (centred @ U)  # (P, r): in the V basis
    return offset + coef @ T.T


def _predict(fits, Y: np.ndarray) -> np.ndarray:
    """Out-of-fold ridge predictions of each row of Y (P, N): P outcomes (the covariate and its
    permutations) at once, the penalty of each fold and outcome chosen by leave-one-out on the
    fold's training units."""
    out = np.empty(Y.shape)
    for test, U, S, T in fits:
        out[:, test] = _fitted(U, S, T, Y[:, ~test])
    return out


def ridge_predict(train: np.ndarray, x: np.ndarray, test: np.ndarray) -> np.ndarray:
    """The covariate x (n,) read on the `test` rows (m, E) by the ridge of x on the `train` rows
    (n, E), by the module's rule; features that do not vary on the training rows (a zeroed site)
    read x's mean."""
    mean, scale = train.mean(0), train.std(0) + 1e-8
    U, S, T = _basis((train - mean) / scale, (test - mean) / scale)
    if not len(S):
        return np.full(len(test), x.mean())
    return _fitted(U, S, T, np.asarray(x, dtype=float)[None])[0]


def r_squared(y: np.ndarray, predicted: np.ndarray) -> np.ndarray:
    """1 - SSE / SST along the last axis (one R2 per row of a 2-D y)."""
    sst = np.sum((y - y.mean(-1, keepdims=True)) ** 2, axis=-1)
    return 1 - np.sum((y - predicted) ** 2, axis=-1) / sst


def _assignments(n: int, folds: int, count: int, rng) -> list[np.ndarray]:
    """`count` random assignments of n units to `folds` folds of near-equal size."""
    return [rng.permutation(np.arange(n) % folds) for _ in range(count)]


def median_r2(X: np.ndarray, Y: np.ndarray, assignments: list[np.ndarray]) -> np.ndarray:
    """Per row of Y (P, N): the median over fold assignments of the held-out R2."""
    return np.median([r_squared(Y, _predict(_fold_fits(X, fold), Y)) for fold in assignments], axis=0)


def refit_r2s(X: np.ndarray, y: np.ndarray, folds: int, refits: int, rng) -> np.ndarray:
    """Held-out R2 of `refits` bootstrap resamples of the units, each cross-fitted afresh on one random
    fold assignment (a unit drawn twice keeps both copies in one fold, so none predicts itself);
    resamples whose covariate does not vary are skipped. Every fold of every resample is fitted in
    stacked batches (_refit_predictions)."""
    resamples, tasks = [], []  # tasks: (resample, training rows, held-out rows)
    for _ in range(refits):
        drawn = rng.integers(0, len(y), len(y))
        units, unit_of = np.unique(drawn, return_inverse=True)
        if np.ptp(y[drawn]) == 0 or len(units) < 2:
            continue
        fold = rng.permutation(np.arange(len(units)) % min(folds, len(units)))[unit_of]
        tasks += [(len(resamples), fold != f, fold == f) for f in np.unique(fold)]
        resamples.append(drawn)
    if not resamples:
        return np.array([])
    drawn = np.stack(resamples)  # (R, N)
    which, train, test = (np.stack(column) for column in zip(*tasks))  # (F,), (F, N), (F, N)
    predicted = np.empty(drawn.shape)
    step = max(1, 2**24 // (X.shape[0] * X.shape[1]))  # tasks per batch: about 128 MB of states
    for start in range(0, len(which), step):
        part = slice(start, start + step)
        fitted = _refit_predictions(X, y, drawn[which[part]], train[part])
        for r, held, values in zip(which[part], test[part], fitted):
            predicted[r, held] = values[held]
    return r_squared(y[drawn], predicted)


def _unit_penalties(gram: np.ndarray, y: np.ndarray, copies: np.ndarray) -> np.ndarray:
    """(F,) each fold's penalty, chosen by leave-one-out on its training units once each (`copies` (F,
    units) > 0; gram (F, units, units)), the folds with as many training units fitted as one stack."""
    best = np.empty(len(gram))
    sizes = (copies > 0).sum(1)
    for size in np.unique(sizes):
        fits = np.flatnonzero(sizes == size)
        held = np.nonzero(copies[fits] > 0)[1].reshape(len(fits), size)  # (G, size) unit indices
        sub = gram[fits[:, None, None], held[:, :, None], held[:, None, :]]  # (G, size, size)
        # the units' states centred on their own mean (as leave-one-out's fit with an intercept has them)
        sub = sub - sub.mean(1, keepdims=True) - sub.mean(2, keepdims=True) + sub.mean((1, 2), keepdims=True)
        values, U = np.linalg.eigh(sub)
        S = _singular(values)[0]
        centred = y[held] - y[held].mean(1, keepdims=True)
        best[fits] = _loo_penalties(U, S, centred[:, None])[:, 0]
    return best


def _refit_predictions(X: np.ndarray, y: np.ndarray, drawn, train) -> np.ndarray:
    """(F, N) predictions of every row of F resampled folds (rows X[drawn] (F, N, E)), each fold's ridge
    fitted on its `train` rows: X centred and scaled by them, the penalty chosen by leave-one-out on the
    training units once each (copies would make leave-one-out find each held-out row's twin in training
    and choose almost no penalty), scaled by copies per unit so data and penalty keep their balance. The
    fit's prediction of row i is the kernel form of ridge, offset + G[i, train] (G[train, train] + a
    I)^-1 y_c with G = Z Z' (exact: G's null directions on the training rows are orthogonal to every
    row's G[i, train])."""
    F, units = len(drawn), np.arange(len(X))
    copies = ((drawn[..., None] == units) & train[..., None]).sum(1)  # (F, units): training copies
    n = train.sum(1)  # (F,)
    # X centred and scaled by the training rows (copies counted), on the units (a row is its unit's):
    # G = (X - m) W (X - m)' with W = diag(1 / (s + 1e-8)^2), expanded so that the one product over
    # the model's width is a single matrix product; X is shifted by its column means first, so the
    # expansion's terms stay of the size of the spread
    X = X - X.mean(0)
    mean = copies @ X / n[:, None]  # (F, E)
    w = 1 / (np.sqrt(np.maximum(copies @ X**2 / n[:, None] - mean**2, 0)) + 1e-8) ** 2  # (F, E)
    weighted = (X[None] * w[:, None, :]).reshape(F * len(units), -1)
    a = (w * mean) @ X.T  # (F, units)
    gram = (weighted @ X.T).reshape(F, len(units), len(units)) - a[:, :, None] - a[:, None, :]
    gram += (w * mean**2).sum(1)[:, None, None]
    G = gram[np.arange(F)[:, None, None], drawn[:, :, None], drawn[:, None, :]]  # (F, N, N)
    yd = y[drawn]
    best = _unit_penalties(gram, y, copies) * n / (copies > 0).sum(1)  # (F,)
    offset = (yd * train).sum(1) / n
    # the other rows' rows and columns zeroed, a on their diagonal: their dual coefficient is 0
    kernel = G * train[:, :, None] * train[:, None, :] + best[:, None, None] * np.eye(G.shape[1])
    dual = np.linalg.solve(kernel, np.where(train, yd - offset[:, None], 0)[..., None])  # (F, N, 1)
    return offset[:, None] + ((G * train[:, None, :]) @ dual)[..., 0]


def median_centred(draws: np.ndarray, point: float, level: float = 0.95) -> tuple[float, float]:
    """The draws' central `level` percentiles moved so that their median sits on the point. A
    refitted resample holds about 63% distinct units, so its fit predicts worse than the full one:
    its R2 sits below the point by a learning-curve shift that is not uncertainty about the point
    (Efron's bias-corrected percentiles overcorrect it where nearly every draw is below: on SmolLM2's
    layer 18 they gave an interval above its point)."""
    if not len(draws):
        return np.nan, np.nan
    low, middle, high = np.percentile(draws, [50 - 50 * level, 50, 50 + 50 * level])
    return float(point + low - middle), float(point + high - middle)


def crossfit_r2(
    X: np.ndarray,
    y: np.ndarray,
    folds: int = 10,
    permutations: int = 200,
    seed: int = 0,
    assignments: int = ASSIGNMENTS,
    refits: int = REFITS,
) -> dict:
    """Held-out R2 of a ridge readout of y (N,) from X (N, E): the median over `assignments` fold
    assignments, its CI from `refits` refitted bootstrap resamples and its permutation p (the module
    doc)."""
    rng = np.random.default_rng(seed)
    X = np.asarray(X, dtype=np.float64)
    folds = min(folds, len(y))
    # row 0 the covariate, then its permutations: every row through the same assignments and arithmetic
    Y = np.stack([y] + [rng.permutation(y) for _ in range(permutations)])
    r2s = median_r2(X, Y, _assignments(len(y), folds, assignments, rng))
    r2, null = r2s[0], r2s[1:]
    low, high = median_centred(refit_r2s(X, y, folds, refits, rng), r2)
    return {
        "r2": float(r2),
        "ci_low": low,
        "ci_high": high,
        "p_permutation": float((1 + (null >= r2).sum()) / (1 + len(null))) if permutations else np.nan,
        "null_r2_median": float(np.median(null)) if permutations else np.nan,
        "null_r2_q95": float(np.quantile(null, 0.95)) if permutations else np.nan,
    }
