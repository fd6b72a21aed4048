"""Edited forward passes, batched like patching (intervene/engine.py): many (sequence, head set)
variants per pass, each pass starting at its variants' lowest edited layer from the hidden state
the clean run recorded there (the layers below compute exactly what the clean run computed).

An edit changes a head at every position, so no position is clean above that layer; but variants
with the same heads edited and sequences that share a prefix compute that prefix identically. Their
sequences are packed as tries (packing.py: each distinct prefix once, its depth as position id, a
mask showing a node its ancestors), one head set per packed row; on the gender suite's items this
forwards 60% of the tokens. Where packing would change a result it is not used: a family whose
mask cannot be packed (sharing.prefix_sharing_blocker), `Resample`, whose draw is per position
of the batch, and an edit at the prediction alone (AT_PREDICTION), whose last node another
sequence of its trie may run through.

Shapes: V variants, L layers, H heads, T tokens, K label ids, N sequences of a Bank, G packed rows,
P packed length, E model width.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from ..attention.capture import editing, picked_logits
from ..forward.packing import pack_trie, packed_inputs, sorted_packs
from ..forward.sharing import prefix_sharing_blocker
from ..intervene.engine import Bank, lowest_layer, plan_passes
from ..intervene.rerun import Changes, forward_from, narrowed_behaviour, rerun_logits
from ..model.anatomy import module_of
from ..model.footprint import device_patch_budget
from .editor import RowEditor
from .kinds import HeadEdit, Resample

LOGIT_BYTES = 128 * 2**20  # full-vocabulary logits of one text pass


@dataclass(frozen=True)
class Variants:
    """Edited variants of a bank's sequences: variant v runs sequence `base[v]` (V,) of `bank` with
    the heads `heads[v]` (V, L, H) edited by `edit`, or by `edit[which[v]]` where `edit` is a tuple
    (one call for the sweep's quarters, each with its own parameters, so that more variants share a
    pass and a prefix)."""

    bank: Bank
    edit: HeadEdit | tuple
    base: torch.Tensor
    heads: torch.Tensor
    which: torch.Tensor | None = None


def _groups(bank: Bank, base: torch.Tensor, heads: torch.Tensor, row_tokens: int):
    """Passes: variants grouped by lowest edited layer, sorted by length, at most `row_tokens` each."""
    first = lowest_layer(heads.any(-1))  # (V,) from the (V, L, H) masks
    lengths = bank.lengths[base]
    for layer in first.unique().tolist():
        group = (first == layer).nonzero()[:, 0]
        group = group[torch.argsort(lengths[group], stable=True)]
        for rows in plan_passes(group, lengths, torch.zeros_like(lengths), row_tokens):
            yield min(layer, len(bank.hidden) - 1), rows


def _editor(variants: Variants, rows, last=None) -> RowEditor:
    """The editor of a pass whose batch rows are the variants `rows` (`last`: each one's prediction
    position, where an edit AT_PREDICTION edits alone)."""
    which = variants.which
    return RowEditor(variants.edit, variants.heads[rows], None if which is None else which[rows], last)


def _packed_groups(bank: Bank, base: torch.Tensor, heads: torch.Tensor, row_tokens: int, which=None):
    """Passes of tries: variants grouped by lowest edited layer and then by head set (and edit, with
    `which`), each group's sequences sorted by tokens and packed with their neighbours
    (packing.neighbour_packs), the packs of a layer in passes of at most `row_tokens` rows x packed
    length. Yields (layer, packs), a pack being a list of variant indices that share one head set."""
    first, of = lowest_layer(heads.any(-1)), base.tolist()  # (V,) from the (V, L, H) masks; host
    for layer in first.unique().tolist():
        group = (first == layer).nonzero()[:, 0]
        key = heads[group].flatten(1).long()  # (n, L H)
        if which is not None:
            key = torch.cat([key, which[group, None]], 1)
        _, head_set = torch.unique(key, dim=0, return_inverse=True)
        packs, sizes = [], []
        for s in head_set.unique().tolist():
            members = group[head_set == s].tolist()
            sequences = [bank.sequences[of[v]] for v in members]
            found, counts = sorted_packs(sequences, len(members))
            packs += [[members[i] for i in pack] for pack in found]
            sizes += counts
        sizes = torch.tensor(sizes)
        order = torch.argsort(sizes, stable=True)  # similar sizes pad little
        for run in plan_passes(order, sizes, torch.zeros_like(sizes), row_tokens):
            yield min(layer, len(bank.hidden) - 1), [packs[i] for i in run.tolist()]


def _packed_pass(module, variants: Variants, packs, first: int, vocabulary):
    """One edited forward pass of packed tries, starting at layer `first` from the recorded hidden
    state of each node (a node's state is that of every sequence through it, at its depth). Returns
    the logits after each variant's last token, in the order of the packs' variants, and whether
    the lm head was narrowed to `vocabulary`."""
    bank, of = variants.bank, variants.base.tolist()  # the base sequences, on the host once
    tries = [pack_trie([bank.sequences[of[v]] for v in pack]) for pack in packs]
    ids, pos, mask = packed_inputs(tries, pad_id=0)  # (G, P), (G, P), (G, 1, P, P)
    rows, nodes, sequences, depths, last = [], [], [], [], ([], [])
    for g, (pack, (*_, where)) in enumerate(zip(packs, tries)):
        for v, path in zip(pack, where):
            rows += [g] * len(path)
            nodes += path
            sequences += [of[v]] * len(path)
            depths += range(len(path))
            last[0].append(g), last[1].append(path[-1])
    hidden = bank.hidden[first]  # (N, T, E)
    state = hidden.new_zeros(len(packs), ids.shape[1], hidden.shape[-1])  # (G, P, E); pads stay 0
    state[rows, nodes] = hidden[sequences, depths]
    leaders = torch.tensor([pack[0] for pack in packs])  # one head set (and edit) per packed row
    contexts = [
        editing(_editor(variants, leaders)),
        picked_logits(module, (torch.tensor(last[0]), torch.tensor(last[1]))),
    ]
    inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
    logits, narrowed = forward_from(
        module, first, state, inputs, Changes(contexts, vocabulary), bank.returns_tuple
    )
    return logits[0], narrowed


def _behaviour_passes(module, variants: Variants, vocabulary, row_tokens: int, share: bool):
    """Per pass: (variant indices, logits after each one's last token, whether they are narrowed to
    `vocabulary`), packed (shared prefixes) or one padded row per variant."""
    bank, base, heads = variants.bank, variants.base, variants.heads
    if share:
        for first, packs in _packed_groups(bank, base, heads, row_tokens, variants.which):
            logits, narrowed = _packed_pass(module, variants, packs, first, vocabulary)
            yield torch.tensor([v for pack in packs for v in pack]), logits, narrowed
        return
    for first, rows in _groups(bank, base, heads, row_tokens):
        at = bank.lengths[base[rows]] - 1
        last = picked_logits(module, (torch.arange(len(rows)), at))
        editor = editing(_editor(variants, rows, at))
        sequences = base[rows]
        hidden = bank.hidden[first][sequences]
        logits, narrowed = rerun_logits(
            module, bank, sequences, first, hidden, Changes([editor, last], vocabulary)
        )
        yield rows, logits[0], narrowed


def packs_edits(module, bank: Bank, edit) -> bool:
    """Whether edited passes of `bank`'s sequences may share prefixes (see the module's docstring)."""
    edits = edit if isinstance(edit, tuple) else (edit,)
    longest = int(bank.lengths.max())
    # a resampled edit draws per pass shape; one at the prediction alone would edit a node that other
    # sequences of its trie run through
    exact = not any(isinstance(e, Resample) or e.AT_PREDICTION for e in edits)
    return exact and prefix_sharing_blocker(module.config, longest) is None


@torch.inference_mode()
def edited_behaviour(
    model, variants: Variants, positive, negative, row_tokens: int | None = None, share: bool | None = None
) -> torch.Tensor:
    """y = log p(positive) - log p(negative) after each of the `variants` (V,): float64. A variant
    editing nothing gets the clean y. Passes of at most `row_tokens` rows x tokens (None: the
    device's budget, model.footprint.device_patch_budget). `share`: pack shared prefixes (None:
    wherever that is exact, `packs_edits`)."""
    module = module_of(model)
    row_tokens = row_tokens or device_patch_budget(module, int(variants.bank.lengths.max()))
    y = torch.empty(len(variants.base), dtype=torch.float64)
    labels = torch.cat([positive, negative], 1)
    vocabulary = labels[labels >= 0].unique()
    share = packs_edits(module, variants.bank, variants.edit) if share is None else share
    for rows, logits, narrowed in _behaviour_passes(module, variants, vocabulary, row_tokens, share):
        y[rows] = (
            narrowed_behaviour(logits, positive[rows], negative[rows], vocabulary, narrowed)
            .double()
            .to(y.device)
        )
    return y.cpu()


@torch.inference_mode()
def edited_text_costs(
    model, bank: Bank, clean_logp: list[torch.Tensor], edit, heads: torch.Tensor, base=None, which=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per variant v (one per (text, head set): `bank` sequence base[v], default v % N, with heads[v]
    edited by `edit`, or by `edit[which[v]]` where `edit` is a tuple): the mean over the text's
    predicted positions of KL(clean || edited) of the next-token
    distribution, and the mean log-loss of the text's own next tokens. `clean_logp[n]`: (T_n - 1,
    vocab) float32."""
    module = module_of(model)
    N = len(bank.lengths)
    base = torch.arange(len(heads)) % N if base is None else torch.as_tensor(base)
    vocab = clean_logp[0].shape[-1]
    kl, loss = torch.empty(len(heads), dtype=torch.float64), torch.empty(len(heads), dtype=torch.float64)
    row_tokens = max(1, LOGIT_BYTES // (4 * vocab))
    clean_p = [logp.exp() for logp in clean_logp]  # once, not per variant
    of, which = base.tolist(), None if which is None else torch.as_tensor(which)
    for first, rows in _groups(bank, base, heads, row_tokens):
        editor = editing(_editor(Variants(bank, edit, base, heads, which), rows))
        hidden = bank.hidden[first][base[rows]]
        logits = rerun_logits(module, bank, base[rows], first, hidden, Changes([editor]))[0].float()
        at = rows.tolist()  # host indices into kl and loss (rows may live on the device)
        each = [_costs(logits[b], bank, of[v], clean_logp[of[v]], clean_p[of[v]]) for b, v in enumerate(at)]
        kl[at], loss[at] = torch.stack([torch.stack(c) for c in each]).double().cpu().T  # one copy a pass
    return kl, loss


def text_costs(logits: torch.Tensor, bank: Bank, n: int, clean_logp: torch.Tensor, clean_p=None):
    """(mean KL(clean || edited) over text n's predicted positions, its mean log-loss) from the
    edited logits (T, vocab) of its pass; `clean_p`: clean_logp.exp() when the caller has it."""
    kl, loss = _costs(logits, bank, n, clean_logp, clean_p)
    return kl.item(), loss.item()


def _costs(logits, bank: Bank, n: int, clean_logp, clean_p=None) -> tuple[torch.Tensor, torch.Tensor]:
    """text_costs as two tensors where the logits are (read back by the caller, once per pass)."""
    length = len(bank.sequences[n])
    logp = torch.log_softmax(logits[: length - 1].float(), -1)
    clean_p = clean_logp.exp() if clean_p is None else clean_p
    kl = (clean_p * (clean_logp - logp)).sum(-1).mean()
    return kl, -logp.gather(1, bank.ids[n, 1:length, None]).mean()


def raw_rows(target: str, keys, **values) -> pd.DataFrame:
    """Raw values of edited passes, one row per (k, draw, index) key: y, or a text's KL and loss."""
    k, draw, index = zip(*keys) if keys else ((), (), ())
    frame = pd.DataFrame({"target": target, "k": k, "draw": draw, "index": index})
    for name in ("y", "kl", "loss"):
        frame[name] = values.get(name, np.nan)
    return frame
