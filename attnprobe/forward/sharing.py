"""When a model's keys and values of shared positions can be computed once and reused, exactly.

Two users: the run packs prompts with common prefixes into one sequence (packing.run_with_shared_prefixes),
and batched patching leaves out the clean prefix of x and x' and reads its recorded keys and values
(intervene/engine.py). Both are exact only when every position sees every earlier one as a plain forward
would: no sliding window or attention chunk that the sequence reaches, and attention layers only.
"""

from __future__ import annotations

from ..attention.logits import predictions_edited
from ..model import routes_attention


def prefix_sharing_blocker(config, longest: int) -> str | None:
    """Why keys and values of shared positions cannot be computed once for sequences of up to
    `longest` tokens, or None when they can: the family's attention must go through attnprobe's
    function (which packs or prepends them), every layer must be an attention layer with plain keys
    and values, and no sequence may reach a sliding window or an attention chunk (the mask would then
    hide keys from some positions that a shared computation shows); nor may an edit acting at the
    predictions a pass reads be applied (attention.logits.predictions_edited)."""
    text = config.get_text_config()
    if predictions_edited():  # one sequence's prediction may be a position another runs through
        return "an edit acting at the prediction alone is applied"
    if not routes_attention(config):
        return f"'{text.model_type}' attention bypasses attnprobe's attention function"
    other = sorted(set(getattr(text, "layer_types", None) or ()) - {"full_attention", "sliding_attention"})
    if other:
        return f"'{text.model_type}' has {', '.join(other)} layers, which keep no plain key/value cache"
    for name in ("sliding_window", "attention_chunk_size"):
        window = getattr(text, name, None)
        if isinstance(window, int) and longest >= window - 1:
            return f"prompts of up to {longest} tokens reach its {name.replace('_', ' ')} of {window}"
    return None
