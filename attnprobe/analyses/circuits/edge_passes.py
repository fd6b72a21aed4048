"""Every edge's attribution, and exact runs of edge circuits, on the pairs of a comparison
(wiring.py's hooks; runs.Patching names the model, the banks and the pairs).

  EAP     an edge's first-order effect on y of its receiver reading the sender's x' write:
          sum over the group's positions of (w_s(x') - w_s(x)) . dy/da_r at x
  EAP-IG  the same with dy/da_r averaged over the IG_STEPS runs whose embeddings are moved towards
          x''s (eap.py's path; the last run is x, so EAP comes from the same passes)

An edge's score on a set of items is the OLS slope of its attribution on the covariate (as the
parts'), kept as per-fold sums (`FoldSums`) so no per-item, per-edge table is held: a quarter's
circuit is chosen from the other quarters' sums.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from ...intervene.gradients import frozen_weights
from ...intervene.rerun import rerun_y
from ...intervene.sites import registered
from ..senders import pair_tensors
from .graph import IG_STEPS
from .wiring import PROJECTIONS, Patched, Window, bank_writes, receivers_read

PASS_BYTES = 2**28  # what one pass's per-edge tensors may take (rows are sized from it)


@dataclass
class FoldSums:
    """Per fold f (0..3): items n, sums of the covariate x and x^2, of each edge's attribution a
    (F, size) and of x a."""

    n: np.ndarray
    x: np.ndarray
    xx: np.ndarray
    a: np.ndarray
    xa: np.ndarray

    @classmethod
    def empty(cls, size: int, folds: int = 4) -> FoldSums:
        zeros = lambda *shape: np.zeros(shape)
        return cls(zeros(folds), zeros(folds), zeros(folds), zeros(folds, size), zeros(folds, size))

    def add(self, fold: np.ndarray, x: np.ndarray, a: np.ndarray) -> None:
        for f in np.unique(fold):
            on = fold == f
            self.n[f] += on.sum()
            self.x[f] += x[on].sum()
            self.xx[f] += (x[on] ** 2).sum()
            self.a[f] += a[on].sum(0)
            self.xa[f] += x[on] @ a[on]

    def slope(self, folds=None) -> np.ndarray:
        """(size,) each edge's OLS slope on the covariate over the items of `folds` (None: all);
        NaN where the covariate does not vary there."""
        on = np.arange(len(self.n)) if folds is None else np.asarray(folds)
        n, x, xx = self.n[on].sum(), self.x[on].sum(), self.xx[on].sum()
        spread = xx - x * x / n if n else 0.0
        if n < 2 or spread <= 1e-12 * max(xx, 1.0):
            return np.full(self.a.shape[1], np.nan)
        return (self.xa[on].sum(0) - x * self.a[on].sum(0) / n) / spread


def rows_per_pass(graph, width: int, aligned: int, per: int) -> int:
    """Rows of a pass whose `per` tensors of (senders or receivers) x aligned x width floats fit
    PASS_BYTES."""
    biggest = max(graph.n_senders, graph.n_receivers) * aligned * width * 4 * per
    return max(1, PASS_BYTES // biggest)


def edge_attributions(patching, sites, covariate: np.ndarray, fold: np.ndarray) -> dict:
    """{"eap": FoldSums, "eap_ig": FoldSums} of every edge over the comparison's pairs."""
    graph, bank = patching.graph, patching.bank
    out = {method: FoldSums.empty(graph.size) for method in ("eap", "eap_ig")}
    width = bank.hidden[0].shape[-1]
    aligned = int(max(int(bank.lengths[p.item]) - p.at for p in patching.pairs)) if patching.pairs else 1
    step = rows_per_pass(graph, width, aligned, 3)
    for start in range(0, len(patching.pairs), step):
        chosen = slice(start, start + step)
        scores = _attribution_batch(patching, sites, patching.pairs[chosen])
        for method, values in scores.items():
            out[method].add(fold[chosen], covariate[chosen], values)
    return out


def _attribution_batch(patching, sites, pairs) -> dict:
    graph, bank, donor, module = patching.graph, patching.bank, patching.donor, patching.module
    rows, donors, window, T = _window(patching, pairs)
    every = graph.n_senders
    delta = bank_writes(sites, graph, donor, donors, window, every, cf=True)
    delta = torch.where(window.valid[:, None, :, None].to(delta.device), delta - bank_writes(
        sites, graph, bank, rows, window, every), 0)  # fmt: skip
    clean = bank.hidden[0][rows][:, :T]
    towards = window.put(torch.zeros_like(clean, dtype=torch.float32), delta[:, 0])
    summed = None
    for k in range(1, IG_STEPS + 1):
        hidden = (clean.float() + (1 - k / IG_STEPS) * towards).to(clean.dtype)
        hidden.requires_grad_(True)
        with frozen_weights(module), torch.enable_grad():
            with receiver_gradients(sites, graph, window) as collect:
                rerun_y(module, bank, rows, 0, hidden, patching.labels[rows]).sum().backward()
            gradient = collect()
        summed = gradient if summed is None else summed + gradient
    onehot, by_sender = window.onehot().to(delta), delta.permute(0, 2, 3, 1)  # (B, A, E, S)
    # sum over a group's positions and the width of dy/da_r . delta_s: a product per row and position
    per_edge = lambda g: torch.einsum(
        "bars,bag->brsg", torch.matmul(g.transpose(1, 2), by_sender), onehot
    ).flatten(1)[:, graph.index]
    return {
        "eap": per_edge(gradient).double().cpu().numpy(),  # the last run, k = m, is x
        "eap_ig": per_edge(summed / IG_STEPS).double().cpu().numpy(),
    }


