"""The placebo of each edit fitted on the covariate (`edit --placebo N`): is it the covariate the edit
erases that removes the gradient, or would any unit-level variable do, chosen as the real edit was?
The covariate is permuted across units (each unit keeps one value, another unit's), N times, and
every choice the sweep makes from the data is made again on each permutation:

- a head kind: per quarter, the top k heads by the permuted covariate's gradient scores on its
  training quarters (unless the user listed the heads), the kind refitted there on them (a kind
  fitted in order, KIND-seq: in order on the heads chosen);
- a per-layer edit (the stream's eraser, an MLP mode): refitted at every layer and each quarter's
  layer chosen as the real edit's was (stats.keeping.layers: the most gradient removed on the other
  quarters' items among the layers the gate admits; the gate, what the edit keeps of the
  definitional gap and its KL, is the real edit's: measuring it again for every refit would cost
  N times the whole sweep of that edit, its control prompts and texts at every layer).

Each refit is measured on the items like the real edit; the rows name the heads or layers chosen.
stats.placebo.placebo_table compares the real gradient removed with the permuted ones (p = (1 +
#placebo >= real) / (1 + N), its floor 1 / (1 + N)).
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np
import pandas as pd

from ...heads import HeadSet
from ...intervene.selection import chosen_heads
from ...stats.keeping.layers import chosen_layers, quarter_layers
from ...stats.placebo import PLACEBO_PREFIX as PREFIX  # the raw rows' kind: placebo-KIND
from ..layers.stream import quarters_bias
from ..passes import raw_rows
from ..sequential import HeadFit, kind_class
from .measure import behaviour_values
from .options import Sweep

PLACEBO_CHOICES = "repeated"  # each placebo refit chooses its heads and layers again (since round 6)


def placebo_kinds(kinds) -> list[str]:
    """The raw head kinds (KIND, KIND-seq) whose parameters depend on the covariate (the others'
    placebo is the edit itself)."""
    return [kind for kind in kinds if kind_class(kind)[0].COVARIATE]


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


def measure_placebo(sweep, kinds, sets: dict, rescore=None) -> pd.DataFrame:
    """Raw bias values (target bias, k, draw d, index, y; kind placebo-KIND) of every item, its quarter's
    heads edited by the kind refitted on permutation d of the covariate. `rescore(covariate)` (item id
    -> value) gives the quarters' head scores of a covariate: with it each permutation chooses its own
    heads, as the sweep chose `sets` (k -> fold -> heads); without it (heads the user listed) the
    heads are `sets`'."""
    model, options, inputs, n_heads = sweep.model, sweep.options, sweep.inputs, sweep.n_heads
    L, units = model.info.n_layers, [i.unit for i in inputs.items]
    ids = [i.item_id for i in inputs.items]
    rng = np.random.default_rng(options.seed + 1)
    frames, fits = [], {kind: HeadFit(kind, options, model.model) for kind in kinds}
    for d in range(options.placebo):
        fake = replace(inputs, covariate=permuted(inputs.covariate, units, rng))
        scores = rescore(dict(zip(ids, fake.covariate))) if rescore else None
        chosen = {
            k: {f: chosen_heads(scores[f], k, n_heads) if scores else per_fold[f] for f in range(4)}
            for k, per_fold in sets.items()
        }
        named = {k: " | ".join(str(HeadSet(per_fold[f])) for f in range(4)) for k, per_fold in chosen.items()}
        for kind in kinds:  # per quarter and k, refitted on its heads (at once: one fit per quarter)
            fit = fits[kind]
            edits = tuple(fit(fake, inputs.training(f), chosen[k][f]) for k in chosen for f in range(4))
            base, masks, keys, which = [], [], [], []
            for i, (k, per_fold) in enumerate(chosen.items()):
                for index in range(len(inputs.items)):
                    base.append(index), keys.append((k, d, index)), which.append(4 * i + inputs.fold[index])
                    masks.append(HeadSet(per_fold[inputs.fold[index]]).mask(L, n_heads))
            y = behaviour_values(model, inputs.bank, edits, base, masks, inputs.labels, which)
            rows = raw_rows("bias", keys, y=y).assign(kind=PREFIX + kind)
            frames.append(rows.assign(heads=rows["k"].map(named)))
        _progress(sweep.log, "edit: placebo, {done} of {n} permutations of the covariate", d, options.placebo)
    return pd.concat(frames, ignore_index=True).assign(heads_all="")


def measure_layer_placebo(sweep, measured: pd.DataFrame, k: int, fit, name: str) -> pd.DataFrame:
    """A per-layer edit's placebo, its layer choice repeated: per permutation d of the covariate the
    edit `name` (`fit(inputs, layer, folds)`) refitted on every quarter's training quarters at every
    layer the real edit was measured at (an edit of several layers: every number of layers) and
    measured on the items; each quarter's layer chosen as the real edit's was
    (stats.keeping.layers.chosen_layers: the most gradient removed on the other quarters' items among
    the layers the gate admits), the gate that of the real edit in `measured` (its clean and per-layer
    rows: what the edit keeps of the definitional gap and its KL, which the covariate does not
    choose). Returns the bias rows (kind placebo-NAME-chosen, k the real chosen layer `k`, draw d,
    heads: the layers permutation d chose)."""
    model, options, inputs = sweep.model, sweep.options, sweep.inputs
    units, rng = [i.unit for i in inputs.items], np.random.default_rng(options.seed + 1)
    gate = measured[(measured["kind"] != name) | (measured["target"] != "bias")]
    layers = sorted(int(k) for k in measured.loc[measured["kind"] == name, "k"].unique())
    n, frames = len(inputs.items), []
    for d in range(options.placebo):
        fake = replace(inputs, covariate=permuted(inputs.covariate, units, rng))
        bias = [
            raw_rows("bias", [(layer, -1, i) for i in range(n)], y=quarters_bias(model, fake, fit, layer)[1])
            for layer in layers
        ]
        refits = inputs.describe(pd.concat(bias, ignore_index=True).assign(kind=name))
        chosen = chosen_layers(pd.concat([gate, refits], ignore_index=True), name)
        layer = pd.Series(inputs.fold).map(chosen).to_numpy()
        y = refits.set_index(["k", "index"])["y"]
        picked = y.reindex(list(zip(layer, range(n)))).to_numpy()
        choice = quarter_layers(chosen, name)
        frames.append(raw_rows("bias", [(k, d, i) for i in range(n)], y=picked).assign(heads=choice))
        _progress(sweep.log, f"edit: {name}'s placebo, {{done}} of {{n}} permutations", d, options.placebo)
    return pd.concat(frames, ignore_index=True).assign(kind=f"{PREFIX}{name}-chosen", heads_all="")


def layer_placebo(part, key: str, sweep: Sweep, frames: list, name: str, fit) -> list:
    """A per-layer edit's placebo (the stream's, an MLP mode's: `name`, fitted by `fit`), its layers
    chosen again on every permutation (none without --placebo); frames[0] holds the clean values,
    frames[-1] that edit's part."""
    if not sweep.options.placebo:
        return []
    measured = pd.concat([frames[0], frames[-1]], ignore_index=True)  # the clean rows and the edit's
    chosen = chosen_layers(measured, name)
    plan = f"{key} {name} {sorted(chosen.items(), key=str)} {sweep.options.placebo} {PLACEBO_CHOICES}"
    placebo = lambda: measure_layer_placebo(sweep, measured, chosen["all"], fit, name)
    return [part(f"placebo-{name}", placebo, hashlib.sha256(plan.encode()).hexdigest()[:16])]
