"""The parameters of the edits, estimated from recorded head outputs (a patching Bank: per layer
the outputs z (N, H, T, D) of N right-padded sequences).

- mean ablation: each head's mean z over every token of the reference sequences;
- resample ablation: z at up to `n` reference tokens drawn at random (seeded);
- projection: per head the direction along which its z at the prediction position (each item's
  last token) follows the covariate: the least-squares slope vector
  b = sum_i (x_i - mean x) (z_i - mean z) / sum_i (x_i - mean x)^2, scaled to unit length. Removing
  it removes what the head's output says linearly about the stereotype covariate;
- orthogonal projection: the same direction made orthogonal to the head's definitional direction
  g (its mean z at the prediction position on the control prompts of the positive label minus the
  negative's, on half 0 of them): the output keeps its component along g exactly;
- erasure (LEACE, Belrose et al. 2023, with the definitional contrast kept): per head, with mu and
  Sigma the mean and covariance of z over the training items and u = Cov(z, x), the edit
  z' = z - u a.(z - mu) / a.u makes Cov(z', x) = u - u = 0 on those items for any a with a.u != 0;
  LEACE's a = Sigma^+ u changes z least in expectation. Keeping the definitional mean difference
  delta (a.delta = 0) at least change gives a = Sigma^+ u - (delta' Sigma^+ u / delta' Sigma^+ delta)
  Sigma^+ delta; then z'(positive) - z'(negative) = delta - u a.delta / a.u = delta in the mean.
  Keeping the definitional midpoint m as well (a.(m - mu) = 0: kind leace_mid) leaves each label's
  mean where it was, so the edit cannot shift the gendered prompts toward one label at this site.
"""

from __future__ import annotations

import numpy as np
import torch

from ..intervene.engine import Bank

BANK_TOKENS = 2048  # reference tokens kept for resample ablation


def subset(bank: Bank, fold: np.ndarray, on: np.ndarray) -> Bank:
    """The sequences of `bank` whose fold is one of `on` (their outputs only)."""
    keep = torch.as_tensor(np.isin(fold, on))
    return Bank(
        bank.ids[keep], bank.lengths[keep], [], [], [], [z[keep] for z in bank.outputs], [], None, None, False
    )


def token_mask(bank: Bank) -> torch.Tensor:
    """(N, T) bool: the positions each sequence has."""
    return torch.arange(bank.ids.shape[1])[None] < bank.lengths[:, None]


def token_means(bank: Bank) -> torch.Tensor:
    """(L, H, D) mean z over every token of every sequence."""
    valid = token_mask(bank)[:, None, :, None].float()  # (N, 1, T, 1)
    return torch.stack([(z.float() * valid).sum((0, 2)) / valid.sum() for z in bank.outputs])


def token_sample(bank: Bank, n: int, seed: int) -> torch.Tensor:
    """(L, H, n', D) z at n' = min(n, tokens) tokens drawn without replacement."""
    rows, positions = token_mask(bank).nonzero(as_tuple=True)
    generator = torch.Generator().manual_seed(seed)
    pick = torch.randperm(len(rows), generator=generator, device="cpu")[:n].to(rows.device)
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


def control_halves(sign: np.ndarray, pairs=(), fitted=None) -> np.ndarray:
    """Per control prompt: 0 or 1, the cross-fitting half of the prompts a keep constraint may be
    fitted on (`fitted`, default all), or 2 for prompts no fit uses. With `pairs` (the word pair of
    each prompt) a pair's prompts share a half, the pairs alternating in file order: a constraint
    fitted on one half is judged on words it never saw. Without pairs the prompts alternate within
    each label."""
    fitted = np.ones(len(sign), bool) if fitted is None else np.asarray(fitted, bool)
    half = np.full(len(sign), 2)
    if len(pairs):
        order = {pair: i % 2 for i, pair in enumerate(dict.fromkeys(np.asarray(pairs)[fitted]))}
        half[fitted] = [order[pair] for pair in np.asarray(pairs)[fitted]]
        return half
    for label in np.unique(sign):
        rows = np.flatnonzero((sign == label) & fitted)
        half[rows] = np.arange(len(rows)) % 2
    return half


def pls_directions(z: torch.Tensor, x: np.ndarray, rank: int) -> torch.Tensor:
    """(rank, E) the weights of PLS1 of the covariate x (n,) on the rows z (n, E) (NIPALS, Wold 1966;
    DAMA's subspace): w1 is the unit slope direction (z's covariance with x); each next one is the
    covariance with x of z deflated by the scores before it (z <- z - t p', t = z w, p = z't / t't),
    orthogonal to them, so removing all is I - W'W and the span grows toward every direction along
    which z predicts x linearly. Zero rows once nothing left in z covaries with x."""
    zc = (z - z.mean(0)).double()
    xc = torch.as_tensor(x - x.mean(), dtype=torch.float64, device=z.device)
    out = torch.zeros(rank, z.shape[-1], dtype=torch.float64, device=z.device)
    floor = 1e-10 * float(zc.norm()) * float(xc.norm())
    for j in range(rank):
        w = zc.T @ xc
        w = w - out[:j].T @ (out[:j] @ w)  # orthogonal in exact arithmetic; kept so in floating point
        if float(w.norm()) <= floor:
            break
        out[j] = w / w.norm()
        t = zc @ out[j]
        zc = zc - torch.outer(t, zc.T @ t / (t @ t))
    return out.to(z.dtype)


