"""Where things are inside a loaded model: the one place every caller looks them up.

A caller may hold a ProbeModel (attnprobe's wrapper) or the bare `torch.nn.Module`; `module_of`
gives the module either way. Decoder layers are the module list with one entry per hidden layer;
a layer's MLP goes by the names families use; an attention module is the innermost module whose
class name ends in "Attention" and that knows its layer index; a layer's sliding window or chunk
comes from the config's layer types, else the module's or the config's one window. `sites_of` is
the one site vocabulary (`Sites`: attention, pre-norms, head outputs, post-norms, MLPs and what they
add, final norm, lm head) that direct attribution, path patching, senders and the MLP edits read;
`mlp_added` is the one rule for what a layer's MLP adds (the post-MLP norm where there is one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UnsupportedFamily

MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "ffn")  # a decoder layer's MLP, by family
OUTPUTS = ("o_proj", "dense", "out_proj", "c_proj")  # an attention module's output projection
FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "final_norm")  # after the last layer
# a layer's MLP pre-norm: Gemma 2/3's pre_feedforward_layernorm first (there post_attention_layernorm
# is the norm after attention), Llama's post_attention_layernorm, GPT-2's ln_2
MLP_NORMS = ("pre_feedforward_layernorm", "post_attention_layernorm", "ln_2", "ffn_norm", "norm_2")
PRE_NORMS = ("input_layernorm", "ln_1", "self_attn_layer_norm", "attention_norm", "norm_1", "ln_attn")


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


def mlp_added(layer, mlp: torch.nn.Module | None = None) -> torch.nn.Module | None:
    """What a decoder layer's MLP adds to the residual stream: the norm after the MLP where the family
    has one (Gemma 2/3: a linear edit or patch before a norm that scales each dimension would not
    hold after it), else the MLP itself (`mlp`, by default the layer's)."""
    norm = getattr(layer, "post_feedforward_layernorm", None)  # as mlp_written
    return norm if norm is not None else (mlp if mlp is not None else layer_mlp(layer))


def mlp_written(layer, out: torch.Tensor) -> torch.Tensor:
    """What a decoder layer's MLP adds to the stream given its output `out` (mlp_added's site)."""
    norm = getattr(layer, "post_feedforward_layernorm", None)
    return norm(out) if norm is not None else out


@dataclass(frozen=True)
class Sites:
    """The one vocabulary of a model's sites, per decoder layer (an entry None where the family has
    none of the names looked for): the attention module, its pre-norm, its output projection (the
    heads' outputs), the norm after attention (None where the output is added as it is), the MLP's
    pre-norm, the MLP and what it adds to the stream (mlp_added); the final norm and the lm head."""

    attention: list
    pre_norm: list
    outputs: list
    after_attention: list
    mlp_norm: list
    mlp: list
    mlp_added: list
    final_norm: torch.nn.Module | None
    lm_head: torch.nn.Module | None

    @property
    def mlp_normed(self) -> list[bool]:
        """Per layer, whether what the MLP adds is a norm of its output (Gemma 2/3) rather than it."""
        return [a is not m for a, m in zip(self.mlp_added, self.mlp)]

    def complete(self, *names: str) -> bool:
        """Whether every layer has each of the named sites (and the model a final norm and head)."""
        lists = [getattr(self, name) for name in names]
        return all(x is not None for x in (self.final_norm, self.lm_head)) and all(
            entries and None not in entries for entries in lists
        )


def sites_of(model) -> Sites:
    """Where each site of `model` (a ProbeModel or module) is (Sites)."""
    module = module_of(model)
    layers = decoder_layers(module)
    attention = [
        next((m for m in la.modules() if type(m).__name__.endswith("Attention")), None) for la in layers
    ]
    mlps = [layer_mlp(layer) for layer in layers]
    # Gemma 2/3 normalise each sublayer's output before adding it (their post_attention_layernorm
    # is a post-norm only beside a pre_feedforward_layernorm; in Llama that name is the MLP's pre-norm)
    after = [
        getattr(la, "post_attention_layernorm", None) if hasattr(la, "pre_feedforward_layernorm") else None
        for la in layers
    ]
    norms = [m for name, m in module.named_modules() if name.rsplit(".", 1)[-1] in FINAL_NORMS]
    return Sites(
        attention=attention,
        pre_norm=[next((getattr(la, n) for n in PRE_NORMS if hasattr(la, n)), None) for la in layers],
        outputs=[next((getattr(a, n) for n in OUTPUTS if hasattr(a, n)), None) for a in attention],
        after_attention=after,
        mlp_norm=[next((getattr(la, n) for n in MLP_NORMS if hasattr(la, n)), None) for la in layers],
        mlp=mlps,
        mlp_added=[mlp_added(la, m) for la, m in zip(layers, mlps)],
        final_norm=norms[-1] if norms else None,
        lm_head=module.get_output_embeddings(),
    )


def parts_of(model):
    """(per-layer attention output projections, the norms after each layer's attention, what each
    layer's MLP adds, the final norm, the lm head) as direct attribution reads them, or None where the
    model's anatomy is not one this attribution reads."""
    sites = sites_of(model)
    if not sites.complete("outputs", "mlp_added"):
        return None
    return sites.outputs, sites.after_attention, sites.mlp_added, sites.final_norm, sites.lm_head
