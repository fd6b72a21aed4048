"""What a family's attention declares, read into what a from-scratch recomputation needs.

One generic reading serves every family whose attention module is built from the usual parts:
projections (separate q/k/v, or fused in a declared layout; nn.Linear or GPT-2's Conv1D, biases
included), QK-norm (RMS or LayerNorm, per head or over all heads, Gemma's 1 + weight), rotary
positions (every scheme of rope.py, partial, half or interleaved pairs, per layer type, layers
without rotary), scaling (1/sqrt(head_dim), Gemma's query_pre_attn_scalar, Granite's
attention_multiplier), clip_qkv, logit soft-capping, attention sinks, and sliding or chunked
windows per layer type. Families whose attention bypasses transformers' attention interface
(GPT-Neo, GPT-J, CodeGen, Bloom, Falcon, MPT) have a short recipe each in recipes.py.
A module with any part this file does not know is unsupported, with the part named: never a guess.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import UnsupportedFamily
from ..model.anatomy import OUTPUTS, window_of
from . import reference as ref
from . import rope

# Parts of an attention module that the generic reading understands.
PROJECTIONS = {"q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "c_attn", "Wqkv"}
NORMS = (("q_norm", "k_norm"), ("q_layernorm", "k_layernorm"))
HARMLESS = {"attn_dropout", "resid_dropout", "attention_dropout", "dropout"}  # identity in eval mode
# How a fused projection lays out q, k and v along its output features:
#   stacked:  [q (H D) | k (Hkv D) | v (Hkv D)]      per_head: per head [q (D) | k (D) | v (D)]
FUSED_LAYOUT = {"qkv_proj": "stacked", "c_attn": "stacked", "Wqkv": "stacked", "query_key_value": "per_head"}
# Facts about families that their modules do not expose as attributes, each read from the family's code:
HALF_PAIRS = {"gpt_oss"}  # rotary without a rotate_half function, on pairs (k, k + R/2)
ROTARY_IN_FLOAT32 = {"ernie4_5", "ernie4_5_moe"}  # q, k rotated in float32 and cast back
ROUNDED_BEFORE_ROTARY = {
    "cohere",
    "cohere2",
    "cohere2_moe",
}  # q, k rounded to float32, rotated in the model dtype
NORM_AFTER_ROTARY = {"nanochat"}  # QK-norm applied to the rotated q and k
ROTARY_ON_SLIDING_LAYERS_ONLY = {
    "cohere2",
    "cohere2_moe",
    "exaone4",
    "exaone_moe",
    "kolibri1",
    "flint",
}  # full layers: no positions


@dataclass
class Projected:
    """What one layer produces before attention: heads, positions and quirks applied."""

    q: torch.Tensor  # (B, H, T, D) after QK-norm and rotary
    k: torch.Tensor  # (B, Hkv, T, D) after QK-norm and rotary
    v: torch.Tensor  # (B, Hkv, T, D)
    scale: float
    window: int | None  # transformers' sliding_window (query sees itself and window - 1 earlier keys)
    softcap: float | None
    out: Callable[[torch.Tensor], torch.Tensor]  # (B, T, H D) -> (B, T, E)
    chunk: int | None = None  # chunked attention: keys in the query's block of `chunk` positions only
    bias: torch.Tensor | None = None  # (H, T, T) additive score bias (ALiBi)
    sinks: torch.Tensor | None = None  # (H,) attention-sink logits


def apply_linear(layer, x: torch.Tensor) -> torch.Tensor:
    """x W^T + b of an nn.Linear, or x W + b of GPT-2's Conv1D (W stored transposed), written out."""
    if type(layer).__name__ == "Conv1D":
        return x @ layer.weight + layer.bias
    if not isinstance(layer, torch.nn.Linear):
        raise UnsupportedFamily(f"projection {type(layer).__name__} is not a plain linear layer")
    y = x @ layer.weight.T
    return y if layer.bias is None else y + layer.bias


def heads_of(module, config) -> tuple[int, int, int]:
    """(query heads H, key/value heads Hkv, head dim D) of one attention module."""
    H = config.num_attention_heads
    Hkv = 1 if getattr(config, "multi_query", False) else getattr(config, "num_key_value_heads", None) or H
    D = getattr(module, "head_dim", None) or getattr(config, "head_dim", None) or config.hidden_size // H
    return H, Hkv, D


def check_parts(module, family: str) -> None:
    """Refuse a module with parts the generic reading does not recompute (gates, convolutions, ...)."""
    known = PROJECTIONS | set(OUTPUTS) | {n for pair in NORMS for n in pair} | HARMLESS
    unknown = [name for name, _ in module.named_children() if name not in known]
    if unknown:
        raise UnsupportedFamily(
            f"'{family}' attention has parts attnprobe does not recompute: {', '.join(unknown)}"
        )
    if not any(hasattr(module, name) for name in OUTPUTS):
        raise UnsupportedFamily(
            f"'{family}' attention has no output projection attnprobe knows ({', '.join(OUTPUTS)})"
        )


