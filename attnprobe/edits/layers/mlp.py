"""MLP-output edits, DAMA's site (Limisiewicz, Marecek & Musil, ICLR 2024): what one decoder layer's
MLP adds to the residual stream (its output after the post-MLP norm where the model has one, as
Gemma's) changed at every position by a mode (edits.layers.modes: zero, mean, project, leace,
leace_mid, or a plug-in's), each fitted at the prediction position (each item's last token) and, but
for zero (the same edit wherever fitted), at the slot's last token (the occupation's, where DAMA fits;
kind mlp-MODE-slot; the control's at its gendered phrase's last token). `--mlp` measures MODES (or the
modes --mlp-modes lists) at every layer; leace_mid is measured in edits of several layers.

The sweep (`edit --mlp`) measures every mode at every layer as the stream is measured
(edits.layers.stream.measure_layers: each quarter's items by the edit fitted on its training quarters, the
control cross-fitted by word, the texts by the all-items edit): raw kind "mlp-MODE", k = the layer;
edits_mlp.csv holds a row per mode and layer and each mode's chosen row (stats.keeping.layers.layer_tables).

Several layers at once (`edit --mlp-layers`, DAMA's design): edits.layers.several.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from ...intervene.engine import Bank
from ...intervene.rerun import ROWS
from ...model.anatomy import decoder_layers, mlp_added
from ...stats.edits import MLP, MLP_LAYERS
from .modes import SITE_MODES
from .stream import PerLayer, StreamEdit, measure_layers

MODES = ("zero", "mean", "project", "leace")  # --mlp's by default, at every layer; raw kind MLP + mode
SLOT = "-slot"  # a mode fitted at the slot's last token: kind MLP + mode + SLOT ("mlp-leace-slot")
POSITIONS = ("last", "slot")  # where an MLP edit is fitted: the prediction, the slot's last token


def layers_at(inputs) -> str:
    """Where an edit of several layers is fitted: at the slot (DAMA's site) where every control prompt
    has a phrase whose position is known, else at the prediction."""
    return "slot" if (np.asarray(inputs.control_at) >= 0).all() else "last"


def kind_of(mode: str, at: str, several: bool = False, rank: int = 1) -> str:
    """The sweep's kind (and saved file's name) of `mode` fitted `at`: mlp-leace, mlp-leace-slot, and
    of several layers mlp-layers-project-slot, at rank 8 mlp-layers-project-r8-slot."""
    ranked = f"-r{rank}" if rank > 1 else ""
    return (MLP_LAYERS if several else MLP) + mode + ranked + (SLOT if at == "slot" else "")


def fitted(modes=MODES) -> tuple[tuple[str, str], ...]:
    """(mode, at) of each MLP edit of `modes` the sweep may measure: each at the prediction and, but a
    mode that does not depend on where it is fitted (zero), at the slot."""
    last = tuple((mode, "last") for mode in modes)
    return last + tuple((mode, "slot") for mode in modes if SITE_MODES[mode].fitted)


def fitted_where(inputs, modes=MODES) -> tuple[tuple[str, str], ...]:
    """(mode, at) of each MLP edit of `modes` the sweep measures: at the prediction position ("last")
    and, where every control prompt has a phrase whose position is known (its `phrase` column), at the
    slot (fitted())."""
    slot = layers_at(inputs) == "slot"
    return tuple((mode, at) for mode, at in fitted(modes) if slot or at == "last")


def _replacing(edit):
    """A forward hook putting `edit.erase(out)` in place of a module's output (an MoE block's extra
    outputs, e.g. router logits, pass through)."""

    def hook(_, args, output):
        if isinstance(output, tuple):
            return (edit.erase(output[0]), *output[1:])
        return edit.erase(output)

    return hook


@dataclass(frozen=True)
class MlpEdit(StreamEdit):
    """The edit of the MLP output of `layer`; parameters (E,) or, inside the sweep, (B, E)."""

    kind: ClassVar[str] = "mlp"
    mode: str = "leace"
    at: str = "last"  # where it was fitted: "last" (the prediction position) or "slot"

    def erase(self, out: torch.Tensor) -> torch.Tensor:
        """out (B, T, E) edited at every position."""
        u, f, mu = (t.to(out)[:, None, :] if t.dim() == 2 else t.to(out) for t in self.params)
        if SITE_MODES[self.mode].replaces:
            return torch.zeros_like(out) + mu
        return out - u * ((out - mu) * f).sum(-1, keepdim=True)

    @property
    def name(self) -> str:
        return kind_of(self.mode, self.at)

    def sites(self) -> str:
        fitted = ", fitted at the slot" if self.at == "slot" else ""
        return f"MLP output of layer {self.layer} ({self.mode}{fitted})"

    def stored(self) -> tuple[dict, dict, dict]:
        tensors, scalars, where = super().stored()  # zero, mean and project share tensors: saved apart
        return (
            {name: t.clone() for name, t in tensors.items()},
            scalars,
            {**where, "mode": self.mode, "fitted_at": self.at},
        )

    @classmethod
    def restored(cls, record: dict, tensors: dict) -> MlpEdit:
        if not isinstance(record.get("mode"), str) or record["mode"] not in SITE_MODES:
            raise ValueError(f"mode {record.get('mode')!r} is none of {', '.join(SITE_MODES)}")
        if record.get("fitted_at", "last") not in POSITIONS:
            raise ValueError(f"fitted_at {record['fitted_at']!r} is neither last nor slot")
        stream = StreamEdit.restored(record, tensors)
        return cls(stream.layer, *stream.params, mode=record["mode"], at=record.get("fitted_at", "last"))

    def hook(self, layer):
        """Register the edit on decoder layer `layer`: a hook replacing what its MLP adds to the stream
        (model.anatomy.mlp_added: after Gemma's post-MLP norm, where a linear eraser still erases)."""
        return mlp_added(layer).register_forward_hook(_replacing(self))

    @classmethod
    def fitted(
        cls, outputs: torch.Tensor, control: torch.Tensor, inputs, layer: int, on, mode: str, at: str = "last"
    ) -> MlpEdit:
        """Fitted by `mode` (edits.layers.modes) on the items of folds `on` from `outputs` (N, E: each
        item's MLP output at its last token, or at its slot's where `at` is "slot") and `control` (M, E:
        each control prompt's, at the same site; a keep constraint is fitted on those of half 0)."""
        return cls.ranked(outputs, control, inputs, (layer, on), mode, at)[0]

    @classmethod
    def ranked(cls, outputs, control, inputs, where: tuple, mode: str, at: str, rank: int = 1) -> list:
        """The `rank` parts (MlpEdits of one layer, applied in order) of `mode`'s edit of rank `rank`
        (SiteMode.fit_ranked), fitted as `fitted` is at `where` (layer, folds)."""
        (layer, on), keep = where, inputs.keep_rows()
        chosen = np.isin(inputs.fold, on)
        z, kept = outputs[torch.as_tensor(chosen)].float(), control[torch.as_tensor(keep)].float()
        fit = SITE_MODES[mode].fit_ranked(z, inputs.covariate[chosen], kept, inputs.control_sign[keep], rank)
        return [cls(layer, *params, mode=mode, at=at) for params in fit]


@torch.inference_mode()
def mlp_outputs(module, bank: Bank, at: torch.Tensor | None = None) -> torch.Tensor:
    """(N, L, E) what each layer's MLP adds to the stream at each sequence's position `at` (N,), by
    default its last token (a pass of its own: a bank records the MLP modules' outputs, before
    Gemma's post-MLP norm)."""
    at = bank.lengths - 1 if at is None else torch.as_tensor(at, device=bank.lengths.device)
    layers = decoder_layers(module)
    caught: dict[int, torch.Tensor] = {}
    hooks = [
        mlp_added(layer).register_forward_hook(
            lambda _, args, out, n=n: caught.__setitem__(n, out[0] if isinstance(out, tuple) else out)
        )
        for n, layer in enumerate(layers)
    ]
    out = []
    try:
        for start in range(0, len(bank.lengths), ROWS):
            ids, lengths = bank.ids[start : start + ROWS], bank.lengths[start : start + ROWS]
            mask = (torch.arange(ids.shape[1], device=ids.device)[None] < lengths[:, None]).long()
            module(input_ids=ids, attention_mask=mask, use_cache=False)
            where = torch.arange(len(lengths), device=ids.device), at[start : start + ROWS]
            out.append(torch.stack([caught[n][where].float() for n in range(len(layers))], 1))
    finally:
        for handle in hooks:
            handle.remove()
    return torch.cat(out)


class Recorded:
    """The MLP outputs of the items and the control prompts at their last token (`at` "last") or at
    their slot's and phrase's (`at` "slot"), recorded on first use (one forward pass of each), and
    the fit of each mode from them."""

    def __init__(self, module, inputs, at: str = "last"):
        self.module, self.inputs, self.at, self.outputs = module, inputs, at, None

    def positions(self, source) -> tuple:
        """Where the items and the control prompts of `source` (an Inputs) are read: their slot's and
        phrase's last token, or None for each one's last token."""
        return (source.slot_at, source.control_at) if self.at == "slot" else (None, None)

    def _recorded(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.outputs is None:
            banks = (self.inputs.bank, self.inputs.control)
            where = self.positions(self.inputs)
            self.outputs = tuple(mlp_outputs(self.module, b, p) for b, p in zip(banks, where))
        return self.outputs

    def both(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, E) the items' and (M, E) the control prompts' MLP outputs of `layer` where fitted."""
        items, control = self._recorded()
        return items[:, layer], control[:, layer]

    def site(self, layer: int) -> torch.Tensor:
        """(N, E) each item's MLP output of `layer` where the edits are fitted."""
        return self._recorded()[0][:, layer]

    def fit(self, mode: str):
        """`fit(inputs, layer, folds)` of the MLP edit `mode`, as measure_layers takes it (the outputs
        recorded at its first call: a sweep whose parts are all read back records nothing)."""

        def fit(source, layer: int, on) -> MlpEdit:
            items, control = self._recorded()
            return MlpEdit.fitted(items[:, layer], control[:, layer], source, layer, on, mode, self.at)

        return fit


def measure_mlp(model, recorded: Recorded, mode: str, log=lambda m: None):
    """Raw values (kind mlp-MODE or mlp-MODE-slot, k = layer) of `mode` at every layer
    (stream.measure_layers)."""
    what = f"MLP output ({mode}{', fitted at the slot' if recorded.at == 'slot' else ''}) of layer"
    fit = recorded.fit(mode)
    return measure_layers(
        model, recorded.inputs, PerLayer(fit, recorded.site, kind_of(mode, recorded.at), what), log
    )
