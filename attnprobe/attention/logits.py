"""Which next-token predictions a forward pass computes and which it reads: the lm head narrowed to
picked (sequence, position) pairs (`picked_logits`), and the pairs the pass in progress reads
(`reading`), where an edit that acts at the prediction alone acts when it is applied to a whole
model (edits.kinds.LeaceMidLast under `run --edit`: the positions whose next token a measure reads,
so a run edits where the sweep fitted and measured it)."""

from __future__ import annotations

import contextvars
from contextlib import contextmanager

import torch

# (sequences (N,), positions (N,)) whose next-token predictions the pass in progress reads; None
# where the pass does not say (every position may be read: a text, a notebook's own call)
_reading: contextvars.ContextVar = contextvars.ContextVar("attnprobe_reading", default=None)


# whether an edit that acts at the predictions a pass reads is applied (edits.editor.at_predictions):
# passes then share no prefixes (one sequence's prediction may be a position another runs through)
_at_predictions: contextvars.ContextVar = contextvars.ContextVar("attnprobe_at_predictions", default=False)


def predictions_edited() -> bool:
    """Whether an edit acting at the predictions a pass reads is applied."""
    return _at_predictions.get()


@contextmanager
def editing_predictions():
    """Within the block an edit acting at the predictions a pass reads is applied."""
    token = _at_predictions.set(True)
    try:
        yield
    finally:
        _at_predictions.reset(token)


def reading() -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (sequences, positions) pairs whose next-token predictions the pass in progress reads, or
    None where it does not say."""
    return _reading.get()


@contextmanager
def read_at(pairs: tuple[torch.Tensor, torch.Tensor] | None):
    """Within the block passes read the next-token predictions at `pairs` (reading)."""
    token = _reading.set(pairs)
    try:
        yield pairs
    finally:
        _reading.reset(token)


def logits_wanted(B: int, device, logit_positions, logit_picks) -> tuple:
    """(logits_to_keep, the (sequences, positions) the lm head alone sees or None, the pairs the
    pass reads: those asked for, none when no logits are)."""
    if logit_picks is not None:
        pick = tuple(torch.as_tensor(x, dtype=torch.long, device=device) for x in logit_picks)
        return 0, pick, pick
    if logit_positions is None:
        return 1, None, (torch.zeros(0, dtype=torch.long, device=device),) * 2
    positions = torch.as_tensor(logit_positions, dtype=torch.long, device=device)
    every = positions if positions.ndim == 2 else positions[None].expand(B, -1)  # (B, P)
    pairs = (torch.arange(B, device=device)[:, None].expand_as(every).flatten(), every.flatten())
    if positions.ndim == 2:  # the lm head sees only the (sequence, position) pairs asked for
        return 0, pairs, pairs
    return positions, None, pairs  # (P,): logits_to_keep keeps them


@contextmanager
def picked_logits(model: torch.nn.Module, pick: tuple[torch.Tensor, torch.Tensor] | None):
    """Within the block the lm head sees only the hidden states at (row, position) pairs `pick`,
    as one sequence (1, N, D), so it computes N logit vectors instead of one per position kept; the
    pass reads them (reading)."""
    if pick is None:
        yield
        return
    hook = model.get_output_embeddings().register_forward_pre_hook(
        lambda module, args: (args[0][pick][None], *args[1:])
    )
    try:
        with read_at(pick):
            yield
    finally:
        hook.remove()
