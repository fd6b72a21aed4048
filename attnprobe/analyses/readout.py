"""Where a covariate becomes linearly readable: a cross-fitted ridge probe on the residual stream.

For a suite whose covariate belongs to a unit (the occupation and its BLS share of women), take the
residual stream after every layer (index 0: the embeddings; the last index is after the final norm,
as transformers returns it) at the last token of the unit's span: per unit, the mean over its
templates of the mean over that template's prompts, so every template weighs the same (templates
whose text up to the span is the same share one forward pass, not one weight). One vector per unit
and layer, X (n units, E). Per layer:

  ridge regression of the covariate on X, cross-fitted over units: K folds; in each, X is centred
  and scaled by the training units, the penalty chosen on them by generalised cross-validation over
  a grid, and the held-out units predicted. Held-out R2 = 1 - SSE / SST of the out-of-fold
  predictions (SST about the mean of all units; R2 <= 0 means no linear readout). The fold draw
  moves R2 (on SmolLM2's embeddings from 0.13 to 0.44), so R2 is the median over ASSIGNMENTS
  random fold assignments.

The unit of inference is the unit (an occupation). CI: the 2.5th and 97.5th percentiles of R2 over
REFITS bootstrap resamples of the units, each cross-fitted afresh (penalty chosen again, a new fold
draw), so it carries the fitting's and the fold draw's variance, moved so that the draws' median sits
on the point (median_centred: a resample's refit, on about 63% distinct units, predicts worse than
the full fit).
p_permutation tests "no better than a
readout of a covariate permuted across units", the same median over the same fold assignments for
each of `permutations` permutations; that null centres below 0 (null_r2_median: ridge on noise
predicts worse than the mean), so p_permutation is not a test of R2 > 0: read ci_low for that.
Holm's adjustment over the layers (999 draws: a floor of 0.001, 0.03 after adjusting for 31 layers).
Units whose span ends in the same token (hygienist and receptionist: `ist`) have the same
embedding at layer 0 (identical states where positions are rotary) and similar ones early on;
shared_last_token names them. Shapes: N units, E model width, K folds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..stats.inference import holm

ALPHAS = np.logspace(-3, 5, 17)  # ridge penalties tried, relative to the mean squared singular value
ASSIGNMENTS = 20  # fold assignments; the reported R2 is the median over them
REFITS = 200  # bootstrap resamples of the units for the CI, each cross-fitted afresh


def _basis(train: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What ridge on the training rows A (n, E) needs, from the n x n Gram matrix (n << E: faster
    than the SVD of A): A = U S V' (singular values above 1e-6 of the largest), and the held-out
    rows B in that basis, T = B V (n_test, r)."""
    values, U = np.linalg.eigh(train @ train.T)
    keep = values > values.max() * 1e-12
    U, S = U[:, keep], np.sqrt(values[keep])
    return U, S, (test @ train.T) @ U / S


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


def _gcv_penalties(U: np.ndarray, S: np.ndarray, centred: np.ndarray, n=None) -> np.ndarray:
    """Per row of `centred` (..., B, n) training outcomes: the penalty of ALPHAS (times the mean
    squared singular value) with the least GCV, the first of equal minima; (..., B). With the SVD
    X = U S V', the fit's hat matrix has eigenvalues h = S^2 / (S^2 + a) on U's columns, so the
    residual's squared norm is |y|^2 - sum_j (2 h_j - h_j^2) (U'y)_j^2 (y is centred, U's columns
    orthonormal). Stacked fits (leading axes) may pad: a singular value of 0 is no component, and
    `n` (...,) counts each fit's rows (default: centred's last axis)."""
    n = np.asarray(centred.shape[-1] if n is None else n, dtype=float)[..., None, None]
    S2 = S**2
    alphas = ALPHAS * (S2.sum(-1) / (S2 > 0).sum(-1))[..., None]  # (..., A)
    shrink = S2[..., None, :] / (S2[..., None, :] + alphas[..., None])  # (..., A, r)
    dof = (1 - shrink.sum(-1)[..., None, :] / n) ** 2  # (..., 1, A): GCV's denominator
    Uy2 = (centred @ U) ** 2  # (..., B, r)
    residual = (centred**2).sum(-1, keepdims=True) - Uy2 @ (2 * shrink - shrink**2).swapaxes(-1, -2)
    best = np.argmin(residual / n / dof, axis=-1)  # (..., B)
    return np.take_along_axis(alphas, best, axis=-1)


