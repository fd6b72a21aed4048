"""Attention rows of long documents: chunked prefill over recorded keys and values.

A document of T tokens is forwarded in chunks of C positions. At every layer a chunk's queries
attend to the keys and values earlier chunks left there (kept by `_Store` as the model computed
them, rotary positions applied) and to the chunk's own, under the mask the layer declares
(`model.anatomy.window_of`): causal, and within its sliding window or attention chunk. Only the query
rows asked for are recorded (capture's row recording). Memory:

  recorded weights  O(layers x heads x rows x T)
  key/value store   O(layers x kv heads x kept keys x D), kept = T for full layers, the window
                    or chunk for the others
  one chunk         O(C x kept keys) for the mask; torch's CPU SDPA works in blocks

never T x T. Exactness: a chunked forward computes every query at the same positions with the same
keys as one forward of the whole text; only the order of floating-point sums differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.capture import ATTN_IMPLEMENTATION, editing, recording
from ..errors import CaptureError
from ..model import ProbeModel
from ..model.anatomy import attention_modules, module_of, window_of
from ..model.footprint import available_memory

CHUNK_TOKENS = 1024  # positions per forward of the prefill


@dataclass(frozen=True)
class _Layer:
    window: int | None  # a query sees itself and window - 1 earlier keys
    chunk: int | None  # a query sees the keys of its own block of `chunk` positions

    def first_visible(self, position: int) -> int:
        """The earliest key a query at `position` sees."""
        if self.window:
            return max(0, position - self.window + 1)
        if self.chunk:
            return position // self.chunk * self.chunk
        return 0

    def visible(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """(Tq, S) bool: query position i sees key position j (absolute positions)."""
        i, j = queries[:, None], keys[None, :]
        keep = j <= i
        if self.window:
            keep &= j > i - self.window  # transformers' sliding_window_overlay
        if self.chunk:
            keep &= (j // self.chunk) == (i // self.chunk)
        return keep


def layer_masks(model) -> list[_Layer]:
    """The window or chunk of every attention layer, from the family's declared facts."""
    config = module_of(model).config.get_text_config()
    return [_Layer(*window_of(m, config, layer)) for layer, m in enumerate(attention_modules(model))]


class _Store:
    """Each layer's keys and values of the positions computed so far that a later query can see."""

    def __init__(self, layers: list[_Layer]):
        self.layers = layers
        self.keys: list[torch.Tensor | None] = [None] * len(layers)  # (1, Hkv, kept, D)
        self.values: list[torch.Tensor | None] = [None] * len(layers)
        self.start = [0] * len(layers)  # absolute position of the first kept key
        self.begin, self.end = 0, 0  # the chunk being computed: positions [begin, end)

    def __call__(self, layer: int, key, value, mask):
        """capture's prefix hook: the chunk's keys after the kept ones, and the mask of absolute
        positions (the model's own mask describes the chunk alone and is replaced)."""
        if mask is not None and mask.dtype != torch.bool:  # ALiBi and other additive biases
            raise CaptureError(
                "this model adds a bias to its attention mask; chunked reading keeps only the mask"
            )
        if self.keys[layer] is not None:
            key = torch.cat([self.keys[layer], key], 2)  # (1, Hkv, S, D)
            value = torch.cat([self.values[layer], value], 2)
        kind = self.layers[layer]
        queries = torch.arange(self.begin, self.end, device=key.device)
        keys = torch.arange(self.start[layer], self.end, device=key.device)
        keep = kind.visible(queries, keys)[None, None]  # (1, 1, C, S)
        first = kind.first_visible(self.end)  # what the next chunk's first query sees
        drop = first - self.start[layer]
        self.keys[layer], self.values[layer] = key[:, :, drop:], value[:, :, drop:]
        self.start[layer] = first
        return key, value, keep


def long_blocker(model) -> str | None:
    """Why `model` cannot read a long text in chunks, or None."""
    module = model.model if isinstance(model, ProbeModel) else model
    text = module.config.get_text_config()
    if module.config._attn_implementation != ATTN_IMPLEMENTATION:
        return f"'{text.model_type}' attention bypasses attnprobe's attention function"
    other = sorted(
        set(getattr(text, "layer_types", None) or ())
        - {"full_attention", "sliding_attention", "chunked_attention"}
    )
    if other:
        return f"'{text.model_type}' has {', '.join(other)} layers, which keep no plain key/value cache"
    return None


