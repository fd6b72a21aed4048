"""The placebo of each edit kind fitted on the covariate (`edit --placebo N`): is it the covariate the
edit erases that removes the gradient, or would any unit-level variable do? The kind is refitted, per
quarter on its training quarters and at the same heads (the found sets), with the covariate permuted
across units (each unit keeps one value, another unit's), N times; each refit edit is measured on
its quarter's items like the real one; the stream's eraser likewise at the layers the sweep chose.
stats.placebo.placebo_table compares the real gradient removed with the permuted ones (p = (1 +
#placebo >= real) / (1 + N), its floor 1 / (1 + N)).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

from ...heads import HeadSet
from ...stats.edits import STREAM
from ...stats.placebo import PLACEBO_PREFIX as PREFIX  # the raw rows' kind: placebo-KIND
from ..kinds import KINDS
from ..passes import raw_rows
from ..stream import StreamEdit, per_row, stream_behaviour
from .measure import behaviour_values


def placebo_kinds(kinds) -> list[str]:
    """The kinds whose parameters depend on the covariate (the others' placebo is the edit itself)."""
    return [kind for kind in kinds if KINDS[kind].COVARIATE]


def permuted(covariate: np.ndarray, units: list, rng: np.random.Generator) -> np.ndarray:
    """The per-item covariate with the units' values shuffled among the units (items of one unit keep
    one value)."""
    names = list(dict.fromkeys(units))
    value = {unit: covariate[units.index(unit)] for unit in names}
    shuffled = dict(zip(names, rng.permutation([value[u] for u in names])))
    return np.array([shuffled[u] for u in units], dtype=float)


def _progress(log, line: str, d: int, n: int) -> None:
    """`line` (with {done} and {n}) logged every 10 permutations and after the last."""
    if (d + 1) % 10 == 0 or d + 1 == n:
        log(line.format(done=d + 1, n=n))


def measure_placebo(
    model, kinds, options, inputs, sets: dict, n_heads: int, log=lambda m: None
) -> pd.DataFrame:
    """Raw bias values (target bias, k, draw d, index, y; kind placebo-KIND) of every item, its quarter's
    found heads edited by the kind refitted on permutation d of the covariate."""
    L, units = model.info.n_layers, [i.unit for i in inputs.items]
    rng = np.random.default_rng(options.seed + 1)
    frames = []
    for d in range(options.placebo):
        fake = replace(inputs, covariate=permuted(inputs.covariate, units, rng))
        for kind in kinds:
            edits = tuple(KINDS[kind].fit(fake, inputs.training(f), options) for f in range(4))
            base, masks, keys = [], [], []
            for k, per_fold in sets.items():
                for index in range(len(inputs.items)):
                    base.append(index), keys.append((k, d, index))
                    masks.append(HeadSet(per_fold[inputs.fold[index]]).mask(L, n_heads))
            y = behaviour_values(model, inputs.bank, edits, base, masks, inputs.labels, inputs.fold[base])
            frames.append(raw_rows("bias", keys, y=y).assign(kind=PREFIX + kind))
        _progress(log, "edit: placebo, {done} of {n} permutations of the covariate", d, options.placebo)
    out = pd.concat(frames, ignore_index=True)
    return out.assign(heads="", heads_all="")


def measure_stream_placebo(
    model, inputs, chosen: dict, options, log=lambda m: None, fit=StreamEdit.fit, name: str = STREAM
) -> pd.DataFrame:
    """The stream's placebo: raw bias rows (kind placebo-stream-chosen, k the layer chosen on every
    item, draw d) of each quarter's items with the stream erased at the layer chosen for the quarter
    (`chosen`: quarter -> layer, stats.edits.chosen_layers) by the eraser refitted on its training
    quarters with permutation d of the covariate. Any per-layer edit `name` alike (`fit(inputs,
    layer, folds)`: an MLP mode's, edits.mlp), its rows of kind placebo-NAME-chosen."""
    units, rng = [i.unit for i in inputs.items], np.random.default_rng(options.seed + 1)
    quarters = [f for f in range(4) if f in chosen]
    frames = []
    for d in range(options.placebo):
        fake = replace(inputs, covariate=permuted(inputs.covariate, units, rng))
        y = np.full(len(inputs.items), np.nan)
        for layer in sorted({chosen[f] for f in quarters}):  # per layer, the quarters that chose it
            fitted = [fit(fake, layer, inputs.training(f)) for f in range(4)]
            mine = np.flatnonzero(np.isin(inputs.fold, [f for f in quarters if chosen[f] == layer]))
            edit = per_row(fitted, inputs.fold)
            y[mine] = stream_behaviour(model.model, inputs.bank, edit, inputs.labels, mine)[mine]
        keys = [(chosen["all"], d, i) for i in np.flatnonzero(np.isfinite(y))]
        frames.append(raw_rows("bias", keys, y=y[np.isfinite(y)]))
        _progress(log, f"edit: {name}'s placebo, {{done}} of {{n}} permutations", d, options.placebo)
    return pd.concat(frames, ignore_index=True).assign(kind=f"{PREFIX}{name}-chosen", heads="", heads_all="")
