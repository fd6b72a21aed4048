"""Direct attribution of the logit difference to every head (by source position) and MLP.

At the position t before the cut, the model's logit difference is y = d_U . h_t (+ the lm head's bias
difference), with d_U = mean W_U row of the positive label's words - that of the negative's (their
first tokens) and h_t = N(x_t) the final norm of the residual x_t. With N's scale frozen at its value
on x_t (RMSNorm: h = x * w / rms(x_t); LayerNorm: h = (x - mean x) * w / sd(x_t) + b), y is linear in
x_t, and x_t is the sum of what every part wrote there: the embedding, each layer's attention output
and MLP output (for families that add them to the residual as they are). A head's part splits exactly
over the source positions it reads: o_proj(z_t) = sum_h sum_s A[t, h, s] v_s^h W_O^h (+ o_proj's
bias), so its share of y from source s is A[t, h, s] (v_s^h . g_h), g = W_O^T d_resid, d_resid the
frozen norm applied to d_U. Families that normalise a sublayer's output before adding it (Gemma 2/3)
have that norm's scale frozen too. `error` is y minus the sum of the parts: zero up to float
rounding where every step is as described (tests/model/test_direct_attribution.py, every family).
Shapes: B prompts, L layers, H heads, S source positions, D head dim, E model width.
"""

from __future__ import annotations

import numpy as np
import torch

from ...attention.capture import editing
from ...attention.logits import read_at
from ...forward.packing import pad_right
from ...model.anatomy import parts_of

EMBED, MLP, BIAS, FINAL = "embedding", "mlp", "bias", "final bias"


def _frozen_norm(
    norm, x: torch.Tensor, h: torch.Tensor, d: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_resid (B, E), constant (B,)): d . N(x + c) = d_resid . c + constant for the parts c of x,
    with N's scale frozen at x (B, E); h = N(x)."""
    if isinstance(norm, torch.nn.LayerNorm) or "LayerNorm" in type(norm).__name__:
        eps = getattr(norm, "eps", 1e-5)
        scale = norm.weight / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
        d_resid = d * scale
        d_resid = d_resid - d_resid.mean(-1, keepdim=True)  # the centring, moved onto d
        bias = norm.bias if getattr(norm, "bias", None) is not None else torch.zeros_like(norm.weight)
        return d_resid, (d * bias).sum(-1)
    # an RMS norm, whatever its weight convention: the gain from a large constant input, the scale
    # 1 / rms(x) from the largest coordinate of x
    gain = norm(torch.full_like(x[:1], 1e3)).to(x.dtype)[0]
    j = x.abs().argmax(-1)
    rows = torch.arange(len(x))
    inverse_rms = h[rows, j] / (gain[j] * x[rows, j])
    return d * gain * inverse_rms[:, None], torch.zeros(len(x), dtype=x.dtype, device=x.device)