def memory_estimate(
    model: ProbeModel, T: int, rows: int, n_layers: int | None = None, chunk: int = CHUNK_TOKENS
) -> int:
    """Bytes a chunked read of `rows` query rows over T tokens holds besides the model: recorded
    weights (float32), the key/value store, one chunk's masks and MLP activations, with a
    factor 2 for temporaries."""
    config = model.model.config.get_text_config()
    layers = layer_masks(model)
    H = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or H
    D = getattr(config, "head_dim", None) or config.hidden_size // H
    width = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    item = torch.finfo(model.dtype).bits // 8
    kept = [T if not (k.window or k.chunk) else min(T, (k.window or k.chunk) + chunk) for k in layers]
    store = sum(2 * kv * n * D * item for n in kept)
    recorded = (n_layers or len(layers)) * H * rows * T * 4
    chunk_work = chunk * max(kept) + 3 * chunk * width * item + 3 * rows * H * T * 4
    return store + recorded + 2 * chunk_work


def check_fits(needed: int, what: str, available: int | None = None) -> None:
    """One line refusing a job whose estimated peak exceeds the memory the system can give."""
    available = available_memory() if available is None else available
    if available is not None and needed > available:
        raise CaptureError(
            f"{what} needs about {needed / 2**30:.1f} GiB besides the model, and this machine has "
            f"{available / 2**30:.1f} GiB available; ask for fewer rows or layers, or a shorter text"
        )


@torch.inference_mode()
def read_rows(
    model: ProbeModel,
    input_ids: torch.Tensor,  # (T,) one document
    rows,  # query positions to record
    layers=None,  # iterable of layer indices; None: every layer
    chunk: int = CHUNK_TOKENS,
    available: int | None = None,  # bytes (for tests); None: what the system reports
) -> dict[int, torch.Tensor]:
    """layer -> (H, R, T) float32 attention weights of the query rows `rows` (sorted as given),
    computed by chunked prefill (see the module doc)."""
    blocker = long_blocker(model)
    if blocker:
        raise CaptureError(
            f"cannot read a long text in chunks: {blocker}; use a text that fits in one forward"
        )
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    T = len(ids)
    if model.info.max_positions and T > model.info.max_positions:
        raise CaptureError(
            f"the text has {T:,} tokens, more than the model's context of "
            f"{model.info.max_positions:,}; shorten it"
        )
    rows = torch.as_tensor(list(rows), dtype=torch.long)
    if rows.numel() == 0 or rows.min() < 0 or rows.max() >= T:
        raise CaptureError(f"rows must be query positions in [0, {T}), got {rows.tolist()[:5]}")
    if chunk < 1:
        raise CaptureError(f"chunk must be at least 1 token, got {chunk}")
    kinds = layer_masks(model)
    wanted = range(len(kinds)) if layers is None else sorted(set(layers))
    check_fits(
        memory_estimate(model, T, len(rows), len(wanted), chunk),
        f"reading {len(rows)} rows of {len(wanted)} layers over {T:,} tokens",
        available,
    )
    config = model.model.config.get_text_config()
    out = {layer: torch.zeros(config.num_attention_heads, len(rows), T) for layer in wanted}
    store = _Store(kinds)
    device = model.device
    for begin in range(0, T, chunk):
        end = min(T, begin + chunk)
        store.begin, store.end = begin, end
        starts = list(store.start)  # each layer's first key in this chunk's recorded weights
        inside = ((rows >= begin) & (rows < end)).nonzero().flatten()
        with recording(
            rows[inside][None] - begin if len(inside) else None, wanted if len(inside) else ()
        ) as plan:
            with editing(None, store):
                model.model(
                    input_ids=ids[None, begin:end].to(device),
                    position_ids=torch.arange(begin, end, device=device)[None],
                    use_cache=False,
                    logits_to_keep=1,
                )
        for layer, weights in plan.weights.items():  # (1, H, r, S): keys starts[layer] .. end - 1
            out[layer][:, inside, starts[layer] : end] = weights[0].float().cpu()
    return out