def _window(patching, pairs):
    """(x's rows, x''s rows, the pairs' Window, the pass's length T)."""
    bank = patching.bank
    rows, donors, at, at_cf = pair_tensors(pairs, "item", "donor", "at", "at_cf")
    T = int(bank.lengths[rows].max())
    device = bank.hidden[0].device
    return rows, donors, Window.of(at, at_cf, bank.lengths[rows], T, patching.donor.ids.shape[1], device), T


@contextmanager
def receiver_gradients(sites, graph, window: Window):
    """Within the block hooks keep the gradient at each receiver's projection output (query, key,
    value), its MLP's input and the final norm's input, and the stream each norm read; yields
    `collect()`, after backward: (B, R, A, E) dy/da_r, each receiver's gradient taken back through
    its own rows of the projection and its norm (the gradient of y in a_r, wiring's added input)."""
    streams, grads = {}, {}

    def keep(key):
        return lambda grad: grads.__setitem__(key, window.gather(grad))

    def stream(key):
        return lambda module, args: streams.__setitem__(key, window.gather(args[0]).detach())

    def hook_output(key):  # a hook returning a value would replace the output: these return None
        return lambda module, args, output: output.register_hook(keep(key)) and None

    def hook_input(key):
        return lambda module, args: args[0].register_hook(keep(key)) and None

    def collect() -> torch.Tensor:
        h = streams[("attention", 0)]
        B, A, E = h.shape
        out = torch.zeros(B, graph.n_receivers, A, E, device=h.device)
        counts = (graph.n_heads, graph.n_kv, graph.n_kv)
        for layer in range(graph.n_layers):
            attention, mlp = graph.receivers_of(layer)
            at_input = []
            for name, count in zip(PROJECTIONS, counts):
                weight = getattr(sites.attention[layer], name).weight.view(count, -1, E)
                g = grads.get((name, layer), torch.zeros(B, A, weight.shape[0] * weight.shape[1]))
                at_input.append(torch.einsum("bacd,cde->bcae", g.view(B, A, count, -1).to(weight), weight))
            out[:, attention] = _norm_vjp(
                sites.pre_norm[layer], streams[("attention", layer)], torch.cat(at_input, 1)
            )
            g = grads.get(("mlp", layer), torch.zeros(B, A, E))
            out[:, mlp] = _norm_vjp(sites.mlp_norm[layer], streams[("mlp", layer)], g[:, None])[:, 0]
        out[:, -1] = grads.get("logits", torch.zeros(B, A, E)).float()
        return out

    with registered([]) as handles:
        for layer in range(graph.n_layers):
            handles.append(sites.pre_norm[layer].register_forward_pre_hook(stream(("attention", layer))))
            for name in PROJECTIONS:
                module = getattr(sites.attention[layer], name)
                handles.append(module.register_forward_hook(hook_output((name, layer))))
            handles.append(sites.mlp_norm[layer].register_forward_pre_hook(stream(("mlp", layer))))
            handles.append(sites.mlp[layer].register_forward_pre_hook(hook_input(("mlp", layer))))
        handles.append(sites.final_norm.register_forward_pre_hook(hook_input("logits")))
        yield collect


def _norm_vjp(norm, h: torch.Tensor, cotangents: torch.Tensor) -> torch.Tensor:
    """(B, r, A, E) float32: the cotangents (B, r, A, E) at the norm's output taken back to its input h
    (B, A, E) (one vector-Jacobian product per receiver, batched)."""
    x = h.detach().requires_grad_(True)
    with torch.enable_grad():
        y = norm.forward(x)
        (g,) = torch.autograd.grad(y, x, cotangents.transpose(0, 1).to(y.dtype), is_grads_batched=True)
    return g.transpose(0, 1).float()


def first_layer(graph, patched: np.ndarray) -> int:
    """The lowest layer a run must start from: that of the lowest receiver of a patched edge (the
    logits: the top layer), or n_layers where nothing is patched."""
    if not patched.any():
        return graph.n_layers
    r, _, _ = np.unravel_index(graph.index[patched], graph.valid.shape)
    return int(min(graph.receiver_order[r].min() // 2, graph.n_layers - 1))


def edge_pass(patching, sites, pair_of: np.ndarray, patched: np.ndarray, layer: int) -> np.ndarray:
    """y of each row's x with the edges `patched` (B, size) reading their senders' x' writes, run from
    `layer` (every patched edge's receiver at or above it)."""
    graph, bank, donor = patching.graph, patching.bank, patching.donor
    rows, donors, window, T = _window(patching, [patching.pairs[i] for i in pair_of])
    given = bank_writes(sites, graph, donor, donors, window, graph.n_senders, cf=True).transpose(1, 2)
    given = given.contiguous()  # (B, A, S, E): Patched's layout
    below = graph.sender(layer, 0)  # senders below the first layer run write as in x's clean run
    diff = torch.zeros_like(given)
    valid = window.valid[:, :, None, None].to(given.device)
    clean = bank_writes(sites, graph, bank, rows, window, below).transpose(1, 2)
    diff[:, :, :below] = torch.where(valid, clean - given[:, :, :below], 0)
    dense = torch.from_numpy(np.stack([graph.dense(p) for p in patched])).to(given.device)
    reads = Patched(dense, given, diff, window, torch.as_tensor(graph.limits))
    hidden = bank.hidden[layer][rows][:, :T]
    contexts = [receivers_read(sites, graph, window, reads)]
    return rerun_y(patching.module, bank, rows, layer, hidden, patching.labels[rows], contexts).cpu().numpy()
