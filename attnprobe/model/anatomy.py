"""Where things are inside a loaded model: the one place every caller looks them up.

A caller may hold a ProbeModel (attnprobe's wrapper) or the bare `torch.nn.Module`; `module_of`
gives the module either way. Decoder layers are the module list with one entry per hidden layer;
a layer's MLP goes by the names families use; an attention module is the innermost module whose
class name ends in "Attention" and that knows its layer index; a layer's sliding window or chunk
comes from the config's layer types, else the module's or the config's one window.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedFamily

MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "ffn")  # a decoder layer's MLP, by family


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


def mlp_modules(model) -> list[torch.nn.Module] | None:
    """Each decoder layer's MLP (by the names families use), or None when a layer has none of them."""
    found = [
        next(
            (getattr(layer, n) for n in MLP_NAMES if isinstance(getattr(layer, n, None), torch.nn.Module)),
            None,
        )
        for layer in decoder_layers(model)
    ]
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