def _predict(fits, Y: np.ndarray) -> np.ndarray:
    """Out-of-fold ridge predictions of each row of Y (P, N): P outcomes (the covariate and its
    permutations) at once, the penalty of each fold and outcome chosen by GCV on the fold's training
    units."""
    out = np.empty(Y.shape)
    for test, U, S, T in fits:
        y_train = Y[:, ~test]  # (P, n)
        offset = y_train.mean(1, keepdims=True)
        centred = y_train - offset
        best = _gcv_penalties(U, S, centred)  # (P,)
        coef = S / (S**2 + best[:, None]) * (centred @ U)  # (P, r): in the V basis
        out[:, test] = offset + coef @ T.T
    return out


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
    """(F,) each fold's penalty, chosen by GCV on its training units once each (`copies` (F, units)
    > 0; gram (F, units, units)), the folds with as many training units fitted as one stack."""
    best = np.empty(len(gram))
    sizes = (copies > 0).sum(1)
    for size in np.unique(sizes):
        fits = np.flatnonzero(sizes == size)
        held = np.nonzero(copies[fits] > 0)[1].reshape(len(fits), size)  # (G, size) unit indices
        values, U = np.linalg.eigh(gram[fits[:, None, None], held[:, :, None], held[:, None, :]])
        keep = values > values.max(-1, keepdims=True) * 1e-12  # as _basis
        S = np.sqrt(np.where(keep, values, 0))
        centred = y[held] - y[held].mean(1, keepdims=True)
        best[fits] = _gcv_penalties(U, S, centred[:, None])[:, 0]
    return best


def _refit_predictions(X: np.ndarray, y: np.ndarray, drawn, train) -> np.ndarray:
    """(F, N) predictions of every row of F resampled folds (rows X[drawn] (F, N, E)), each fold's
    ridge fitted on its `train` rows: X centred and scaled by them, the penalty chosen by GCV on the
    training units once each (copies would make GCV, a leave-one-out shortcut, find each
    held-out row's twin in training and choose almost no penalty), scaled by copies per unit so data
    and penalty keep their balance. The fit's prediction of row i is the kernel form of ridge,
    offset + G[i, train] (G[train, train] + a I)^-1 y_c with G = Z Z' (exact: G's null directions on
    the training rows are orthogonal to every row's G[i, train])."""
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


@torch.no_grad()
def unit_states(pm, suite, span: str) -> tuple[list, np.ndarray, np.ndarray, list[str]]:
    """(units, covariate per unit, (L + 1, N, E) states, each unit's last token): the residual stream
    after every layer at the last token of `span`, per unit the mean over templates of each
    template's mean (each template weighing the same)."""
    from ..run.plan import encode_prompts
    from ..schema.analysis import value_of

    analysis = suite.analysis
    prompts = [p for p in suite.prompts if span in p.spans and value_of(p, analysis.covariate) is not None]
    encoded = encode_prompts(suite, prompts, pm.tokenizer, pm.info.max_positions)
    prefixes = {}  # the prefix up to the span's last token decides the state (causal): once each
    for e in encoded:
        end = e.spans[span][1]
        key = tuple(e.ids[:end])
        prefixes.setdefault(key, []).append(e.prompt)
    keys = sorted(prefixes, key=len)
    states = _last_states(pm, keys)  # (L + 1, prefixes, E)
    rows = pd.DataFrame(
        [
            (
                i,
                str(value_of(p, analysis.unit)),
                p.template_id,
                float(value_of(p, analysis.covariate)),
                key[-1],
            )
            for i, key in enumerate(keys)
            for p in prefixes[key]
        ],
        columns=["row", "unit", "template", "covariate", "last"],
    )
    # each template's mean over its prompts, then the unit's mean over its templates
    cells = rows.groupby(["unit", "template"])["row"].apply(list)
    units = sorted(rows["unit"].unique())
    X = np.stack(
        [np.mean([states[:, r].mean(1) for r in cells[u]], axis=0) for u in units], axis=1
    )  # (L + 1, N, E)
    y = rows.groupby("unit")["covariate"].first().reindex(units).to_numpy()
    last = rows.groupby("unit")["last"].agg(lambda t: t.mode().iloc[0]).reindex(units)
    return units, y, X, [pm.tokenizer.decode([int(t)]) for t in last]


def _last_states(pm, keys: list[tuple]) -> np.ndarray:
    """(L + 1, len(keys), E): the residual stream after every layer at each sequence's last token."""
    from ..forward.packing import pad_right

    states = []
    for start in range(0, len(keys), 64):
        batch = keys[start : start + 64]
        ids, mask = pad_right(batch, pm.tokenizer.pad_token_id or 0)  # (B, T)
        ids, mask = ids.to(pm.device), mask.to(pm.device)
        out = pm.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
        last = torch.tensor([len(k) - 1 for k in batch], device=pm.device)
        hidden = torch.stack(out.hidden_states)  # (L + 1, B, T, E)
        states.append(hidden[:, torch.arange(len(batch), device=pm.device), last].float())  # (L + 1, B, E)
    return torch.cat(states, 1).cpu().numpy()


