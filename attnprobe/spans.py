"""Spans and items: character spans to token ranges, a referent span's words, and a fixed spread
order of items."""

from __future__ import annotations

import hashlib
import re

ARTICLE = re.compile(r"^(the|a|an)\s+", re.IGNORECASE)


def spread_key(item_id: str) -> str:
    """A fixed pseudo-random order of items (by hash), so a subset spreads over slot values."""
    return hashlib.sha256(item_id.encode()).hexdigest()


def token_spans(
    offsets: list[tuple[int, int]], spans: dict[str, tuple[int, int]]
) -> dict[str, tuple[int, int]]:
    """Token range [start, end) of each character span: the tokens that overlap it.

    `offsets` are the tokenizer's (char_start, char_end) per token; special tokens have (0, 0)
    and never belong to a span. A span no token overlaps maps to (-1, -1).
    """
    result = {}
    for name, (char_start, char_end) in spans.items():
        hits = [i for i, (s, e) in enumerate(offsets) if e > s and s < char_end and e > char_start]
        result[name] = (hits[0], hits[-1] + 1) if hits else (-1, -1)
    return result


def candidate_words(prompt, span: str) -> str | None:
    """A referent span's words without a leading article, with the space before them."""
    if span not in prompt.spans:
        return None
    words = ARTICLE.sub("", prompt.text[slice(*prompt.spans[span])].strip())
    return " " + words if words else None
