"""Record attention weights while the model runs, for only the query rows a probe needs.

attnprobe registers an attention function named "attnprobe" with transformers'
`AttentionInterface` (and the boolean mask builder under the same name with
`AttentionMaskInterface`, without which the causal mask would silently be dropped). The function:

  1. computes the layer output with torch's fused SDPA, exactly as the "sdpa" implementation
     does, or with exact math where SDPA cannot (logit soft-capping, attention sinks);
  2. when a capture is active and the layer is selected, recomputes the softmax for the requested
     query rows only, in float32: O(layers x heads x rows x S) memory instead of T x S.

Families whose attention bypasses the interface (models.routes_attention says which) run eager
attention with `output_attentions=True`; their rows are sliced afterwards.

Padding is on the right: every real token keeps position 0..L-1 and, under the causal mask, never
sees a pad, so a prompt's weights do not depend on what else is in its batch.

Shapes: B batch, H query heads, Hkv key/value heads, T query length, S key length, D head dim, R
captured rows per batch item."""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..errors import CaptureError
from .logits import logits_wanted, picked_logits, read_at

ATTN_IMPLEMENTATION = "attnprobe"


@dataclass
class _Plan:
    rows: torch.Tensor | None  # (B, R) query positions, or None for every row
    layers: frozenset[int] | None  # None: every layer
    weights: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (B, H, R, S)

    def wants(self, layer: int | None) -> bool:
        return layer is not None and (self.layers is None or layer in self.layers)


_active_plan: contextvars.ContextVar[_Plan | None] = contextvars.ContextVar("attnprobe_plan", default=None)
# An editor rewrites per-head outputs (head interventions, see attnprobe.measures.head_effects).
_active_editor: contextvars.ContextVar = contextvars.ContextVar("attnprobe_editor", default=None)
# The model's own edit (a saved edit applied to a whole run, `model_edit`): rewrites per-head outputs
# before any measure's editor sees them, so the measures see the edited model.
_model_edit: contextvars.ContextVar = contextvars.ContextVar("attnprobe_model_edit", default=None)
# A prefix: (key, value, mask) -> the same with keys and values of earlier positions prepended
# (intervene/engine.py).
_active_prefix: contextvars.ContextVar = contextvars.ContextVar("attnprobe_prefix", default=None)