def shared_last_tokens(units, last_tokens) -> str:
    """The groups of units whose span ends in the same token: "hygienist, receptionist (ist); ..."."""
    groups = pd.Series(list(units)).groupby(pd.Series(list(last_tokens)), sort=True).agg(list)
    return "; ".join(f"{', '.join(g)} ({t.strip()})" for t, g in groups.items() if len(g) > 1 and t)


def readout_table(
    pm, suite, span: str, folds: int | None = 10, permutations: int = 999, seed: int = 0
) -> pd.DataFrame:
    """Per layer (0: the embeddings): how well the suite's covariate is read linearly from the
    residual stream at the unit's span, held out over units (module doc). `pm`: a ProbeModel;
    `folds` None: 10, or half the units when there are fewer than 20."""
    units, y, X, last = unit_states(pm, suite, span)
    table = states_readout(y, X, folds, permutations, seed)
    return _labelled(table.assign(shared_last_token=shared_last_tokens(units, last)), suite, span)


def _labelled(table: pd.DataFrame, suite, span: str) -> pd.DataFrame:
    """The readout table with the span it was read at and the covariate's name."""
    return table.assign(span=span, covariate=suite.analysis.name(suite.analysis.covariate))


def states_readout(
    y: np.ndarray, X: np.ndarray, folds: int | None = 10, permutations: int = 999, seed: int = 0
):
    """The readout table from the per-unit states alone: y (N,) the covariate, X (L + 1, N, E)."""
    from ..errors import AnalysisError

    folds = folds or min(10, len(y) // 2)
    if len(y) < 2 * folds:
        raise AnalysisError(f"{len(y)} units for {folds} folds: give fewer folds (at least 2 units each)")
    rows = []
    for layer in range(X.shape[0]):
        rows.append({"layer": layer, **crossfit_r2(X[layer], y, folds, permutations, seed)})
    table = pd.DataFrame(rows)
    table["p_holm"] = holm(table["p_permutation"].to_numpy())  # over the layers looked at together
    table["p_floor"] = 1 / (1 + permutations)  # the smallest p the draws allow, before the adjustment
    return table.assign(n_units=len(y))


def states_frame(units, y: np.ndarray, X: np.ndarray, last_tokens=None) -> pd.DataFrame:
    """The per-unit states as a long table (layer, unit, covariate, last_token, s0 .. s{E-1}): what
    readout_states.parquet holds, and `states_readout` recomputes readout.csv from."""
    L, N, E = X.shape
    frame = pd.DataFrame(X.reshape(L * N, E).astype(np.float32), columns=[f"s{e}" for e in range(E)])
    frame.insert(0, "last_token", np.tile(np.asarray(last_tokens or [""] * N, dtype=str), L))
    frame.insert(0, "covariate", np.tile(y, L))
    frame.insert(0, "unit", np.tile(np.asarray(units, dtype=str), L))
    frame.insert(0, "layer", np.repeat(np.arange(L), N))
    return frame


def frame_states(frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(y (N,), X (L + 1, N, E)) back from states_frame's table."""
    L = frame["layer"].nunique()
    states = frame.filter(regex=r"^s\d+$")
    X = states.to_numpy(dtype=np.float64).reshape(L, -1, states.shape[1])
    return frame.loc[frame["layer"] == 0, "covariate"].to_numpy(dtype=float), X


def frame_table(frame: pd.DataFrame, **options) -> pd.DataFrame:
    """The readout table from readout_states.parquet's frame alone (readout.csv's columns but the
    span and covariate names)."""
    first = frame[frame["layer"] == 0]
    shared = shared_last_tokens(first["unit"], first.get("last_token", pd.Series([""] * len(first))))
    return states_readout(*frame_states(frame), **options).assign(shared_last_token=shared)


def write_readout(directory, pm, suite) -> None:
    """readout_states.parquet (the per-unit states, float32) and readout.csv recomputed from them."""
    from ..store import atomic_write, write_parquet, write_table

    units, y, X, last = unit_states(pm, suite, suite.analysis.unit)
    frame = states_frame(units, y, X, last)
    atomic_write(Path(directory) / "readout_states.parquet", lambda p: write_parquet(frame, p))
    table = frame_table(frame, folds=None)  # from the float32 states as written
    write_table(directory, "readout", _labelled(table, suite, suite.analysis.unit))
