"""Where a covariate becomes linearly readable: a cross-fitted ridge probe on the residual stream.

For a suite whose covariate belongs to a unit (the occupation and its BLS share of women), take the
residual stream after every layer (index 0: the embeddings; the last index is after the final norm,
as transformers returns it) at the last token of the unit's span, averaged over the unit's prompts
with every template weighing the same: one vector per unit and layer, X (n units, E). Per layer:

  ridge regression of the covariate on X, cross-fitted over units: K folds (seeded); in each, X is
  centred and scaled by the training units, the penalty chosen on them by generalised
  cross-validation over a grid, and the held-out units predicted. Held-out R2 = 1 - SSE / SST of the
  out-of-fold predictions (SST about the mean of all units; R2 <= 0 means no linear readout).

The unit of inference is the unit (an occupation): its CI is a percentile bootstrap over units of
the out-of-fold predictions (2,000 resamples, seed 0; the fits are not redone, so the interval leaves
out the variance of choosing the penalty); its null is the same cross-fitting with the covariate
permuted across units (`permutations` draws, same folds): p = (1 + draws reaching R2) / (1 + draws),
and Holm's adjustment over the layers (999 draws: a floor of 0.001, 0.03 after adjusting for 31 layers).
Shapes: N units, E model width, K folds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ...stats.inference import holm

ALPHAS = np.logspace(-3, 5, 17)  # ridge penalties tried, relative to the mean squared singular value


def _fold_fits(X: np.ndarray, folds: np.ndarray):
    """Per fold: the held-out mask and what predicting any y needs: the training means and scales,
    the SVD of the scaled training X, and the scaled held-out X."""
    fits = []
    for f in np.unique(folds):
        test = folds == f
        train = ~test
        mean, scale = X[train].mean(0), X[train].std(0) + 1e-8
        U, S, Vt = np.linalg.svd((X[train] - mean) / scale, full_matrices=False)
        fits.append((test, U, S, Vt, (X[test] - mean) / scale))
    return fits


def _predict(fits, Y: np.ndarray) -> np.ndarray:
    """Out-of-fold ridge predictions of each row of Y (P, N): P outcomes (the covariate and its
    permutations) at once, the penalty of each fold and outcome chosen by GCV on the fold's training
    units. With the SVD X = U S V', the fit's hat matrix has eigenvalues S^2 / (S^2 + a)."""
    out = np.empty(Y.shape)
    for test, U, S, Vt, X_test in fits:
        n = int((~test).sum())
        alphas = ALPHAS * np.mean(S**2)  # (A,)
        shrink = S**2 / (S**2 + alphas[:, None])  # (A, r)
        dof = (1 - shrink.sum(1) / n) ** 2  # (A,): GCV's denominator
        step = max(1, 2**22 // (len(alphas) * n))  # outcomes per block: (block, A, n) stays ~32 MB
        for first in range(0, len(Y), step):
            y_train = Y[first : first + step, ~test]  # (B, n)
            offset = y_train.mean(1, keepdims=True)
            centred = y_train - offset
            Uy = centred @ U  # (B, r)
            residual = centred[:, None, :] - (shrink * Uy[:, None, :]) @ U.T  # (B, A, n)
            gcv = np.mean(residual**2, axis=2) / dof  # (B, A)
            best = alphas[np.argmin(gcv, axis=1)]  # the first of equal minima, (B,)
            coef = (S / (S**2 + best[:, None]) * Uy) @ Vt  # (B, E)
            out[first : first + step, test] = offset + coef @ X_test.T
    return out


def r_squared(y: np.ndarray, predicted: np.ndarray) -> np.ndarray:
    """1 - SSE / SST along the last axis (one R2 per row of a 2-D y)."""
    sst = np.sum((y - y.mean(-1, keepdims=True)) ** 2, axis=-1)
    return 1 - np.sum((y - predicted) ** 2, axis=-1) / sst


def crossfit_r2(
    X: np.ndarray, y: np.ndarray, folds: int = 10, permutations: int = 200, seed: int = 0
) -> dict:
    """Held-out R2 of a ridge readout of y (N,) from X (N, E), its bootstrap CI over units and its
    permutation p (see the module doc)."""
    rng = np.random.default_rng(seed)
    fold = rng.permutation(np.arange(len(y)) % min(folds, len(y)))
    fits = _fold_fits(np.asarray(X, dtype=np.float64), fold)
    boot = rng.integers(0, len(y), (2000, len(y)))
    # row 0 the covariate, then its permutations: one pass fits all, the same arithmetic for each
    Y = np.stack([y] + [rng.permutation(y) for _ in range(permutations)])
    fitted = _predict(fits, Y)
    r2s = r_squared(Y, fitted)
    r2, null, predicted = r2s[0], r2s[1:], fitted[0]
    kept = boot[np.ptp(y[boot], axis=1) > 0]  # resamples whose covariate varies
    draws = r_squared(y[kept], predicted[kept])
    return {
        "r2": float(r2),
        "ci_low": float(np.percentile(draws, 2.5)),
        "ci_high": float(np.percentile(draws, 97.5)),
        "p_permutation": float((1 + (null >= r2).sum()) / (1 + len(null))) if permutations else np.nan,
        "null_r2_q95": float(np.quantile(null, 0.95)) if permutations else np.nan,
    }


@torch.no_grad()
def unit_states(pm, suite, span: str) -> tuple[list, np.ndarray, np.ndarray]:
    """(units, covariate per unit, (L + 1, N, E) states): the residual stream after every layer at the
    last token of `span`, averaged per unit over templates (each template weighing the same)."""
    from ...forward.packing import pad_right
    from ...run.plan import encode_prompts
    from ...schema.analysis import value_of

    analysis = suite.analysis
    prompts = [p for p in suite.prompts if span in p.spans and value_of(p, analysis.covariate) is not None]
    encoded = encode_prompts(suite, prompts, pm.tokenizer, pm.info.max_positions)
    prefixes = {}  # the prefix up to the span's last token decides the state (causal): once each
    for e in encoded:
        end = e.spans[span][1]
        key = tuple(e.ids[:end])
        prefixes.setdefault(key, []).append(e.prompt)
    keys = sorted(prefixes, key=len)
    states = []
    for start in range(0, len(keys), 64):
        batch = keys[start : start + 64]
        ids, mask = pad_right(batch, pm.tokenizer.pad_token_id or 0)  # (B, T)
        ids, mask = ids.to(pm.device), mask.to(pm.device)
        out = pm.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
        last = torch.tensor([len(k) - 1 for k in batch], device=pm.device)
        hidden = torch.stack(out.hidden_states)  # (L + 1, B, T, E)
        states.append(hidden[:, torch.arange(len(batch), device=pm.device), last].float())  # (L + 1, B, E)
    states = torch.cat(states, 1).cpu().numpy()  # (L + 1, prefixes, E)
    rows = pd.DataFrame(
        [
            (i, str(value_of(p, analysis.unit)), p.template_id, float(value_of(p, analysis.covariate)))
            for i, key in enumerate(keys)
            for p in prefixes[key][:1]
        ],
        columns=["row", "unit", "template", "covariate"],
    )
    # template means first, then the unit's mean over its templates
    cells = rows.groupby(["unit", "template"])["row"].apply(list)
    units = sorted(rows["unit"].unique())
    X = np.stack(
        [np.mean([states[:, r].mean(1) for r in cells[u]], axis=0) for u in units], axis=1
    )  # (L + 1, N, E)
    y = rows.groupby("unit")["covariate"].first().reindex(units).to_numpy()
    return units, y, X


def readout_table(
    pm, suite, span: str, folds: int | None = 10, permutations: int = 999, seed: int = 0
) -> pd.DataFrame:
    """Per layer (0: the embeddings): how well the suite's covariate is read linearly from the
    residual stream at the unit's span, held out over units (module doc). `pm`: a ProbeModel;
    `folds` None: 10, or half the units when there are fewer than 20."""
    units, y, X = unit_states(pm, suite, span)
    return _labelled(states_readout(y, X, folds, permutations, seed), suite, span)


def _labelled(table: pd.DataFrame, suite, span: str) -> pd.DataFrame:
    """The readout table with the span it was read at and the covariate's name."""
    return table.assign(span=span, covariate=suite.analysis.name(suite.analysis.covariate))


