"""Reading a tokenizer: one place for the options every caller passes.

Each call reads the files afresh. A per-process cache with a deep copy per caller (a tokenizer is
mutable: padding side, pad token) was tried and removed: copying Gemma 3's 262k-token tokenizer took
2.8 s against 4.4 s to read it, so a model loaded once paid both, and SmolLM2's saved 0.07 s a read.
"""

from __future__ import annotations


def read_tokenizer(source: str, offline: bool, trust_remote_code: bool, **kwargs):
    """AutoTokenizer.from_pretrained(source) with attnprobe's options (the hub only where not offline)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        source, local_files_only=offline, trust_remote_code=trust_remote_code, **kwargs
    )
