"""Senders: the edges into a receiver head's value at the occupation position p (analyses.paths).

What one earlier part S wrote into the stream at p (the embedding, a head of a lower layer, a lower
layer's MLP; through the post-norm where the family has one) is swapped for what it wrote in x', on
the one path into the receiver R's value:

  R's value at p is read from N(h_p - c_S(x) + c_S(x'))   (N the layer's pre-attention norm)

with R's weights and the layer's other heads as in x's clean run; the layers above run on.
`screen` gives every sender's attribution g . (c_S(x') - c_S(x)), g = dy/dh_p along that one path
(one backward pass per item: exact up to the layers above R); `edges` the exact effect of chosen ones.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pandas as pd
import torch

from ..attention.capture import editing
from ..errors import RunError
from ..heads import HeadSet
from ..intervene.engine import Bank
from ..intervene.rerun import ROWS, rerun_y
from ..intervene.sites import behaviour_rows
from ..model.anatomy import Sites, sites_of
from ..stats.analyses.paths_tables import RESAMPLED

EMBEDDING = "embedding"


@dataclass(frozen=True)
class Pair:
    """An item (its row in the items' bank) and its reference x' (its row in the reference bank),
    with the occupation's position in each."""

    item: int
    donor: int
    at: int
    at_cf: int
    same_length: bool


def reference_pairs(items, word: str) -> list[Pair]:
    """The items having a `word` counterfactual, in the reference bank's order (inputs.record_inputs)."""
    out = []
    for n, item in enumerate(items):
        for cf in item.counterfactuals:
            if cf.word == word:
                out.append(Pair(n, len(out), cf.at, cf.at_cf, item.same_length(cf)))
    return out


def resample_pairs(items, word: str, seed: int = 0) -> list[Pair]:
    """Per item with an equal-length `word` counterfactual: another item drawn at random (seeded) among
    those of another unit whose tokens differ from x only where x' does (the slot: the same template
    and fill, another occupation of as many tokens) and whose labels are the same. `donor` indexes
    the items: the resample's x' is another item, read from the items' own bank."""
    rng = np.random.default_rng(seed)
    own = {n: cf for n, item in enumerate(items) for cf in item.counterfactuals if cf.word == word}
    by_template: dict = {}
    for n in own:
        by_template.setdefault(items[n].template_id, []).append(n)
    out = []
    for n, cf in own.items():
        x = items[n].x
        if not items[n].same_length(cf):
            continue
        slot = x != cf.x_cf
        others = [
            m
            for m in by_template[items[n].template_id]
            if items[m].unit != items[n].unit
            and own[m].at == cf.at
            and len(items[m].x) == len(x)
            and not ((items[m].x != x) & ~slot).any()
            and (items[m].positive, items[m].negative) == (items[n].positive, items[n].negative)
        ]
        if others:
            m = int(rng.choice(others))
            out.append(Pair(n, m, cf.at, own[m].at, True))
    return out


@dataclass(frozen=True)
class Patching:
    """What patched runs of pairs read: the model's decoder `module`, the bank that runs (`bank`, each
    pair's x), the donors' bank (`donor`, each pair's x'), the `labels` by the running bank's rows;
    `sites` the parts path patching reads (path_sites)."""

    module: torch.nn.Module
    bank: Bank
    donor: Bank
    labels: torch.Tensor

    @cached_property
    def sites(self) -> Sites:
        return path_sites(self.module)


def path_sites(module) -> Sites:
    """The model's sites (model.anatomy.Sites) path patching reads: every layer's attention module,
    pre-attention norm, output projection and what its MLP adds, the final norm; else one line."""
    sites = sites_of(module)
    if not sites.complete("attention", "pre_norm", "outputs", "mlp_added"):
        raise RunError(
            f"--paths: {type(module).__name__} has no attention module, pre-attention norm, output "
            "projection, MLP or final norm where path patching looks; run without --paths"
        )
    return sites


def pair_tensors(pairs: list[Pair], *fields) -> list[torch.Tensor]:
    return [torch.tensor([getattr(p, f) for p in pairs]) for f in fields]


def pair_frame(items, bank, reference, pairs, labels) -> pd.DataFrame:
    """Per pair: its item's ids, covariate, y and y(x') (rows of a raw frame are taken from it)."""
    n, r = pair_tensors(pairs, "item", "donor")
    return pd.DataFrame(
        {
            "item_id": [items[p.item].item_id for p in pairs],
            "unit": [items[p.item].unit for p in pairs],
            "template_id": [items[p.item].template_id for p in pairs],
            "covariate": [items[p.item].covariate for p in pairs],
            "y": behaviour_rows(bank.logits[n], labels[n, 0], labels[n, 1]).double().cpu().numpy(),
            "y_cf": behaviour_rows(reference.logits[r], labels[n, 0], labels[n, 1]).double().cpu().numpy(),
        }
    )


def writes(patching: Patching, pairs: list[Pair], below: int):
    """(sender names, (B, S, E)): what each part below layer `below` wrote at p in x' minus in x."""
    anatomy, bank, reference = patching.sites, patching.bank, patching.donor
    n, r, at, at_cf = pair_tensors(pairs, "item", "donor", "at", "at_cf")
    rows = torch.arange(len(pairs))
    names = [EMBEDDING]
    parts = [(reference.hidden[0][r, at_cf] - bank.hidden[0][n, at])[:, None]]
    for j in range(below):
        z, z_cf = bank.outputs[j][n][rows, :, at], reference.outputs[j][r][rows, :, at_cf]  # (B, H, D)
        B, H, D = z.shape
        project = anatomy.outputs[j]
        diagonal = torch.zeros(B, H, H, D, dtype=z.dtype)
        diagonal[:, torch.arange(H), torch.arange(H)] = z_cf - z
        per_head = project(diagonal.view(B * H, H * D)).view(B, H, -1) - project(
            torch.zeros(1, H * D, dtype=z.dtype)
        )
        post = anatomy.after_attention[j]
        if post is not None:  # the norm after attention: of the layer's whole output, x's other heads kept
            whole = project(z.reshape(B, H * D))[:, None]
            per_head = post(whole + per_head) - post(whole)
        parts.append(per_head)
        names += [HeadSet.name(j, h) for h in range(H)]
        m, m_cf = bank.mlp[j][n, at], reference.mlp[j][r, at_cf]
        if anatomy.mlp_normed[j]:
            m, m_cf = anatomy.mlp_added[j](m), anatomy.mlp_added[j](m_cf)
        parts.append((m_cf - m)[:, None])
        names.append(f"MLP {j}")
    return names, torch.cat(parts, 1)


@dataclass
class _ValueOnly:
    """Editor at `layer`: every head's output as in x's clean run, but the receiver `head` (per row)
    reads the values computed in this run with its clean weights: only its value input changes."""

    layer: int
    head: torch.Tensor  # (B,)
    outputs: torch.Tensor  # (B, H, T, D) clean
    weights: torch.Tensor  # (B, H, T, T) clean

    def __call__(self, site) -> torch.Tensor:
        if site.layer != self.layer:
            return site.output
        B, H, T, _ = site.output.shape
        rows = torch.arange(B)
        own = torch.matmul(
            self.weights[rows, self.head, :T, :T].to(site.value.dtype), site.values()[rows, self.head]
        )
        chosen = (torch.arange(H)[None] == self.head[:, None])[:, :, None, None]
        return torch.where(chosen, own[:, None], self.outputs[:, :, :T].to(site.output.dtype))


@contextmanager
def _read_at(anatomy: Sites, layer: int, h: torch.Tensor, at: torch.Tensor, delta: torch.Tensor):
    """Within the block layer `layer`'s attention reads N(h + delta) (B, E) at each row's position
    `at` (N its pre-attention norm); the residual stream itself is left as it is."""

    def hook(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        new = anatomy.pre_norm[layer](h + delta).to(x.dtype)
        x = x.index_put((torch.arange(len(at)), at), new)
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    handle = anatomy.attention[layer].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _sender_pass(patching: Patching, pairs: list[Pair], heads, layer: int, delta):
    """y of the pairs' x with each receiver's (`heads` (B,) of `layer`) value at p read from
    N(h_p + delta) (B, E); under grad mode when delta needs one."""
    bank = patching.bank
    rows, at = pair_tensors(pairs, "item", "at")
    T = int(bank.lengths[rows].max())
    editor = _ValueOnly(layer, heads, bank.outputs[layer][rows, :, :T], bank.weights[layer][rows, :, :T, :T])
    hidden = bank.hidden[layer][rows]
    h = hidden[torch.arange(len(rows)), at]
    contexts = [editing(editor), _read_at(patching.sites, layer, h, at, delta)]
    return rerun_y(patching.module, bank, rows, layer, hidden, patching.labels[rows], contexts)


def screen(patching: Patching, pairs: list[Pair], receiver: tuple[int, int]):
    """(sender names, (n pairs, S) attribution of each sender's edge into the receiver's value)."""
    layer, head = receiver
    names, out = None, []
    for start in range(0, len(pairs), ROWS):
        batch = pairs[start : start + ROWS]
        delta = torch.zeros(len(batch), patching.bank.hidden[0].shape[-1], requires_grad=True)
        with torch.enable_grad():
            y = _sender_pass(patching, batch, torch.full((len(batch),), head), layer, delta)
            (g,) = torch.autograd.grad(y.sum(), delta)
        with torch.inference_mode():
            names, parts = writes(patching, batch, layer)
            out.append(torch.einsum("be,bse->bs", g.to(parts.dtype), parts).double().cpu().numpy())
    return names, np.concatenate(out)


@torch.inference_mode()
def edges(patching: Patching, pairs: list[Pair], receiver, senders: list[str]) -> np.ndarray:
    """(n pairs, len(senders)) y with each sender's write at p swapped on its path into the
    receiver's value."""
    layer, head = receiver
    out = np.empty((len(pairs), len(senders)))
    per_pair = ROWS // max(1, len(senders)) or 1
    for start in range(0, len(pairs), per_pair):
        batch = pairs[start : start + per_pair]
        names, parts = writes(patching, batch, layer)
        picked = parts[:, [names.index(s) for s in senders]]  # (b, s, E)
        rows = [p for p in batch for _ in senders]
        heads = torch.full((len(rows),), head)
        y = _sender_pass(patching, rows, heads, layer, picked.reshape(len(rows), -1))
        out[start : start + len(batch)] = y.cpu().numpy().reshape(len(batch), len(senders))
    return out


def edge_roles(fold: np.ndarray) -> np.ndarray:
    """Per item (its fold 2 u + t: unit half u, template half t): 1 where it screens senders (fold 0),
    0 where it confirms them (fold 3: other units and other templates; fold 2 where the suite has one
    template), -1 for the rest, so no confirmation shares a unit or a template with the screen."""
    confirms = 3 if (fold == 3).any() else 2
    return np.where(fold == 0, 1, np.where(fold == confirms, 0, -1))


def compared_pairs(items, bank: Bank, reference: Bank, labels, word: str) -> dict:
    """Per comparison, the reference word and RESAMPLED (where any item has one): (x''s bank, the
    pairs, their base rows)."""
    pairs, resampled = reference_pairs(items, word), resample_pairs(items, word)
    out = {word: (reference, pairs, pair_frame(items, bank, reference, pairs, labels))}
    if resampled:
        out[RESAMPLED] = (bank, resampled, pair_frame(items, bank, bank, resampled, labels))
    return out
