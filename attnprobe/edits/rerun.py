"""A run of recorded sequences that starts at a decoder layer from given hidden states: the layers
below are skipped (engine.skipping), the lm head narrowed to the labels' words. What tracing (the
stream patched), paths (one head's inputs patched) and the stream eraser each run, many times."""

from __future__ import annotations

from contextlib import ExitStack

import torch

from ..measures.head_effects.engine import Bank, narrowed_behaviour, narrowed_head, skipping

ROWS = 64  # sequences per pass


def rerun_logits(
    module, bank: Bank, rows: torch.Tensor, layer: int, hidden: torch.Tensor, vocabulary=None, contexts=()
):
    """(logits (B, T, vocab or the vocabulary's), narrowed) of the sequences `rows` of `bank`, run from
    `layer`, which receives `hidden` (B, >= T, E); `contexts`: context managers entered around the
    pass (editors, hooks). Gradients flow where the caller enables them."""
    T = int(bank.lengths[rows].max())
    with ExitStack() as stack:
        stack.enter_context(skipping(module, layer, hidden[:, :T], bank.returns_tuple))
        # the head is narrowed first, so a context that hooks the lm head (picked_logits) hooks that one
        narrowed = vocabulary is not None and stack.enter_context(narrowed_head(module, vocabulary))
        for context in contexts:
            stack.enter_context(context)
        out = module(
            input_ids=bank.ids[rows, :T],
            attention_mask=(torch.arange(T)[None] < bank.lengths[rows, None]).long(),
            use_cache=False,
        )
    return out.logits, narrowed


def rerun_y(module, bank: Bank, rows: torch.Tensor, layer: int, hidden: torch.Tensor, labels, contexts=()):
    """y (B,) float64 of the rows run as rerun_logits does; `labels` (B, 2, K) their label ids."""
    vocabulary = labels[labels >= 0].unique()
    logits, narrowed = rerun_logits(module, bank, rows, layer, hidden, vocabulary, contexts)
    last = logits[torch.arange(len(rows)), bank.lengths[rows] - 1]
    return narrowed_behaviour(last, *labels.unbind(1), vocabulary, narrowed).double()
