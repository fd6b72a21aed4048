"""Head edits fitted site by site (`edit --sequential`): an edit of heads at several layers as an
ordered set of sites, the heads of each layer fitted on their outputs in the model whose heads below
are already edited. The at-once fit (`Kind.fit`) estimates every head from the clean model's
recording, so the parameters of a head above an edited one are fitted on outputs the edit below
then changes (a head that reads an erased head's output no longer carries what it was fitted to
remove, and may carry what it was not). The heads of one layer are fitted together: none of them
reads another's output.

Each kind whose parameters are estimated from recorded outputs (a field left None until fitted:
Mean, Resample, Project and the LEACE kinds) gets a twin, raw kind KIND-seq, measured, refitted by
the placebo (its heads chosen again, then fitted in order) and saved as the sweep's KIND is. Its fit
depends on the heads, so it is made per quarter and k; its random head sets are not drawn (each set
would need fits of its own): the placebo is its null.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch

from ..attention.capture import editing, model_edit
from ..intervene.rerun import ROWS, Reached, rerun_until
from ..intervene.sites import registered
from ..model.anatomy import decoder_layers, module_of
from .editor import RowEditor
from .kinds import KINDS, HeadEdit

SEQUENTIAL = "-seq"  # the raw kind of a kind fitted in order: leace_mid-seq


def recorded_kind(kind: type) -> bool:
    """Whether a kind's parameters are estimated from recorded outputs (a field left None until fitted)."""
    return any(f.default is None for f in fields(kind))


def sequential_kinds(kinds) -> tuple[str, ...]:
    """The raw kinds of `kinds` fitted in order: KIND-seq of each kind with recorded parameters."""
    return tuple(kind + SEQUENTIAL for kind in kinds if recorded_kind(KINDS[kind]))


def kind_class(name: str) -> tuple[type, bool]:
    """(the kind of a raw head kind, whether it is fitted in order): 'leace-seq' -> (Leace, True)."""
    if name not in KINDS and name.endswith(SEQUENTIAL) and name[: -len(SEQUENTIAL)] in KINDS:
        return KINDS[name[: -len(SEQUENTIAL)]], True
    return KINDS[name], False


@torch.inference_mode()
def outputs_at(module, bank, layer: int, start: int, below: HeadEdit, hidden=None) -> tuple:
    """(z (N, H, T, D): the heads' outputs at `layer` of every sequence of `bank` (T its width;
    padding zero), the stream entering `layer` (N, T, E)) with `below` (heads of layers `start` ..
    layer - 1) applied: each pass runs from `hidden` (N, T, E), the stream entering `start` (default
    the recorded one), and stops at `layer`'s attention. An edit that acts at the prediction alone
    acts at each sequence's last token, as in the sweep's passes."""
    L, H = len(bank.outputs), bank.outputs[0].shape[1]
    hidden = bank.hidden[start] if hidden is None else hidden
    heads, caught = below.mask(L, H)[None], {}
    z_out, h_out = torch.zeros_like(bank.outputs[layer]), torch.zeros_like(hidden)

    def catch(site):
        if site.layer == layer:
            caught["z"] = site.output
            raise Reached
        return site.output

    def entering(_, args, kwargs):
        caught["h"] = args[0] if args else kwargs["hidden_states"]

    hook = decoder_layers(module_of(module))[layer].register_forward_pre_hook(entering, with_kwargs=True)
    with registered([hook]):
        for first in range(0, len(bank.lengths), ROWS):
            rows = torch.arange(first, min(first + ROWS, len(bank.lengths)), device=bank.lengths.device)
            editor = RowEditor(below, heads, last=bank.lengths[rows] - 1)
            rerun_until(module, bank, rows, start, hidden[rows], [model_edit(editor), editing(catch)])
            z, h = caught.pop("z"), caught.pop("h")
            z_out[rows, :, : z.shape[2]], h_out[rows, : h.shape[1]] = z.to(z_out), h.to(h_out)
    return z_out, h_out


def _with_layer(edit: HeadEdit, refit: HeadEdit, layer: int) -> HeadEdit:
    """`edit` with every parameter of `layer`'s heads (tensors (L, H, ...)) taken from `refit`."""
    changed = {}
    for f in fields(edit):
        value = getattr(edit, f.name)
        if isinstance(value, torch.Tensor):
            value = value.clone()
            value[layer] = getattr(refit, f.name)[layer]
            changed[f.name] = value
    return replace(edit, **changed)


def fitted_in_order(kind: type, inputs, on, options, heads, module) -> HeadEdit:
    """The `kind` edit of `heads` fitted in order (on the items of folds `on`): the lowest layer's
    heads on the recording, each next layer's on its heads' outputs recorded again with the heads
    below edited (outputs_at, each pass from the stream the previous one reached: one pass over the
    layers in all). What is recorded again: the items and the control prompts (a kind fitted on the
    covariate reads those), and the reference sequences too for the others (mean, resample)."""
    layers = sorted({layer for layer, _ in heads})
    edit = kind.fit(inputs, on, options)
    names = ("bank", "control") + (() if kind.COVARIATE else ("reference",))
    reached = {name: (layers[0], getattr(inputs, name).hidden[layers[0]]) for name in names}
    for layer in layers[1:]:
        below, banks = edit.on(tuple(h for h in heads if h[0] < layer)), {}
        for name, (start, hidden) in list(reached.items()):
            bank = getattr(inputs, name)
            z, entering = outputs_at(module, bank, layer, start, below, hidden)
            reached[name] = (layer, entering)
            outputs = list(bank.outputs)
            outputs[layer] = z
            banks[name] = replace(bank, outputs=outputs)
        refit = kind.fit(replace(inputs, **banks), on, options)
        edit = _with_layer(edit, refit, layer)
    return edit.on(tuple(heads))


class HeadFit:
    """`fit(inputs, on, heads)`: the edit of `heads` of a raw head kind (KIND or KIND-seq), its
    parameters fitted on the items of folds `on`: at once (one fit per folds, whatever the heads) or
    in order (fitted_in_order, per head set). Fits are kept for the latest two inputs given (the
    sweep's and its other half's, or a permutation's), so the sweep's measures and its saved edits
    share them."""

    KEPT = 2

    def __init__(self, name: str, options, module):
        self.name, (self.kind, self.sequential) = name, kind_class(name)
        self.options, self.module, self._kept = options, module, []

    def __call__(self, inputs, on, heads) -> HeadEdit:
        heads, on = tuple(heads), tuple(int(f) for f in on)
        fits = next((fits for seen, fits in self._kept if seen is inputs), None)
        if fits is None:  # inputs by identity: kept alive here, so an id is never another's
            fits = {}
            self._kept = [*self._kept[-self.KEPT + 1 :], (inputs, fits)]
        key = (on, heads) if self.sequential else on
        if key not in fits:
            fits[key] = (
                fitted_in_order(self.kind, inputs, on, self.options, heads, self.module)
                if self.sequential
                else self.kind.fit(inputs, on, self.options)
            )
        return fits[key].on(heads)
