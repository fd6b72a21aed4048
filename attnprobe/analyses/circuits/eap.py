"""Every part's attribution on every pair (x, x'): the first-order effect on y of the part taking
x''s output at the aligned positions (graph.py's parts), from forward and backward passes of x.

  EAP     (Syed et al. 2023):   a_j = sum_t (o_j(x')_t - o_j(x)_t) . dy/do_j at x
  EAP-IG  (Hanna et al. 2024):  the gradient averaged over the m runs whose embeddings at the
          aligned positions are x's moved the fraction 1 - k/m towards x''s (k = 1..m; k = m is x,
          so EAP comes from the same passes), m = IG_STEPS (the paper's default)

o_j is the part's output (a head's z, an MLP's output, the embeddings); t runs over the positions
from the occupation's last token to the end, aligned one to one with x''s. Where x' is longer or
shorter before that (a word of other length), the interpolation's far end is x with every part's
output from x' at those positions, the run whose y exact patching of every part gives.

Shapes: B pairs of a pass, T positions, L layers, H heads, D head dim, E model width.
"""

from __future__ import annotations

import numpy as np
import torch

from ...attention.capture import editing
from ...intervene.engine import aligned
from ...intervene.gradients import frozen_weights
from ...intervene.rerun import ROWS, rerun_y
from ...intervene.sites import Gradients, mlp_outputs
from ...model.anatomy import mlp_modules
from ..senders import Pair, pair_tensors
from .graph import Graph

IG_STEPS = 5


def attributions(patching) -> dict:
    """{"eap": (n, size), "eap_ig": (n, size)} float64: every part's attribution on every pair of a
    comparison (runs.Patching)."""
    out: dict = {"eap": [], "eap_ig": []}
    for start in range(0, len(patching.pairs), ROWS):
        eap, ig = _batch(patching, patching.pairs[start : start + ROWS])
        out["eap"].append(eap)
        out["eap_ig"].append(ig)
    return {k: np.concatenate(v) if v else np.zeros((0, patching.graph.size)) for k, v in out.items()}


def _batch(patching, pairs: list[Pair]):
    bank, donor = patching.bank, patching.donor
    rows, donors, at, at_cf = pair_tensors(pairs, "item", "donor", "at", "at_cf")
    T = int(bank.lengths[rows].max())
    where, index = aligned(torch.arange(T), at, at_cf, bank.lengths[rows], donor)
    device = bank.hidden[0].device
    where, index = where.to(device), index.to(device)
    deltas = _differences(bank, donor, rows, donors, where, index, patching.graph)
    summed = None
    for k in range(1, IG_STEPS + 1):
        grads = _gradients(patching, rows, deltas[0], 1 - k / IG_STEPS)
        summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]
    dot = lambda gs: torch.cat([(d * g).flatten(2).sum(-1) for d, g in zip(deltas, gs)], 1)
    eap = dot(grads)  # the last step, k = m, is x itself
    ig = dot([g / IG_STEPS for g in summed])
    return eap.double().cpu().numpy(), ig.double().cpu().numpy()


def _differences(bank, donor, rows, donors, where, index, graph: Graph) -> list[torch.Tensor]:
    """o(x') - o(x) at the aligned positions (zero elsewhere), per part group in the graph's order:
    embeddings (B, 1, T, E), heads L x (B, H, T, D), MLPs L x (B, 1, T, E); T the pass's (where's)."""
    at_positions, T = where[:, :, None], where.shape[1]

    def stream(recorded):  # (N, T', E) per bank -> (B, 1, T, E)
        own = recorded(bank)[rows][:, :T]
        given = recorded(donor)[donors].gather(1, index[:, :, None].expand(-1, -1, own.shape[-1]))
        return torch.where(at_positions, given.to(own.dtype) - own, 0).float()[:, None]

    out = [stream(lambda b: b.hidden[0])]
    for layer in range(graph.n_layers):
        own = bank.outputs[layer][rows][:, :, :T]
        B, H, _, D = own.shape
        given = donor.outputs[layer][donors].gather(2, index[:, None, :, None].expand(B, H, T, D))
        out.append(torch.where(at_positions[:, None], given.to(own.dtype) - own, 0).float())
    if graph.mlps:
        out += [stream(lambda b, layer=layer: b.mlp[layer]) for layer in range(graph.n_layers)]
    return out


def _gradients(patching, rows, embedding_delta, fraction: float) -> list[torch.Tensor]:
    """dy/do for every part group (as _differences) in the run of x whose embeddings are moved
    `fraction` of the way to x''s at the aligned positions."""
    bank, module = patching.bank, patching.module
    mlps = mlp_modules(module) if patching.graph.mlps else []
    hidden = bank.hidden[0][rows][:, : embedding_delta.shape[2]].float()
    hidden = (hidden + fraction * embedding_delta[:, 0]).to(bank.hidden[0].dtype)
    hidden.requires_grad_(True)
    grads = Gradients()
    with frozen_weights(module), torch.enable_grad():
        contexts = [editing(grads), mlp_outputs(mlps, grads.keep_mlp)]
        rerun_y(module, bank, rows, 0, hidden, patching.labels[rows], contexts).sum().backward()
    L = len(bank.hidden)
    zero = lambda t: torch.zeros_like(t) if t.grad is None else t.grad  # a part y does not read
    out = [hidden.grad.float()[:, None]]
    out += [zero(grads.outputs[layer]).float() for layer in range(L)]
    if mlps:
        out += [zero(grads.mlp[layer]).float()[:, None] for layer in range(L)]
    return out
