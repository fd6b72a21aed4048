"""verify on one long text, layer by layer and in blocks of query rows: never T x T weights of
every layer at once, so an 8k-token text of Gemma 3 fits in a few GB.

The model runs once through attnprobe's attention function (the path runs use). At each layer an
editor (capture.editing) sees the layer's query, keys, values and mask; a pre-hook has recorded
the hidden states entering the layer. For every block of query rows it compares, against the
from-scratch reference (declared.py recomputes q, k, v, positions and quirks from those hidden
states and the layer's weights):

  capture:  the weights capture records for those rows (capture.attention_weights, the code that
            records rows in a run), and the layer's output;
  eager:    transformers' own eager attention function of the family, applied to the layer's
            query, keys and values for those rows (its whole-model eager path would hold every
            layer's T x T weights).

Then the block is dropped. The table has verify.verify's columns.
"""

from __future__ import annotations

import inspect
import sys

import pandas as pd
import torch

from ..attention.capture import ATTN_IMPLEMENTATION, attention_weights, editing, rows_of_mask
from ..errors import UnsupportedFamily
from ..forward.longdoc import check_fits
from ..model import ProbeModel, load_model, load_tokenizer
from ..model.anatomy import attention_modules
from . import (
    TOLERANCES,
    _max_diff,
    _reference_module,
    long_text,
    low_precision_tolerances,
    verify,
    with_verdict,
)
from . import reference as ref
from .declared import generic
from .recipes import RECIPES

BLOCK_ROWS = 256  # query rows compared at once


def _eager_function(module):
    """The family's own eager attention function (transformers' modeling module), or None."""
    return getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)


def _eager_rows(module, site, rows: slice):
    """transformers' eager attention on the query rows `rows`:
    (context (1, r, H, D), weights (1, H, r, S))."""
    eager = _eager_function(module)
    mask = rows_of_mask(
        site.mask, torch.arange(rows.start, rows.stop)[None], 1, site.key.shape[2], site.causal
    )
    additive = (
        None
        if mask is None
        else torch.zeros(mask.shape, dtype=site.query.dtype).masked_fill(
            ~mask, torch.finfo(site.query.dtype).min
        )
    )  # what transformers' eager mask holds
    accepted = inspect.signature(eager).parameters
    options = {"scaling": site.scaling, "dropout": 0.0}
    if "softcap" in accepted:
        options["softcap"] = site.softcap
    return eager(module, site.query[:, :, rows], site.key, site.value, additive, **options)


def _reference_rows(p, rows: slice, T: int):
    """The from-scratch (context (1, H, r, D), weights (1, H, r, T)) of the query rows `rows`."""
    a, b = rows.start, rows.stop
    keep = ref.causal_mask(b - a, b)  # (r, b): the rows are the last r of b positions
    if p.window is not None:
        keep = keep & ref.local_mask(b - a, b, window=p.window - 1)
    if p.chunk is not None:
        keep = keep & ref.chunk_mask(b - a, b, chunk=p.chunk)
    mask = keep if p.bias is None else torch.where(keep, p.bias[..., a:b, :b].to(p.q.dtype), float("-inf"))
    context, weights = ref.scaled_dot_product_attention(
        p.q[:, :, a:b],
        p.k[:, :, :b],
        p.v[:, :, :b],
        attn_mask=mask,
        scale=p.scale,
        enable_gqa=True,
        softcap=p.softcap,
        sinks=p.sinks,
    )
    return context, torch.nn.functional.pad(weights, (0, T - b))  # keys after the block: weight 0


