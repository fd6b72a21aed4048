"""Attention views for notebooks (bertviz), fed by attnprobe's capture."""

from __future__ import annotations

from .capture import run_with_capture
from .errors import AttnprobeError
from .models import ProbeModel

MAX_TOKENS = 256  # bertviz's head view becomes unreadable (and slow) beyond a few hundred tokens


def head_view(model: ProbeModel, text: str, html_action: str = "view"):
    """bertviz's head view of one text: every layer and head, all rows.

    bertviz draws with require.js and d3 from a CDN, so it needs a Jupyter front end with network;
    the HTML report has an offline view of its own. `html_action="return"` returns the HTML object.
    """
    from bertviz import head_view as bertviz_head_view

    if not isinstance(text, str):
        raise AttnprobeError("head_view shows one text at a time (bertviz has no batch view); pass a single string")
    enc = model.tokenizer(text, return_tensors="pt")
    n_tokens = enc["input_ids"].shape[1]
    if n_tokens > MAX_TOKENS:
        raise AttnprobeError(f"text has {n_tokens} tokens; head_view is readable up to {MAX_TOKENS}: shorten the text")
    captured = run_with_capture(model, enc["input_ids"], enc["attention_mask"])
    attention = tuple(captured.weights[layer][:1] for layer in sorted(captured.weights))  # per layer (1, H, T, T)
    tokens = [model.tokenizer.decode([i]) for i in enc["input_ids"][0].tolist()]
    assert all(a.shape[-1] == len(tokens) for a in attention)  # bertviz's most common failure, checked early
    return bertviz_head_view(attention, tokens, html_action=html_action)
