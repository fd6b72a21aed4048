"""Tokenizers read once per process: a command that plans (the tokenizer alone) and then loads the
model, or a notebook that loads one model several times, parses tokenizer.json once. Each caller
gets its own copy (a tokenizer is mutable: padding side, pad token)."""

from __future__ import annotations

import copy
from collections import OrderedDict
from pathlib import Path

_READ: OrderedDict = OrderedDict()  # key -> the tokenizer as read
_KEPT = 4  # tokenizers kept (each a few MB)


def _files_signature(source: str) -> tuple:
    """(name, size, mtime) of each file of a local directory, so an edited or replaced tokenizer file is
    read again; () for a hub id (its cached revision does not change under a process)."""
    folder = Path(source)
    if not folder.is_dir():
        return ()
    return tuple(sorted((p.name, s.st_size, s.st_mtime_ns) for p in folder.iterdir() if (s := p.stat())))


def read_tokenizer(source: str, offline: bool, trust_remote_code: bool, **kwargs):
    """AutoTokenizer.from_pretrained(source), read from disk once per process for the same files and
    options (a tokenizer with remote code always afresh: its code may keep state)."""
    from transformers import AutoTokenizer

    read = lambda: AutoTokenizer.from_pretrained(
        source, local_files_only=offline, trust_remote_code=trust_remote_code, **kwargs
    )
    if trust_remote_code:
        return read()
    key = (str(source), offline, tuple(sorted(kwargs.items())), _files_signature(source))
    if key not in _READ:
        _READ[key] = read()
        while len(_READ) > _KEPT:
            _READ.popitem(last=False)
    _READ.move_to_end(key)
    return copy.deepcopy(_READ[key])
