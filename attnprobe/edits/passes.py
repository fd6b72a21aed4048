"""Edited forward passes, batched like patching (patching/engine.py): many (sequence, head set)
variants per pass, each pass starting at its variants' lowest edited layer from the hidden state
the clean run recorded there (the layers below compute exactly what the clean run computed).

Shapes: V variants, L layers, H heads, T tokens, K label ids, N sequences of a Bank.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch

from ..capture import editing, picked_logits
from ..patching.engine import ROW_TOKENS, Bank, lowest_layer, narrowed_head, plan_passes, skipping
from ..patching.sites import behaviour_rows
from .kinds import HeadEdit, RowEditor

LOGIT_BYTES = 128 * 2**20  # full-vocabulary logits of one text pass


def _groups(bank: Bank, base: torch.Tensor, heads: torch.Tensor, row_tokens: int):
    """Passes: variants grouped by lowest edited layer, sorted by length, at most `row_tokens` each."""
    first = lowest_layer(heads.any(-1))  # (V,) from the (V, L, H) masks
    lengths = bank.lengths[base]
    for layer in first.unique().tolist():
        group = (first == layer).nonzero()[:, 0]
        group = group[torch.argsort(lengths[group], stable=True)]
        for rows in plan_passes(group, lengths, torch.zeros_like(lengths), row_tokens):
            yield min(layer, len(bank.hidden) - 1), rows


def _pass(module, bank: Bank, edit: HeadEdit, base, heads, rows, first: int, *contexts):
    """One edited forward pass of the variants `rows`, starting at layer `first` from the recorded
    hidden state; `contexts` are entered around it too. Returns (output, what they yielded)."""
    lengths = bank.lengths[base[rows]]
    T = int(lengths.max())
    with ExitStack() as stack:
        stack.enter_context(skipping(module, first, bank.hidden[first][base[rows], :T], bank.returns_tuple))
        stack.enter_context(editing(RowEditor(edit, heads[rows])))
        entered = [stack.enter_context(c) for c in contexts]
        out = module(
            input_ids=bank.ids[base[rows], :T],
            attention_mask=(torch.arange(T)[None] < lengths[:, None]).long(),
            use_cache=False,
        )
    return out, entered


@torch.inference_mode()
def edited_behaviour(
    model,
    bank: Bank,
    edit: HeadEdit,
    base: torch.Tensor,
    heads: torch.Tensor,
    positive: torch.Tensor,
    negative: torch.Tensor,
    row_tokens: int = ROW_TOKENS,
) -> torch.Tensor:
    """y = log p(positive) - log p(negative) after each variant's sequence `bank[base]` with the heads
    `heads` (V, L, H) edited by `edit`: (V,) float64. A variant editing nothing gets the clean y."""
    module = model if isinstance(model, torch.nn.Module) else model.model
    y = torch.empty(len(base), dtype=torch.float64)
    labels = torch.cat([positive, negative], 1)
    vocabulary = labels[labels >= 0].unique()
    for first, rows in _groups(bank, base, heads, row_tokens):
        lengths = bank.lengths[base[rows]]
        last = picked_logits(module, (torch.arange(len(rows)), lengths - 1))
        out, (narrowed, _) = _pass(
            module, bank, edit, base, heads, rows, first, narrowed_head(module, vocabulary), last
        )
        logits = out.logits[0]
        pos, neg = positive[rows], negative[rows]
        if narrowed:
            narrow = lambda ids: torch.where(ids >= 0, torch.searchsorted(vocabulary, ids.clamp(min=0)), -1)
            pos, neg = narrow(pos), narrow(neg)
        y[rows] = behaviour_rows(logits, pos, neg).double().cpu()
    return y


@torch.inference_mode()
def edited_text_costs(
    model, bank: Bank, clean_logp: list[torch.Tensor], edit: HeadEdit, heads: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per variant v (one per (text, head set): `bank` sequence v % N with heads[v] edited): the mean
    over the text's predicted positions of KL(clean || edited) of the next-token distribution, and
    the mean log-loss of the text's own next tokens. `clean_logp[n]`: (T_n - 1, vocab) float32."""
    module = model if isinstance(model, torch.nn.Module) else model.model
    N = len(bank.lengths)
    base = torch.arange(len(heads)) % N
    vocab = clean_logp[0].shape[-1]
    kl, loss = torch.empty(len(heads), dtype=torch.float64), torch.empty(len(heads), dtype=torch.float64)
    row_tokens = max(1, LOGIT_BYTES // (4 * vocab))
    clean_p = [logp.exp() for logp in clean_logp]  # once, not per variant
    for first, rows in _groups(bank, base, heads, row_tokens):
        logits = _pass(module, bank, edit, base, heads, rows, first)[0].logits.float()
        for b, v in enumerate(rows.tolist()):
            n = int(base[v])
            length = int(bank.lengths[n])
            logp = torch.log_softmax(logits[b, : length - 1], -1)
            kl[v] = (clean_p[n] * (clean_logp[n] - logp)).sum(-1).mean().item()
            loss[v] = -logp.gather(1, bank.ids[n, 1:length, None]).mean().item()
    return kl, loss