def _projections(module, x, H, Hkv, D):
    """(q (B, T, H D), k (B, T, Hkv D), v (B, T, Hkv D)) from separate or fused projections."""
    if all(hasattr(module, n) for n in ("q_proj", "k_proj", "v_proj")):
        q, k, v = (apply_linear(getattr(module, n), x) for n in ("q_proj", "k_proj", "v_proj"))
        if (q.shape[-1], k.shape[-1], v.shape[-1]) != (
            H * D,
            Hkv * D,
            Hkv * D,
        ):  # a gate in q, or another value width
            raise UnsupportedFamily(
                f"q/k/v projections give {q.shape[-1]}/{k.shape[-1]}/{v.shape[-1]} features where "
                f"{H} x {D} / {Hkv} x {D} / {Hkv} x {D} heads are declared"
            )
        return q, k, v
    name = next((n for n in FUSED_LAYOUT if hasattr(module, n)), None)
    if name is None:
        raise UnsupportedFamily(
            "attention has neither q/k/v projections nor a fused projection attnprobe knows"
        )
    fused = apply_linear(getattr(module, name), x)
    B, T, _ = fused.shape
    if FUSED_LAYOUT[name] == "stacked":
        return fused.split([H * D, Hkv * D, Hkv * D], dim=-1)
    per_head = fused.view(B, T, H, 3 * D)
    return (part.reshape(B, T, H * D) for part in per_head.split(D, dim=-1))


def _norm(norm, x: torch.Tensor, heads: int, D: int) -> torch.Tensor:
    """A QK-norm on x (B, T, heads D): per head when its weight has D (or heads x D, one row per
    head) entries or it has none, over all heads when it has heads D; RMS or LayerNorm by its class."""
    kind = type(norm).__name__
    weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None) or 1e-6
    B, T, _ = x.shape
    per_head = (
        weight is None or weight.ndim == 2 or weight.numel() == D
    )  # a weightless norm: per head (NanoChat)
    shaped = x.view(B, T, heads, D) if per_head else x
    if "RMSNorm" in kind:
        unit = torch.ones(shaped.shape[-1], dtype=x.dtype, device=x.device)  # a norm without a learned scale
        normed = ref.rms_norm(
            shaped, unit if weight is None else weight, eps, offset=1.0 if "Gemma" in kind else 0.0
        )
    elif "LayerNorm" in kind:
        if isinstance(eps, tuple):
            eps = eps[0]
        # torch's LayerNorm computes in the input's dtype; the families' own LayerNorms (Cohere) in float32
        compute = x.dtype if isinstance(norm, torch.nn.LayerNorm) else torch.float32
        normed = ref.layer_norm(
            shaped.to(compute), weight.to(compute), None if bias is None else bias.to(compute), eps
        ).to(x.dtype)
    else:
        raise UnsupportedFamily(f"QK-norm {kind} is neither an RMSNorm nor a LayerNorm")
    return normed.reshape(B, T, heads * D)


def pair_layout(module, family: str) -> tuple[bool, float]:
    """(interleaved, direction) of the family's rotary: pairs (2k, 2k + 1) or (k, k + D/2), turned
    forwards (+1) or backwards (-1, NanoChat). Read from the family's own `rotate_half` applied to
    0..7: the half layout gives -4 -5 -6 -7 0 1 2 3 (backwards: 4 5 6 7 -0 -1 -2 -3)."""
    rotate_half = getattr(sys.modules.get(type(module).__module__), "rotate_half", None)
    if rotate_half is None and family in HALF_PAIRS:
        return False, 1.0
    if rotate_half is None:
        raise UnsupportedFamily(f"{type(module).__name__} declares rotary positions but no rotate_half")
    turned = rotate_half(torch.arange(8.0)).tolist()
    layouts = {
        (False, 1.0): [-4.0, -5.0, -6.0, -7.0, 0.0, 1.0, 2.0, 3.0],
        (False, -1.0): [4.0, 5.0, 6.0, 7.0, 0.0, -1.0, -2.0, -3.0],
        (True, 1.0): [-1.0, 0.0, -3.0, 2.0, -5.0, 4.0, -7.0, 6.0],
        (True, -1.0): [1.0, 0.0, 3.0, -2.0, 5.0, -4.0, 7.0, -6.0],
    }
    for layout, expected in layouts.items():
        if turned == expected:
            return layout
    raise UnsupportedFamily(
        f"{type(module).__name__}'s rotate_half is neither the half nor the interleaved layout"
    )


