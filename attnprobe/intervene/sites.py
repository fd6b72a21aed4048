"""The site primitives every patching path reads and writes through.

Heads are edited inside attnprobe's registered attention function (`capture.editing`: an editor
sees an `AttentionSite` and returns the head outputs to use); MLP outputs through forward hooks on
each decoder layer's MLP. Behaviour y = log p(positive set) - log p(negative set) from next-token
logits, a set's probability the sum over its words. Shapes: B rows, V vocabulary, K label ids per
side, L layers, H heads, T tokens, D head dim, E model width.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..attention.capture import AttentionSite
from ..forward.packing import pad_right


def behaviour_rows(logits: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """y per row of logits (B, V), each row with its own label sets: ids (B, K), -1 where a row has
    fewer than K. Each side is the log of its words' summed probabilities."""
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)

    def side(ids):
        picked = logp.gather(1, ids.clamp(min=0).to(logp.device))
        return torch.logsumexp(picked.masked_fill((ids < 0).to(logp.device), float("-inf")), dim=-1)

    return side(positive) - side(negative)


def label_ids(sets: list[list[int]]) -> torch.Tensor:
    """Label id lists -> (n, K), padded with -1 (forward.packing.pad_right: one tensor, one copy)."""
    return pad_right(sets, -1)[0]


@contextmanager
def last_position_mlp(mlp: torch.nn.Module | None, last: torch.Tensor):
    """Within the block `mlp` (the top layer's) reads only each row's position `last` (B,): its input
    (B, T, E) becomes (B, 1, E). Only the logits at those positions are read, and nothing reads the
    top layer at any other position; the residual add broadcasts the (B, 1, E) output over the row,
    exact at `last` and unread elsewhere. Saves the top layer's MLP at every other position; an MLP
    called with more than its hidden state is left whole."""
    if mlp is None:
        yield
        return

    def narrow(module, args, kwargs):
        if len(args) == 1 and not kwargs and args[0].ndim == 3 and args[0].shape[0] == len(last):
            return (args[0][torch.arange(len(last)), last.to(args[0].device)][:, None],), kwargs
        return None

    handle = mlp.register_forward_pre_hook(narrow, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@dataclass
class Activations:
    """One run's patchable activations: per-head outputs, attention weights and MLP outputs."""

    outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (1, H, T, D)
    weights: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (1, H, T, T)
    mlp: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (1, T, E)

    def __call__(self, site: AttentionSite) -> torch.Tensor:  # an editor that records and changes nothing
        self.outputs[site.layer] = site.output.detach()
        self.weights[site.layer] = site.weights().detach()
        return site.output


@contextmanager
def mlp_outputs(modules, change):
    """Forward hooks on each layer's MLP: `change(layer, out)` sees its output (B, T, E) and returns
    the output to use instead, or None to keep it (MoE blocks' extra outputs pass through)."""

    def hook(layer):
        def replace(module, args, output):
            out = output[0] if isinstance(output, tuple) else output  # MoE blocks add router logits
            new = change(layer, out)
            if new is None:
                return output
            return (new, *output[1:]) if isinstance(output, tuple) else new

        return replace

    with registered([m.register_forward_hook(hook(layer)) for layer, m in enumerate(modules or [])]):
        yield


@contextmanager
def registered(handles: list):
    """Within the block the hooks whose `handles` are given stay registered; on leaving (an error
    too) each is removed. A caller may append handles to the list inside the block."""
    try:
        yield handles
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class Gradients:
    """Editor for attribution: recomputes each head's output from weights that keep their gradient,
    and (with `mlp_outputs(modules, gradients.keep_mlp)`) keeps each MLP output's gradient. Where
    nothing requires a gradient yet (the weights' gradients off: the first layer), the tensor becomes
    the leaf."""

    weights: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (B, H, T, T)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (B, H, T, D)
    mlp: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (B, T, E)

    def __call__(self, site: AttentionSite) -> torch.Tensor:
        weights = _keep_gradient(site.weights())
        output = torch.matmul(weights.to(site.value.dtype), site.values())
        output.retain_grad()
        self.weights[site.layer], self.outputs[site.layer] = weights, output
        return output

    def keep_mlp(self, layer: int, out: torch.Tensor) -> None:
        self.mlp[layer] = _keep_gradient(
            out
        )  # a parallel block's first MLP (GPT-NeoX, GPT-J) depends on no attention


def _keep_gradient(x: torch.Tensor) -> torch.Tensor:
    """x with its gradient kept after backward: retained, or x made a leaf where nothing upstream needs
    one."""
    if x.requires_grad:
        x.retain_grad()
    else:
        x.requires_grad_(True)
    return x


@contextmanager
def recording_mlp(modules, acts: Activations):
    """Record each layer's MLP output (B, T, E) into `acts.mlp`, changing nothing."""

    def keep(layer, out):
        acts.mlp[layer] = out.detach()

    with mlp_outputs(modules, keep):
        yield