class _LayerCheck:
    """The editor: compares each layer in blocks of rows and keeps the worst differences."""

    def __init__(self, model: ProbeModel, block: int):
        hf = model.model
        self.config = hf.config.get_text_config()
        self.modules = attention_modules(hf)
        self.rotary = any(name.endswith("rotary_emb") for name, _ in hf.named_modules())
        self.dtype = model.dtype
        self.low = model.dtype not in TOLERANCES
        self.block = block
        self.inputs: dict[int, torch.Tensor] = {}
        self.expected: dict[int, torch.Tensor] = {}  # layer -> reference output, until the post-hook
        self.rows: dict[int, dict] = {}

    def __call__(self, site):
        layer, module = site.layer, self.modules[site.layer]
        x = self.inputs.pop(layer)
        T = x.shape[1]
        reference = _reference_module(module, self.dtype)  # a float32 copy for a low-precision model
        x = x.float() if self.low else x
        positions = torch.arange(T).expand(1, T)
        recipe = RECIPES.get(self.config.model_type)
        with torch.no_grad():
            p = (recipe or (lambda *a: generic(*a, self.rotary)))(reference, x, layer, self.config, positions)
            worst = {"capture": 0.0, "eager": 0.0}
            contexts = {"reference": [], "eager": []}
            for a in range(0, T, self.block):
                rows = slice(a, min(T, a + self.block))
                context, expected = _reference_rows(p, rows, T)
                index = torch.arange(rows.start, rows.stop)[None]
                mask = rows_of_mask(site.mask, index, 1, site.key.shape[2], site.causal)
                captured = attention_weights(
                    site.query[:, :, rows], site.key, mask, site.scaling, site.softcap, site.sinks
                )
                eager_context, eager = _eager_rows(module, site, rows)
                length = torch.tensor([rows.stop - rows.start])
                for path, got in (("capture", captured), ("eager", eager)):
                    diff, _ = _max_diff(got.to(expected.dtype), expected, length, relative=False)
                    worst[path] = max(worst[path], diff) if diff == diff else float("nan")
                contexts["reference"].append(context)
                contexts["eager"].append(eager_context.transpose(1, 2).to(context.dtype))
            expected_out = p.out(ref.merge_heads(torch.cat(contexts["reference"], 2)))
            eager_out = p.out(ref.merge_heads(torch.cat(contexts["eager"], 2)))
        self.expected[layer] = expected_out
        eager_doutput, _ = _max_diff(eager_out, expected_out, torch.tensor([T]), relative=True)
        self.rows[layer] = {
            "max_dweights_eager": worst["eager"],
            "max_dweights_capture": worst["capture"],
            "max_doutput_eager": eager_doutput,
        }
        return site.output

    def compare_output(self, layer: int, output: torch.Tensor) -> None:
        expected = self.expected.pop(layer)
        diff, _ = _max_diff(
            output.to(expected.dtype), expected, torch.tensor([expected.shape[1]]), relative=True
        )
        self.rows[layer]["max_doutput_capture"] = diff