def rope_parameters(config, layer: int) -> dict | None:
    """This layer's rotary parameters, or None for a layer without rotary positions."""
    params = getattr(config, "rope_parameters", None)
    layer_types = getattr(config, "layer_types", None)
    if (
        config.model_type in ROTARY_ON_SLIDING_LAYERS_ONLY
        and layer_types
        and "sliding_attention" in layer_types
        and layer_types[layer] != "sliding_attention"
    ):
        return None
    if params and layer_types and layer_types[layer] in params:  # per layer type (Gemma 3: local vs global)
        params = params[layer_types[layer]]
    no_rope = getattr(config, "no_rope_layers", None)
    if no_rope is not None and not no_rope[layer]:  # SmolLM3: 0 marks a layer without rotary
        return None
    return dict(params) if params else None


def rotate(q, k, params: dict, config, positions, interleaved: bool, direction: float = 1.0):
    """Rotary positions on q and k (B, heads, T, D); in float32 for the families that do so."""
    if config.model_type in ROUNDED_BEFORE_ROTARY:
        q, k = q.float().to(q.dtype), k.float().to(k.dtype)
    if config.model_type in ROTARY_IN_FLOAT32 and q.dtype != torch.float32:
        q32, k32 = rotate(q.float(), k.float(), params, config, positions, interleaved, direction)
        return q32.to(q.dtype), k32.to(k.dtype)
    D = q.shape[-1]
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    rotary_dim = int(D * factor)
    try:
        theta, attention = rope.frequencies(
            params, rotary_dim, getattr(config, "max_position_embeddings", 0), int(positions.max()) + 1
        )
    except NotImplementedError as exc:
        raise UnsupportedFamily(f"{exc} has no from-scratch recomputation yet") from None
    turn = direction * ref.rope_angles(positions, theta)[:, None]  # (B, 1, T, R/2), shared by heads
    return (
        ref.apply_rotary(q, turn, interleaved, attention),
        ref.apply_rotary(k, turn, interleaved, attention),
    )


def scale_of(module, config, D: int) -> float:
    """Scores are q.k x scale: 1/sqrt(D), Gemma's query_pre_attn_scalar^-1/2, or Granite's
    attention_multiplier; a module that declares another `scaling` is unsupported (an undeclared quirk)."""
    if getattr(config, "attention_multiplier", None) is not None:
        scale = float(config.attention_multiplier)
    elif getattr(config, "query_pre_attn_scalar", None):
        scale = config.query_pre_attn_scalar**-0.5
    else:
        scale = D**-0.5
    declared = getattr(module, "scaling", None)
    if isinstance(declared, (int, float)) and not math.isclose(declared, scale, rel_tol=1e-9):
        raise UnsupportedFamily(
            f"{type(module).__name__} scales scores by {declared:g}, which attnprobe cannot derive "
            f"from its config (derived {scale:g})"
        )
    return scale


def clip_qkv(q, k, v, clip: float | None):
    """OLMo's clip_qkv: projections clamped to [-clip, clip]."""
    return (q, k, v) if not clip else (q.clamp(-clip, clip), k.clamp(-clip, clip), v.clamp(-clip, clip))


def generic(module, x, layer, config, positions, rotary: bool) -> Projected:
    """Any family built from the usual parts (see the module docstring). `rotary`: the model has
    a rotary embedding (else positions are absolute, already in x)."""
    check_parts(module, config.model_type)
    H, Hkv, D = heads_of(module, config)
    q, k, v = _projections(module, x, H, Hkv, D)
    q, k, v = clip_qkv(q, k, v, getattr(config, "clip_qkv", None))

    def norms(q, k):
        for q_name, k_name in NORMS:
            if hasattr(module, q_name):
                q, k = _norm(getattr(module, q_name), q, H, D), _norm(getattr(module, k_name), k, Hkv, D)
        return q, k

    after = config.model_type in NORM_AFTER_ROTARY
    if not after:
        q, k = norms(q, k)
    q, k, v = ref.split_heads(q, H), ref.split_heads(k, Hkv), ref.split_heads(v, Hkv)
    params = rope_parameters(config, layer) if rotary else None
    if params is not None:
        q, k = rotate(q, k, params, config, positions, *pair_layout(module, config.model_type))
    if after:
        q, k = norms(ref.merge_heads(q), ref.merge_heads(k))
        q, k = ref.split_heads(q, H), ref.split_heads(k, Hkv)
    window, chunk = window_of(module, config, layer)
    out = getattr(module, next(n for n in OUTPUTS if hasattr(module, n)))
    return Projected(
        q,
        k,
        v,
        scale=scale_of(module, config, D),
        window=window,
        softcap=getattr(config, "attn_logit_softcapping", None),
        out=lambda context: apply_linear(out, context),
        chunk=chunk,
        sinks=getattr(module, "sinks", None),
    )
