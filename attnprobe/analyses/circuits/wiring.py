"""Runs at the grain of edges (edges.py): each receiver reads its own copy of the residual stream.

At the aligned positions of a pair (from the occupation's last token to the end, `Window`), every
receiver r reads N(h + a_r) instead of N(h): h the stream it reads, N its norm (the layer's pre-norm
for queries, keys and values, the MLP's pre-norm, none for the logits), a_r what is added for r
alone. A query, key or value input is then that head's rows of the projection applied to N(h + a_r)
(hooked on the projection's output, so rotary, query/key norms, grouped heads and masks stay the
model's own).

  exact patching (`Patched`)   a_r = - sum over the edges (s, r, g) outside the circuit of
                               [w_s(this run) - w_s(x')] at positions of group g: r reads its
                               circuit senders' writes from this run, every other sender's from x'
  attribution                  dy/da_r at a_r = 0, the gradient along r's input alone (from the
                               gradient at r's projection output, edge_passes.receiver_gradients),
                               and an edge's first-order effect is (w_s(x') - w_s(x)) . dy/da_r

w_s is what sender s writes: the embeddings; a head's output through its columns of the output
projection (where the family normalises the attention output, Gemma 2/3, times that norm's gain at
the layer's whole output: the heads' writes sum to what the layer adds); an MLP's output (through
its post-norm where there is one). Shapes: B rows, A aligned positions, E width, S senders, R
receivers, H heads, D head dim.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ...errors import RunError
from ...intervene.sites import registered
from ...model.anatomy import Sites, sites_of
from .edges import GROUPS, EdgeGraph

PROJECTIONS = ("q_proj", "k_proj", "v_proj")
SUM_CHUNK = 4096  # edges summed at once where a receiver's patched edges are summed one by one


def edge_sites(module) -> Sites:
    """The sites edges need, else one line: every layer's pre-norm, query/key/value projections,
    output projection, MLP pre-norm, MLP and final norm."""
    sites = sites_of(module)
    names = ("attention", "pre_norm", "outputs", "mlp_norm", "mlp", "mlp_added")
    if not sites.complete(*names) or not all(hasattr(a, p) for a in sites.attention for p in PROJECTIONS):
        raise RunError(
            f"--circuit-grain edges: {type(module).__name__} has no separate query, key and value "
            "projections, pre-norms or MLP where edges are read; run --circuits with --circuit-grain parts"
        )
    return sites


@dataclass(frozen=True)
class Window:
    """Each row's aligned positions, a = 0..A-1: `pos` in x (at + a), `pos_cf` in x' (at_cf + a),
    `valid` where a < the row's length - at, `group` (GROUPS' index: a = 0 the occupation, the row's
    last the last, between them between; -1 past the row)."""

    pos: torch.Tensor
    pos_cf: torch.Tensor
    valid: torch.Tensor
    group: torch.Tensor

    @classmethod
    def of(cls, at, at_cf, lengths, width: int, width_cf: int, device=None) -> Window:
        at, at_cf, n = at.to(device), at_cf.to(device), (lengths - at).to(device)
        a = torch.arange(int(n.max()), device=device)[None]
        valid = a < n[:, None]
        group = torch.where(a == n[:, None] - 1, 2, torch.where(a == 0, 0, 1))
        pos = (at[:, None] + a).clamp(max=width - 1)
        return cls(pos, (at_cf[:, None] + a).clamp(max=width_cf - 1), valid, torch.where(valid, group, -1))

    def gather(self, t: torch.Tensor, cf: bool = False) -> torch.Tensor:
        """(B, T, ...) -> (B, A, ...) at the aligned positions."""
        pos = (self.pos_cf if cf else self.pos).to(t.device)
        return t[torch.arange(len(pos), device=t.device)[:, None], pos]

    def put(self, t: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """t (B, T, ...) with values (B, A, ...) at the valid aligned positions (a copy: autograd-safe)."""
        b, a = self.valid.nonzero(as_tuple=True)
        out = t.clone()
        out[b.to(t.device), self.pos[b, a].to(t.device)] = values[b, a].to(t.dtype)
        return out

    def onehot(self) -> torch.Tensor:
        """(B, A, 3) float: which group each aligned position is in (zero past the row)."""
        return torch.nn.functional.one_hot(self.group.clamp(min=0), len(GROUPS)) * self.valid[..., None]


def norm_gain(norm, x: torch.Tensor) -> torch.Tensor:
    """(..., E) float32 g with norm(x) = g * x: an RMS norm's per-position scale times its per-dimension
    weight (whichever the family's weight convention: w' = norm(1) sqrt(1 + eps)). Modules are called by
    `forward` here and below: their hooks (the wiring's own) must not fire on these side computations."""
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    if eps is None:
        raise RunError(
            f"--circuit-grain edges: the norm after attention ({type(norm).__name__}) is not an RMS norm"
        )
    ones = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    weight = norm.forward(ones).float() * (1 + eps) ** 0.5
    x = x.float()
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def head_writes(sites: Sites, layer: int, z: torch.Tensor) -> torch.Tensor:
    """(B, H, A, E) float32: what each head writes, from its outputs z (B, A, H, D)."""
    project = sites.outputs[layer]
    B, A, H, D = z.shape
    weight = project.weight.view(-1, H, D)
    out = torch.einsum("bahd,ehd->bhae", z.to(weight.dtype), weight).float()
    post = sites.after_attention[layer]
    if post is not None:
        out = out * norm_gain(post, project.forward(z.reshape(B, A, H * D)))[:, None]
    return out


def mlp_write(sites: Sites, layer: int, out: torch.Tensor) -> torch.Tensor:
    """(B, A, E) float32: what the MLP adds, from its output (through its post-norm where it has one)."""
    if sites.mlp_normed[layer]:
        out = sites.mlp_added[layer].forward(out)
    return out.float()


@torch.no_grad()
def bank_writes(sites: Sites, graph: EdgeGraph, bank, rows, window: Window, limit: int, cf=False):
    """(B, limit, A, E) float32: the first `limit` senders' writes in the bank's clean runs of `rows`
    at the window's positions (x''s with `cf`)."""
    at = lambda t: window.gather(t[rows], cf)
    parts = [at(bank.hidden[0]).float()[:, None]]
    for layer in range(graph.n_layers):
        if graph.sender(layer, 0) >= limit:
            break
        parts.append(head_writes(sites, layer, at(bank.outputs[layer].transpose(1, 2))))
        parts.append(mlp_write(sites, layer, at(bank.mlp[layer]))[:, None])
    return torch.cat(parts, 1)[:, :limit]


@dataclass
class Patched:
    """Exact patching: `patched` (B, R, S, 3) the edges outside each row's circuit; `donor` (B, A, S, E)
    every sender's write in x'; `diff` (B, A, S, E) w_s(this run) - w_s(x'), filled below the first
    layer run (from the clean banks) and by each sender as it writes. Positions lead the senders so
    that each position's (S, E) block is one matrix for the sums."""

    patched: torch.Tensor
    donor: torch.Tensor
    diff: torch.Tensor
    window: Window
    limits: torch.Tensor  # (R,) the senders a receiver can read are those below its limit
    sparse: ClassVar[bool] = True  # False: every block summed densely, nothing from the total (tests)

    def added(self, start: int, stop: int) -> torch.Tensor | None:
        """(B, r, A, E) minus the sum of the patched edges' diffs into receivers start..stop (one
        block: they read the same senders), or None where none is patched. Per row, receiver and
        group, the sparser of the patched edges and the others is summed (the others from the total
        of every sender's diff): a circuit of a few edges costs a few edges, not every sender."""
        patched = self.patched[:, start:stop, : int(self.limits[start])]
        if not patched.any():
            return None
        B, r, senders, _ = patched.shape
        diff = self.diff[:, :, :senders]
        flip = patched.sum(2) * 2 > senders  # (B, r, 3): sum the edges not patched instead
        flip &= self.sparse
        sparse = self._summed(patched ^ flip[:, :, None, :], diff)
        group = self.window.group.clamp(min=0)[:, None, :].expand(B, r, -1)
        flipped = flip.gather(2, group)[..., None]  # (B, r, A, 1)
        return -torch.where(flipped, self.total[:, None] - sparse, sparse)

    def _summed(self, chosen: torch.Tensor, diff: torch.Tensor) -> torch.Tensor:
        """(B, r, A, E): per row and receiver the sum of the chosen (B, r, S, 3) senders' diffs (B, A,
        S, E) at the positions of each group; as one matrix product per row and position where many
        are chosen, else entry by entry."""
        B, r, senders, _ = chosen.shape
        A, E = diff.shape[1], diff.shape[3]
        onehot = self.window.onehot().to(diff)  # (B, A, 3)
        b, receiver, sender, g = chosen.nonzero(as_tuple=True)
        if 30 * len(b) >= B * r * senders or not self.sparse:
            by_position = torch.einsum("brsg,bag->bars", chosen.to(diff), onehot)
            return torch.matmul(by_position, diff).transpose(1, 2)
        out = torch.zeros(B * r, A, E, dtype=diff.dtype, device=diff.device)
        for at in range(0, len(b), SUM_CHUNK):
            k = slice(at, at + SUM_CHUNK)
            contribution = diff[b[k], :, sender[k]] * onehot[b[k], :, g[k]][..., None]  # (k, A, E)
            out.index_add_(0, b[k] * r + receiver[k], contribution)
        return out.view(B, r, A, E)

    def wrote(self, start: int, stop: int, writes: torch.Tensor) -> None:
        """Senders start..stop wrote `writes` (B, s, A, E) in this run."""
        live = writes.transpose(1, 2) - self.donor[:, :, start:stop]
        live = torch.where(self.window.valid[:, :, None, None], live, 0)
        self.diff[:, :, start:stop] = live
        self.total += live.sum(2)

    def __post_init__(self):
        # (B, A, E) the sum of every sender's diff so far: those not run yet are 0 until they write,
        # so a block reads the total of the senders below it (kept as each writes)
        self.total = self.diff.sum(2)


@contextmanager
def receivers_read(sites: Sites, graph: EdgeGraph, window: Window, reads):
    """Within the block each receiver reads N(h + a_r) at the window's positions, a_r from
    `reads.added(start, stop)` (None: those receivers read h), and each sender reports its writes to
    `reads.wrote(start, stop, writes)` (B, s, A, E). Layers skipped by the run fire no hook."""
    hooks = _Hooks(sites, graph, window, reads)
    H, G = graph.n_heads, graph.n_kv
    with registered([]) as handles:
        for layer in range(graph.n_layers):
            attention = sites.attention[layer]
            handles.append(sites.pre_norm[layer].register_forward_pre_hook(hooks.read_stream(layer)))
            for slot, name, count in zip((0, H, H + G), PROJECTIONS, (H, G, G)):
                handles.append(
                    getattr(attention, name).register_forward_hook(hooks.project(layer, slot, count))
                )
            handles.append(sites.outputs[layer].register_forward_hook(hooks.heads_wrote(layer)))
            handles.append(sites.mlp_norm[layer].register_forward_pre_hook(hooks.read_mlp_stream(layer)))
            handles.append(sites.mlp[layer].register_forward_pre_hook(hooks.mlp_input(layer)))
            handles.append(sites.mlp_added[layer].register_forward_hook(hooks.mlp_wrote(layer)))
        handles.append(sites.final_norm.register_forward_pre_hook(hooks.logits_input))
        yield


@dataclass
class _Hooks:
    """The hooks of receivers_read, per layer: the stream each block of receivers reads and what is
    added for each (`state`), the projections and the MLP's input recomputed from it, the senders'
    writes reported."""

    sites: Sites
    graph: EdgeGraph
    window: Window
    reads: object
    state: dict = field(default_factory=dict)

    def read_stream(self, layer: int):
        attention, _ = self.graph.receivers_of(layer)

        def hook(module, args):
            self.state[layer] = (
                self.window.gather(args[0]),
                self.reads.added(attention.start, attention.stop),
            )

        return hook

    def project(self, layer: int, slot: int, count: int):
        """A projection's output with each of its heads' rows applied to N(h + a_r) (B, count, A, E)."""

        def hook(module, args, output):
            h, added = self.state[layer]
            if added is None:
                return None
            own = (h[:, None].float() + added[:, slot : slot + count]).to(h.dtype)
            normed = self.sites.pre_norm[layer].forward(own)
            weight = module.weight.view(count, -1, module.weight.shape[-1])
            new = torch.einsum("bcae,cde->bacd", normed.to(weight.dtype), weight)
            if module.bias is not None:
                new = new + module.bias.view(count, -1)
            B, T, _ = output.shape
            return self.window.put(output.view(B, T, count, -1), new).view(B, T, -1)

        return hook

    def heads_wrote(self, layer: int):
        def hook(module, args, output):
            z = self.window.gather(args[0]).unflatten(-1, (self.graph.n_heads, -1))
            self.reads.wrote(
                self.graph.sender(layer, 0), self.graph.sender(layer), head_writes(self.sites, layer, z)
            )

        return hook

    def read_mlp_stream(self, layer: int):
        _, mlp = self.graph.receivers_of(layer)

        def hook(module, args):
            self.state[("mlp", layer)] = (self.window.gather(args[0]), self.reads.added(mlp, mlp + 1))

        return hook

    def mlp_input(self, layer: int):
        def hook(module, args):
            h, added = self.state[("mlp", layer)]
            if added is None:
                return None
            normed = self.sites.mlp_norm[layer].forward((h.float() + added[:, 0]).to(h.dtype))
            return (self.window.put(args[0], normed), *args[1:])

        return hook

    def mlp_wrote(self, layer: int):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            written = self.window.gather(out).float()[:, None]  # mlp_added's output: what the MLP adds
            self.reads.wrote(self.graph.sender(layer), self.graph.sender(layer) + 1, written)

        return hook

    def logits_input(self, module, args):
        h = self.window.gather(args[0])
        added = self.reads.added(self.graph.n_receivers - 1, self.graph.n_receivers)
        return None if added is None else (self.window.put(args[0], (h.float() + added[:, 0]).to(h.dtype)),)
