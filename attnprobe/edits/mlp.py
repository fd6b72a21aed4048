"""MLP-output edits, DAMA's site (Limisiewicz, Marecek & Musil, ICLR 2024): what one decoder layer's
MLP adds to the residual stream (its output after the post-MLP norm where the model has one, as
Gemma's) changed at every position by one of five modes, each fitted at the prediction position (each
item's last token) and, but for zero (the same edit wherever fitted), at the slot's last token (the
occupation's, where DAMA fits; kind mlp-MODE-slot; the control's at its gendered phrase's last token):

  zero     the output removed: out -> 0
  mean     the output replaced by its mean over the training items
  project  the covariate's direction removed: out -> out - u u.out, u the unit least-squares slope
           of out on the covariate (estimate.covariate_directions)
  leace    the covariate erased keeping the definitional mean difference, with the stream's shrunk
           covariance (estimate.erasers): out -> out - u f.(out - mu)
  leace_mid  leace keeping the definitional midpoint too: neither label's mean output moves

The sweep (`edit --mlp`) measures every mode at every layer as the stream is measured
(edits.stream.measure_layers: each quarter's items by the edit fitted on its training quarters, the
control cross-fitted by word, the texts by the all-items edit): raw kind "mlp-MODE", k = the layer;
edits_mlp.csv holds a row per mode and layer and each mode's chosen row (stats.edits.stream_table).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from ..intervene.engine import Bank
from ..intervene.rerun import ROWS
from ..model.anatomy import decoder_layers, mlp_added
from ..stats.edits import MLP
from .estimate import covariate_directions, definitional_directions, definitional_midpoints, erasers
from .stream import StreamEdit, measure_layers

MODES = ("zero", "mean", "project", "leace", "leace_mid")  # the raw rows' kind: MLP + mode ("mlp-leace")
COVARIATE_MODES = ("project", "leace", "leace_mid")  # fitted on the covariate: these have a placebo
SLOT = "-slot"  # a mode fitted at the slot's last token: kind MLP + mode + SLOT ("mlp-leace-slot")
POSITIONS = ("last", "slot")  # where an MLP edit is fitted: the prediction, the slot's last token
FITTED = tuple((mode, "last") for mode in MODES) + tuple((mode, "slot") for mode in MODES[1:])


def kind_of(mode: str, at: str) -> str:
    """The sweep's kind (and saved file's name) of `mode` fitted `at`: mlp-leace, mlp-leace-slot."""
    return MLP + mode + (SLOT if at == "slot" else "")


MLP_KINDS = tuple(kind_of(mode, at) for mode, at in FITTED)  # every MLP edit the sweep may measure


def fitted_where(inputs) -> tuple[tuple[str, str], ...]:
    """(mode, at) of each MLP edit the sweep measures: at the prediction position ("last") and, where
    every control prompt has a phrase whose position is known (its `phrase` column), at the slot (but
    zero: the same edit wherever it is fitted)."""
    slot = (np.asarray(inputs.control_at) >= 0).all()
    return tuple((mode, at) for mode, at in FITTED if slot or at == "last")


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
        if self.mode in ("zero", "mean"):
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
        if record.get("mode") not in MODES:
            raise ValueError(f"mode {record.get('mode')!r} is none of {', '.join(MODES)}")
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
        """Fitted on the items of folds `on` from `outputs` (N, E: each item's MLP output at its last
        token, or at its slot's where `at` is "slot") and, for leace, `control` (M, E: each control
        prompt's, at the same site), keeping the definitional mean difference of the prompts a keep
        constraint is fitted on."""
        chosen = np.isin(inputs.fold, on)
        z = outputs[torch.as_tensor(chosen)].float()
        zero = torch.zeros(z.shape[-1], dtype=z.dtype, device=z.device)
        if mode in ("zero", "mean"):
            return cls(layer, zero, zero, z.mean(0) if mode == "mean" else zero, mode=mode, at=at)
        x = inputs.covariate[chosen]
        if mode == "project":
            u = covariate_directions(z[:, None, None, :], x)[0, 0]
            return cls(layer, u, u, zero, mode=mode, at=at)
        keep = inputs.keep_rows()
        fit, sign = control[torch.as_tensor(keep)].float()[:, None, None, :], inputs.control_sign[keep]
        midpoint = definitional_midpoints(fit, sign) if mode == "leace_mid" else None
        g = definitional_directions(fit, sign)
        along, functional, mean = erasers(z[:, None, None, :], x, g, shrink=True, midpoint=midpoint)
        return cls(layer, along[0, 0], functional[0, 0], mean[0, 0], mode=mode, at=at)


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

    def _recorded(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.outputs is None:
            where = (self.inputs.slot_at, self.inputs.control_at) if self.at == "slot" else (None, None)
            banks = (self.inputs.bank, self.inputs.control)
            self.outputs = tuple(mlp_outputs(self.module, b, p) for b, p in zip(banks, where))
        return self.outputs

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
    return measure_layers(model, recorded.inputs, fit, recorded.site, kind_of(mode, recorded.at), what, log)
