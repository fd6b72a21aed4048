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

`columns: stereoset` reads StereoSet's JSON as distributed (Nadeem et al., ACL 2021; dev.json):
each example of data.intrasentence is one row, its three sentences under their gold labels
(stereotype, anti-stereotype, unrelated) as the sentence columns, its id, target, bias_type and
context (with BLANK) as metadata. An example is one item keyed by its id (a file written on one
line reads as the same file indented); messages name the line of the example's id.
"""

from __future__ import annotations

import json
import re

from ..errors import SuiteError

WORD = re.compile(r"\S+")
SPANS = ("differ", "shared")
STEREOSET = {"stereotype": "stereotype", "anti-stereotype": "anti-stereotype", "unrelated": "unrelated"}


def parse_columns(ctx, item) -> dict[str, str] | None:
    """The entry's `columns:` mapping (sentence column -> its label), or None."""
    columns = item.get("columns")
    if columns is None:
        return None
    if columns == "stereoset":
        columns = STEREOSET
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
            "e.g. {sent_more: more, sent_less: less}, or is `stereoset` (StereoSet's JSON)",
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


def stereoset_rows(path, text: str) -> list[tuple[int, dict]]:
    """(line, record) per example of StereoSet's data.intrasentence: the three sentences under their
    gold labels, the example's other plain fields as metadata."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SuiteError(
            f"{path}:{exc.lineno}: invalid JSON ({exc.msg}); give StereoSet's file as distributed"
        ) from None
    data = doc.get("data") if isinstance(doc, dict) else None
    examples = data.get("intrasentence") if isinstance(data, dict) else None
    if not isinstance(examples, list):
        raise SuiteError(
            f"{path}: no data.intrasentence list; `columns: stereoset` reads StereoSet's dev.json as "
            "distributed"
        )
    rows, line, at, seen = [], 1, 0, {}
    for k, example in enumerate(examples, start=1):
        key = example.get("id") if isinstance(example, dict) else None
        key = str(key) if isinstance(key, (str, int)) and str(key).strip() else ""
        found = text.find(json.dumps(key), at) if key else -1
        if found >= 0:  # the example's line (for messages), counted on from the previous one
            line, at = line + text.count("\n", at, found), found
        where = f"{path}:{line}: example {k}"
        if not key:
            raise SuiteError(f"{where} has no `id`; each example is one item keyed by its id")
        if key in seen:
            raise SuiteError(f"{where} repeats id {key!r} of example {seen[key]}; each id names one example")
        seen[key] = k
        sentences = example.get("sentences") if isinstance(example, dict) else None
        if not isinstance(sentences, list):
            raise SuiteError(f"{where} has no `sentences` list; give StereoSet's file as distributed")
        record = {f: v for f, v in example.items() if isinstance(v, (str, int, float)) and f != "sentences"}
        for sentence in sentences:
            label = sentence.get("gold_label") if isinstance(sentence, dict) else None
            if label not in STEREOSET or not isinstance(sentence.get("sentence"), str) or label in record:
                raise SuiteError(
                    f"{where}: each sentence needs a `sentence` and a gold_label, one each of stereotype, "
                    "anti-stereotype and unrelated"
                )
            record[label] = sentence["sentence"]
        rows.append((line, record))
    return rows
