"""Reading a tokenizer: one place for the options every caller passes.

Each call reads the files afresh, but within `read_once()`: there a second read of the same source
with the same options returns the tokenizer the first read made (one command's plan and the model
loaded for it share one, as if it were handed on; Gemma 3's takes 4.4 s to read). A per-process
cache with a deep copy per caller (a tokenizer is mutable: padding side, pad token) was tried and
removed: copying Gemma 3's 262k-token tokenizer took 2.8 s, so a model loaded once paid both.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

_READ: ContextVar[dict | None] = ContextVar("tokenizers_read", default=None)


def read_tokenizer(source: str, offline: bool, trust_remote_code: bool, **kwargs):
    """AutoTokenizer.from_pretrained(source) with attnprobe's options (the hub only where not offline);
    inside `read_once()` the tokenizer this source already gave there."""
    from transformers import AutoTokenizer

    read, key = _READ.get(), (str(source), offline, trust_remote_code, tuple(sorted(kwargs.items())))
    if read is not None and key in read:
        return read[key]
    tokenizer = AutoTokenizer.from_pretrained(
        source, local_files_only=offline, trust_remote_code=trust_remote_code, **kwargs
    )
    if read is not None:
        read[key] = tokenizer
    return tokenizer


@contextmanager
def read_once():
    """Within the block (one command: its plan, then its model) each tokenizer is read once."""
    token = _READ.set({} if _READ.get() is None else _READ.get())
    try:
        yield
    finally:
        _READ.reset(token)
