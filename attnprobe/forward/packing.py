"""Prefix packing: prompts that share token prefixes forwarded once, as a trie in one row.

Each pack of sequences becomes one row holding every distinct prefix once (`pack_trie`), its depth
as position id and a mask that shows each node its ancestors and itself (`packed_inputs`). For a
causal model that is exactly each sequence's own attention; `run_with_shared_prefixes` maps the
recorded weights and the logits back to each sequence's positions.

Shapes: G packed rows, L packed length, B sequences, T their padded length, R recorded rows,
Rg recorded rows of a pack, H heads, P logit positions.
"""

from __future__ import annotations

import numpy as np
import torch

from ..attention.capture import Captured, picked_logits, recording
from .device import on_host

PACK_TOKENS = 64  # a pack grows to this many distinct tokens, or twice its first sequence if longer


def pad_right(sequences, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id sequences -> input_ids and attention_mask (B, T), padded on the right."""
    T = max(len(s) for s in sequences)
    ids = torch.tensor([list(s) + [pad_id] * (T - len(s)) for s in sequences], dtype=torch.long)
    mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in sequences], dtype=torch.long)
    return ids.reshape(len(sequences), T), mask.reshape(len(sequences), T)


def common_length(a: tuple, b: tuple) -> int:
    """Length of the common prefix of two token sequences."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def distinct_tokens(pack: list[tuple[int, ...]]) -> int:
    """The nodes of the trie of a pack's sequences in token order: each adds what follows the prefix
    it shares with the previous one."""
    return sum(len(b) - common_length(a, b) for a, b in zip([(), *pack], pack))


def neighbour_packs(sequences: list[tuple[int, ...]], order: list[int], most: int) -> tuple[list, list]:
    """Runs of neighbours in `order` (indices of `sequences`, sorted by their tokens) as packs of at
    most `most` sequences whose distinct tokens (a sequence adds what follows the prefix it shares
    with the previous one) stay within PACK_TOKENS, or twice the pack's first sequence where that is
    longer: so a long prompt still shares itself with the continuations that follow it. Returns
    the packs (lists of indices) and each pack's distinct token count."""
    packs, sizes, previous = [], [], ()
    for i in order:
        new = len(sequences[i]) - common_length(previous, sequences[i])
        limit = max(PACK_TOKENS, 2 * len(sequences[packs[-1][0]])) if packs else 0
        if packs and len(packs[-1]) < most and sizes[-1] + new <= limit:
            packs[-1].append(i)
            sizes[-1] += new
        else:
            packs.append([i])
            sizes.append(len(sequences[i]))
        previous = sequences[i]
    return packs, sizes


def sorted_packs(sequences: list[tuple[int, ...]], most: int) -> tuple[list, list]:
    """neighbour_packs over the sequences in token order (the leaves of their trie, left to right)."""
    order = sorted(range(len(sequences)), key=sequences.__getitem__)
    return neighbour_packs(sequences, order, most)


def pack_trie(sequences: list[tuple[int, ...]]) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """Token id sequences as one trie: (tokens, depths, parents, where) with one entry per distinct
    prefix, so a token shared by several sequences' prefixes appears once; a node comes after its
    parent (-1: a root); where[b][t] is the node of sequence b's position t."""
    tokens, depths, parents, where, node = [], [], [], [], {}
    for s in sequences:
        path, parent = [], -1
        for t, token in enumerate(s):
            key = (parent, token)
            if key not in node:
                node[key] = len(tokens)
                tokens.append(token), depths.append(t), parents.append(parent)
            parent = node[key]
            path.append(parent)
        where.append(path)
    return tokens, depths, parents, where


def packed_inputs(tries: list, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Model inputs of packed tries (pack_trie), one row each, padded on the right: token ids and
    position ids (G, L), and the mask (G, 1, L, L) that lets a node see its ancestors and itself
    (a pad sees only itself)."""
    ids, _ = pad_right([tokens for tokens, *_ in tries], pad_id)  # (G, L)
    pos, _ = pad_right([depths for _, depths, *_ in tries], 0)  # (G, L)
    L = ids.shape[1]
    mask = np.tile(np.eye(L, dtype=bool), (len(tries), 1, 1))  # (G, L, L): a node (or pad) sees itself
    for g, (_, _, parents, _) in enumerate(tries):
        seen = mask[g]  # numpy rows: a host loop over nodes without a torch call per node
        for i, parent in enumerate(parents):  # ... and what its parent sees (parents come first)
            if parent >= 0:
                seen[i] |= seen[parent]
    return ids, pos, torch.from_numpy(mask).unsqueeze(1)


@torch.inference_mode()
def run_with_shared_prefixes(
    model: torch.nn.Module,
    packs: list[list[tuple[int, ...]]],  # rows of token id sequences; each row is forwarded as one trie
    pad_id: int,
    rows: torch.Tensor | None = None,
    layers=None,
    logit_positions: torch.Tensor | None = None,
    logit_picks: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Captured:
    """What `run_with_capture(pad_right(sequences))` returns, forwarding every shared prefix once.

    Each pack becomes one row, the trie of its sequences (pack_trie, packed_inputs): each distinct
    prefix's last token once, its depth as position id, seeing its ancestors and itself. For a
    causal model that is exactly each sequence's own attention: the same keys and values at the same
    positions, the same keys visible. Weights are mapped back to each sequence's positions (over its
    T padded keys, 0 beyond its length, as under the causal mask); the lm head runs only where asked.

    `rows`: (B, R) query positions to record, B sequences in pack order (None: all);
    `logit_positions`: (P,) or per sequence (B, P) positions whose logits to return;
    `logit_picks`: (N,) sequences and (N,) positions, whose logits come back as one row per distinct
    packed node (U, V) with each pick's row in `logit_rows` (sequences through a node share it)."""
    if not isinstance(model, torch.nn.Module):  # a ProbeModel
        model = model.model
    sequences = [s for pack in packs for s in pack]
    B, T = len(sequences), max(len(s) for s in sequences)
    device = next(model.parameters()).device
    with on_host():  # the tries and their index tensors: built on the CPU, copied once
        rows = torch.arange(T).expand(B, T) if rows is None else torch.as_tensor(rows, dtype=torch.long).cpu()
        tries = [pack_trie(pack) for pack in packs]
        ids, pos, mask = packed_inputs(tries, pad_id)  # (G, L), (G, L), (G, 1, L, L)
        L = ids.shape[1]
        owner = torch.tensor([g for g, pack in enumerate(packs) for _ in pack])  # (B,) each sequence's row
        paths = [p for *_, where in tries for p in where]
        node = torch.tensor([p + [0] * (T - len(p)) for p in paths])  # (B, T) each position's packed node
        in_sequence = torch.arange(T)[None, :] < torch.tensor([len(s) for s in sequences])[:, None]  # (B, T)
        group_rows, row_index = _recorded_rows(node.gather(1, rows), owner, len(packs))
        pick, logit_rows = _packed_picks(node, owner, L, logit_positions, logit_picks)
    pick = pick and tuple(x.to(device) for x in pick)
    # every index tensor the unpacking reads goes to the device once, before the forward is queued
    unpacking = tuple(t.to(device) for t in (owner, row_index, node, in_sequence))
    with recording(group_rows.to(device), layers) as plan, picked_logits(model, pick):
        out = model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=pos.to(device),
            use_cache=False,
            logits_to_keep=0 if pick else 1,
        )

    weights = {layer: _unpacked(recorded, *unpacking) for layer, recorded in plan.weights.items()}
    if logit_picks is not None:
        return Captured(weights, rows, out.logits[0], logit_rows)  # (U, V), (N,)
    logits = None if pick is None else out.logits.reshape(B, -1, out.logits.shape[-1])  # (B, P, V)
    return Captured(weights=weights, rows=rows, logits=logits)


