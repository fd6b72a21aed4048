"""Scored continuations at the speed of the prompt phase: sum log p(tail | prefix) for many pairs.

Referent choice (and any measure that scores a continuation after a prompt) asks the same thing:
the log-probability of a few tail tokens after a long shared prefix (a sentence and a question),
for several tails per prefix. Each (prefix, tail) is one sequence prefix + tail; sequences sorted by
their tokens are packed as tries (packing.run_with_shared_prefixes: every distinct prefix forwarded
once, exact for a causal model), and the lm head runs only at the positions that predict a tail
token, P per sequence instead of the whole length, so the full-vocabulary logits never exist for
the other positions. Where prefixes cannot be shared exactly (sharing.prefix_sharing_blocker) each
sequence is its own row, with the lm head still narrowed to those positions.

Shapes: B sequences of a batch, P logit positions per sequence, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .capture import pad_right, run_with_capture
from .errors import SuiteError
from .packing import run_with_shared_prefixes
from .sharing import prefix_sharing_blocker

PACK_TOKENS = 64  # distinct tokens a pack (one row) grows to, as the prompt phase's packs
LOGIT_BUDGET = 32 * 2**20  # logits (B x P x V floats) held at once: 128 MB in float32


def _common(a: tuple, b: tuple) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _packs(sequences: list[tuple[int, ...]], share: bool, most: int = 256) -> list[list[int]]:
    """Indices of the sequences, sorted by their tokens, grouped into packs of at most `most`
    neighbours whose distinct tokens stay within PACK_TOKENS (one sequence a pack without sharing)."""
    order = sorted(range(len(sequences)), key=lambda i: sequences[i])
    if not share:
        return [[i] for i in order]
    packs, size, previous = [], 0, ()
    for i in order:
        new = len(sequences[i]) - _common(previous, sequences[i])
        if packs and size + new <= PACK_TOKENS and len(packs[-1]) < most:
            packs[-1].append(i)
            size += new
        else:
            packs.append([i])
            size = len(sequences[i])
        previous = sequences[i]
    return packs


@torch.no_grad()
def continuation_logprobs(
    pm,
    pairs: list[tuple[list[int], list[int]]],
    batch_size: int = 256,
    advance: Callable[[int], None] | None = None,
) -> list[float]:
    """sum_t log p(tail[t] | prefix + tail[:t]) for each (prefix, tail) pair (token ids), in order.
    `batch_size`: sequences per forward pass at most (fewer where the logits would exceed
    LOGIT_BUDGET); `advance(n)` is told after each pass."""
    if not pairs:
        return []
    model, tokenizer = pm.model, pm.tokenizer
    sequences = [tuple(prefix) + tuple(tail) for prefix, tail in pairs]
    longest = max(map(len, sequences))
    share = prefix_sharing_blocker(model.config, longest) is None
    vocabulary = model.get_output_embeddings().weight.shape[0]
    widest = max(len(tail) for _, tail in pairs)
    per_pass = max(1, min(batch_size, LOGIT_BUDGET // max(1, widest * vocabulary)))
    out = [0.0] * len(pairs)
    packs, start = _packs(sequences, share, per_pass), 0
    while start < len(packs):
        batch, n = [], 0  # whole packs, at most per_pass sequences
        while start < len(packs) and (not batch or n + len(packs[start]) <= per_pass):
            batch.append(packs[start])
            n += len(packs[start])
            start += 1
        members = [i for pack in batch for i in pack]
        # (B, P) the positions that predict each tail token, padded by repeating the last
        positions = torch.tensor(
            [[len(pairs[i][0]) - 1 + min(t, len(pairs[i][1]) - 1) for t in range(widest)] for i in members]
        )
        if share:
            rows = [[sequences[i] for i in pack] for pack in batch]
            dummy = torch.zeros(len(members), 1, dtype=torch.long)  # no attention is recorded
            logits = run_with_shared_prefixes(
                model, rows, tokenizer.pad_token_id, dummy, layers=[], logit_positions=positions
            ).logits  # (B, P, V)
        else:
            ids, mask = pad_right([sequences[i] for i in members], tokenizer.pad_token_id)
            logits = run_with_capture(model, ids, mask, layers=[], logit_positions=positions).logits
        logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)  # (B, P, V)
        for b, i in enumerate(members):
            tail = torch.as_tensor(pairs[i][1])
            out[i] = float(logp[b, torch.arange(len(tail)), tail].sum())
        if advance is not None:
            advance(len(members))
    return out


def check_context(encoded, sequences: Callable, max_positions: int | None, what: str) -> None:
    """Before any weights load: refuse a prompt whose scored continuation (`sequences(e)`: prefix ids
    and {key: (text, tail ids)}, or None) would run past the model's context."""
    if not max_positions:
        return
    for e in encoded:
        scored = sequences(e)
        if scored is None or not scored[1]:
            continue
        prefix, tails = scored
        n = len(prefix) + max(len(tail) for _, tail in tails.values()) - 1  # the last token is not forwarded
        if n > max_positions:
            raise SuiteError(
                f"{e.prompt.origin}: prompt {e.prompt.prompt_id} with {what} needs {n:,} positions, more "
                f"than the model's context of {max_positions:,}; shorten the sentence or {what}"
            )
