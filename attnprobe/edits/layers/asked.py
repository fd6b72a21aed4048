"""The per-layer edits a sweep's options ask for, listed once: the sweep measures them (and refits the
covariate-fitted ones on the placebo's permutations), saves the chosen ones and applies them to the
--also suites, each from this list."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ...stats.edits import STREAM
from . import mlp as mlps
from . import several
from .modes import SITE_MODES
from .stream import STREAM_MODE, StreamEdit, measure_stream


@dataclass(frozen=True)
class LayerKind:
    """One per-layer edit by its raw kind (`name`, also its saved file's): the stream's or an MLP
    mode's at each layer, or at several consecutive layers at once (k: how many; the MLPs' at `rank`
    directions per layer), an MLP's fitted `at` the prediction ("last") or the slot."""

    name: str
    site: str  # "stream" or "mlp"
    mode: str
    at: str = "last"
    several: bool = False
    rank: int = 1

    @property
    def covariate(self) -> bool:
        """Fitted on the covariate: the placebo refits it on each permutation."""
        return SITE_MODES[self.mode].covariate

    def measure(self, sweep):
        """Its raw values at every layer (or window) on `sweep` (edits.sweep.options.Sweep)."""
        model, inputs, log = sweep.model, sweep.inputs, sweep.log
        if self.site == "stream":
            if self.several:
                return several.measure_stream_layers(model, inputs, log, self.mode)
            return measure_stream(model, inputs, log)
        if self.several:
            return several.measure_mlp_layers(model, sweep.recorded(self.at), self.mode, log, self.rank)
        return mlps.measure_mlp(model, sweep.recorded(self.at), self.mode, log)

    def fit(self, sweep):
        """`fit(inputs, layer, folds)` of one of its edits (a window's: `layer` is how many layers)."""
        n_layers = sweep.model.info.n_layers
        if self.site == "stream" and not self.several:
            return StreamEdit.fit
        if self.site == "stream":
            return several.stream_layers_fit(sweep.model.model, n_layers, self.mode)
        if self.several:
            return several.layers_fit(sweep.recorded(self.at), self.mode, n_layers, self.rank)
        return sweep.recorded(self.at).fit(self.mode)


def asked(options, inputs=None) -> list[LayerKind]:
    """The per-layer edits `options` (EditOptions) ask for, in the order the sweep measures them: the
    stream's at each layer (--stream), each --mlp-modes' at each layer, the stream's entering several
    layers per --stream-layer-modes, the MLPs' of several layers per --mlp-layer-modes and rank. An
    MLP's is fitted at the prediction and, where every control prompt of `inputs` has a phrase, at the
    slot (mlp.fitted_where; the several layers' at one of the two, mlp.layers_at); without `inputs`,
    at either (every kind a sweep may have saved)."""
    kinds = [LayerKind(STREAM, "stream", STREAM_MODE)] if options.stream else []
    modes = options.mlp_modes if options.mlp else ()
    single = mlps.fitted(modes) if inputs is None else mlps.fitted_where(inputs, modes)
    kinds += [LayerKind(mlps.kind_of(m, at), "mlp", m, at) for m, at in single]
    streams = options.stream_layer_modes if options.stream_layers else ()
    kinds += [LayerKind(several.stream_layers_kind(m), "stream", m, several=True) for m in streams]
    windows = several.layers_grid(options.mlp_ranks, options.mlp_layer_modes) if options.mlp_layers else ()
    positions = mlps.POSITIONS if inputs is None else (mlps.layers_at(inputs),)
    for (m, rank), at in itertools.product(windows, positions):
        kinds.append(LayerKind(mlps.kind_of(m, at, True, rank), "mlp", m, at, True, rank))
    return kinds