def _recorded_rows(
    wanted: torch.Tensor, owner: torch.Tensor, n_packs: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(G, Rg) the packed nodes each row records (the nodes its sequences' requested rows `wanted`
    (B, R) fall on, padded by repeating the first) and (B, R) where each requested row is among them."""
    wanted, owner = wanted.tolist(), owner.tolist()  # plain lists: no torch call per sequence
    record = [set() for _ in range(n_packs)]
    for g, rows in zip(owner, wanted):
        record[g].update(rows)
    record = [sorted(r) or [0] for r in record]
    width = max(len(r) for r in record)
    group_rows = torch.tensor([r + [r[0]] * (width - len(r)) for r in record])
    where = [{r: k for k, r in enumerate(rows)} for rows in record]
    row_index = torch.tensor([[where[g][r] for r in rows] for g, rows in zip(owner, wanted)])
    return group_rows, row_index


def _unpacked(recorded: torch.Tensor, owner, row_index, node, in_sequence) -> torch.Tensor:
    """One layer's packed weights (G, H, Rg, L) as each sequence's own (B, H, R, T): its row, its
    requested query rows, its keys at their packed nodes, 0 beyond its own tokens."""
    L = recorded.shape[-1]  # the index tensors are on the recorded weights' device
    w = recorded[owner]  # (B, H, Rg, L)
    w = w.gather(2, row_index[:, None, :, None].expand(-1, w.shape[1], -1, L))  # (B, H, R, L)
    keys = node[:, None, None, :]  # (B, 1, 1, T)
    w = w.gather(3, keys.expand(-1, w.shape[1], w.shape[2], -1))  # (B, H, R, T)
    return w * in_sequence[:, None, None, :]


def _packed_picks(node, owner, L: int, logit_positions, logit_picks) -> tuple:
    """(the packed (row, node) pairs the lm head sees, or None; with `logit_picks`, the row of each
    pick among the distinct nodes, else None)."""
    if logit_picks is not None:
        b, t = (torch.as_tensor(x, dtype=torch.long).cpu() for x in logit_picks)
        distinct, logit_rows = torch.unique(owner[b] * L + node[b, t], return_inverse=True)  # (U,), (N,)
        return (distinct // L, distinct % L), logit_rows
    if logit_positions is None:
        return None, None
    B, T = node.shape
    positions = torch.as_tensor(logit_positions, dtype=torch.long).cpu().clamp(max=T - 1)
    at = node.gather(1, positions.expand(B, -1))  # (B, P) nodes
    return (owner[:, None].expand_as(at).flatten(), at.flatten()), None
