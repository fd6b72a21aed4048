"""Edits of several MLP layers at once (`edit --mlp-layers`, DAMA's design: the MLP outputs of
consecutive layers edited together, Limisiewicz, Marecek & Musil, ICLR 2024): MlpLayers, an ordered
set of MLP edits (edits.layers.mlp), each fitted on the MLP outputs of the model with the edits of the
layers below it applied (fitted_layers). The sweep measures windows of DAMA's layer counts (1, 5 and 9
of LLaMA 7B's 32 layers) scaled to the model's depth, ending at a mid-upper layer, for DAMA's
projection (project: out -> (I - W'W) out, no affine term, W the rank's orthonormal directions,
`--mlp-ranks`), 2DAMA's keep rule (dual: only the directions it keeps) and leace_mid, fitted at the
slot where the control names its phrases: raw kind "mlp-layers-MODE(-rRANK)(-slot)", k = the number of
layers, so the chosen row takes each quarter's count from the other quarters. An edit of rank r holds
r parts per layer, applied in order: orthonormal projections, so together they are I - W'W.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ...attention.capture import model_edit
from ...intervene.engine import Bank
from ...intervene.rerun import ROWS, rerun_logits
from ...intervene.sites import registered
from ...model.anatomy import decoder_layers, mlp_added, module_of
from .mlp import POSITIONS, MlpEdit, Recorded, kind_of
from .modes import SITE_MODES
from .stream import PARAMETERS, PerLayer, measure_layers, untouched

LAYERS_MODES = ("project", "dual", "leace_mid")  # DAMA's projection, 2DAMA's keep rule, the midpoint kept
MAX_RANK = 64  # the most directions an edit of several layers removes per layer (--mlp-ranks)
DAMA_COUNTS, DAMA_DEPTH = (1, 5, 9), 32  # DAMA's layer counts on LLaMA 7B's 32 layers


def layers_grid(ranks=(1,)) -> tuple[tuple[str, int], ...]:
    """(mode, rank) of each edit of several layers measured: every mode of LAYERS_MODES at rank 1, the
    ranked ones (project, dual) at each of `ranks`."""
    return tuple(
        (mode, rank) for mode in LAYERS_MODES for rank in ranks if rank == 1 or SITE_MODES[mode].ranked
    )


def layers_kinds(ranks=(1,)) -> tuple[str, ...]:  # the raw kinds of layers_grid(ranks), either position
    return tuple(kind_of(mode, at, True, rank) for mode, rank in layers_grid(ranks) for at in POSITIONS)


@dataclass(frozen=True)
class MlpLayers:
    """MLP edits of several layers applied together, in layer order (`parts`: `rank` of them per layer,
    applied in order); saved, applied and transferred as one edit. Inside the sweep each part may hold
    per-row parameters (StreamEdit.rows)."""

    kind: ClassVar[str] = "mlp_layers"
    parts: tuple[MlpEdit, ...] = ()

    @property
    def layer(self) -> int:
        """The first edited layer (a rerun starts from the stream entering it)."""
        return self.parts[0].layer

    @property
    def rowwise(self) -> bool:
        return self.parts[0].rowwise

    @classmethod
    def stacked(cls, fitted: list, which: torch.Tensor) -> MlpLayers:
        """One edit whose every part has per-row parameters: row n's are fitted[which[n]]'s."""
        same_layer = zip(*(edit.parts for edit in fitted))
        return replace(fitted[0], parts=tuple(MlpEdit.stacked(list(parts), which) for parts in same_layer))

    @property
    def rank(self) -> int:  # the directions (parts) per layer
        return len(self.parts) // len({part.layer for part in self.parts})

    @property
    def name(self) -> str:
        first = self.parts[0]
        return kind_of(first.mode, first.at, True, self.rank)

    def rows(self, rows: torch.Tensor) -> MlpLayers:
        return replace(self, parts=tuple(part.rows(rows) for part in self.parts))

    def sites(self) -> str:
        first, layers = self.parts[0], dict.fromkeys(part.layer for part in self.parts)
        fitted = ", fitted at the slot" if first.at == "slot" else ""
        ranked = f", rank {self.rank}" if self.rank > 1 else ""
        return f"MLP outputs of layers {', '.join(map(str, layers))} ({first.mode}{ranked}{fitted})"

    @contextmanager
    def applied(self, model):
        """Within the block every pass of `model` has each part at its layer."""
        layers = decoder_layers(module_of(model))
        with registered([part.hook(layers[part.layer]) for part in self.parts]), model_edit(untouched):
            yield

    def stored(self) -> tuple[dict, dict, dict]:
        tensors = {
            f"{i}.{name}": t for i, part in enumerate(self.parts) for name, t in part.stored()[0].items()
        }
        first = self.parts[0]
        return (
            tensors,
            {},
            {"layers": [part.layer for part in self.parts], "mode": first.mode, "fitted_at": first.at},
        )

    @classmethod
    def restored(cls, record: dict, tensors: dict) -> MlpLayers:
        layers = record.get("layers")
        if not (isinstance(layers, list) and layers and all(type(n) is int for n in layers)):
            raise ValueError(f"layers must be a list of layer numbers, not {layers!r}")
        rank = len(layers) // len(set(layers))
        if layers != sorted(layers) or any(layers.count(n) != rank for n in layers) or rank > MAX_RANK:
            raise ValueError(f"layers {layers} must be increasing, each as often (the rank, 1 to {MAX_RANK})")
        names = {f"{i}.{name}" for i in range(len(layers)) for name in PARAMETERS}
        if set(tensors) != names:
            raise ValueError(f"an edit of {len(layers)} MLP layers holds {', '.join(sorted(names))}")
        return cls(
            tuple(
                MlpEdit.restored(
                    {**record, "layer": n}, {name: tensors[f"{i}.{name}"] for name in PARAMETERS}
                )
                for i, n in enumerate(layers)
            )
        )


def dama_windows(n_layers: int) -> tuple[tuple[int, ...], int]:
    """(layer counts, last layer) of the windows measured: DAMA's counts scaled to the model's depth
    (at least 1, 2 and 3 layers, so a shallow model has windows of several layers too; at most the
    layers up to the last), ending at the layer 85% of the way up (a mid-upper layer, where DAMA's
    causal tracing put gender bias). SmolLM2's 30 layers: 1, 5, 8 ending at 25; Gemma 3's 18: 1, 3, 5
    ending at 14."""
    end = round(0.85 * (n_layers - 1))
    scaled = (max(i + 1, round(c * n_layers / DAMA_DEPTH)) for i, c in enumerate(DAMA_COUNTS))
    return tuple(sorted({min(end + 1, c) for c in scaled})), end


class _Stop(Exception):  # raised by a hook once the one MLP output a pass is run for is recorded
    pass


@torch.inference_mode()
def mlp_output_at(module, bank: Bank, at, layer: int, start: int = 0) -> torch.Tensor:
    """(N, E) what layer `layer`'s MLP adds to the stream at each sequence's position `at` (None: its
    last token), under whatever edits are in force at layers `start` and above: each pass starts from
    the recorded stream entering layer `start` and stops at `layer`."""
    at = bank.lengths - 1 if at is None else torch.as_tensor(at, device=bank.lengths.device)
    caught = {}

    def stop(_, args, out):
        caught["out"] = out[0] if isinstance(out, tuple) else out
        raise _Stop

    handle = mlp_added(decoder_layers(module)[layer]).register_forward_hook(stop)
    out = []
    try:
        for first in range(0, len(bank.lengths), ROWS):
            rows = torch.arange(first, min(first + ROWS, len(bank.lengths)), device=bank.lengths.device)
            try:
                rerun_logits(module, bank, rows, start, bank.hidden[start][rows])
            except _Stop:
                pass
            out.append(caught["out"][torch.arange(len(rows), device=rows.device), at[rows]].float())
    finally:
        handle.remove()
    return torch.cat(out)


def fitted_layers(recorded: Recorded, source, layers, on, mode: str, rank: int = 1) -> MlpLayers:
    """The edit of `layers` (in order), each layer's `rank` parts fitted (MlpEdit.ranked, on the items
    of folds `on`) on the MLP outputs of the model with the parts below it applied: the first from the
    recorded outputs, each next one from passes of its own."""
    parts: list[MlpEdit] = []
    banks = (source.bank, source.control)
    for layer in layers:
        if parts:
            with MlpLayers(tuple(parts)).applied(recorded.module):
                items, control = (
                    mlp_output_at(recorded.module, bank, p, layer, start=layers[0])
                    for bank, p in zip(banks, recorded.positions(source))
                )
        else:
            items, control = recorded.both(layer)
        parts += MlpEdit.ranked(items, control, source, (layer, on), mode, recorded.at, rank)
    return MlpLayers(tuple(parts))


def layers_fit(recorded: Recorded, mode: str, n_layers: int, rank: int = 1):
    """`fit(inputs, count, folds)` of `mode` at `rank` on the `count` layers ending at dama_windows'
    last layer."""
    end = dama_windows(n_layers)[1]
    return lambda source, count, on: fitted_layers(
        recorded, source, range(end - count + 1, end + 1), on, mode, rank
    )


def measure_mlp_layers(model, recorded: Recorded, mode: str, log=lambda m: None, rank: int = 1):
    """Raw values (kind mlp-layers-MODE(-rR)(-slot), k = the number of layers) of `mode` at `rank` on
    each window of dama_windows (stream.measure_layers; no readout: the edited vectors are several)."""
    counts, end = dama_windows(model.info.n_layers)
    fit = layers_fit(recorded, mode, model.info.n_layers, rank)
    fitted = ", fitted at the slot" if recorded.at == "slot" else ""
    ranked = f", rank {rank}" if rank > 1 else ""
    what = f"MLP outputs ({mode}{ranked}{fitted}) of the layers up to {end}, count"
    name = kind_of(mode, recorded.at, True, rank)
    return measure_layers(model, recorded.inputs, PerLayer(fit, None, name, what, counts), log)
