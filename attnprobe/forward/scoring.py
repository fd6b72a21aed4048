"""Scored continuations at the speed of the prompt phase: log p(tail | prefix) for many pairs.

Referent choice, multiple choice and sentence likelihood ask the same thing: the log-probability
of tail tokens after a prefix (a sentence and a question; a context; a sentence's first token), for
several tails per prefix. Each (prefix, tail) is one sequence prefix + tail; sequences sorted by
their tokens are packed as tries (packing.neighbour_packs, run_with_shared_prefixes: every distinct
prefix forwarded once, exact for a causal model), and the lm head runs only at the positions that
predict a tail token, once per distinct trie node (options after one question share the node that
predicts their first token), so full-vocabulary logits never exist elsewhere. Where prefixes cannot
be shared exactly (sharing.prefix_sharing_blocker) each sequence is its own row, with the lm head
still narrowed to those positions.

    log p(tail[t] | ...) = logit[tail[t]] - logsumexp(logits)     at the position before tail[t]

Shapes: N scored tokens of a pass, U their distinct positions, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..attention.capture import run_with_capture
from ..errors import SuiteError
from .packing import distinct_tokens, pad_right, run_with_shared_prefixes, sorted_packs
from .sharing import prefix_sharing_blocker

LOGIT_BUDGET = 128 * 2**20  # logits (N x V floats) a pass holds at most: 512 MB in float32
LOGSUMEXP_ROWS = 16  # rows of logits reduced at a time on a CPU (16 x 49,152 floats: 3 MB, cache-sized)


def _passes(pairs, sequences, share: bool, batch_size: int, most_picks: int) -> list[list[list[int]]]:
    """Whole packs per pass (one sequence a pack without sharing), at most `batch_size` sequences and
    `most_picks` scored tokens a pass (one sequence alone may exceed it); packs ordered by their
    distinct tokens so a pass pads little."""
    packs = []
    for pack in sorted_packs(sequences, batch_size if share else 1)[0]:
        packs.append([])
        picks = 0  # a pack is cut where its scored tokens would exceed the budget
        for i in pack:
            if packs[-1] and picks + len(pairs[i][1]) > most_picks:
                packs.append([])
                picks = 0
            packs[-1].append(i)
            picks += len(pairs[i][1])
    passes, n, picks = [], 0, 0
    for pack in sorted(packs, key=lambda pack: distinct_tokens([sequences[i] for i in pack])):
        pack_picks = sum(len(pairs[i][1]) for i in pack)
        if not passes or n + len(pack) > batch_size or picks + pack_picks > most_picks:
            passes.append([])
            n, picks = 0, 0
        passes[-1].append(pack)
        n, picks = n + len(pack), picks + pack_picks
    return passes


@torch.no_grad()
def token_logprobs(
    pm,
    pairs: list[tuple[list[int], list[int]]],
    batch_size: int = 256,
    advance: Callable[[int], None] | None = None,
) -> list[torch.Tensor]:
    """log p(tail[t] | prefix + tail[:t]) for each (prefix, tail) pair (token ids), one tensor of
    len(tail) values per pair, in order. `batch_size`: sequences per forward pass at most (fewer where
    the logits would exceed LOGIT_BUDGET); `advance(n)` is told after each pass."""
    model, tokenizer = pm.model, pm.tokenizer
    sequences = [tuple(prefix) + tuple(tail) for prefix, tail in pairs]
    out = [torch.zeros(len(tail), dtype=torch.float64, device="cpu") for _, tail in pairs]
    if not sequences:
        return out
    share = prefix_sharing_blocker(model.config, max(map(len, sequences))) is None
    vocabulary = model.get_output_embeddings().weight.shape[0]
    for batch in _passes(pairs, sequences, share, batch_size, max(1, LOGIT_BUDGET // vocabulary)):
        members = [i for pack in batch for i in pack]
        scored = [
            (b, len(pairs[i][0]) - 1 + t, token)
            for b, i in enumerate(members)
            for t, token in enumerate(pairs[i][1])
        ]
        if scored:
            b, t, tail = (torch.tensor(column) for column in zip(*scored))  # (N,) each
            if share:
                rows = [[sequences[i] for i in pack] for pack in batch]
                dummy = torch.zeros(len(members), 1, dtype=torch.long)  # no attention is recorded
                captured = run_with_shared_prefixes(
                    model, rows, tokenizer.pad_token_id, dummy, layers=[], logit_picks=(b, t)
                )
            else:
                ids, mask = pad_right([sequences[i] for i in members], tokenizer.pad_token_id)
                captured = run_with_capture(model, ids, mask, layers=[], logit_picks=(b, t))
            logits = captured.logits.to(torch.promote_types(captured.logits.dtype, torch.float32))  # (U, V)
            at = captured.logit_rows.to(logits.device)  # (N,) the row of each scored token
            values = (logits[at, tail.to(logits.device)] - row_logsumexp(logits)[at]).double().cpu()
            for i, piece in zip(members, values.split([len(pairs[i][1]) for i in members])):
                out[i] = piece
        if advance is not None:
            advance(len(members))
    return out


def row_logsumexp(logits: torch.Tensor, rows: int = LOGSUMEXP_ROWS) -> torch.Tensor:
    """logsumexp over the last axis of (U, V) logits, `rows` rows at a time: torch's runs max,
    subtract, exp and sum as separate passes over U x V floats (360 MB for a pass of SmolLM2's scored
    positions, written and read back from memory); a block of rows stays in the cache."""
    if logits.device.type != "cpu" or len(logits) <= rows:
        return torch.logsumexp(logits, -1)
    return torch.cat([torch.logsumexp(block, -1) for block in logits.split(rows)])


def continuation_logprobs(pm, pairs, batch_size: int = 256, advance=None) -> list[float]:
    """sum_t log p(tail[t] | prefix + tail[:t]) for each (prefix, tail) pair (token_logprobs)."""
    return [float(values.sum()) for values in token_logprobs(pm, pairs, batch_size, advance)]


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