def explained(scores: torch.Tensor, target: np.ndarray) -> torch.Tensor:
    """(r,) the share of the target's variance each column of scores (n, r) explains alone (squared
    correlation); 0 for a constant column."""
    s = (scores - scores.mean(0)).double()
    t = torch.as_tensor(target - np.mean(target), dtype=torch.float64, device=scores.device)
    denominator = (s * s).sum(0) * (t @ t)
    return torch.where(
        denominator > 0, (t @ s) ** 2 / denominator.clamp(min=1e-300), torch.zeros_like(denominator)
    )


def definitional_directions(last: torch.Tensor, sign: np.ndarray) -> torch.Tensor:
    """(L, H, D) mean z (n, L, H, D) of the positive-label rows minus the negative-label rows."""
    sign = torch.as_tensor(sign)
    return last[sign > 0].mean(0) - last[sign < 0].mean(0)


def definitional_midpoints(last: torch.Tensor, sign: np.ndarray) -> torch.Tensor:
    """(L, H, D) the midpoint of the positive-label rows' mean and the negative-label rows' mean."""
    sign = torch.as_tensor(sign)
    return (last[sign > 0].mean(0) + last[sign < 0].mean(0)) / 2


def orthogonal_directions(u: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """(L, H, D) unit directions u (L, H, D) with their component along g removed (zero where none
    is left)."""
    g_unit = g / g.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    rest = u - (u * g_unit).sum(-1, keepdim=True) * g_unit
    norm = rest.norm(dim=-1, keepdim=True)
    return torch.where(norm > 1e-6, rest / norm.clamp(min=1e-12), torch.zeros_like(rest))


def shrunk(sigma: torch.Tensor, n: int) -> torch.Tensor:
    """Covariances (..., p, p) of n rows shrunk toward tr/p times the identity by the oracle
    approximating shrinkage weight (Chen, Wiesel, Eldar and Hero 2010):
    rho = min(1, ((1 - 2/p) tr(S^2) + tr(S)^2) / ((n + 1 - 2/p) (tr(S^2) - tr(S)^2 / p)))."""
    p = sigma.shape[-1]
    tr = sigma.diagonal(dim1=-2, dim2=-1).sum(-1)
    tr2 = (sigma * sigma).sum((-2, -1))  # tr(S^2) of a symmetric S
    rho = ((1 - 2 / p) * tr2 + tr**2) / ((n + 1 - 2 / p) * (tr2 - tr**2 / p)).clamp(min=1e-300)
    rho = rho.clamp(0, 1)[..., None, None]
    return (1 - rho) * sigma + rho * (tr / p)[..., None, None] * torch.eye(p, dtype=sigma.dtype)


def erasers(
    last: torch.Tensor,
    x: np.ndarray,
    keep: torch.Tensor | None = None,
    shrink: bool = False,
    midpoint: torch.Tensor | None = None,
) -> tuple:
    """Per head (u, f, mu), each (L, H, D), of z' = z - u f.(z - mu): LEACE of the covariate x (n,)
    from z (n, L, H, D), with `keep` (L, H, D) a mean difference the edit must not change (None:
    plain LEACE) and `midpoint` (L, H, D) a point it must leave where it is (the definitional
    midpoint: with both kept, each label's mean is unmoved). f = a / a.u; zero for a head whose
    output does not covary with x. `shrink`: the covariance in a = Sigma^+ u is shrunk (`shrunk`): for
    a site as wide as the model, fitted on fewer rows than it has dimensions, where Sigma^+ would
    amplify directions the rows barely span. Any a with a.u != 0 erases (Cov(z', x) = 0 on the rows
    fitted); shrinking and the kept constraints only change which."""
    z = last.double()
    mu = z.mean(0)
    zc = z - mu
    xc = torch.as_tensor(x - x.mean(), dtype=torch.float64)
    u = torch.einsum("n,nlhd->lhd", xc, zc) / len(xc)  # Cov(z, x)
    sigma = torch.einsum("nlhd,nlhe->lhde", zc, zc) / len(xc)  # Cov(z)
    sigma = shrunk(sigma, len(xc)) if shrink else sigma
    inverse = torch.linalg.pinv(sigma, hermitian=True)
    a = torch.einsum("lhde,lhe->lhd", inverse, u)
    kept = [k.double() for k in (keep, None if midpoint is None else midpoint.double() - mu) if k is not None]
    if kept:
        # least change subject to a.k = 0 for each kept column k of K (the edit moves z by u f.(z - mu),
        # so a difference k, or a point mu + k, is untouched): a = S u - S K (K'S K)^+ K'S u, S = Sigma^+
        K = torch.stack(kept, -1)  # (L, H, D, c)
        SK = inverse @ K
        gram = torch.linalg.pinv(K.transpose(-1, -2) @ SK, hermitian=True)  # (L, H, c, c)
        a = a - (SK @ (gram @ (SK.transpose(-1, -2) @ u[..., None])))[..., 0]
    au = (a * u).sum(-1, keepdim=True)
    scale = (u.norm(dim=-1, keepdim=True) * a.norm(dim=-1, keepdim=True)).clamp(min=1e-30)
    f = torch.where(au.abs() > 1e-9 * scale, a / au, torch.zeros_like(a))
    return u.float(), f.float(), mu.float()
