"""The linear readout's ridge fits: batched over the covariate and its permutations, against one
outcome at a time.

    python benchmarks/readout.py STATES [--repeats 3] [--out benchmarks/results]

STATES: a run's readout_states.parquet (`attnprobe edit --paths` writes it; on the gender suite and
smollm2-135m: 31 layers x 60 occupations x 576). Each round computes the readout table of every
layer (10 folds, 20 fold assignments, --permutations permutations; `attnprobe edit --paths` uses 999)
twice, in turn: with `analyses.readout.states_readout` (all outcomes of a fold in one batched
pass) and with the loop it replaced, written out below (per outcome: its own leave-one-out search over the
penalties). Figures are medians of the rounds. Agreement: the largest |difference| of R2 and the
null's median and 95th percentile, and whether every p is equal. Writes readout.json and readout.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import pandas as pd

from attnprobe.analyses.readout import frame_states, states_readout
from attnprobe.stats.analyses.ridge import ALPHAS, ASSIGNMENTS, _fold_fits


def _one_outcome(fits, y: np.ndarray) -> np.ndarray:
    """Out-of-fold predictions of one outcome: the per-outcome loop the batched fit replaced."""
    out = np.empty(len(y))
    for test, U, S, T in fits:
        y_train = y[~test]
        offset = y_train.mean()
        Uy = U.T @ (y_train - offset)
        leverage = 1 / len(y_train) + (U**2) @ (S**2 / (S**2 + ALPHAS[:, None] * np.mean(S**2))).T  # (n, A)
        best, best_loo = None, np.inf
        for j, a in enumerate(ALPHAS * np.mean(S**2)):
            shrink = S**2 / (S**2 + a)
            residual = (y_train - offset) - U @ (shrink * Uy)
            loo = np.mean((residual / (1 - leverage[:, j])) ** 2)  # exact leave-one-out
            if loo < best_loo:
                best, best_loo = a, loo
        out[test] = offset + T @ (S / (S**2 + best) * Uy)
    return out


def _r2(y, predicted) -> float:
    return float(1 - np.sum((y - predicted) ** 2) / np.sum((y - y.mean()) ** 2))


def looped_readout(y: np.ndarray, X: np.ndarray, permutations: int, seed: int = 0) -> pd.DataFrame:
    """states_readout's columns r2, p_permutation and the null's median and 95th percentile, each
    outcome fitted alone on each fold assignment (the same draws; the CI's refits are one outcome
    each already)."""
    folds = min(10, len(y) // 2)
    rows = []
    for layer in range(X.shape[0]):
        rng = np.random.default_rng(seed)
        Y = np.stack([y] + [rng.permutation(y) for _ in range(permutations)])
        assignments = [rng.permutation(np.arange(len(y)) % folds) for _ in range(ASSIGNMENTS)]
        fits = [_fold_fits(np.asarray(X[layer], dtype=np.float64), fold) for fold in assignments]
        r2s = np.median([[_r2(row, _one_outcome(f, row)) for row in Y] for f in fits], axis=0)
        r2, null = r2s[0], r2s[1:]
        rows.append(
            {
                "layer": layer,
                "r2": r2,
                "p_permutation": (1 + (null >= r2).sum()) / (1 + len(null)),
                "null_r2_median": np.median(null),
                "null_r2_q95": np.quantile(null, 0.95),
            }
        )
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("states", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--permutations", type=int, default=99)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    y, X = frame_states(pd.read_parquet(args.states))
    seconds = {"batched": [], "looped": []}
    for _ in range(args.repeats):
        started = time.perf_counter()
        batched = states_readout(y, X, folds=None, permutations=args.permutations)
        seconds["batched"].append(time.perf_counter() - started)
        started = time.perf_counter()
        looped = looped_readout(y, X, args.permutations)
        seconds["looped"].append(time.perf_counter() - started)
    values = ["r2", "null_r2_median", "null_r2_q95"]
    result = {
        "states": str(args.states),
        "layers_units_width": list(X.shape),
        "repeats": args.repeats,
        "batched_s": statistics.median(seconds["batched"]),
        "looped_s": statistics.median(seconds["looped"]),
        "max_abs_difference": float((batched[values] - looped[values]).abs().max().max()),
        "p_equal": bool((batched["p_permutation"] == looped["p_permutation"]).all()),
    }
    result["speed_up"] = result["looped_s"] / result["batched_s"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "readout.json").write_text(json.dumps(result, indent=1) + "\n")
    L, N, E = X.shape
    (args.out / "readout.md").write_text(
        f"Readout of {L} layers x {N} units x {E} ({args.permutations} permutations, 10 folds, "
        f"{ASSIGNMENTS} fold assignments), median of "
        f"{args.repeats} rounds: batched {result['batched_s']:.1f} s, one outcome at a time "
        f"{result['looped_s']:.1f} s ({result['speed_up']:.1f}x); largest |difference| "
        f"{result['max_abs_difference']:.2g}, every p equal: {result['p_equal']}.\n"
    )
    print((args.out / "readout.md").read_text(), end="")


if __name__ == "__main__":
    main()
