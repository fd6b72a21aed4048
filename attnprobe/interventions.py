"""Head interventions: which heads carry a behaviour, not only where they look.

Behaviour per item: y(x) = log p(positive | x) - log p(negative | x) at the cut, e.g.
log p(she) - log p(he) after "The nurse said that". A counterfactual x' changes one slot
("The woman said that") and must tokenise to the same length. Per item:

  total effect     TE   = y(x') - y(x)
  pattern swap     IE_h = y(x with head h's attention weights taken from x') - y(x)
                          (the natural indirect effect through head h's pattern, Vig et al. 2020)
  zero ablation    y(x with head h's output set to 0) - y(x)
  mean ablation    y(x with head h's output set to its mean over the suite's items) - y(x)
  attribution      (A'_h - A_h) . dy/dA_h, a first-order estimate of IE_h from one forward and one
                   backward pass (attribution patching)

The edits run inside attnprobe's registered attention function (a forward hook cannot change a
pattern): `capture.editing(editor)` installs an editor, called with one `AttentionSite` per layer,
that returns the per-head output. One small editor per operation: PatternSwap, ZeroAblation and
MeanAblation rewrite chosen heads of chosen batch rows; AttributionWeights keeps gradients of the
weights; OutputSums collects mean head outputs. All heads of all layers are patched in one batch:
row 1 + i carries the edit of head i. This module chooses no items and writes no files.

Shapes: B batch, L layers, H heads, T tokens, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .capture import AttentionSite, editing, pad_right, run_with_capture


@dataclass
class HeadsEdit:
    """Base of the editors that replace the output of chosen heads in chosen batch rows."""

    heads: torch.Tensor  # (B, L, H) bool: which heads each batch row edits

    def __call__(self, site: AttentionSite) -> torch.Tensor:
        edit = self.heads[:, site.layer].to(site.query.device)  # (B, H)
        if not edit.any():
            return site.output
        return torch.where(edit[:, :, None, None], self.replacement(site), site.output)

    def replacement(self, site: AttentionSite) -> torch.Tensor:  # (B, H, T, D)
        raise NotImplementedError


@dataclass
class PatternSwap(HeadsEdit):
    """Head output computed with the attention pattern (1 - alpha) A + alpha A' (A' from the donor x')."""

    donor: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (1, H, T, S) weights from x'
    alpha: float = 1.0

    def replacement(self, site):
        own = site.weights()  # (B, H, T, S)
        pattern = (1 - self.alpha) * own + self.alpha * self.donor[site.layer].to(own.dtype)
        return torch.matmul(pattern.to(site.value.dtype), site.values())  # (B, H, T, D)


@dataclass
class ZeroAblation(HeadsEdit):
    """Head output set to 0."""

    def replacement(self, site):
        return torch.zeros_like(site.output)


@dataclass
class MeanAblation(HeadsEdit):
    """Head output set to its mean over the suite's items (see `head_means`)."""

    means: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (H, D)

    def replacement(self, site):
        return self.means[site.layer].to(site.output.dtype)[None, :, None, :].expand_as(site.output)


@dataclass
class AttributionWeights:
    """Recomputes the output from explicit attention weights that keep their gradient (layer -> (B, H, T, S))."""

    weights: dict[int, torch.Tensor] = field(default_factory=dict)

    def __call__(self, site: AttentionSite) -> torch.Tensor:
        weights = site.weights()  # (B, H, T, S)
        weights.retain_grad()
        self.weights[site.layer] = weights
        return torch.matmul(weights.to(site.value.dtype), site.values())


@dataclass
class OutputSums:
    """Sums each head's output over the real query positions (changes nothing): layer -> (H, D)."""

    sums: dict[int, torch.Tensor] = field(default_factory=dict)
    count: int = 0  # (item, position) pairs summed

    def __call__(self, site: AttentionSite) -> torch.Tensor:
        B, _, T, _ = site.query.shape
        mask = site.full_mask()
        real = torch.ones(B, T, dtype=torch.bool, device=site.query.device) if mask is None else mask[:, 0].diagonal(dim1=1, dim2=2)
        dtype = torch.promote_types(site.output.dtype, torch.float32)
        self.sums[site.layer] = self.sums.get(site.layer, 0) + (site.output.to(dtype) * real[:, None, :, None]).sum((0, 2))
        self.count += int(real.sum()) if site.layer == 0 else 0
        return site.output


def behaviour(logits: torch.Tensor, positive: int, negative: int) -> torch.Tensor:
    """y = log p(positive) - log p(negative) from next-token logits (..., V)."""
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    return logp[..., positive] - logp[..., negative]


