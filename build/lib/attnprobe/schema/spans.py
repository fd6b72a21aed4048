"""Spans and items: character spans to token ranges, a referent span's words, a fixed spread
order of items, and the notes on spans at the first token (a sink, or left out by first_token)."""

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


def sink_notes(suite, encoded) -> list[str]:
    """A warning for each attention target on the first token (with first_token: keep: models park
    attention there, so weight on it says little about the span), and for each span that
    first_token: exclude leaves without a token (the first token alone): those prompts drop out."""
    sinks, dropped = {}, {}
    targets = {t for m in suite.attention for t in m.targets}
    for e in encoded:
        for name in targets & {n for n, (start, _) in e.spans.items() if start == 0}:
            sinks.setdefault(name, []).append(e.prompt)
        for name in e.prompt.spans.keys() - e.spans.keys():
            dropped.setdefault(name, []).append(e.prompt)
    said = lambda found: f"{len(found)} prompt(s) (e.g. {found[0].origin}: {found[0].text!r})"
    return [
        f"attention target '{name}' sits on the first token in {said(found)}, where most models park "
        "attention (a sink); set first_token: bos (prepend the model's BOS token) or exclude in the suite"
        for name, found in sinks.items()
        if suite.first_token == "keep"
    ] + [
        f"first_token: exclude leaves span '{name}' no token in {said(found)}: it is the first token "
        "alone; those prompts drop out of measures of that span; use first_token: bos to keep them"
        for name, found in dropped.items()
    ]
