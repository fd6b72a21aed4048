"""Attention from first principles, in plain torch. Read top to bottom.

Nothing here imports transformers. `verify/__init__.py` feeds these functions a layer's own weights and the
hidden states that entered it, and compares what comes out with what the model computed.

Vocabulary: *scores* are before the softmax, *weights* after.
Shapes: B batch, H query heads, Hkv key/value heads, T queries, S keys, D head dim, E model width.
Masks are boolean with True = may attend (torch's SDPA convention) unless said otherwise.
"""

from __future__ import annotations

import math

import torch

from . import rope

# --------------------------------------------------------------------------------------------
# 1. Softmax over keys, with masks
# --------------------------------------------------------------------------------------------


def masked_softmax(scores: torch.Tensor, valid_lens: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last axis, keeping only the first `valid_lens` keys.

    scores: (B, T, S) or (B, H, T, S). valid_lens: None, (B,) one length per batch item, or (B, T)
    one length per query. Masked entries are exactly 0; a row with no valid key is all 0.
    """
    if valid_lens is None:
        return torch.softmax(scores, dim=-1)
    S = scores.shape[-1]
    lens = valid_lens if valid_lens.ndim == 2 else valid_lens[:, None].expand(-1, scores.shape[-2])  # (B, T)
    keep = torch.arange(S, device=scores.device)[None, None, :] < lens[..., None]  # (B, T, S)
    if scores.ndim == 4:
        keep = keep[:, None]  # (B, 1, T, S), shared by heads
    return _softmax_where(scores, keep)


def _softmax_where(scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Softmax over the kept entries only; masked entries and fully masked rows are exactly 0."""
    scores = scores.masked_fill(~keep, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return torch.where(keep, weights, torch.zeros((), dtype=weights.dtype, device=weights.device)).nan_to_num(
        0.0
    )


# --------------------------------------------------------------------------------------------
# 2. Masks
# --------------------------------------------------------------------------------------------


def causal_mask(T: int, S: int | None = None, device=None) -> torch.Tensor:
    """(T, S): query i sees keys j <= i + (S - T) (queries are the last T of S positions)."""
    S = T if S is None else S
    i = torch.arange(T, device=device)[:, None] + (S - T)
    j = torch.arange(S, device=device)[None, :]
    return j <= i


def local_mask(T: int, S: int | None = None, window: int = 1, device=None) -> torch.Tensor:
    """(T, S): |i - j| <= window. Combine with `causal_mask` for a causal sliding window.

    Hugging Face's `sliding_window = W` lets a query see itself and W - 1 earlier keys, which is
    `local_mask(..., window=W - 1)` here.
    """
    S = T if S is None else S
    i = torch.arange(T, device=device)[:, None] + (S - T)
    j = torch.arange(S, device=device)[None, :]
    return (i - j).abs() <= window


def chunk_mask(T: int, S: int | None = None, chunk: int = 1, device=None) -> torch.Tensor:
    """(T, S): query i sees key j only within the same block of `chunk` positions (Llama 4's
    chunked attention). Combine with `causal_mask`."""
    S = T if S is None else S
    i = torch.arange(T, device=device)[:, None] + (S - T)
    j = torch.arange(S, device=device)[None, :]
    return (i // chunk) == (j // chunk)


def padding_mask(lengths: torch.Tensor, S: int) -> torch.Tensor:
    """(B, 1, 1, S): key j of item b is real when j < lengths[b] (padding on the right)."""
    return (torch.arange(S, device=lengths.device)[None, :] < lengths[:, None])[:, None, None, :]


# --------------------------------------------------------------------------------------------
# 3. Scaled dot-product attention (torch.nn.functional.scaled_dot_product_attention's contract)
# --------------------------------------------------------------------------------------------


def soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """Logit soft-capping (Gemma 2): a smooth clamp of scores into (-cap, cap)."""
    return cap * torch.tanh(scores / cap)


def scaled_dot_product_attention(
    query: torch.Tensor,  # (..., H, T, D)
    key: torch.Tensor,  # (..., Hkv, S, D)
    value: torch.Tensor,  # (..., Hkv, S, Dv)
    # broadcastable to (..., H, T, S); bool keep-mask or additive float
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # (H,) one extra logit per head with no value (attention sinks)
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (output (..., H, T, Dv), weights (..., H, T, S)).

    weights = softmax(q k^T * scale [soft-capped] + mask); output = dropout(weights) v.
    The returned weights are before dropout. With `enable_gqa`, query head h reads key/value head
    h // (H / Hkv), as torch does. `is_causal` aligns the causal mask top-left, as torch does.
    """
    if is_causal and attn_mask is not None:
        raise ValueError("give either attn_mask or is_causal, not both (as torch's SDPA)")
    H, T, D = query.shape[-3:]
    S = key.shape[-2]
    if key.shape[-3] != H:
        if not enable_gqa:
            raise ValueError(f"{H} query heads but {key.shape[-3]} key heads: pass enable_gqa=True")
        group = H // key.shape[-3]
        key = key.repeat_interleave(group, dim=-3)  # (..., H, S, D)
        value = value.repeat_interleave(group, dim=-3)  # (..., H, S, Dv)
    scale = 1.0 / math.sqrt(D) if scale is None else scale

    scores = torch.matmul(query, key.transpose(-2, -1)) * scale  # (..., H, T, S)
    if softcap is not None:
        scores = soft_cap(scores, softcap)
    keep = torch.ones(T, S, dtype=torch.bool, device=query.device)
    if is_causal:
        keep = torch.tril(keep)  # top-left aligned, like torch
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = keep & attn_mask
    elif attn_mask is not None:
        scores = scores + attn_mask
    keep = keep.expand_as(scores)
    if sinks is not None:
        # The sink joins the softmax as an extra column and is dropped after it.
        sink = sinks.reshape(-1, 1, 1).to(scores.dtype).expand(*scores.shape[:-1], 1)  # (..., H, T, 1)
        always = torch.ones_like(keep[..., :1])
        weights = _softmax_where(torch.cat([scores, sink], -1), torch.cat([keep, always], -1))[..., :-1]
    else:
        weights = _softmax_where(scores, keep)  # (..., H, T, S)
    dropped = weights
    if dropout_p > 0.0:
        drop = torch.rand(weights.shape, generator=generator, device=weights.device) < dropout_p
        dropped = weights.masked_fill(drop, 0.0) / (1.0 - dropout_p)
    return torch.matmul(dropped, value), weights  # (..., H, T, Dv), (..., H, T, S)


# --------------------------------------------------------------------------------------------
# 4. Additive (Bahdanau) attention
# --------------------------------------------------------------------------------------------


def additive_attention(
    query: torch.Tensor,  # (B, T, Dq)
    key: torch.Tensor,  # (B, S, Dk)
    value: torch.Tensor,  # (B, S, Dv)
    w_q: torch.Tensor,  # (A, Dq)
    w_k: torch.Tensor,  # (A, Dk)
    w_v: torch.Tensor,  # (A,)
    valid_lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """score(q, k) = w_v^T tanh(W_q q + W_k k). Returns (output (B, T, Dv), weights (B, T, S))."""
    features = torch.tanh((query @ w_q.T)[:, :, None, :] + (key @ w_k.T)[:, None, :, :])  # (B, T, S, A)
    scores = features @ w_v  # (B, T, S)
    weights = masked_softmax(scores, valid_lens)
    return weights @ value, weights


# --------------------------------------------------------------------------------------------
# 5. Normalisations used on queries and keys (QK-norm)
# --------------------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    compute_dtype: torch.dtype | None = torch.float32,
) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * (offset + weight) over the last axis.

    Gemma stores the scale as weight - 1 (offset=1). Transformers' models normalise in float32
    whatever the weights' dtype (even float64), so that is the default `compute_dtype`.
    """
    dtype = x.dtype
    xc = x.to(compute_dtype or dtype)
    normed = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    if offset:  # Gemma: the scale is applied in the compute dtype
        return (normed * (offset + weight.to(normed.dtype))).to(dtype)
    return weight * normed.to(dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis (biased variance)."""
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    out = (x - mean) / torch.sqrt(var + eps) * weight
    return out if bias is None else out + bias


# --------------------------------------------------------------------------------------------
# 6. Positions: rotary embeddings (RoPE) and ALiBi
# --------------------------------------------------------------------------------------------


def rope_inverse_frequencies(rotary_dim: int, base: float, scheme: str = "default", **params) -> torch.Tensor:
    """(rotary_dim / 2,) angular speed of each rotated pair, theta_k = base^(-2k / rotary_dim), under
    a context-stretching scheme (linear, dynamic, yarn, llama3, longrope: see rope.py)."""
    params = {**params, "rope_theta": base, "rope_type": scheme}
    return rope.frequencies(params, rotary_dim, params.get("max_position_embeddings", 0), seq_len=0)[0]


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """(..., T, rotary_dim / 2) angle of each pair: position x speed, in float32 as the models do."""
    return rope.angles(positions, inv_freq)


def apply_rotary(
    x: torch.Tensor, angles: torch.Tensor, interleaved: bool = False, attention_factor: float = 1.0
) -> torch.Tensor:
    """Rotate pairs of features of x (..., T, D) by `angles` (..., T, R/2); see rope.rotate."""
    return rope.rotate(x, angles, interleaved, attention_factor)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """(H,) ALiBi head slopes: the geometric sequence 2^(-8/n), 2^(-16/n), ... for n = H a power of two;
    otherwise the closest power of two's slopes, then every other slope of the next power of two."""

    def powers(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = powers(closest)
    if closest < n_heads:
        slopes += powers(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes)


def mpt_alibi_slopes(n_heads: int, max_bias: float = 8.0) -> torch.Tensor:
    """(H,) MPT's ALiBi slopes: with P the power of two at or above H, 2^(-max_bias m / P) for
    m = 1..P; when P > H, the odd-numbered slopes come first, then the even ones, and the first H are kept."""
    P = 2 ** math.ceil(math.log2(n_heads))
    slopes = 1.0 / torch.pow(2, torch.arange(1, P + 1, dtype=torch.int64).float() * (max_bias / P))
    if P != n_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes


def alibi_bias(slopes: torch.Tensor, T: int, S: int | None = None) -> torch.Tensor:
    """(H, T, S) additive bias -slope_h * (i - j): farther keys are penalised linearly."""
    S = T if S is None else S
    i = torch.arange(T)[:, None] + (S - T)
    j = torch.arange(S)[None, :]
    return -slopes[:, None, None] * (i - j).float()


# --------------------------------------------------------------------------------------------
# 7. Multi-head attention: one projection, split into heads, attend, merge, project out
# --------------------------------------------------------------------------------------------


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, T, n_heads * D) -> (B, n_heads, T, D)."""
    B, T, _ = x.shape
    return x.view(B, T, n_heads, -1).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B, T, H * D)."""
    B, H, T, D = x.shape
    return x.transpose(1, 2).reshape(B, T, H * D)


def multi_head_attention(
    x: torch.Tensor,  # (B, T, E)
    w_qkv: torch.Tensor,  # ((H + 2 Hkv) D, E): query, key and value projections stacked
    w_out: torch.Tensor,  # (E, H D)
    n_heads: int,
    n_kv_heads: int | None = None,
    b_qkv: torch.Tensor | None = None,
    b_out: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Self-attention of x with itself. Returns (output (B, T, E), weights (B, H, T, T))."""
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    D = w_qkv.shape[0] // (n_heads + 2 * n_kv_heads)
    qkv = x @ w_qkv.T + (0 if b_qkv is None else b_qkv)  # (B, T, (H + 2 Hkv) D)
    q, k, v = qkv.split([n_heads * D, n_kv_heads * D, n_kv_heads * D], dim=-1)
    q, k, v = split_heads(q, n_heads), split_heads(k, n_kv_heads), split_heads(v, n_kv_heads)  # (B, *, T, D)
    if is_causal and attn_mask is not None:  # both: the causal mask joins the given one
        T = x.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()  # (T, T)
        if attn_mask.dtype == torch.bool:
            attn_mask = attn_mask & causal
        else:
            attn_mask = attn_mask.masked_fill(~causal, float("-inf"))
        is_causal = False
    context, weights = scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        is_causal=is_causal,
        enable_gqa=n_kv_heads != n_heads,
    )  # (B, H, T, D)
    out = merge_heads(context) @ w_out.T + (0 if b_out is None else b_out)  # (B, T, E)
    return out, weights
