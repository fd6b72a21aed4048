"""Rows that hold several sentences: benchmarks of sentence pairs or sets, read as distributed.

A sentences entry with `columns: {sent_more: more, sent_less: less}` (CrowS-Pairs' CSV) reads each
row as one item with one prompt per listed column, the column's label going to the entry's label
column (`version`, or `column:`); the row's other columns are metadata of every prompt (e.g.
bias_type). The sentences of a row differ in a few words: two spans are computed from the words
(whitespace-separated) the row's sentences share at the start and at the end:

  differ   the words between, where this sentence differs from the others ("women", "men")
  shared   the words after them, the same in every sentence of the row (absent when the
           sentences differ at their end)

so `attention: [{source: shared, targets: [differ]}]` reads how the shared words attend to the
group word, and the likelihood measure scores the shared words conditioned on it.

`columns:` may instead name a published format (formats.FORMATS: `stereoset`, `crows_pairs`).
"""

from __future__ import annotations

import re

from ...errors import SuiteError
from .formats import named, names

WORD = re.compile(r"\S+")
SPANS = ("differ", "shared")


def parse_columns(ctx, item) -> dict[str, str] | None:
    """The entry's `columns:` mapping (sentence column -> its label), or None."""
    columns = item.get("columns")
    if columns is None:
        return None
    published = named(item, "columns")
    if published is not None:
        columns = published.mapping
    if (
        not isinstance(columns, dict)
        or len(columns) < 2
        or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in columns.items())
        or len(set(columns.values())) != len(columns)
    ):
        ctx.fail(
            item,
            "columns",
            "`columns` maps each column holding one of a row's sentences to its label, at least two, "
            f"e.g. {{sent_more: more, sent_less: less}}, or names a published format: {names('columns')}",
        )
    if "spans" in item or "optional_spans" in item or "pair" in item or "files" in item:
        ctx.fail(item, "columns", "an entry with `columns` takes one `file:`; its spans are computed")
    return dict(columns)


def expand_rows(rows: list, columns: dict[str, str], label: str) -> tuple[list, dict]:
    """One row per (file row, sentence column), its text that column's sentence and `label` its
    label; and the computed spans of each new row's record (keyed by the record's id)."""
    out, spans = [], {}
    for path, number, record in rows:
        texts = []
        for column in columns:
            text = record.get(column)
            if not isinstance(text, str) or not text.strip():
                raise SuiteError(
                    f"{path}:{number}: column '{column}' holds no sentence; fill it or drop the row"
                )
            texts.append(text.strip())
        computed = diff_spans(texts)
        if computed is None:
            raise SuiteError(f"{path}:{number}: the row's sentences are identical; drop the row")
        meta = {k: v for k, v in record.items() if k not in columns and k != "text"}
        for value, text, found in zip(columns.values(), texts, computed):
            new = {**meta, "text": text, label: value}
            out.append((path, number, new))
            spans[id(new)] = found
    return out, spans


def diff_spans(texts: list[str]) -> list[dict[str, tuple[int, int]]] | None:
    """Per sentence, the character spans `differ` and (when non-empty) `shared`: the words after
    the longest common word prefix and before the longest common word suffix of all sentences, and
    that suffix. None when the sentences are identical."""
    words = [[(m.start(), m.end(), m.group()) for m in WORD.finditer(t)] for t in texts]
    tokens = [[w for *_, w in ws] for ws in words]
    shortest = min(map(len, tokens))
    prefix = 0
    while prefix < shortest and len({t[prefix] for t in tokens}) == 1:
        prefix += 1
    suffix = 0
    while suffix < shortest - prefix and len({t[len(t) - 1 - suffix] for t in tokens}) == 1:
        suffix += 1
    if all(len(t) == prefix + suffix for t in tokens):
        return None
    out = []
    for ws in words:
        middle = ws[prefix : len(ws) - suffix]
        found = {}
        if middle:
            found["differ"] = (middle[0][0], middle[-1][1])
        if suffix:
            found["shared"] = (ws[len(ws) - suffix][0], ws[-1][1])
        out.append(found)
    return out