def expand_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, Hkv, S, D) -> (B, H, S, D): query head h reads key/value head h // (H / Hkv)."""
    n_kv = x.shape[1]
    return x if n_kv == n_heads else x.repeat_interleave(n_heads // n_kv, dim=1)


def attention_weights(
    query: torch.Tensor,  # (B, H, R, D) the query rows wanted
    key: torch.Tensor,  # (B, Hkv, S, D)
    mask: torch.Tensor | None,  # (B, 1 or H, R, S): bool (True = attend) or additive float
    scaling: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # (H,) per-head sink logits (gpt-oss)
) -> torch.Tensor:
    """Exact attention weights in float32 (float64 for a float64 model), (B, H, R, S), also when the
    caller runs under torch.autocast (which would otherwise do the q.k products in bfloat16)."""
    with torch.autocast(query.device.type, enabled=False):
        return _attention_weights(query, key, mask, scaling, softcap, sinks)


def _attention_weights(query, key, mask, scaling, softcap, sinks) -> torch.Tensor:
    dtype = torch.promote_types(query.dtype, torch.float32)
    key = expand_kv(key, query.shape[1]).to(dtype)
    scores = torch.matmul(query.to(dtype), key.transpose(-1, -2)) * scaling  # (B, H, R, S)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)  # Gemma 2 logit soft-capping
    if mask is not None:
        scores = (
            scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.to(dtype)
        )
    if sinks is None:
        weights = torch.softmax(scores, dim=-1)
    else:
        # A sink is one extra logit per head that takes probability mass and has no value.
        sink = sinks.to(dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)  # (B, H, R, 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    # A row with every key masked (a pad query outside a sliding window) gives 0/0; make it 0 so
    # that 0 x value stays finite, as torch's fused SDPA does.
    return weights.nan_to_num(0.0)


def rows_of_mask(
    mask: torch.Tensor | None, rows: torch.Tensor, B: int, S: int, causal: bool
) -> torch.Tensor | None:
    """The mask restricted to the captured rows: (B, 1 or H, R, S)."""
    if mask is None:
        if not causal:
            return None
        keys = torch.arange(S, device=rows.device)
        return (keys[None, None, :] <= rows[:, :, None])[:, None]  # (B, 1, R, S), causal
    mask = mask.expand(B, -1, -1, -1)
    index = rows[:, None, :, None].expand(B, mask.shape[1], rows.shape[1], S)
    return mask.gather(2, index)


def attnprobe_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (B, H, T, D)
    key: torch.Tensor,  # (B, Hkv, S, D)
    value: torch.Tensor,  # (B, Hkv, S, D)
    attention_mask: torch.Tensor | None,  # (B, 1, T, S) bool, or None when plainly causal
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    causal = getattr(module, "is_causal", True)
    plan, prefix = _active_plan.get(), _active_prefix.get()
    if prefix is not None:
        key, value, attention_mask = prefix(module.layer_idx, key, value, attention_mask)
    B, H, T, D = query.shape
    S = key.shape[2]
    scaling = D**-0.5 if scaling is None else scaling

    if softcap is None and s_aux is None:
        output = F.scaled_dot_product_attention(
            query,
            expand_kv(key, H),
            expand_kv(value, H),
            attn_mask=attention_mask,
            dropout_p=dropout,
            scale=scaling,
            is_causal=attention_mask is None and causal and T > 1,
        )  # (B, H, T, D)
    else:  # exact math: SDPA has no soft-capping or sinks
        all_rows = torch.arange(T, device=query.device).expand(B, T)
        weights = attention_weights(
            query, key, rows_of_mask(attention_mask, all_rows, B, S, causal), scaling, softcap, s_aux
        )
        output = torch.matmul(weights.to(value.dtype), expand_kv(value, H))  # (B, H, T, D)

    layer = getattr(module, "layer_idx", None)
    for editor in (_model_edit.get(), _active_editor.get()):  # the model's edit first, then a measure's
        if editor is not None:
            site = AttentionSite(
                layer, query, key, value, attention_mask, scaling, softcap, s_aux, causal, output
            )
            output = editor(site)  # (B, H, T, D)
    if plan is not None and plan.wants(layer):
        rows = (
            torch.arange(T, device=query.device).expand(B, T)
            if plan.rows is None
            else plan.rows.to(query.device)
        )
        R = rows.shape[1]
        q_rows = query.gather(2, rows[:, None, :, None].expand(B, H, R, D))  # (B, H, R, D)
        mask_rows = rows_of_mask(attention_mask, rows, B, S, causal)
        plan.weights[layer] = attention_weights(q_rows, key, mask_rows, scaling, softcap, s_aux).detach()

    return output.transpose(1, 2).contiguous(), None  # (B, T, H, D)


AttentionInterface.register(ATTN_IMPLEMENTATION, attnprobe_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def enable(model: torch.nn.Module) -> None:
    """Route `model`'s attention through attnprobe (or eager, for families that bypass the interface)."""
    implementation = ATTN_IMPLEMENTATION if getattr(model, "_supports_attention_backend", False) else "eager"
    model.set_attn_implementation(implementation)


@contextmanager
def recording(rows: torch.Tensor | None = None, layers=None):
    """Within the block, the registered attention function records weights into the yielded plan."""
    plan = _Plan(rows=rows, layers=None if layers is None else frozenset(layers))
    with _bound(_active_plan, plan):
        yield plan


@contextmanager
def _bound(var: contextvars.ContextVar, value):
    """`var` set to `value` within the block, then what it was."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


@dataclass(frozen=True)
class AttentionSite:
    """What an editor sees at one attention layer: its inputs, its settings and its per-head output."""

    layer: int | None
    query: torch.Tensor  # (B, H, T, D)
    key: torch.Tensor  # (B, Hkv, S, D)
    value: torch.Tensor  # (B, Hkv, S, D)
    mask: torch.Tensor | None  # (B, 1, T, S) bool, or None when plainly causal
    scaling: float
    softcap: float | None
    sinks: torch.Tensor | None
    causal: bool
    output: torch.Tensor  # (B, H, T, D) per-head context, before the output projection

    def full_mask(self) -> torch.Tensor | None:
        """The mask of every query row: (B, 1, T, S), or None where nothing is masked."""
        B, _, T, _ = self.query.shape
        rows = torch.arange(T, device=self.query.device).expand(B, T)
        return rows_of_mask(self.mask, rows, B, self.key.shape[2], self.causal)

    def weights(self) -> torch.Tensor:
        """The attention weights of every head and query row, recomputed: (B, H, T, S)."""
        return attention_weights(
            self.query, self.key, self.full_mask(), self.scaling, self.softcap, self.sinks
        )

    def values(self) -> torch.Tensor:
        """Values with one head per query head: (B, H, S, D)."""
        return expand_kv(self.value, self.query.shape[1])


@contextmanager
def editing(editor, prefix=None):
    """Within the block, `editor(site: AttentionSite)` may replace each layer's per-head output
    (B, H, T, D) (see attnprobe.measures.head_effects), and `prefix(layer, key, value, mask)` may prepend
    recorded keys and values of positions the input leaves out (see attnprobe.measures.head_effects)."""
    with _bound(_active_editor, editor), _bound(_active_prefix, prefix):
        yield editor


def active_model_edit():
    """The model edit in force (None outside `model_edit` blocks)."""
    return _model_edit.get()


@contextmanager
def model_edit(editor):
    """Within the block the model itself is edited: `editor(site)` rewrites each layer's per-head
    output before any measure's `editing` editor sees it (which then patches or records the edited
    model). Blocks nest: the inner editor applies after the outer one."""
    outer = _model_edit.get()
    with _bound(_model_edit, editor if outer is None else _Chain(outer, editor)):
        yield editor


@dataclass(frozen=True)
class _Chain:
    first: object
    then: object

    def __call__(self, site):
        return self.then(replace(site, output=self.first(site)))


@dataclass
class Captured:
    """What one batched forward pass recorded."""

    weights: dict[int, torch.Tensor]  # layer -> (B, H, R, S) float32
    rows: torch.Tensor  # (B, R) the query positions of each row
    logits: torch.Tensor | None  # (B, P, V) at `logit_positions`, (U, V) with `logit_picks`, or None
    logit_rows: torch.Tensor | None = None  # (N,) with `logit_picks`: the row of `logits` of each pick

    def cpu(self) -> Captured:
        """The same on the CPU, where the measures read it (a no-op on a CPU model)."""
        moved = lambda t: None if t is None else t.cpu()
        weights = {layer: w.cpu() for layer, w in self.weights.items()}
        return Captured(weights, self.rows.cpu(), moved(self.logits), moved(self.logit_rows))


def encode(tokenizer, texts: list[str]) -> dict[str, torch.Tensor]:
    """Tokenise a batch with right padding: input_ids and attention_mask, (B, T)."""
    tokenizer.padding_side = "right"
    return tokenizer(list(texts), return_tensors="pt", padding=True)


def capture_texts(model, texts: list[str], layers=None) -> Captured:
    """Attention weights of every query row of `texts` (right-padded into one batch) at `layers`
    (None: all): `pm.capture(texts)`. Row b of a layer's (B, H, T, T) weights is texts[b]."""
    batch = encode(model.tokenizer, list(texts))
    return run_with_capture(model, batch["input_ids"], batch["attention_mask"], layers=layers)


@torch.inference_mode()
def run_with_capture(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # (B, T)
    attention_mask: torch.Tensor | None = None,  # (B, T) 1 = token, 0 = right padding
    rows: torch.Tensor | None = None,  # (B, R) query positions to record; None: all T rows
    layers=None,  # iterable of layer indices; None: all layers
    # (P,) or per sequence (B, P) positions whose next-token logits to return
    logit_positions: torch.Tensor | None = None,
    logit_picks: tuple[torch.Tensor, torch.Tensor] | None = None,  # (N,) sequences and (N,) positions
) -> Captured:
    """One forward pass that records attention weights for the requested rows and layers; logits at
    `logit_positions`, or at exactly the N (sequence, position) pairs of `logit_picks`."""
    if not isinstance(model, torch.nn.Module):  # a ProbeModel
        model = model.model
    B, T = input_ids.shape
    if rows is not None:
        rows = torch.as_tensor(rows, dtype=torch.long)
        if rows.ndim != 2 or rows.shape[0] != B:
            raise CaptureError(f"rows must have shape (batch, R) = ({B}, R), got {tuple(rows.shape)}")
        if rows.numel() and (rows.min() < 0 or rows.max() >= T):
            raise CaptureError(f"rows must lie in [0, {T}) for a batch of length {T}")
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    attention_mask = None if attention_mask is None else attention_mask.to(device)
    keep, pick, reads = logits_wanted(B, device, logit_positions, logit_picks)
    implementation = model.config._attn_implementation
    if implementation == ATTN_IMPLEMENTATION:
        recorded = recording(None if rows is None else rows.to(device), layers)
        with recorded as plan, picked_logits(model, pick), read_at(reads):
            out = model(
                input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=keep
            )
        weights = plan.weights
    elif implementation == "eager":
        with picked_logits(model, pick), read_at(reads):
            out = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                use_cache=False,
                output_attentions=True,
                logits_to_keep=keep,
            )
        weights = _eager_rows(out.attentions, rows, layers, device)
    else:
        raise CaptureError(
            f"model attention is '{implementation}'; load it with attnprobe.load_model or call "
            "attnprobe.attention.capture.enable(model)"
        )
    all_rows = torch.arange(T).expand(B, T) if rows is None else rows
    if logit_picks is not None:
        return Captured(weights, all_rows, out.logits[0], torch.arange(out.logits.shape[1]))
    logits = (
        None
        if logit_positions is None
        else out.logits
        if pick is None
        else out.logits.reshape(B, -1, out.logits.shape[-1])
    )
    return Captured(weights=weights, rows=all_rows, logits=logits)


def _eager_rows(attentions, rows, layers, device) -> dict:
    """The wanted layers' rows of an eager pass's attentions, float32 at least (float64 kept)."""
    wanted = range(len(attentions)) if layers is None else layers
    weights = {}
    for layer in wanted:
        full = attentions[layer]  # (B, H, T, S)
        full = full if full.dtype in (torch.float32, torch.float64) else full.float()
        if rows is None:
            weights[layer] = full
        else:
            B, H, _, S = full.shape
            index = rows.to(device)[:, None, :, None].expand(B, H, rows.shape[1], S)
            weights[layer] = full.gather(2, index)  # (B, H, R, S)
    return weights
