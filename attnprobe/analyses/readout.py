"""Where a covariate becomes linearly readable: a cross-fitted ridge probe on the residual stream.

For a suite whose covariate belongs to a unit (the occupation and its BLS share of women), take the
residual stream after every layer (index 0: the embeddings; the last index is after the final norm,
as transformers returns it) at the last token of the unit's span: per unit, the mean over its
templates of the mean over that template's prompts, so every template weighs the same (templates
whose text up to the span is the same share one forward pass, not one weight). One vector per unit
and layer, X (n units, E). Per layer:

  ridge regression of the covariate on X, cross-fitted over units: K folds; in each, X is centred
  and scaled by the training units, the penalty chosen on them by exact leave-one-out error over
  a grid, and the held-out units predicted. Held-out R2 = 1 - SSE / SST of the out-of-fold
  predictions (SST about the mean of all units; R2 <= 0 means no linear readout). The fold draw
  moves R2 (on SmolLM2's embeddings from 0.13 to 0.44), so R2 is the median over ASSIGNMENTS
  random fold assignments.

The ridge and its statistics are stats.analyses.ridge's. The unit of inference is the unit (an
occupation). CI: the 2.5th and 97.5th percentiles of R2 over REFITS bootstrap resamples of the
units, each cross-fitted afresh (penalty chosen again, a new fold draw), so it carries the fitting's
and the fold draw's variance, moved so that the draws' median sits on the point (median_centred: a
resample's refit, on about 63% distinct units, predicts worse than the full fit).
p_permutation tests "no better than a readout of a covariate permuted across units", the same median
over the same fold assignments for each of `permutations` permutations; that null centres below 0
(null_r2_median: ridge on noise predicts worse than the mean), so p_permutation is not a test of R2
> 0: read ci_low for that. Holm's adjustment over the layers (999 draws: a floor of 0.001, 0.03
after adjusting for 31 layers). Units whose span ends in the same token (hygienist and receptionist:
`ist`) have the same embedding at layer 0 (identical states where positions are rotary) and similar
ones early on; shared_last_token names them. Shapes: N units, E model width, K folds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..stats.analyses.ridge import crossfit_r2
from ..stats.inference import holm


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
