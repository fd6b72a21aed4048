"""Executing a plan: the per-batch kernel (one forward, every measure read from it), the example
prompts for the attention view, progress, and the deferred Ctrl-C. Returns data; writes nothing.
"""

from __future__ import annotations

import base64
import os
import signal
import sys
from contextlib import contextmanager

import torch

from ..capture import pad_right, run_with_capture
from ..measures import attention as attention_measure
from ..measures import next_token as next_token_measure
from ..models import ProbeModel
from ..suite import Suite
from .plan import Encoded


def measure_batch(pm: ProbeModel, suite: Suite, batch: list[Encoded], cand_ids: dict) -> tuple[list, dict]:
    """Attention blocks (prompt_id, source, target, L*H weights) and log-probability rows (as
    column lists) for one batch, from a single forward pass."""
    ids, mask = pad_right([e.forward_ids for e in batch], pm.tokenizer.pad_token_id)

    # Rows to capture: the tokens of every source span, per prompt; padded by repeating the first.
    rows_per_prompt = [attention_measure.source_rows(suite.attention, e.spans) or [0] for e in batch]
    R = max(len(r) for r in rows_per_prompt)
    rows = torch.tensor([r + [r[0]] * (R - len(r)) for r in rows_per_prompt])  # (B, R)
    positions = next_token_measure.logit_positions(batch)
    captured = run_with_capture(pm, ids, mask, rows=rows, layers=None if suite.attention else [],
                                logit_positions=torch.tensor(positions) if positions else None)

    blocks = []
    if suite.attention:
        W = torch.stack([captured.weights[layer] for layer in sorted(captured.weights)])  # (L, B, H, R, S)
        blocks = attention_measure.blocks(suite.attention, batch, rows_per_prompt, W)
    return blocks, next_token_measure.logprobs(pm, batch, captured.logits, positions, cand_ids)


def example_attention(pm: ProbeModel, encoded: list[Encoded], contrast: str | None, n_items: int = 2) -> list[dict]:
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
    weights = torch.stack([captured.weights[layer] for layer in sorted(captured.weights)], dim=1)  # (B, L, H, T, T)
    examples = []
    for b, e in enumerate(chosen):
        T = len(e.ids)
        # weights in [0, 1] quantised to uint16 (error <= 8e-6) and base64-encoded: compact and quick to write
        quantised = torch.round(weights[b, :, :, :T, :T].clamp(0, 1) * 65535).to(torch.int32).numpy().astype("<u2")
        examples.append({
            "prompt_id": e.prompt.prompt_id, "text": e.prompt.text, "label": str(e.prompt.meta.get(f"{contrast}_label", "")),
            "tokens": [pm.tokenizer.decode([i]) for i in e.ids], "spans": e.spans,
            "shape": list(quantised.shape), "weights_u16_base64": base64.b64encode(quantised.tobytes()).decode(),
        })
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


def progress_bar(total: int, initial: int, enabled: bool | None, unit: str = "prompt", desc: str = "attnprobe run"):
    from tqdm import tqdm

    if enabled is None:
        enabled = sys.stderr.isatty() and not os.environ.get("CI")
    return tqdm(total=total, initial=initial, disable=not enabled, unit=unit, desc=desc, dynamic_ncols=True, smoothing=0.1)
