"""Rotary position embeddings (RoPE) from first principles: the speed of each rotated pair under
every context-stretching scheme transformers' families declare, and the rotation itself.

A head of D features rotates R = D x partial_rotary_factor of them in R/2 pairs; pair k turns by
position x theta_k with theta_k = base^(-2k / R). The schemes change theta (and some scale the
rotated features by an attention factor). Computed in float32, as the models do.
"""

from __future__ import annotations

import math

import torch


def default_frequencies(rotary_dim: int, base: float) -> torch.Tensor:
    """(R/2,) theta_k = base^(-2k / R)."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def _llama3(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> torch.Tensor:
    """Slow pairs (wavelength > context / low) divided by `factor`, fast pairs (wavelength <
    context / high) kept, a linear blend in between (in context / wavelength)."""
    context = original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    slow, fast = wavelength > context / low_freq_factor, wavelength < context / high_freq_factor
    blend = (context / wavelength - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )  # 0 slow edge, 1 fast edge
    mixed = (1 - blend) * inv_freq / factor + blend * inv_freq
    return torch.where(slow, inv_freq / factor, torch.where(fast, inv_freq, mixed))


def _yarn(
    rotary_dim: int,
    base: float,
    factor: float,
    original: int,
    beta_fast: float,
    beta_slow: float,
    truncate: bool,
) -> torch.Tensor:
    """YaRN (Peng et al. 2023): pairs that turn fewer than beta_slow times over the original
    context are interpolated (theta / factor), pairs that turn more than beta_fast times are kept,
    with a linear ramp over the pair index in between."""

    def pair_index(turns: float) -> float:
        # the pair k whose wavelength fits `turns` times into the original context:
        # original / (2 pi base^(2k/R)) = turns  <=>  k = R ln(original / (2 pi turns)) / (2 ln base)
        return rotary_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_index(beta_fast), pair_index(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a ramp of width 0 would divide by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep theta), 0: interpolate (theta / factor)
    powers = base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    return (1.0 / (factor * powers)) * (1 - keep) + (1.0 / powers) * keep


def _mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 mscale ln(factor) + 1 (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def frequencies(
    params: dict, rotary_dim: int, max_position_embeddings: int, seq_len: int
) -> tuple[torch.Tensor, float]:
    """(theta (R/2,), attention factor) for a rope_parameters dict and a sequence of `seq_len`
    positions. Schemes: default, linear, dynamic (NTK), yarn, llama3, longrope."""
    scheme = params.get("rope_type", params.get("type", "default"))
    base = params["rope_theta"]
    if scheme == "default":
        return default_frequencies(rotary_dim, base), 1.0
    if scheme == "linear":  # positions interpolated: every speed divided by the factor
        return default_frequencies(rotary_dim, base) / params["factor"], 1.0
    if scheme == "dynamic":  # NTK-aware: the base grows once the sequence outgrows the trained context
        factor, trained = params["factor"], max_position_embeddings
        longest = max(seq_len, trained)
        base = base * ((factor * longest / trained) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
        return default_frequencies(rotary_dim, base), 1.0
    if scheme == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return _llama3(default_frequencies(rotary_dim, base), **{k: params[k] for k in keys}), 1.0
    original = params.get("original_max_position_embeddings") or max_position_embeddings
    factor = params.get("factor") or max_position_embeddings / original
    if scheme == "yarn":
        attention = params.get("attention_factor")
        if attention is None:
            mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
            attention = (
                _mscale(factor, mscale) / _mscale(factor, mscale_all)
                if mscale and mscale_all
                else _mscale(factor)
            )
        theta = _yarn(
            rotary_dim,
            base,
            factor,
            original,
            params.get("beta_fast") or 32,
            params.get("beta_slow") or 1,
            params.get("truncate", True),
        )
        return theta, float(attention)
    if scheme == "longrope":  # per-pair factors, the long set once the sequence outgrows the trained context
        attention = params.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        factors = torch.tensor(
            params["long_factor"] if seq_len > original else params["short_factor"], dtype=torch.float32
        )
        shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        return 1.0 / (factors * base**shape), float(attention)
    raise NotImplementedError(f"rope scheme '{scheme}'")


def angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """(..., T, R/2) angle of each pair: position x speed, in float32 as the models do."""
    return positions.float()[..., None] * inv_freq.float().to(positions.device)


def rotate(
    x: torch.Tensor, turn: torch.Tensor, interleaved: bool = False, attention_factor: float = 1.0
) -> torch.Tensor:
    """Rotate pairs of features of x (..., T, D) by `turn` (..., T, R/2); features past R pass through.

    A pair (a, b) becomes f (a cos t - b sin t, a sin t + b cos t), f the attention factor. Pairs
    are (k, k + R/2) in the "half" layout of Llama/NeoX checkpoints, or (2k, 2k + 1) when
    `interleaved` (GPT-J, CodeGen, Cohere).
    """
    R = 2 * turn.shape[-1]
    rot, rest = x[..., :R], x[..., R:]
    cos = (turn.cos() * attention_factor).to(
        x.dtype
    )  # in float32 first, then the model dtype, as the models do
    sin = (turn.sin() * attention_factor).to(x.dtype)
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]  # (..., T, R/2) each
        turned = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    else:
        a, b = rot[..., : R // 2], rot[..., R // 2 :]
        # Written as the models write it (x cos + rotate_half(x) sin over the duplicated angles) so
        # float rounding matches: the first half gets a cos - b sin, the second b cos + a sin.
        turned = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return torch.cat([turned, rest], dim=-1)
