"""Recipes for families that the generic reading (declared.py) cannot describe: GPT-2's scaling by
layer, and the families whose attention bypasses transformers' attention interface (verified on
their eager weights): GPT-Neo, GPT-J, CodeGen, Bloom, Falcon, MPT. Each returns a Projected from a
layer's own weights and the hidden states that entered it; the math is in reference.py and rope.py.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedFamily
from . import reference as ref
from . import rope
from .declared import Projected, apply_linear, rope_parameters, rotate


def _gpt2(module, x, layer, config, positions) -> Projected:
    """GPT-2: one Conv1D for [q | k | v]; learned positions are already in x; scores optionally
    unscaled, or also divided by the layer number (scale_attn_by_inverse_layer_idx)."""
    H, E = config.num_attention_heads, config.hidden_size
    q, k, v = apply_linear(module.c_attn, x).split(E, dim=-1)  # (B, T, E) each
    scale = (E // H) ** -0.5 if config.scale_attn_weights else 1.0
    if config.scale_attn_by_inverse_layer_idx:
        scale /= layer + 1
    return Projected(
        ref.split_heads(q, H),
        ref.split_heads(k, H),
        ref.split_heads(v, H),
        scale,
        None,
        None,
        out=lambda context: apply_linear(module.c_proj, context),
    )


def _gpt_neo(module, x, layer, config, positions) -> Projected:
    """GPT-Neo: unscaled scores; "local" layers see themselves and window_size - 1 earlier tokens."""
    H = config.num_heads
    q, k, v = (ref.split_heads(apply_linear(p, x), H) for p in (module.q_proj, module.k_proj, module.v_proj))
    window = config.window_size if config.attention_layers[layer] == "local" else None
    return Projected(q, k, v, 1.0, window, None, out=lambda context: apply_linear(module.out_proj, context))


def _sinusoid_rotary(q, k, rotary_dim: int, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-J and CodeGen: rotary on the first rotary_dim features, interleaved pairs, base 10000."""
    turn = ref.rope_angles(positions, rope.default_frequencies(rotary_dim, 10000.0))[:, None]
    return ref.apply_rotary(q, turn, interleaved=True), ref.apply_rotary(k, turn, interleaved=True)


def _gptj(module, x, layer, config, positions) -> Projected:
    """GPT-J: separate q/k/v without bias, partial interleaved rotary, 1/sqrt(D)."""
    H = config.n_head
    D = config.n_embd // H
    q, k, v = (ref.split_heads(apply_linear(p, x), H) for p in (module.q_proj, module.k_proj, module.v_proj))
    q, k = _sinusoid_rotary(q, k, config.rotary_dim or D, positions)
    return Projected(q, k, v, D**-0.5, None, None, out=lambda context: apply_linear(module.out_proj, context))


def _codegen(module, x, layer, config, positions) -> Projected:
    """CodeGen: one projection in 4 blocks (its training ran on 4 TPU cores), each [q | v | k]
    for H/4 heads; partial interleaved rotary; 1/sqrt(D)."""
    H = config.n_head
    D = config.n_embd // H
    B, T, _ = x.shape
    blocks = apply_linear(module.qkv_proj, x).view(B, T, 4, 3 * H * D // 4)
    q, v, k = (part.reshape(B, T, H * D) for part in blocks.split(H * D // 4, dim=-1))  # heads block-major
    q, k, v = ref.split_heads(q, H), ref.split_heads(k, H), ref.split_heads(v, H)
    q, k = _sinusoid_rotary(q, k, config.rotary_dim or D, positions)
    return Projected(q, k, v, D**-0.5, None, None, out=lambda context: apply_linear(module.out_proj, context))


def _per_head_fused(fused: torch.Tensor, H: int, D: int):
    """Per head [q (D) | k (D) | v (D)] -> three (B, H, T, D)."""
    B, T, _ = fused.shape
    q, k, v = fused.view(B, T, H, 3 * D).split(D, dim=-1)
    return (part.transpose(1, 2) for part in (q, k, v))


def _bloom(module, x, layer, config, positions) -> Projected:
    """Bloom: fused per head [q | k | v], ALiBi (a per-head linear penalty on distance), 1/sqrt(D)."""
    H = config.n_head
    D = config.hidden_size // H
    q, k, v = _per_head_fused(apply_linear(module.query_key_value, x), H, D)
    bias = ref.alibi_bias(ref.alibi_slopes(H), x.shape[1]).to(x.device)
    return Projected(
        q, k, v, D**-0.5, None, None, out=lambda context: apply_linear(module.dense, context), bias=bias
    )


def _falcon(module, x, layer, config, positions) -> Projected:
    """Falcon: one projection laid out per generation (new architecture: per key/value head
    [its queries | k | v]; multi-query: [q | k | v] with one key/value head; else per head
    [q | k | v]); rotary positions (half layout); 1/sqrt(D)."""
    if config.alibi:
        raise UnsupportedFamily(
            "Falcon with ALiBi has no from-scratch recomputation yet (Falcon with rotary positions has)"
        )
    H = config.num_attention_heads
    D = config.hidden_size // H
    fused = apply_linear(module.query_key_value, x)
    B, T, _ = fused.shape
    if config.new_decoder_architecture:
        Hkv = config.num_kv_heads
        groups = fused.view(B, T, Hkv, H // Hkv + 2, D)
        q = groups[:, :, :, :-2].reshape(B, T, H, D).transpose(1, 2)
        k, v = groups[:, :, :, -2].transpose(1, 2), groups[:, :, :, -1].transpose(1, 2)
    elif config.multi_query:
        q, k, v = fused.split([H * D, D, D], dim=-1)
        q, k, v = ref.split_heads(q, H), ref.split_heads(k, 1), ref.split_heads(v, 1)
    else:
        q, k, v = _per_head_fused(fused, H, D)
    q, k = rotate(q, k, rope_parameters(config, layer), config, positions, interleaved=False)
    return Projected(q, k, v, D**-0.5, None, None, out=lambda context: apply_linear(module.dense, context))


def _mpt(module, x, layer, config, positions) -> Projected:
    """MPT: one projection [q | k | v], clamped by clip_qkv; ALiBi with MPT's slopes; softmax_scale
    or 1/sqrt(D)."""
    H = config.n_heads
    D = config.d_model // H
    attn = config.attn_config
    fused = apply_linear(module.Wqkv, x)
    if attn.clip_qkv:
        fused = fused.clamp(-attn.clip_qkv, attn.clip_qkv)
    q, k, v = (ref.split_heads(part, H) for part in fused.chunk(3, dim=-1))
    bias = None
    if attn.alibi:
        bias = ref.alibi_bias(ref.mpt_alibi_slopes(H, attn.alibi_bias_max), x.shape[1]).to(x.device)
    scale = attn.softmax_scale or D**-0.5
    return Projected(
        q, k, v, scale, None, None, out=lambda context: apply_linear(module.out_proj, context), bias=bias
    )


RECIPES = {
    "gpt2": _gpt2,
    "gpt-sw3": _gpt2,
    "gpt_neo": _gpt_neo,
    "gptj": _gptj,
    "codegen": _codegen,
    "bloom": _bloom,
    "falcon": _falcon,
    "mpt": _mpt,
}