def _last_logits(model, ids: torch.Tensor, editor=None) -> torch.Tensor:
    """Next-token logits after the last token of each row of ids (B, T), all of equal length."""
    mask = torch.ones_like(ids)
    if editor is None:
        return run_with_capture(model, ids, mask, layers=[], logit_positions=torch.tensor([ids.shape[1] - 1])).logits[:, 0]
    with editing(editor):
        return run_with_capture(model, ids, mask, layers=[], logit_positions=torch.tensor([ids.shape[1] - 1])).logits[:, 0]


def one_hot_heads(n_layers: int, n_heads: int) -> torch.Tensor:
    """(1 + L H, L, H): row 0 edits nothing, row 1 + l H + h edits head (l, h) alone."""
    heads = torch.zeros(1 + n_layers * n_heads, n_layers, n_heads, dtype=torch.bool)
    index = torch.arange(n_layers * n_heads)
    heads[1 + index, index // n_heads, index % n_heads] = True
    return heads


def head_means(model, prompts: list[torch.Tensor], n_layers: int, batch_size: int = 32) -> dict[int, torch.Tensor]:
    """Mean per-head attention output over every real position of every prompt: layer -> (H, D)."""
    editor = OutputSums()
    for start in range(0, len(prompts), batch_size):
        ids, mask = pad_right(prompts[start:start + batch_size], 0)  # pad queries are left out of the sums
        with editing(editor):
            run_with_capture(model, ids, mask, layers=[], logit_positions=torch.tensor([0]))
    return {layer: editor.sums[layer] / editor.count for layer in range(n_layers)}


def item_effects(model, x: torch.Tensor, x_cf: torch.Tensor, positive: int, negative: int, n_layers: int,
                 n_heads: int, means: dict | None = None, modes=("pattern", "zero", "mean"), top_k: int | None = None) -> dict:
    """Effects of every head for one item. x, x_cf: (T,) token ids of equal length.

    Returns y, y_cf, te, `attribution` (L, H) and per mode an (L, H) tensor of y(edited) - y(x);
    with `top_k`, exact patching runs only for the k heads with the largest |attribution| (NaN elsewhere)."""
    ids = torch.stack([x, x_cf])  # (2, T)
    y, y_cf = behaviour(_last_logits(model, ids), positive, negative).tolist()
    donor = run_with_capture(model, x_cf[None], torch.ones(1, len(x_cf), dtype=torch.long)).weights  # layer -> (1, H, T, T)
    result = {"y": y, "y_cf": y_cf, "te": y_cf - y, "attribution": attribution(model, x, donor, positive, negative, n_layers)}
    heads = one_hot_heads(n_layers, n_heads)
    if top_k is not None:
        keep = result["attribution"].abs().flatten().topk(min(top_k, n_layers * n_heads)).indices
        heads = heads[torch.cat([torch.zeros(1, dtype=torch.long), 1 + keep])]  # (1 + k, L, H)
    batch = x[None].expand(len(heads), -1)
    editors = {"pattern": PatternSwap(heads, donor=donor), "zero": ZeroAblation(heads), "mean": MeanAblation(heads, means=means or {})}
    for mode in modes:
        if mode == "mean" and not means:
            continue
        editor = editors[mode]
        ys = behaviour(_last_logits(model, batch, editor), positive, negative)  # (rows,)
        effect = torch.full((n_layers * n_heads,), float("nan"), dtype=ys.dtype)
        effect[heads[1:].flatten(1).float().argmax(1)] = ys[1:] - ys[0]
        result[mode] = effect.view(n_layers, n_heads)
    return result


def attribution(model, x: torch.Tensor, donor: dict, positive: int, negative: int, n_layers: int) -> torch.Tensor:
    """First-order estimate of every head's pattern-swap effect: sum over (query, key) of
    (A'_h - A_h) * dy/dA_h, from one forward and one backward pass. Returns (L, H)."""
    editor = AttributionWeights()
    ids = x[None]
    model_module = model if isinstance(model, torch.nn.Module) else model.model
    with torch.enable_grad(), editing(editor):
        out = model_module(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, logits_to_keep=1)
        y = behaviour(out.logits[0, -1], positive, negative)
        y.backward()
    estimates = []
    for layer in range(n_layers):
        weights = editor.weights[layer]  # (1, H, T, T)
        delta = donor[layer].to(weights.dtype) - weights.detach()
        estimates.append((delta * weights.grad).sum((0, 2, 3)))  # (H,)
    model_module.zero_grad(set_to_none=True)
    return torch.stack(estimates).detach()
