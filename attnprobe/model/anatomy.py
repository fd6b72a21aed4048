"""Where things are inside a loaded model: the one place every caller looks them up.

A caller may hold a ProbeModel (attnprobe's wrapper) or the bare `torch.nn.Module`; `module_of`
gives the module either way. Decoder layers are the module list with one entry per hidden layer;
a layer's MLP goes by the names families use; an attention module is the innermost module whose
class name ends in "Attention" and that knows its layer index; a layer's sliding window or chunk
comes from the config's layer types, else the module's or the config's one window; `parts_of` names
what direct attribution and the path analysis read (output projections, norms, MLPs, the lm head).
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedFamily

MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "ffn")  # a decoder layer's MLP, by family
OUTPUTS = ("o_proj", "dense", "out_proj", "c_proj")  # an attention module's output projection
FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "final_norm")  # after the last layer


def module_of(model) -> torch.nn.Module:
    """The torch module of a ProbeModel, or the module itself."""
    return model if isinstance(model, torch.nn.Module) else model.model


def decoder_layers(model) -> torch.nn.ModuleList:
    """The model's decoder layers: the module list with one entry per hidden layer (empty if none)."""
    module = module_of(model)
    n = module.config.num_hidden_layers
    return next(
        (m for m in module.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n),
        torch.nn.ModuleList(),
    )


def layer_mlp(layer) -> torch.nn.Module | None:
    """A decoder layer's MLP (by the names families use), or None."""
    return next(
        (getattr(layer, n) for n in MLP_NAMES if isinstance(getattr(layer, n, None), torch.nn.Module)), None
    )


def mlp_modules(model) -> list[torch.nn.Module] | None:
    """Each decoder layer's MLP (by the names families use), or None when a layer has none of them."""
    found = [layer_mlp(layer) for layer in decoder_layers(model)]
    return found if found and all(m is not None for m in found) else None


def attention_modules(model) -> list[torch.nn.Module]:
    """Each layer's attention module (the innermost, when one wraps another, as GPT-Neo's)."""

    def index(m):
        return getattr(m, "layer_idx", getattr(m, "layer_id", None))

    found = [
        m
        for m in module_of(model).modules()
        if type(m).__name__.endswith("Attention") and isinstance(index(m), int)
    ]
    inner = [m for m in found if not any(other is not m and other in set(m.modules()) for other in found)]
    return sorted(inner, key=index)


def window_of(module, config, layer: int) -> tuple[int | None, int | None]:
    """(sliding window, chunk) of one layer, from its layer type; without layer types, the
    module's own window or else the config's one window for all layers (Mistral, Mixtral, Phi-3)."""
    layer_types = getattr(config, "layer_types", None)
    kind = layer_types[layer] if layer_types else None
    if kind == "sliding_attention":
        return config.sliding_window, None
    if kind == "chunked_attention":
        return None, config.attention_chunk_size
    if kind == "full_attention":
        return None, None
    if kind is not None:
        raise UnsupportedFamily(f"layer type '{kind}' has no from-scratch recomputation yet")
    if hasattr(module, "sliding_window"):
        return module.sliding_window, None
    return getattr(config, "sliding_window", None), None


def parts_of(model):
    """(per-layer attention output projections, the norms after each layer's attention (None where
    its output is added as it is), what each layer's MLP adds (the MLP, or the norm after it), the
    final norm, the lm head), or None where the model's anatomy is not one this attribution reads."""
    outputs, after_attention, mlp_added = [], [], []
    mlps = mlp_modules(model) or []
    for i, layer in enumerate(decoder_layers(model)):
        attention = next((m for m in layer.modules() if type(m).__name__.endswith("Attention")), None)
        outputs.append(next((getattr(attention, n) for n in OUTPUTS if hasattr(attention, n)), None))
        # Gemma 2/3 normalise each sublayer's output before adding it (their post_attention_layernorm
        # is a post-norm only beside a pre_feedforward_layernorm; in Llama that name is the MLP's pre-norm)
        post = hasattr(layer, "pre_feedforward_layernorm")
        after_attention.append(getattr(layer, "post_attention_layernorm", None) if post else None)
        mlp_added.append(
            getattr(layer, "post_feedforward_layernorm", None) or (mlps[i] if i < len(mlps) else None)
        )
    norms = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in FINAL_NORMS]
    if not outputs or None in outputs or None in mlp_added or not norms:
        return None
    return outputs, after_attention, mlp_added, norms[-1], model.get_output_embeddings()
