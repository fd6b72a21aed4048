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
from ..intervene.rerun import ROWS, Changes, rerun_logits
from .kinds import KINDS, HeadEdit, RowEditor

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


class _Caught(Exception):  # raised once the one layer a pass is run for has been seen
    pass


@torch.inference_mode()
def outputs_at(module, bank, layer: int, start: int, below: HeadEdit) -> torch.Tensor:
    """(N, H, T, D) the heads' outputs at `layer` of every sequence of `bank` (T its width; padding
    zero), with `below` (heads of layers `start` .. layer - 1) applied: each pass runs from the
    recorded stream entering `start` and stops at `layer`'s attention. An edit that acts at the
    prediction alone acts at each sequence's last token, as in the sweep's passes."""
    L, H = len(bank.outputs), bank.outputs[0].shape[1]
    heads, out, caught = below.mask(L, H)[None], torch.zeros_like(bank.outputs[layer]), {}

    def catch(site):
        if site.layer == layer:
            caught["z"] = site.output
            raise _Caught
        return site.output

    for first in range(0, len(bank.lengths), ROWS):
        rows = torch.arange(first, min(first + ROWS, len(bank.lengths)), device=bank.lengths.device)
        editor = RowEditor(below, heads, last=bank.lengths[rows] - 1)
        try:
            changes = Changes([model_edit(editor), editing(catch)])
            rerun_logits(module, bank, rows, start, bank.hidden[start][rows], changes)
        except _Caught:
            pass
        z = caught.pop("z")
        out[rows, :, : z.shape[2]] = z.to(out)
    return out


def _recorded_again(inputs, module, layer: int, start: int, below: HeadEdit):
    """`inputs` with the heads' outputs at `layer` of the items, their reference sequences and the
    control prompts recorded again with `below` applied (outputs_at)."""
    banks = {}
    for name in ("bank", "reference", "control"):
        bank = getattr(inputs, name)
        outputs = list(bank.outputs)
        outputs[layer] = outputs_at(module, bank, layer, start, below)
        banks[name] = replace(bank, outputs=outputs)
    return replace(inputs, **banks)


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
    below edited (outputs_at)."""
    layers = sorted({layer for layer, _ in heads})
    edit = kind.fit(inputs, on, options)
    for layer in layers[1:]:
        below = edit.on(tuple(h for h in heads if h[0] < layer))
        refit = kind.fit(_recorded_again(inputs, module, layer, layers[0], below), on, options)
        edit = _with_layer(edit, refit, layer)
    return edit.on(tuple(heads))


class HeadFit:
    """`fit(inputs, on, heads)`: the edit of `heads` of a raw head kind (KIND or KIND-seq), its
    parameters fitted on the items of folds `on`: at once (one fit per folds of the latest inputs
    given, whatever the heads) or in order (fitted_in_order, per head set)."""

    def __init__(self, name: str, options, module):
        self.kind, self.sequential = kind_class(name)
        self.options, self.module, self._inputs, self._fits = options, module, None, {}

    def __call__(self, inputs, on, heads) -> HeadEdit:
        heads = tuple(heads)
        if self.sequential:
            return fitted_in_order(self.kind, inputs, on, self.options, heads, self.module)
        if self._inputs is not inputs:  # the sweep's, the other half's, a permutation's
            self._inputs, self._fits = inputs, {}
        on = tuple(int(f) for f in on)
        if on not in self._fits:
            self._fits[on] = self.kind.fit(inputs, on, self.options)
        return self._fits[on].on(heads)
