"""Edits of several MLP layers at once (`edit --mlp-layers`, DAMA's design: the MLP outputs of
consecutive layers edited together, Limisiewicz, Marecek & Musil, ICLR 2024): MlpLayers, an ordered
set of MLP edits (edits.layers.mlp), each fitted on the MLP outputs of the model with the edits of the
layers below it applied (fitted_layers). The sweep measures windows of DAMA's layer counts (1, 5 and 9
of LLaMA 7B's 32 layers) scaled to the model's depth, ending at a mid-upper layer, by default for
DAMA's projection (project: out -> (I - W'W) out, no affine term, W the rank's orthonormal directions,
`--mlp-ranks`), 2DAMA's keep rule (dual: only the directions it keeps) and leace_mid, and for any
other mode `--mlp-layer-modes` lists (zero, mean, leace, a plug-in's), fitted at the slot where the
control names its phrases: raw kind "mlp-layers-MODE(-rRANK)(-slot)", k = the number of
layers, so the chosen row takes each quarter's count from the other quarters. An edit of rank r holds
r parts per layer, applied in order: orthonormal projections, so together they are I - W'W.

The stream alike (`edit --stream-layers`): StreamLayers, the stream's erasers (edits.layers.stream)
entering the same windows of layers, each fitted on the stream of the model erased below it
(fitted_stream_layers); raw kind "stream-layers", and for another mode of `--stream-layer-modes`
(leace_mid, project, ...) "stream-layers-MODE". Both are LayerEdits.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ...attention.capture import model_edit
from ...intervene.engine import Bank
from ...intervene.rerun import ROWS, Reached, rerun_until
from ...intervene.sites import registered
from ...model.anatomy import decoder_layers, mlp_added, module_of
from ...stats.edits import STREAM_LAYERS
from .mlp import MlpEdit, Recorded, kind_of
from .modes import SITE_MODES
from .stream import PARAMETERS, STREAM_MODE, PerLayer, StreamEdit, last_states, measure_layers, untouched

# --mlp-layers' modes by default: DAMA's projection, 2DAMA's keep rule, the midpoint kept (--mlp-layer-modes
# takes any registered mode)
LAYERS_MODES = ("project", "dual", "leace_mid")
MAX_RANK = 64  # the most directions an edit of several layers removes per layer (--mlp-ranks)
DAMA_COUNTS, DAMA_DEPTH = (1, 5, 9), 32  # DAMA's layer counts on LLaMA 7B's 32 layers


def layers_grid(ranks=(1,), modes=LAYERS_MODES) -> tuple[tuple[str, int], ...]:
    """(mode, rank) of each edit of several layers measured: every mode of `modes` at rank 1, the
    ranked ones (project, dual) at each of `ranks`."""
    return tuple((mode, rank) for mode in modes for rank in ranks if rank == 1 or SITE_MODES[mode].ranked)


@dataclass(frozen=True)
class LayerEdits:
    """Edits of several layers applied together, in layer order (`parts`: per layer `rank` of them,
    applied in order, each a StreamEdit or a subclass); saved, applied and transferred as one edit.
    Inside the sweep each part may hold per-row parameters (StreamEdit.rows)."""

    kind: ClassVar[str] = "layers"
    part: ClassVar[type] = StreamEdit
    parts: tuple[StreamEdit, ...] = ()

    @property
    def layer(self) -> int:
        """The first edited layer (a rerun starts from the stream entering it)."""
        return self.parts[0].layer

    @property
    def rowwise(self) -> bool:
        return self.parts[0].rowwise

    @classmethod
    def stacked(cls, fitted: list, which: torch.Tensor) -> LayerEdits:
        """One edit whose every part has per-row parameters: row n's are fitted[which[n]]'s."""
        same_layer = zip(*(edit.parts for edit in fitted))
        return replace(fitted[0], parts=tuple(cls.part.stacked(list(parts), which) for parts in same_layer))

    @property
    def rank(self) -> int:  # the directions (parts) per layer
        return len(self.parts) // len({part.layer for part in self.parts})

    def rows(self, rows: torch.Tensor) -> LayerEdits:
        return replace(self, parts=tuple(part.rows(rows) for part in self.parts))

    @contextmanager
    def applied(self, model):
        """Within the block every pass of `model` has each part at its layer."""
        layers = decoder_layers(module_of(model))
        with registered([part.hook(layers[part.layer]) for part in self.parts]), model_edit(untouched):
            yield

    def about(self) -> dict:  # what a saved file records of the parts besides their layers
        return {}

    def stored(self) -> tuple[dict, dict, dict]:
        tensors = {
            f"{i}.{name}": t for i, part in enumerate(self.parts) for name, t in part.stored()[0].items()
        }
        return tensors, {}, {"layers": [part.layer for part in self.parts], **self.about()}

    @classmethod
    def restored(cls, record: dict, tensors: dict) -> LayerEdits:
        layers = record.get("layers")
        if not (isinstance(layers, list) and layers and all(type(n) is int for n in layers)):
            raise ValueError(f"layers must be a list of layer numbers, not {layers!r}")
        rank = len(layers) // len(set(layers))
        if layers != sorted(layers) or any(layers.count(n) != rank for n in layers) or rank > MAX_RANK:
            raise ValueError(f"layers {layers} must be increasing, each as often (the rank, 1 to {MAX_RANK})")
        names = {f"{i}.{name}" for i in range(len(layers)) for name in PARAMETERS}
        if set(tensors) != names:
            raise ValueError(f"an edit of {len(layers)} layers holds {', '.join(sorted(names))}")
        own = lambda i: {name: tensors[f"{i}.{name}"] for name in PARAMETERS}  # part i's tensors
        return cls(tuple(cls.part.restored({**record, "layer": n}, own(i)) for i, n in enumerate(layers)))


@dataclass(frozen=True)
class MlpLayers(LayerEdits):
    """The MLP outputs of several layers edited together (MlpEdit parts)."""

    kind: ClassVar[str] = "mlp_layers"
    part: ClassVar[type] = MlpEdit

    @property
    def name(self) -> str:
        first = self.parts[0]
        return kind_of(first.mode, first.at, True, self.rank)

    def sites(self) -> str:
        first, layers = self.parts[0], dict.fromkeys(part.layer for part in self.parts)
        fitted = ", fitted at the slot" if first.at == "slot" else ""
        ranked = f", rank {self.rank}" if self.rank > 1 else ""
        return f"MLP outputs of layers {', '.join(map(str, layers))} ({first.mode}{ranked}{fitted})"

    def about(self) -> dict:
        return {"mode": self.parts[0].mode, "fitted_at": self.parts[0].at}


@dataclass(frozen=True)
class StreamLayers(LayerEdits):
    """The stream's edits entering several layers (StreamEdit parts, fitted by `mode`: LEACE unless
    --stream-layer-modes names another), each fitted on the stream of the model with the edits below
    it applied (fitted_stream_layers)."""

    kind: ClassVar[str] = "stream_layers"
    mode: str = STREAM_MODE

    @property
    def name(self) -> str:
        return stream_layers_kind(self.mode)

    def sites(self) -> str:
        mode = "" if self.mode == STREAM_MODE else f" ({self.mode})"
        return f"stream entering layers {', '.join(str(part.layer) for part in self.parts)}{mode}"

    def about(self) -> dict:
        return {"mode": self.mode}

    @classmethod
    def restored(cls, record: dict, tensors: dict) -> StreamLayers:
        mode = record.get("mode", STREAM_MODE)  # files saved before the stream took modes: LEACE
        if mode not in SITE_MODES:
            raise ValueError(f"mode {mode!r} is not a registered mode ({', '.join(SITE_MODES)})")
        return replace(super().restored(record, tensors), mode=mode)


def stream_layers_kind(mode: str = STREAM_MODE) -> str:
    """The raw kind (and saved file's name) of the stream's edits of several layers by `mode`:
    stream-layers (LEACE, as before modes), stream-layers-leace_mid."""
    return STREAM_LAYERS if mode == STREAM_MODE else f"{STREAM_LAYERS}-{mode}"


def dama_windows(n_layers: int) -> tuple[tuple[int, ...], int]:
    """(layer counts, last layer) of the windows measured: DAMA's counts scaled to the model's depth
    (at least 1, 2 and 3 layers, so a shallow model has windows of several layers too; at most the
    layers up to the last), ending at the layer 85% of the way up (a mid-upper layer, where DAMA's
    causal tracing put gender bias). SmolLM2's 30 layers: 1, 5, 8 ending at 25; Gemma 3's 18: 1, 3, 5
    ending at 14."""
    end = round(0.85 * (n_layers - 1))
    scaled = (max(i + 1, round(c * n_layers / DAMA_DEPTH)) for i, c in enumerate(DAMA_COUNTS))
    return tuple(sorted({min(end + 1, c) for c in scaled})), end


@torch.inference_mode()
def state_at(module, bank: Bank, at, layer: int, start: int = 0, entering: bool = False, edit=None):
    """(N, E) what layer `layer`'s MLP adds to the stream (`entering`: the stream entering the layer)
    at each sequence's position `at` (None: its last token), with `edit` (of layers `start` and above)
    applied: each pass starts from the recorded stream entering layer `start` and stops at `layer`.
    The edit and the catch are entered inside the rerun, after the recorded stream is put in at
    `start` (a pre-hook entered before it would act on what that replaces)."""
    at = bank.lengths - 1 if at is None else torch.as_tensor(at, device=bank.lengths.device)
    caught = {}

    def stop(_, args, out):
        caught["out"] = out[0] if isinstance(out, tuple) else out
        raise Reached

    def stop_entering(_, args, kwargs):
        caught["out"] = args[0] if args else kwargs["hidden_states"]
        raise Reached

    @contextmanager
    def catching():
        block = decoder_layers(module)[layer]
        if entering:
            handle = block.register_forward_pre_hook(stop_entering, with_kwargs=True)
        else:
            handle = mlp_added(block).register_forward_hook(stop)
        try:
            yield
        finally:
            handle.remove()

    out = []
    for first in range(0, len(bank.lengths), ROWS):
        rows = torch.arange(first, min(first + ROWS, len(bank.lengths)), device=bank.lengths.device)
        contexts = [*([] if edit is None else [edit.applied(module)]), catching()]
        rerun_until(module, bank, rows, start, bank.hidden[start][rows], contexts)
        out.append(caught["out"][torch.arange(len(rows), device=rows.device), at[rows]].float())
    return torch.cat(out)


def in_order(layers, recorded, rerun, fit, edit) -> LayerEdits:
    """`edit(parts)` of `layers` fitted in order: `fit(layer, items, control)` -> the layer's parts,
    on `recorded(layer)` for the first layer and on `rerun(layer, below)` (the model with `below`, the
    parts fitted so far, applied) for each next one."""
    parts: list = []
    for layer in layers:
        items, control = rerun(layer, edit(tuple(parts))) if parts else recorded(layer)
        parts += fit(layer, items, control)
    return edit(tuple(parts))


def fitted_layers(recorded: Recorded, source, layers, on, mode: str, rank: int = 1) -> MlpLayers:
    """The edit of `layers` (in order), each layer's `rank` parts fitted (MlpEdit.ranked, on the items
    of folds `on`) on the MLP outputs of the model with the parts below it applied: the first from the
    recorded outputs, each next one from passes of its own (but for a mode that does not read them:
    zero)."""
    banks, positions = (source.bank, source.control), recorded.positions(source)

    def rerun(layer, below):
        if not SITE_MODES[mode].fitted:  # zero reads nothing: the recorded outputs stand in
            return recorded.both(layer)
        return tuple(
            state_at(recorded.module, bank, p, layer, layers[0], edit=below)
            for bank, p in zip(banks, positions)
        )

    def fit(layer, items, control):
        return MlpEdit.ranked(items, control, source, (layer, on), mode, recorded.at, rank)

    return in_order(layers, recorded.both, rerun, fit, MlpLayers)


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


def fitted_stream_layers(module, source, layers, on, mode: str = STREAM_MODE) -> StreamLayers:
    """The stream's edits by `mode` entering `layers` (in order; StreamEdit.fitted on the items of
    folds `on`), each fitted on the stream of the model with the edits below it applied: the first
    from the recorded stream, each next one from passes of its own."""
    banks = (source.bank, source.control)

    def recorded(layer):
        return tuple(last_states(bank, layer)[:, 0, 0] for bank in banks)

    def rerun(layer, below):
        return tuple(state_at(module, bank, None, layer, layers[0], True, below) for bank in banks)

    def fit(layer, items, control):
        return [StreamEdit.fitted(source, layer, on, items, control, mode)]

    return in_order(layers, recorded, rerun, fit, lambda parts: StreamLayers(parts, mode))


def stream_layers_fit(module, n_layers: int, mode: str = STREAM_MODE):
    """`fit(inputs, count, folds)` of the stream's edits by `mode` on the `count` layers ending at
    dama_windows' last layer."""
    end = dama_windows(n_layers)[1]
    return lambda source, count, on: fitted_stream_layers(
        module, source, range(end - count + 1, end + 1), on, mode
    )


def measure_stream_layers(model, inputs, log=lambda m: None, mode: str = STREAM_MODE):
    """Raw values (kind stream_layers_kind(mode), k = the number of layers) of the stream edited by
    `mode` entering each window of dama_windows' layers (stream.measure_layers; no readout: the edited
    vectors are several)."""
    counts, end = dama_windows(model.info.n_layers)
    fit = stream_layers_fit(model.model, model.info.n_layers, mode)
    what = f"stream edited ({mode}) entering the layers up to {end}, count"
    return measure_layers(model, inputs, PerLayer(fit, None, stream_layers_kind(mode), what, counts), log)
