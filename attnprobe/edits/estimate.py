"""The parameters of the edits, estimated from recorded head outputs (a patching Bank: per layer
the outputs z (N, H, T, D) of N right-padded sequences).

- mean ablation: each head's mean z over every token of the reference sequences;
- resample ablation: z at up to `n` reference tokens drawn at random (seeded);
- projection: per head the direction along which its z at the prediction position (each item's
  last token) follows the covariate: the least-squares slope vector
  b = sum_i (x_i - mean x) (z_i - mean z) / sum_i (x_i - mean x)^2, scaled to unit length. Removing
  it removes what the head's output says linearly about the stereotype covariate.
"""

from __future__ import annotations

import numpy as np
import torch

from ..measures.head_effects.engine import Bank

BANK_TOKENS = 2048  # reference tokens kept for resample ablation


def subset(bank: Bank, fold: np.ndarray, on: np.ndarray) -> Bank:
    """The sequences of `bank` whose fold is one of `on` (their outputs only)."""
    keep = torch.as_tensor(np.isin(fold, on))
    return Bank(
        bank.ids[keep], bank.lengths[keep], [], [], [], [z[keep] for z in bank.outputs], [], None, None, False
    )


def _valid(bank: Bank) -> torch.Tensor:
    """(N, T) bool: the positions each sequence has."""
    return torch.arange(bank.ids.shape[1])[None] < bank.lengths[:, None]


def token_means(bank: Bank) -> torch.Tensor:
    """(L, H, D) mean z over every token of every sequence."""
    valid = _valid(bank)[:, None, :, None].float()  # (N, 1, T, 1)
    return torch.stack([(z.float() * valid).sum((0, 2)) / valid.sum() for z in bank.outputs])


def token_sample(bank: Bank, n: int, seed: int) -> torch.Tensor:
    """(L, H, n', D) z at n' = min(n, tokens) tokens drawn without replacement."""
    rows, positions = _valid(bank).nonzero(as_tuple=True)
    generator = torch.Generator().manual_seed(seed)
    pick = torch.randperm(len(rows), generator=generator)[:n]
    return torch.stack([z[rows[pick], :, positions[pick]].float().transpose(0, 1) for z in bank.outputs])


def last_outputs(bank: Bank) -> torch.Tensor:
    """(N, L, H, D) z at each sequence's last token (where the next token is predicted)."""
    last = bank.lengths - 1
    return torch.stack([z[torch.arange(len(last)), :, last].float() for z in bank.outputs], 1)


def covariate_directions(last: torch.Tensor, x: np.ndarray) -> torch.Tensor:
    """(L, H, D) unit slope vectors of z (n, L, H, D) on the covariate x (n,); zero where z does not
    vary with x (or x is constant)."""
    xc = torch.as_tensor(x - x.mean(), dtype=torch.float32)
    sxx = float((xc**2).sum())
    if sxx == 0:
        return torch.zeros(last.shape[1:])
    slope = torch.einsum("n,nlhd->lhd", xc, last - last.mean(0)) / sxx
    norm = slope.norm(dim=-1, keepdim=True)
    return torch.where(norm > 0, slope / norm.clamp(min=1e-12), torch.zeros_like(slope))
