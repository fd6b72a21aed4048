"""Recompute every attention layer from scratch and compare it with the model, layer by layer.

For each attention module a forward pre-hook records the hidden states that enter it and a
forward hook what leaves it. From those inputs and the layer's own weights, `reference.py` alone
recomputes queries, keys, values, positions, scores, weights and the layer output (transformers'
attention and rotary code are never called). Two model paths are checked against it:

  eager:    transformers' own eager attention with `output_attentions=True`;
  capture:  attnprobe's registered attention function (SDPA output, recorded weights),

so a bug in either shows. Padding is on the right; only real query rows are compared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import torch

from . import reference as ref
from .capture import ATTN_IMPLEMENTATION, encode, run_with_capture
from .errors import UnsupportedFamily
from .models import ProbeModel, load_model

DEFAULT_TEXTS = [
    "The doctor spoke to the nurse. She said to him that the results were ready.",
    "The mechanic called the secretary because he needed the invoice.",
    "They said that the engineer would arrive soon.",
    "Hello",
]

# Tolerances, per dtype, on max |difference| over real query rows.
# float32: transformers' eager attention and ours sum in different orders; measured differences
#   are near 1e-7 for weights; outputs carry the magnitude of the hidden states, so they are
#   compared relative to the layer's largest output value.
# float64: the capture path computes in float64 throughout. transformers' eager path does not: most
#   families take the softmax in float32 even for float64 weights, so its weights are only good
#   to float32 rounding (~1e-7); that path gets the float32 tolerances, stated in the table.
TOLERANCES = {
    torch.float32: {"eager": (1e-5, 1e-5), "capture": (1e-5, 1e-5)},
    torch.float64: {"eager": (1e-5, 1e-5), "capture": (1e-10, 1e-10)},
}


@dataclass
class Projected:
    """What one layer's recipe produces before attention: heads, positions and quirks applied."""

    q: torch.Tensor  # (B, H, T, D) after QK-norm and rotary
    k: torch.Tensor  # (B, Hkv, T, D) after QK-norm and rotary
    v: torch.Tensor  # (B, Hkv, T, D)
    scale: float
    window: int | None  # transformers' sliding_window (query sees itself and window - 1 earlier keys)
    softcap: float | None
    out: Callable[[torch.Tensor], torch.Tensor]  # (B, T, H D) -> (B, T, E)


def _linear(x, layer) -> torch.Tensor:
    """x W^T + b of an nn.Linear, written out."""
    y = x @ layer.weight.T
    return y if layer.bias is None else y + layer.bias


def _conv1d(x, layer) -> torch.Tensor:
    """GPT-2's Conv1D stores W transposed: x W + b."""
    return x @ layer.weight + layer.bias


