"""Erasure checked after the fact: can the covariate still be read from the edited site? Per quarter
f, a ridge readout of the covariate (stats.analyses.ridge's rule, the readout per layer's) from the
found heads' outputs at the prediction position (for a per-layer edit: the stream entering its
layer, the layer's MLP output) is read on f's items, from the outputs as they are (before) and as
f's edit makes them (after).

The readout is trained on rows the edit was not fitted on: f's edit (and heads) come from its
training quarters (the other units and templates), which an eraser leaves with no covariance with
the covariate by construction, so a readout trained there reads nothing whatever the edit leaves
elsewhere. It is trained on the quarter of the other units and f's templates instead (no unit of
f, none of the edit's rows), or, where that quarter is the edit's (one template), on half of f's
own units and read on the other half, both ways. Before and after use the same rows.

The outputs are the recorded ones with the edit applied at its heads: an edit of several layers
does not pass its changes on to the later heads here (exact for heads of one layer). stats.edits
turns the held-out readings into R2.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from ...heads import HeadSet
from ...stats.analyses.ridge import ridge_predict
from ..editor import replaced
from ..passes import raw_rows


def site_features(last: torch.Tensor, heads, edit=None) -> np.ndarray:
    """(N, k D) the outputs of `heads` in `last` (N, L, H, D), each edited by `edit` when given."""
    columns = []
    for layer, head in HeadSet(heads):
        z = last[:, layer]  # (N, H, D)
        if edit is not None:
            z = replaced(edit, layer, z[:, :, None, :])[:, :, 0, :]
        columns.append(z[:, head].double().cpu().numpy())
    return np.concatenate(columns, 1)


def readout_splits(inputs, f: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train, read) item indices of quarter f's readout, as the module says: neither shares a unit
    with the other, and no train row is one f's edit was fitted on."""
    held = np.flatnonzero(inputs.fold == f)
    beside = f ^ 2  # the other unit half, f's template half
    if beside not in inputs.training(f) and (inputs.fold == beside).any():
        return [(np.flatnonzero(inputs.fold == beside), held)] if len(held) else []
    units = pd.Series(inputs.covariate[held], index=[inputs.items[i].unit for i in held])
    order = units.groupby(level=0).first().sort_values(kind="stable").index  # alternately by covariate
    half = np.isin(units.index, order[::2])
    if half.all() or not half.any():
        return []
    return [(held[half], held[~half]), (held[~half], held[half])]


def _held_out_reads(features, inputs, k: int) -> tuple[list, list]:
    """(keys (k, -1, item), the covariate read on each held-out item): each quarter f read from
    `features(f)` (N, D) by a readout trained on rows f's edit was not fitted on (readout_splits)."""
    keys, values = [], []
    for f in range(4):
        splits = readout_splits(inputs, f)
        site = features(f) if splits else None
        for train, read in splits:
            keys += [(k, -1, int(i)) for i in read]
            values += list(ridge_predict(site[train], inputs.covariate[train], site[read]))
    return keys, values


def readout_rows(last: torch.Tensor, inputs, edits: dict, sets: dict):
    """Raw rows (targets readout_before and readout_after; k, draw -1, item index; y: the covariate
    read on the held-out item) of every k, each quarter f read from its found heads before and after
    its edit (`edits[f, k]`) by a readout trained on rows the edit was not fitted on."""
    frames = []
    for target, edited in (("readout_before", False), ("readout_after", True)):
        keys, values = [], []
        for k, per_fold in sets.items():
            features = lambda f, chosen=per_fold, edited=edited, k=k: site_features(
                last, chosen[f], edits[f, k] if edited else None
            )
            read = _held_out_reads(features, inputs, k)
            keys, values = keys + read[0], values + read[1]
        frames.append(raw_rows(target, keys, y=np.array(values, dtype=float)))
    return frames


def layer_readout_rows(site: torch.Tensor, quarters, inputs, layer: int):
    """The same for a per-layer edit (the stream's, an MLP's; k = `layer`): `site` (N, E) each
    item's vector at its last token, `quarters` the edit with each item's quarter's parameters;
    quarter f is read with f's parameters applied to every row (its readout's training rows too)."""
    before = site.double().cpu().numpy()

    def after(f: int) -> np.ndarray:
        own = quarters.rows(torch.full((len(site),), int(np.flatnonzero(inputs.fold == f)[0])))
        return own.erase(site[:, None, :])[:, 0, :].double().cpu().numpy()

    frames = []
    for target, features in (("readout_before", lambda f: before), ("readout_after", after)):
        keys, read = _held_out_reads(features, inputs, layer)
        frames.append(raw_rows(target, keys, y=np.array(read, dtype=float)))
    return frames
