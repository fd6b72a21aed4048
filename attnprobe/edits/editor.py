"""Where a head edit acts in a pass: RowEditor, the editor `capture.editing` and `capture.model_edit`
call at every attention layer, edits each row's chosen heads, and an edit that acts at the prediction
alone (AT_PREDICTION: edits.kinds.LeaceMidLast) only at the positions whose next token is predicted.
The sweep's passes say which (`last`, each row's prediction position); applied to a whole model
(`run --edit`, `edited` in a notebook) the positions come from the pass itself (`at_predictions`:
the ones whose next-token prediction it reads, attention.logits.reading), and every position where
it does not say (a text, a notebook's own call: each position predicts).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..attention.capture import model_edit
from ..attention.logits import editing_predictions, reading
from ..errors import AttnprobeError


@dataclass
class RowEditor:
    """Editor for `capture.editing`: row b of the batch has the heads `rows[b]` (B, L, H) edited, by
    `edit`, or with a tuple of edits by `edit[which[b]]` (e.g. each quarter's own parameters); an
    edit AT_PREDICTION only at position last[b] where `last` is given, else at the positions `ends`
    (B, T) marks where it is given (at_predictions), else at every position."""

    edit: object  # a HeadEdit, or a tuple of them
    rows: torch.Tensor  # (B, L, H) bool, or (1, L, H) for every row
    which: torch.Tensor | None = None  # (B,) index into a tuple `edit`
    last: torch.Tensor | None = None  # (B,) each row's prediction position
    ends: torch.Tensor | None = None  # (B, T) bool: the positions predicted in the pass in progress

    def __call__(self, site) -> torch.Tensor:
        chosen = self.rows[:, site.layer].to(site.output.device)  # (B, H)
        if not chosen.any():
            return site.output
        edits = self.edit if isinstance(self.edit, tuple) else (self.edit,)
        which = torch.zeros(len(chosen), dtype=torch.long) if self.which is None else self.which
        out = site.output
        for i, edit in enumerate(edits):
            mine = chosen & (which.to(chosen.device) == i)[:, None]  # (B, H): rows of edit i
            if mine.any():
                where = mine[:, :, None, None]
                if edit.AT_PREDICTION:
                    where = where & self._predicted(out)
                out = torch.where(where, replaced(edit, site.layer, site.output), out)
        return out

    def _predicted(self, out: torch.Tensor) -> torch.Tensor | bool:
        """(B, 1, T, 1) the positions an edit at the prediction acts at (True: every one)."""
        positions = torch.arange(out.shape[2], device=out.device)
        if self.last is not None:
            return (positions == self.last.to(out.device)[:, None])[:, None, :, None]
        if self.ends is not None and self.ends.shape == (out.shape[0], out.shape[2]):
            return self.ends.to(out.device)[:, None, :, None]
        return True


def replaced(edit, layer: int, z: torch.Tensor) -> torch.Tensor:
    """`edit.replacement(layer, z)`, refused in one line unless it has z's shape (B, H, T, D): a kind's
    output that would broadcast (one row for every row, say) edits what it was not asked to."""
    out = edit.replacement(layer, z)
    if not isinstance(out, torch.Tensor) or out.shape != z.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise AttnprobeError(
            f"edit kind {edit.kind!r} ({type(edit).__module__}) replaced layer {layer}'s heads with {got}, "
            f"not their shape {tuple(z.shape)} (B, H, T, D); fix its replacement()"
        )
    return out


@contextmanager
def at_predictions(module, editor: RowEditor):
    """model_edit(editor), with `editor.ends` set before every pass of `module` (the model called) to
    the positions whose
    next-token prediction the pass reads (attention.logits.reading; None where it does not say)."""

    def before(_, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        pairs, editor.ends = reading(), None
        if pairs is not None and ids is not None:
            editor.ends = torch.zeros(ids.shape[:2], dtype=torch.bool, device=ids.device)
            editor.ends[pairs[0].to(ids.device), pairs[1].to(ids.device)] = True

    hook = module.register_forward_pre_hook(before, with_kwargs=True)
    try:
        with model_edit(editor), editing_predictions():
            yield editor
    finally:
        hook.remove()