@torch.no_grad()
def attribute(
    pm, prompts: list, t: list[int], labels: list[tuple[list[int], list[int]]], classes: list
) -> list[dict]:
    """For each prompt (its token ids, read up to t[b] inclusive): {"y": the logit difference,
    "parts": {(layer, head, position class): value}, "error": y - their sum}. `labels[b]`: the
    positive and negative words' first token ids; `classes[b][s]`: the class of source position s."""
    model, (outputs, after_attention, mlp_added, norm, head) = pm.model, parts_of(pm.model)
    ids, mask = pad_right([p[: i + 1] for p, i in zip(prompts, t)], pm.tokenizer.pad_token_id)
    rows, at = torch.arange(len(prompts)), torch.as_tensor(t)
    sites, mlp_out, final, post = {}, {}, {}, {}

    def record(site):  # changes nothing: keeps each layer's weights at row t and its values
        w = site.weights()[rows, :, at]  # (B, H, S)
        sites[site.layer] = (w.float(), site.values().float())
        return site.output

    hooks = [m.register_forward_hook(_keep(mlp_out, i, rows, at)) for i, m in enumerate(mlp_added)]
    hooks += [
        m.register_forward_hook(lambda m, a, out, i=i: post.update({i: (a[0][rows, at], out[rows, at])}))
        for i, m in enumerate(after_attention)
        if m is not None
    ]
    hooks.append(
        norm.register_forward_hook(lambda m, a, out: final.update(x=a[0][rows, at], h=out[rows, at]))
    )
    try:
        with editing(record), read_at((rows, at)):  # the prediction read: an edit there acts there
            out = model(
                input_ids=ids.to(pm.device), attention_mask=mask.to(pm.device), output_hidden_states=True
            )
    finally:
        for hook in hooks:
            hook.remove()
    x, h, W = final["x"].float(), final["h"].float(), head.weight.float()
    d = torch.stack([W[pos].mean(0) - W[neg].mean(0) for pos, neg in labels])  # (B, E)
    y = (d * h).sum(-1)
    if getattr(head, "bias", None) is not None:
        y = y + torch.stack(
            [head.bias[pos].float().mean() - head.bias[neg].float().mean() for pos, neg in labels]
        )
    d_resid, constant = _frozen_norm(norm, x, h, d)
    embed = (out.hidden_states[0][rows, at].float() * d_resid).sum(-1)
    per_layer = []
    for layer, projection in enumerate(outputs):
        weights, values = sites[layer]  # (B, H, S), (B, H, S, D)
        d_layer = d_resid  # what the attention output must be dotted with: through its post-norm, frozen
        if layer in post:
            d_layer = _frozen_norm(
                after_attention[layer], post[layer][0].float(), post[layer][1].float(), d_resid
            )[0]
        g, bias = _transposed(projection, d_layer, values.shape[1] * values.shape[3])  # (B, H*D), (B,)
        g = g.view(len(prompts), values.shape[1], 1, values.shape[3])
        per_source = weights * (values * g).sum(-1)  # (B, H, S)
        mlp = (mlp_out[layer].float() * d_resid).sum(-1)
        per_layer.append((per_source.double().cpu(), bias.cpu(), mlp.cpu()))  # one copy each, not per prompt
    biased = getattr(head, "bias", None) is not None  # what its bias adds beside d . h joins the constant
    ends = constant.double().cpu() + ((y - (d * h).sum(-1)).double().cpu() if biased else 0.0)
    y, embed = y.cpu(), embed.cpu()
    return [_parts(b, y, embed, float(ends[b]), per_layer, classes[b], t[b]) for b in range(len(prompts))]


def _parts(b: int, y, embed, end: float, per_layer: list, classes: list, t: int) -> dict:
    """Prompt b's parts: the embedding, the final constant (`end`), per layer its MLP, its bias and each
    head's share from each class of source position (up to t); and what they leave unexplained."""
    parts = {(-1, -1, EMBED): embed[b].item(), (-1, -1, FINAL): end}
    names = list(dict.fromkeys(classes))
    onehot = np.array([[c == name for name in names] for c in classes], dtype=float)  # (S, C)
    for layer, (per_source, bias, mlp) in enumerate(per_layer):
        parts[(layer, -1, MLP)] = mlp[b].item()
        parts[(layer, -1, BIAS)] = bias[b].item()
        summed = per_source[b, :, : t + 1].numpy() @ onehot  # (H, C)
        for (h_, c), v in np.ndenumerate(summed):
            parts[(layer, h_, names[c])] = float(v)
    return {"y": y[b].item(), "parts": parts, "error": y[b].item() - sum(parts.values())}


def _keep(store: dict, layer: int, rows, at):
    def hook(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        store[layer] = out[rows, at] if out.shape[1] > 1 else out[rows, 0]

    return hook


def _transposed(projection, d_resid: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, bias part): g = W_O^T d_resid (B, H*D) and d_resid . o_proj's bias (B,), by differentiating
    d_resid . o_proj(z) at z = 0 (a Linear or a Conv1D alike)."""
    with torch.enable_grad():
        z = torch.zeros(len(d_resid), width, device=d_resid.device, dtype=d_resid.dtype, requires_grad=True)
        out = projection(z.to(projection.weight.dtype)).float()
        (g,) = torch.autograd.grad((out * d_resid).sum(), z)
    return g.detach(), (out.detach() * d_resid).sum(-1)
