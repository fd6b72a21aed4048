"""Attribution patching in batches: first-order estimates of every head's and layer's patch-in
effect for many (x, x') pairs, from one forward and one backward pass of the pairs' x together.

For a head, (z' - z) . dy/dz summed over the aligned positions (its output z, as engine.py patches
it) and (A' - A) . dy/dA (its pattern; pairs of equal length only); for a layer's MLP output m,
(m' - m) . dy/dm. x' comes from an engine.Bank; the weights' gradients stay off (only activations
need one). tests/reference_patching.attribution is the one-item reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...intervene.engine import Bank
from ...intervene.gradients import gradients
from ...model.anatomy import mlp_modules


@dataclass
class Pairs:
    """(x, x') pairs for attribution: x's index into the attribution batch, x' in the Bank, and
    the first aligned position in each."""

    x: torch.Tensor  # (n,) index into the sequences passed to `attribution`
    donor: torch.Tensor  # (n,) bank index of x'
    at: torch.Tensor  # (n,)
    donor_at: torch.Tensor  # (n,)
    same_length: torch.Tensor  # (n,) bool: the pattern attribution is defined


def estimate(
    model, bank: Bank, xs: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor, pairs: Pairs
) -> dict:
    """First-order estimates of every pair's patch-in effects, from one forward and one backward
    pass of the bank's sequences `xs` (n_x,): per head (z' - z) . dy/dz (output) and (A' - A) . dy/dA
    (pattern; NaN for pairs of different lengths), per layer (m' - m) . dy/dm (MLP output); sums over
    the aligned positions. Returns attribution_output, attribution_pattern (n, L, H), attribution_mlp (n,
    L)."""
    lengths = bank.lengths[xs]
    T, device, mlps = int(lengths.max()), bank.hidden[0].device, mlp_modules(model)
    grads = gradients(model, bank, xs, positive, negative, mlps)
    n, L = len(pairs.x), len(bank.hidden)
    positions = torch.arange(T)[None]
    where = ((positions >= pairs.at[:, None]) & (positions < lengths[pairs.x, None])).to(device)  # (n, T)
    index = (
        (positions - pairs.at[:, None] + pairs.donor_at[:, None]).clamp(0, bank.ids.shape[1] - 1).to(device)
    )
    result = {"attribution_output": [], "attribution_pattern": [], "attribution_mlp": []}
    for layer in range(L):
        Z, W = grads.outputs[layer], grads.weights[layer]  # (n_x, H, T, D), (n_x, H, T, T)
        z, dy_dz, w, dy_dw = Z.detach()[pairs.x], Z.grad[pairs.x], W.detach()[pairs.x], W.grad[pairs.x]
        H = z.shape[1]
        donor_z = bank.outputs[layer][pairs.donor].gather(
            2, index[:, None, :, None].expand(n, H, T, z.shape[-1])
        )
        dz = torch.where(where[:, None, :, None], donor_z.to(z.dtype) - z, 0)
        result["attribution_output"].append((dz * dy_dz).sum((2, 3)))
        donor_w = bank.weights[layer][pairs.donor]
        donor_w = donor_w.gather(2, index[:, None, :, None].expand(n, H, T, donor_w.shape[-1]))[..., :T]
        dw = torch.where(where[:, None, :, None], donor_w.to(w.dtype) - w, 0)
        pattern = (dw * dy_dw).sum((2, 3))
        result["attribution_pattern"].append(
            torch.where(pairs.same_length[:, None].to(device), pattern, float("nan"))
        )
        if mlps:
            M = grads.mlp[layer]  # (n_x, T, E)
            donor_m = bank.mlp[layer][pairs.donor].gather(1, index[:, :, None].expand(n, T, M.shape[-1]))
            dm = torch.where(where[:, :, None], donor_m.to(M.dtype) - M.detach()[pairs.x], 0)
            result["attribution_mlp"].append((dm * M.grad[pairs.x]).sum((1, 2)))
        else:
            result["attribution_mlp"].append(torch.full((n,), float("nan"), device=device))
    return {key: torch.stack(values, 1).detach().double().cpu() for key, values in result.items()}
