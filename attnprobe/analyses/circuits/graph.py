"""The parts a circuit is made of, how they are ranked, and which circuits are evaluated.

Parts (nodes): the token embeddings, every attention head (its output z, before the output
projection) and every MLP (its output). A circuit C is the embeddings and a set of heads and MLPs;
run on x, every part outside C gives the output it had in x' (at the aligned positions, from the
occupation's last token on), every part in C computes from what reaches it. The embeddings are in
every circuit: without them every part reads x''s stream and y is y(x') whatever C holds. Since
each part reads the sum of all earlier parts' outputs, any such set is connected from the
embeddings to the logits, so at this grain pruning changes nothing (edges are the next grain).

Ranking: a part's score on a set of items is the slope, over the items' covariate, of its
attribution (below: its first-order effect on y of taking x''s output), i.e. to first
order the part's contribution to TE's covariate gradient; parts are ranked by its absolute value,
as EAP-IG ranks edges (Hanna et al. 2024).

Attribution, every part's on every pair (x, x'):

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

from dataclasses import dataclass

import numpy as np
import torch

from ...attention.capture import editing
from ...heads import HeadSet
from ...intervene.engine import aligned
from ...intervene.gradients import frozen_weights
from ...intervene.rerun import ROWS, rerun_y
from ...intervene.sites import Gradients, mlp_outputs
from ...model.anatomy import mlp_modules
from ..senders import Pair, pair_tensors

EMBEDDING = "embedding"
SIZES = (1, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)  # parts beside the embeddings; + all


@dataclass(frozen=True)
class Graph:
    """The parts of a model of `n_layers` x `n_heads` (and an MLP per layer where `mlps`), indexed
    0 (the embeddings), 1 + l H + h (head h of layer l), 1 + L H + l (layer l's MLP)."""

    n_layers: int
    n_heads: int
    mlps: bool
    always = 1  # the embeddings are in every circuit
    sampled_every = 4  # random circuits, subsets and single parts are run on every 4th pair

    def top(self, scores: np.ndarray, n: int) -> np.ndarray:
        return top_parts(scores, n)

    def random(self, n: int, rng) -> np.ndarray:
        return random_parts(self.size, n, rng)

    @property
    def size(self) -> int:
        return 1 + self.n_layers * self.n_heads + self.n_layers * self.mlps

    def names(self) -> list[str]:
        L, H = self.n_layers, self.n_heads
        heads = [HeadSet.name(l, h) for l in range(L) for h in range(H)]
        return [EMBEDDING, *heads, *([f"MLP{l}" for l in range(L)] if self.mlps else [])]

    def groups(self, chosen: np.ndarray) -> list[np.ndarray]:
        """The groups a worst subset of circuit `chosen` is drawn from (search.py): each of its parts
        beside the embeddings."""
        return [np.array([j]) for j in np.flatnonzero(chosen[self.always :]) + self.always]

    def layers(self) -> np.ndarray:
        """(size,) the layer each part is in (-1: the embeddings)."""
        L, H = self.n_layers, self.n_heads
        return np.concatenate([[-1], np.repeat(np.arange(L), H), np.arange(L) if self.mlps else []]).astype(
            int
        )

    def masks(self, patched: np.ndarray):
        """(embeddings (V,), heads (V, L, H), MLPs (V, L) or None) of boolean part masks (V, size)."""
        L, H = self.n_layers, self.n_heads
        heads = patched[:, 1 : 1 + L * H].reshape(-1, L, H)
        return patched[:, 0], heads, patched[:, 1 + L * H :] if self.mlps else None

    def of_heads(self, heads) -> np.ndarray:
        """(size,) bool: the embeddings and these (layer, head) pairs."""
        chosen = np.zeros(self.size, dtype=bool)
        chosen[0] = True
        for layer, head in heads:
            chosen[1 + layer * self.n_heads + head] = True
        return chosen

    def sizes(self) -> list[int]:
        """The circuit sizes evaluated (parts beside the embeddings): SIZES below the parts there
        are, and all of them (the full model, faithful by construction: a check)."""
        parts = self.size - 1
        return [n for n in SIZES if n < parts] + [parts]


def part_scores(attribution: np.ndarray, covariate: np.ndarray) -> np.ndarray:
    """(size,) each part's score on these items: the OLS slope of its attribution (n, size) on the
    covariate (n,); NaN where the covariate does not vary."""
    x = covariate - covariate.mean()
    spread = float(x @ x)
    if len(x) < 2 or spread == 0:
        return np.full(attribution.shape[1], np.nan)
    return x @ np.nan_to_num(attribution) / spread


def top_parts(scores: np.ndarray, n: int) -> np.ndarray:
    """(size,) bool: the embeddings and the n parts of largest |score| (NaN: 0), ranked as size_ranks
    ranks them (near-ties in index order)."""
    order = size_order(np.nan_to_num(scores[1:], nan=0.0))
    chosen = np.zeros(len(scores), dtype=bool)
    chosen[0] = True
    chosen[1 + order[:n]] = True
    return chosen


def size_order(values) -> np.ndarray:
    """Indices by |value|, largest first, NaN last; values equal to 12 digits of the largest are tied
    and kept in index order (parts a model treats alike must not be reordered by their values' last
    bits: a ratio of slopes rounds differently from the slopes)."""
    size = np.abs(np.asarray(values, dtype=float))
    scale = np.nanmax(size, initial=0.0) or 1.0
    keyed = np.where(np.isnan(size), -np.inf, np.round(size / scale, 12))
    return np.argsort(-keyed, kind="stable")


def size_ranks(shares) -> np.ndarray:
    """1-based ranks by |share| in size_order (NaN: no rank): the order top_parts chooses parts in."""
    ranks = np.empty(len(shares))
    ranks[size_order(shares)] = np.arange(1, len(shares) + 1)
    return np.where(np.isnan(np.asarray(shares, dtype=float)), np.nan, ranks)


def random_parts(size: int, n: int, rng) -> np.ndarray:
    """(size,) bool: the embeddings and n parts drawn at random (the baseline of a circuit of n)."""
    chosen = np.zeros(size, dtype=bool)
    chosen[0] = True
    chosen[1 + rng.choice(size - 1, n, replace=False)] = True
    return chosen


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
