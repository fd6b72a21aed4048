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

import copy
import inspect
from importlib.resources import files

import pandas as pd
import torch

from ..attention.capture import ATTN_IMPLEMENTATION, encode, run_with_capture
from ..errors import UnsupportedFamily
from ..model import ProbeModel, load_model
from ..model.anatomy import attention_modules
from . import reference as ref
from .declared import check_parts, generic
from .recipes import RECIPES

# the sentences `verify` runs by default (package data: one per line)
DEFAULT_TEXTS = files("attnprobe.verify").joinpath("data/texts.txt").read_text(encoding="utf-8").splitlines()

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


def recompute_layer(
    module, x, layer, config, lengths, rotary: bool = True
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """From-scratch (weights (B, H, T, T), output (B, T, E), max |score|) of one attention layer.
    `rotary`: the model has a rotary embedding (else positions are already in x)."""
    B, T, _ = x.shape
    positions = torch.arange(T, device=x.device).expand(B, T)  # right padding: real tokens at 0..L-1
    recipe = RECIPES.get(config.model_type)
    p = (
        recipe(module, x, layer, config, positions)
        if recipe
        else generic(module, x, layer, config, positions, rotary)
    )
    keep = ref.causal_mask(T, device=x.device) & ref.padding_mask(lengths.to(x.device), T)  # (B, 1, T, T)
    if p.window is not None:
        keep = keep & ref.local_mask(T, window=p.window - 1, device=x.device)
    if p.chunk is not None:
        keep = keep & ref.chunk_mask(T, chunk=p.chunk, device=x.device)
    mask = (
        keep if p.bias is None else torch.where(keep, p.bias.to(p.q.dtype), float("-inf"))
    )  # ALiBi: additive
    context, weights = ref.scaled_dot_product_attention(
        p.q, p.k, p.v, attn_mask=mask, scale=p.scale, enable_gqa=True, softcap=p.softcap, sinks=p.sinks
    )  # (B, H, T, D), (B, H, T, T)
    group = p.q.shape[1] // p.k.shape[1]
    scores = (p.q @ p.k.repeat_interleave(group, dim=1).transpose(-2, -1)) * p.scale
    return weights, p.out(ref.merge_heads(context)), scores.abs().max().item()


def _run_recorded(model, modules, run) -> tuple[list, list, object]:
    """Run `run()` with hooks that record each attention module's input and output."""
    inputs, outputs = [None] * len(modules), [None] * len(modules)

    def pre_hook(i):
        def hook(module, args, kwargs):
            inputs[i] = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments  # by name

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


def _max_diff(a: torch.Tensor, b: torch.Tensor, lengths: torch.Tensor, relative: bool) -> tuple[float, int]:
    """(max |a - b| over each item's real query rows (dim 1 of outputs, dim 2 of weights), the number
    of those rows where a has NaN and b does not). Such rows are left out of the maximum (which would
    skip NaN silently anyway) and counted; NaN in b (the reference) is a NaN difference. NaN on both
    sides agrees."""
    worst, nan_rows = 0.0, 0
    for i, length in enumerate(lengths.tolist()):
        x, y = (a[i, :length], b[i, :length]) if a.ndim == 3 else (a[i, :, :length], b[i, :, :length])
        if (y.isnan() & ~x.isnan()).any():
            return float("nan"), nan_rows
        only_a = (x.isnan() & ~y.isnan()).flatten(0, -2).any(-1)  # per query row (and head)
        nan_rows += int(only_a.sum())
        x, y = x.double().nan_to_num(), y.double().nan_to_num()
        rows = (x - y).abs().flatten(0, -2)[~only_a]
        diff = rows.max().item() if rows.numel() else 0.0
        if relative:
            diff /= max(1.0, y.abs().max().item())
        worst = max(worst, diff)
    return worst, nan_rows


def low_precision_tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(weights, relative output) tolerances of a bfloat16 or float16 model against a float32
    reference of the same layer inputs: 4 eps of the format (bfloat16 eps 2^-7: 0.031; float16
    eps 2^-10: 0.0039). The model rounds q, k, v, the scores or weights and the products to that
    format, each within eps / 2 relative; worst cases compound those roundings with the size of
    the scores, but they mostly cancel: measured, SmolLM2-135M stays within 2.2 eps on weights and
    2.7 eps on outputs in bfloat16 (2.7 and 2.8 in float16), Gemma 3 270M within 2.4 and 1.8 eps in
    bfloat16. Errors of method (a wrong scale, mask or rotation) move weights by tenths."""
    eps = torch.finfo(dtype).eps
    return 4 * eps, 4 * eps


def _reference_module(module, dtype: torch.dtype):
    """The layer itself, or for a low-precision model a float32 copy (the reference is float32)."""
    return module if dtype in TOLERANCES else copy.deepcopy(module).float()


def long_text(tokenizer, n_tokens: int) -> str:
    """A text of about `n_tokens` tokens: the built-in sentences repeated (for windows and long masks)."""
    unit = " ".join(DEFAULT_TEXTS[:3]) + " "
    per_unit = max(1, len(tokenizer(unit)["input_ids"]))
    return unit * (n_tokens // per_unit + 1)


def verify(model: ProbeModel | str, texts: list[str] | None = None) -> pd.DataFrame:
    """One row per layer: max |d weights| and |d output| of both paths against the reference.
    `model` is a loaded ProbeModel or a model spec (loaded in float32). Families whose attention
    bypasses the interface are verified on their eager weights (both columns read them)."""
    model = load_model(model) if isinstance(model, str) else model
    hf = model.model
    family = hf.config.get_text_config().model_type
    modules = attention_modules(hf)
    if not modules:
        raise UnsupportedFamily(
            f"model family '{family}' has no attention module attnprobe can hook (none with a layer index)"
        )
    if family not in RECIPES:
        check_parts(modules[0], family)
    enc = encode(model.tokenizer, texts or DEFAULT_TEXTS)
    ids, mask = enc["input_ids"].to(model.device), enc["attention_mask"].to(model.device)
    lengths = mask.sum(1).cpu()
    dtype, low = model.dtype, model.dtype not in TOLERANCES
    rows = {
        layer: {
            "family": family,
            "layer": layer,
            "model_dtype": str(dtype).removeprefix("torch."),
            "reference_dtype": "float32" if low else str(dtype).removeprefix("torch."),
            "n_texts": len(lengths),
            "max_tokens": int(lengths.max()),
        }
        for layer in range(len(modules))
    }
    previous = hf.config._attn_implementation
    try:
        for path in ("eager", "capture"):
            _compare_path(hf, modules, path, ids, mask, dtype, rows)
    finally:
        hf.set_attn_implementation(previous)
    return with_verdict(pd.DataFrame(rows.values()))


def with_verdict(table: pd.DataFrame) -> pd.DataFrame:
    """`table` with `passed`: both paths' weights and outputs within their tolerances."""
    table["passed"] = True
    for path in ("eager", "capture"):
        table["passed"] &= (table[f"max_dweights_{path}"] <= table[f"tol_weights_{path}"]) & (
            table[f"max_doutput_{path}"] <= table[f"tol_output_{path}"]
        )
    return table


def _compare_path(hf, modules, path: str, ids, mask, dtype, rows: dict) -> None:
    """Run the model through `path` (eager, or attnprobe's capture where the family takes the
    interface) on `ids` with their padding `mask`, recompute every layer from its recorded input and
    add the differences to `rows`."""
    lengths = mask.sum(1).cpu()
    config = hf.config.get_text_config()
    interface = bool(getattr(hf, "_supports_attention_backend", False))
    rotary = any(name.endswith("rotary_emb") for name, _ in hf.named_modules())
    low = dtype not in TOLERANCES
    hf.set_attn_implementation(ATTN_IMPLEMENTATION if path == "capture" and interface else "eager")
    if path == "eager":
        run = lambda: (
            hf(input_ids=ids, attention_mask=mask, output_attentions=True, use_cache=False).attentions
        )
    else:
        run = lambda: run_with_capture(hf, ids, mask).weights
    inputs, outputs, got_weights = _run_recorded(hf, modules, run)
    for layer, module in enumerate(modules):
        x = inputs[layer].get("hidden_states", next(iter(inputs[layer].values())))
        with torch.no_grad():
            weights, output, _ = recompute_layer(
                _reference_module(module, dtype), x.float() if low else x, layer, config, lengths, rotary
            )
        if inputs[layer].get("residual") is not None:  # a module given the residual adds it itself (Bloom)
            output = output + inputs[layer]["residual"].to(output.dtype)
        row = rows[layer]
        dweights, nan_w = _max_diff(got_weights[layer].to(weights.dtype), weights, lengths, False)
        doutput, nan_o = _max_diff(outputs[layer].to(output.dtype), output, lengths, relative=True)
        if path == "capture" and nan_w + nan_o:  # attnprobe's own weights: NaN is a failure
            dweights = doutput = float("nan")
        row[f"max_dweights_{path}"], row[f"max_doutput_{path}"] = dweights, doutput
        row[f"nan_rows_{path}"] = nan_w
        if low:
            tol_w, tol_o = low_precision_tolerances(dtype)
        else:
            tol_w, tol_o = TOLERANCES[dtype]["capture" if path == "capture" and interface else "eager"]
        row[f"tol_weights_{path}"], row[f"tol_output_{path}"] = tol_w, tol_o


def format_table(table: pd.DataFrame) -> str:
    """The per-layer table and a one-line verdict, as `attnprobe verify` prints them."""
    header = (
        f"{'layer':>5}  {'dweights eager':>14}  {'dweights capture':>16}  {'doutput eager':>13}  "
        f"{'doutput capture':>15}  {'tol (e / c)':>17}  status"
    )
    lines = [header]
    for r in table.itertuples():
        lines.append(
            f"{r.layer:>5}  {r.max_dweights_eager:>14.2e}  {r.max_dweights_capture:>16.2e}  "
            f"{r.max_doutput_eager:>13.2e}"
            f"  {r.max_doutput_capture:>15.2e}  {r.tol_weights_eager:>8.0e} / {r.tol_weights_capture:>6.0e}"
            f"  {'ok' if r.passed else 'FAIL'}"
        )
    failed = int((~table["passed"]).sum())
    first = table.iloc[0]
    worst = table[["max_dweights_eager", "max_dweights_capture"]].max(skipna=False)
    verdict = (
        f"{'PASS' if failed == 0 else 'FAIL'}: {first.family}, {first.model_dtype} against a "
        f"{first.reference_dtype} reference, "
        f"{len(table)} layers, {first.n_texts} texts ("
        + (
            f"a padded batch and one of {first.max_tokens:,} tokens in blocks of "
            f"{first.long_block_rows} rows); "
            if "long_block_rows" in table
            else f"padded batch, longest {first.max_tokens} tokens); "
        )
        + f"max |dweights| eager {worst.max_dweights_eager:.2e}, capture {worst.max_dweights_capture:.2e}"
        + (f"; {failed} layer(s) out of tolerance" if failed else "")
    )
    notes = []
    if worst.max_dweights_capture == 0.0:
        notes.append(
            "A difference of exactly 0 means bit-identical: in this dtype the reference performs the same "
            "floating-point "
            "operations in the same order as the model (the same matmuls on the same inputs, the softmax "
            "along the "
            "same axis), so nothing rounds differently; a wrong scale, mask or rotation shows as 1e-3 or "
            "more."
        )
    if "long_block_rows" in table:
        notes.append(
            f"The text of {first.max_tokens:,} tokens was verified alone, {first.long_block_rows} query "
            "rows at a time; for it the eager column is the family's own eager attention function applied "
            "to the layer's queries, keys and values (the whole-model eager path would hold every layer's "
            "T x T weights)."
        )
    nan_rows = int(table["nan_rows_eager"].sum()) if "nan_rows_eager" in table else 0
    if nan_rows:
        notes.append(
            f"transformers' own eager attention gave NaN weights on {nan_rows} real query rows (where the "
            "reference and attnprobe's capture are finite); those rows are left out of its column and "
            "counted in nan_rows_eager."
        )
    if first.reference_dtype != first.model_dtype:
        notes.append(
            f"Tolerance for {first.model_dtype}: 4 eps of the format (see "
            "attnprobe.verify.low_precision_tolerances)."
        )
    return "\n".join(lines + [verdict] + notes)
