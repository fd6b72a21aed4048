"""Executing a plan: the per-batch kernel (one forward, every measure read from it), the example
prompts for the attention view, and the deferred Ctrl-C. Returns data; writes nothing.
"""

from __future__ import annotations

import base64
import signal
from contextlib import contextmanager

import torch

from ..capture import pad_right, run_with_capture
from ..measures import BATCH_KINDS
from ..models import ProbeModel
from ..packing import run_with_shared_prefixes
from ..suite import Suite
from .plan import Encoded


def measure_batch(
    pm: ProbeModel, suite: Suite, batch: list[Encoded], context: dict, packs: list[int] | None = None
) -> dict:
    """Every per-batch measure kind's part for one batch ({kind name: part}), from a single
    forward pass that captures what all of them asked for. `packs`: the sizes of the packs of
    consecutive prompts forwarded as one row each, every shared prefix once (see plan.Batch)."""
    asked, states = {}, {}
    for kind in BATCH_KINDS:
        keywords, states[kind.NAME] = kind.request(suite, batch)
        assert not set(keywords) & set(asked), f"{kind.NAME} asks for capture arguments another kind sets"
        asked.update(keywords)
    if packs:
        prompts = iter(batch)
        rows = [[next(prompts).forward_ids for _ in range(size)] for size in packs]
        captured = run_with_shared_prefixes(pm, rows, pm.tokenizer.pad_token_id, **asked)
    else:
        ids, mask = pad_right([e.forward_ids for e in batch], pm.tokenizer.pad_token_id)
        captured = run_with_capture(pm, ids, mask, **asked)
    return {
        kind.NAME: kind.read(pm, suite, batch, captured, states[kind.NAME], context) for kind in BATCH_KINDS
    }


def pack_weights(weights: torch.Tensor) -> tuple[list[int], str]:
    """(L, H, T, T) weights in [0, 1] for the attention view: quantised to uint16 (error <= 8e-6)
    and base64-encoded, compact and quick to write."""
    quantised = torch.round(weights.clamp(0, 1) * 65535).to(torch.int32).numpy().astype("<u2")
    return list(quantised.shape), base64.b64encode(quantised.tobytes()).decode()


def example_attention(
    pm: ProbeModel, encoded: list[Encoded], contrast: str | None, n_items: int = 2
) -> list[dict]:
    """Full attention (every layer, head, row) of a few prompts, for the report's attention view:
    every variant of the first item of the first and of the last template."""
    templates = list(dict.fromkeys(e.prompt.template_id for e in encoded))
    wanted_templates = list(dict.fromkeys([templates[0], templates[-1]]))[:n_items]
    chosen = []
    for template in wanted_templates:
        first_item = next(e.prompt.item_id for e in encoded if e.prompt.template_id == template)
        chosen += [e for e in encoded if e.prompt.item_id == first_item]
    ids, mask = pad_right([e.ids for e in chosen], pm.tokenizer.pad_token_id)
    captured = run_with_capture(pm, ids, mask)  # one batch, every row
    weights = torch.stack(
        [captured.weights[layer] for layer in sorted(captured.weights)], dim=1
    )  # (B, L, H, T, T)
    examples = []
    for b, e in enumerate(chosen):
        T = len(e.ids)
        shape, packed = pack_weights(weights[b, :, :, :T, :T])
        examples.append(
            {
                "prompt_id": e.prompt.prompt_id,
                "item_id": e.prompt.item_id,
                "text": e.prompt.text,
                "label": str(e.prompt.meta.get(f"{contrast}_label", "")),
                "tokens": [pm.tokenizer.decode([i]) for i in e.ids],
                "spans": e.spans,
                "shape": shape,
                "weights_u16_base64": packed,
            }
        )
    return examples


@contextmanager
def deferred_interrupt(log):
    """The first Ctrl-C asks the loop to stop after the current chunk; a second one stops at once."""
    requested = []

    def handler(signum, frame):
        if requested:
            raise KeyboardInterrupt
        requested.append(signum)
        log("interrupt: finishing the current chunk, then stopping (Ctrl-C again to stop at once)")

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: no handler, Ctrl-C behaves as usual
        yield lambda: False
        return
    try:
        yield lambda: bool(requested)
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def ignored_interrupts():
    """Ctrl-C does nothing inside (main thread only): for the last write before stopping."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