def _rope(config, layer: int, head_dim: int, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    params = dict(config.rope_parameters)
    layer_types = getattr(config, "layer_types", None)
    if layer_types and layer_types[layer] in params:  # per-layer-type rotary (Gemma 3: local vs global)
        params = dict(params[layer_types[layer]])
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    scheme = params.get("rope_type", "default")
    if scheme not in ("default", "linear", "llama3"):
        raise UnsupportedFamily(f"rope scheme '{scheme}' has no from-scratch recomputation yet")
    inv_freq = ref.rope_inverse_frequencies(rotary_dim, params["rope_theta"], scheme, **params)
    angles = ref.rope_angles(positions, inv_freq)[:, None]  # (B, 1, T, rotary_dim / 2), shared by heads
    return ref.apply_rotary(x, angles)


def _window(config, layer: int) -> int | None:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return config.sliding_window if layer_types[layer] == "sliding_attention" else None
    if config.model_type == "mistral":
        return config.sliding_window
    return None


def _llama_like(module, x, layer, config, positions) -> Projected:
    """Llama, Mistral, Qwen2/3, Gemma 2/3, Phi: separate q/k/v projections, optional QK-norm, RoPE."""
    H, Hkv = config.num_attention_heads, config.num_key_value_heads
    D = getattr(config, "head_dim", None) or config.hidden_size // H
    q = ref.split_heads(_linear(x, module.q_proj), H)  # (B, H, T, D)
    k = ref.split_heads(_linear(x, module.k_proj), Hkv)  # (B, Hkv, T, D)
    v = ref.split_heads(_linear(x, module.v_proj), Hkv)
    family = config.model_type
    if family == "qwen3":
        q = ref.rms_norm(q, module.q_norm.weight, config.rms_norm_eps)
        k = ref.rms_norm(k, module.k_norm.weight, config.rms_norm_eps)
    elif family in ("gemma3", "gemma3_text"):
        q = ref.rms_norm(q, module.q_norm.weight, config.rms_norm_eps, offset=1.0)
        k = ref.rms_norm(k, module.k_norm.weight, config.rms_norm_eps, offset=1.0)
    elif family == "phi" and config.qk_layernorm:
        q = ref.layer_norm(q, module.q_layernorm.weight, module.q_layernorm.bias, config.layer_norm_eps)
        k = ref.layer_norm(k, module.k_layernorm.weight, module.k_layernorm.bias, config.layer_norm_eps)
    q, k = _rope(config, layer, D, positions, q), _rope(config, layer, D, positions, k)
    gemma = family in ("gemma2", "gemma3", "gemma3_text")
    out_proj = module.dense if family == "phi" else module.o_proj
    return Projected(
        q, k, v,
        scale=(config.query_pre_attn_scalar if gemma else D) ** -0.5,
        window=_window(config, layer),
        softcap=getattr(config, "attn_logit_softcapping", None) if gemma else None,
        out=lambda context: _linear(context, out_proj),
    )


def _gpt2(module, x, layer, config, positions) -> Projected:
    """GPT-2: one Conv1D for q, k, v; learned absolute positions are already in x."""
    H, E = config.num_attention_heads, config.hidden_size
    q, k, v = _conv1d(x, module.c_attn).split(E, dim=-1)  # (B, T, E) each
    scale = (E // H) ** -0.5 if config.scale_attn_weights else 1.0
    if config.scale_attn_by_inverse_layer_idx:
        scale /= layer + 1
    return Projected(ref.split_heads(q, H), ref.split_heads(k, H), ref.split_heads(v, H), scale, None, None,
                     out=lambda context: _conv1d(context, module.c_proj))


def _gpt_neox(module, x, layer, config, positions) -> Projected:
    """GPT-NeoX: one projection laid out per head as [q | k | v]; partial rotary."""
    H = config.num_attention_heads
    D = config.hidden_size // H
    B, T, _ = x.shape
    qkv = _linear(x, module.query_key_value).view(B, T, H, 3 * D).transpose(1, 2)  # (B, H, T, 3D)
    q, k, v = qkv.split(D, dim=-1)  # (B, H, T, D) each
    q, k = _rope(config, layer, D, positions, q), _rope(config, layer, D, positions, k)
    return Projected(q, k, v, D**-0.5, None, None, out=lambda context: _linear(context, module.dense))


def _opt(module, x, layer, config, positions) -> Projected:
    """OPT: biased q/k/v projections, learned absolute positions already in x."""
    H = config.num_attention_heads
    D = config.hidden_size // H
    q, k, v = (ref.split_heads(_linear(x, p), H) for p in (module.q_proj, module.k_proj, module.v_proj))
    return Projected(q, k, v, D**-0.5, None, None, out=lambda context: _linear(context, module.out_proj))


RECIPES: dict[str, Callable[..., Projected]] = {
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "opt": _opt,
    **{family: _llama_like for family in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text", "phi")},
}


def recompute_layer(module, x, layer, config, lengths) -> tuple[torch.Tensor, torch.Tensor]:
    """From-scratch (weights (B, H, T, T), output (B, T, E)) of one attention layer."""
    B, T, _ = x.shape
    positions = torch.arange(T, device=x.device).expand(B, T)  # right padding: real tokens at 0..L-1
    p = RECIPES[config.model_type](module, x, layer, config, positions)
    keep = ref.causal_mask(T, device=x.device) & ref.padding_mask(lengths.to(x.device), T)  # (B, 1, T, T)
    if p.window is not None:
        keep = keep & ref.local_mask(T, window=p.window - 1, device=x.device)
    context, weights = ref.scaled_dot_product_attention(
        p.q, p.k, p.v, attn_mask=keep, scale=p.scale, enable_gqa=True, softcap=p.softcap
    )  # (B, H, T, D), (B, H, T, T)
    return weights, p.out(ref.merge_heads(context))


def _attention_modules(model) -> list[torch.nn.Module]:
    found = [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]
    return sorted(found, key=lambda m: m.layer_idx)


def _run_recorded(model, modules, run) -> tuple[list, list, object]:
    """Run `run()` with hooks that record each attention module's input and output."""
    inputs, outputs = [None] * len(modules), [None] * len(modules)

    def pre_hook(i):
        def hook(module, args, kwargs):
            inputs[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    def post_hook(i):
        def hook(module, args, kwargs, output):
            outputs[i] = output[0] if isinstance(output, tuple) else output
        return hook

    handles = [m.register_forward_pre_hook(pre_hook(i), with_kwargs=True) for i, m in enumerate(modules)]
    handles += [m.register_forward_hook(post_hook(i), with_kwargs=True) for i, m in enumerate(modules)]
    try:
        with torch.no_grad():
            result = run()
    finally:
        for handle in handles:
            handle.remove()
    return inputs, outputs, result


def _max_diff(a: torch.Tensor, b: torch.Tensor, lengths: torch.Tensor, relative: bool) -> float:
    """Max |a - b| over each item's real query rows (dim 1 of outputs, dim 2 of weights)."""
    worst = 0.0
    for i, length in enumerate(lengths.tolist()):
        x, y = (a[i, :length], b[i, :length]) if a.ndim == 3 else (a[i, :, :length], b[i, :, :length])
        diff = (x.double() - y.double()).abs().max().item()
        if relative:
            diff /= max(1.0, y.double().abs().max().item())
        worst = max(worst, diff)
    return worst


def verify(model: ProbeModel | str, texts: list[str] | None = None) -> pd.DataFrame:
    """One row per layer: max |d weights| and |d output| of both paths against the reference.
    `model` is a loaded ProbeModel or a model spec (loaded in float32)."""
    model = load_model(model) if isinstance(model, str) else model
    hf = model.model
    config = hf.config.get_text_config()
    family = config.model_type
    if family not in RECIPES or not getattr(hf, "_supports_attention_backend", False):
        raise UnsupportedFamily(
            f"model family '{family}' has no from-scratch recomputation in attnprobe verify "
            f"(supported: {', '.join(sorted(set(RECIPES)))})"
        )
    enc = encode(model.tokenizer, texts or DEFAULT_TEXTS)
    ids, mask = enc["input_ids"].to(model.device), enc["attention_mask"].to(model.device)
    lengths = mask.sum(1).cpu()
    modules = _attention_modules(hf)
    dtype = model.dtype
    tolerances = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    previous = hf.config._attn_implementation
    rows = {layer: {"family": family, "layer": layer, "model_dtype": str(dtype).removeprefix("torch."),
                    "n_texts": len(lengths)} for layer in range(len(modules))}
    try:
        for path in ("eager", "capture"):
            hf.set_attn_implementation("eager" if path == "eager" else ATTN_IMPLEMENTATION)
            if path == "eager":
                run = lambda: hf(input_ids=ids, attention_mask=mask, output_attentions=True, use_cache=False).attentions
            else:
                run = lambda: run_with_capture(hf, ids, mask).weights
            inputs, outputs, got_weights = _run_recorded(hf, modules, run)
            tol_w, tol_o = tolerances[path]
            for layer, module in enumerate(modules):
                with torch.no_grad():
                    weights, output = recompute_layer(module, inputs[layer], layer, config, lengths)
                row = rows[layer]
                row[f"max_dweights_{path}"] = _max_diff(got_weights[layer].to(weights.dtype), weights, lengths, False)
                row[f"max_doutput_{path}"] = _max_diff(outputs[layer], output, lengths, relative=True)
                row[f"tol_weights_{path}"], row[f"tol_output_{path}"] = tol_w, tol_o
    finally:
        hf.set_attn_implementation(previous)
    table = pd.DataFrame(rows.values())
    table["passed"] = True
    for path in ("eager", "capture"):
        table["passed"] &= (table[f"max_dweights_{path}"] <= table[f"tol_weights_{path}"]) & (
            table[f"max_doutput_{path}"] <= table[f"tol_output_{path}"])
    return table


def verify_spec(spec: str, texts: list[str], dtype: str = "float32", trust_remote_code: bool = False,
                allow_pickle: bool = False) -> pd.DataFrame:
    """Load `spec` in `dtype` and verify it (what `attnprobe verify` runs)."""
    return verify(load_model(spec, dtype=dtype, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle), texts)


def format_table(table: pd.DataFrame) -> str:
    """The per-layer table and a one-line verdict, as `attnprobe verify` prints them."""
    header = f"{'layer':>5}  {'dweights eager':>14}  {'dweights capture':>16}  {'doutput eager':>13}  {'doutput capture':>15}  {'tol (e / c)':>17}  status"
    lines = [header]
    for r in table.itertuples():
        lines.append(
            f"{r.layer:>5}  {r.max_dweights_eager:>14.2e}  {r.max_dweights_capture:>16.2e}  {r.max_doutput_eager:>13.2e}"
            f"  {r.max_doutput_capture:>15.2e}  {r.tol_weights_eager:>8.0e} / {r.tol_weights_capture:>6.0e}"
            f"  {'ok' if r.passed else 'FAIL'}"
        )
    failed = int((~table["passed"]).sum())
    first = table.iloc[0]
    worst = table[["max_dweights_eager", "max_dweights_capture"]].max()
    verdict = (
        f"{'PASS' if failed == 0 else 'FAIL'}: {first.family}, {first.model_dtype}, {len(table)} layers, {first.n_texts} texts "
        f"(padded batch); max |dweights| eager {worst.max_dweights_eager:.2e}, capture {worst.max_dweights_capture:.2e}"
        + (f"; {failed} layer(s) out of tolerance" if failed else "")
    )
    return "\n".join(lines + [verdict])