def states_readout(
    y: np.ndarray, X: np.ndarray, folds: int | None = 10, permutations: int = 999, seed: int = 0
):
    """The readout table from the per-unit states alone: y (N,) the covariate, X (L + 1, N, E)."""
    from ...errors import AnalysisError

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


def states_frame(units, y: np.ndarray, X: np.ndarray) -> pd.DataFrame:
    """The per-unit states as a long table (layer, unit, covariate, s0 .. s{E-1}): what
    readout_states.parquet holds, and `states_readout` recomputes readout.csv from."""
    L, N, E = X.shape
    frame = pd.DataFrame(X.reshape(L * N, E).astype(np.float32), columns=[f"s{e}" for e in range(E)])
    frame.insert(0, "covariate", np.tile(y, L))
    frame.insert(0, "unit", np.tile(np.asarray(units, dtype=str), L))
    frame.insert(0, "layer", np.repeat(np.arange(L), N))
    return frame


def frame_states(frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(y (N,), X (L + 1, N, E)) back from states_frame's table."""
    L = frame["layer"].nunique()
    X = frame.filter(regex=r"^s\d+$").to_numpy(dtype=np.float64).reshape(L, -1, frame.shape[1] - 3)
    return frame.loc[frame["layer"] == 0, "covariate"].to_numpy(dtype=float), X


def write_readout(directory, pm, suite) -> None:
    """readout_states.parquet (the per-unit states, float32) and readout.csv recomputed from them."""
    from ...store import atomic_write, write_parquet, write_table

    units, y, X = unit_states(pm, suite, suite.analysis.unit)
    frame = states_frame(units, y, X)
    atomic_write(Path(directory) / "readout_states.parquet", lambda p: write_parquet(frame, p))
    table = states_readout(*frame_states(frame), folds=None)  # from the float32 states as written
    write_table(directory, "readout", _labelled(table, suite, suite.analysis.unit))