def verify_long(model: ProbeModel, input_ids: torch.Tensor, block: int = BLOCK_ROWS) -> pd.DataFrame:
    """verify.verify's table for one long text (input_ids (T,)), compared in blocks of `block`
    query rows (see the module doc). Only for families whose attention goes through attnprobe's."""
    hf = model.model
    config = hf.config.get_text_config()
    if hf.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise UnsupportedFamily(
            f"'{config.model_type}' attention bypasses attnprobe's function, so it cannot be verified in "
            "blocks of rows; use a shorter --long"
        )
    modules = attention_modules(hf)
    if _eager_function(modules[0]) is None:
        raise UnsupportedFamily(f"'{config.model_type}' has no eager attention function to compare with")
    ids = torch.as_tensor(input_ids).reshape(1, -1)
    T = ids.shape[1]
    check_fits(_memory(model, T, block), f"verifying a text of {T:,} tokens in blocks of {block} rows")
    check = _LayerCheck(model, block)
    handles = _hooked(modules, check)
    try:
        with torch.inference_mode(), editing(check):
            hf(input_ids=ids.to(model.device), use_cache=False, logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    dtype = model.dtype
    low = dtype not in TOLERANCES
    tolerances = low_precision_tolerances(dtype) if low else TOLERANCES[dtype]["capture"]
    eager_tolerances = low_precision_tolerances(dtype) if low else TOLERANCES[dtype]["eager"]
    table = pd.DataFrame(
        {
            "family": config.model_type,
            "layer": layer,
            "model_dtype": str(dtype).removeprefix("torch."),
            "reference_dtype": "float32" if low else str(dtype).removeprefix("torch."),
            "n_texts": 1,
            "max_tokens": T,
            **check.rows[layer],
            "nan_rows_eager": 0,
            "nan_rows_capture": 0,
            "tol_weights_eager": eager_tolerances[0],
            "tol_output_eager": eager_tolerances[1],
            "tol_weights_capture": tolerances[0],
            "tol_output_capture": tolerances[1],
            "block_rows": block,
        }
        for layer in range(len(modules))
    )
    return with_verdict(table)


def _hooked(modules, check) -> list:
    """Hooks that hand `check` each attention module's input, then its output to compare."""

    def pre_hook(layer):
        def hook(module, args, kwargs):
            bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
            check.inputs[layer] = bound.get("hidden_states", next(iter(bound.values())))

        return hook

    def post_hook(layer):
        def hook(module, args, kwargs, output):
            check.compare_output(layer, output[0] if isinstance(output, tuple) else output)

        return hook

    handles = [m.register_forward_pre_hook(pre_hook(i), with_kwargs=True) for i, m in enumerate(modules)]
    return handles + [m.register_forward_hook(post_hook(i), with_kwargs=True) for i, m in enumerate(modules)]


def _memory(model: ProbeModel, T: int, block: int) -> int:
    """Bytes the long verify holds besides the model (float32 reference): one layer's hidden
    states, q, k, v and contexts of the reference and eager paths (12 T x E), three blocks of
    weights with their scores (6 H x block x T), the model's masks (2 T x T bool) and the MLP's
    activations (3 T x intermediate), with a factor 2 for temporaries."""
    config = model.model.config.get_text_config()
    H = config.num_attention_heads
    D = getattr(config, "head_dim", None) or config.hidden_size // H
    width = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    per_token = 12 * max(config.hidden_size, H * D) + 3 * width
    return 2 * (4 * T * per_token + 6 * 4 * H * block * T + 2 * T * T)


# --long texts up to this many tokens join the padded batch (so padding and windows meet); longer
# ones are verified alone, in blocks of query rows (verify_long), where the families allow it.
PADDED_LONG_LIMIT = 1024
LONG_WITHOUT_CONTEXT = 2**20  # the bound on --long for a config that states no context length


def verify_spec(
    spec: str,
    texts: list[str],
    dtype: str = "float32",
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    long_tokens: int | None = None,
    device: str = "cpu",
) -> pd.DataFrame:
    """Load `spec` in `dtype` on `device` and verify it (what `attnprobe verify` runs); `long_tokens` adds a
    text of that many tokens: in the padded batch up to PADDED_LONG_LIMIT, else in blocks."""
    if long_tokens:  # from the config, before weights load or any text is built (GPT-2: 1,024)
        context = load_tokenizer(spec, trust_remote_code, tokenizer=False)[1] or LONG_WITHOUT_CONTEXT
        if long_tokens > context:
            raise UnsupportedFamily(
                f"--long {long_tokens:,} is more than the model's context of {context:,} tokens; give at "
                f"most {context:,}"
            )
    model = load_model(
        spec, dtype=dtype, device=device, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle
    )
    routed = model.model.config._attn_implementation == ATTN_IMPLEMENTATION
    if long_tokens and (long_tokens > PADDED_LONG_LIMIT and routed):
        return combined(verify(model, texts), verify_long(model, long_ids(model.tokenizer, long_tokens)))
    if long_tokens:
        texts = [*texts, long_text(model.tokenizer, long_tokens)]
        config = model.model.config.get_text_config()
        # eager keeps every layer's (B, H, T, T) weights, and the reference one layer's in float64
        weights = (len(texts) + 1) * config.num_attention_heads * 4 * (long_tokens + 64) ** 2
        check_fits(
            config.num_hidden_layers * weights,
            f"verifying {len(texts)} texts padded to {long_tokens:,} tokens",
        )
    return verify(model, texts)


def long_ids(tokenizer, n_tokens: int) -> torch.Tensor:
    """Exactly `n_tokens` token ids of long_text."""
    ids, asked = [], n_tokens
    while len(ids) < n_tokens:  # long_text's length is estimated from one unit's tokens
        ids = tokenizer(long_text(tokenizer, asked))["input_ids"]
        asked *= 2
    return torch.tensor(ids[:n_tokens])


def combined(short: pd.DataFrame, long: pd.DataFrame) -> pd.DataFrame:
    """One row per layer: the worse of the padded batch's and the long text's differences."""
    table = short.copy()
    for column in [c for c in short if c.startswith(("max_d", "nan_rows"))]:
        table[column] = pd.concat([short[column], long[column]], axis=1).max(axis=1, skipna=False)
    table["n_texts"] = short["n_texts"] + 1
    table["max_tokens"] = long["max_tokens"]
    table["long_block_rows"] = long["block_rows"]
    table["passed"] = short["passed"] & long["passed"]
    return table
