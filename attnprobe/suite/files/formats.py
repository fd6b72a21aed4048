"""Published benchmark files read as distributed: the formats a sentences entry names instead of
spelling out its columns or roles. A new published format is one entry of FORMATS (and a reader when
its file is not rows of CSV, TSV or JSONL).

  columns: stereoset    StereoSet's JSON (Nadeem et al., ACL 2021; dev.json): each example of
                        data.intrasentence is one row, its three sentences under their gold labels
                        (stereotype, anti-stereotype, unrelated) as the sentence columns, its id,
                        target, bias_type and context (with BLANK) as metadata. An example is one item
                        keyed by its id (a file written on one line reads as the same file indented);
                        messages name the line of the example's id.
  columns: crows_pairs  CrowS-Pairs' CSV (Nangia et al., EMNLP 2020): sent_more and sent_less, labelled
                        `more` and `less`; its other columns (bias_type, stereo_antistereo) metadata.
  choices: bbq          BBQ's JSONL (Parrish et al., Findings of ACL 2022): context, question,
                        ans0-ans2, label, question_polarity, context_condition (choices.py reads the
                        target and unknown answers from answer_info).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from ...errors import SuiteError


@dataclass(frozen=True)
class Published:
    key: str  # the entry's key naming it: `columns` (sentence column -> label), `choices` (role -> column)
    mapping: dict  # what naming it stands for
    read: Callable | None = None  # (path, text) -> [(line, record)] where the file is not rows
    item: str | None = None  # the record field keying an item (else the row)


def named(item: dict, key: str) -> Published | None:
    """The published format the entry names under `key`, or None."""
    value = item.get(key)
    found = FORMATS.get(value) if isinstance(value, str) else None
    return found if found is not None and found.key == key else None


def names(key: str) -> str:
    return ", ".join(name for name, f in FORMATS.items() if f.key == key)


def stereoset_rows(path, text: str) -> list[tuple[int, dict]]:
    """(line, record) per example of StereoSet's data.intrasentence: the three sentences under their
    gold labels, the example's other plain fields as metadata."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SuiteError(
            f"{path}:{exc.lineno}: invalid JSON ({exc.msg}); give StereoSet's file as distributed"
        ) from None
    except RecursionError:
        raise SuiteError(
            f"{path}:1: JSON nested too deep to read; give StereoSet's file as distributed"
        ) from None
    examples = _intrasentence(path, doc)
    rows, line, at, seen = [], 1, 0, {}
    for k, example in enumerate(examples, start=1):
        raw = example.get("id") if isinstance(example, dict) else None
        key = (
            str(raw) if isinstance(raw, (str, int)) and not isinstance(raw, bool) and str(raw).strip() else ""
        )
        found = text.find(json.dumps(key), at) if key else -1
        if found >= 0:  # the example's line (for messages), counted on from the previous one
            line, at = line + text.count("\n", at, found), found
        where = f"{path}:{line}: example {k}"
        if not key:
            got = "has no `id`" if raw in (None, "") else f"has the id {json.dumps(raw)[:40]}, not a string"
            raise SuiteError(
                f"{where} {got}; each example is one item keyed by its id (a string, as distributed)"
            )
        if key in seen:
            raise SuiteError(f"{where} repeats id {key!r} of example {seen[key]}; each id names one example")
        seen[key] = k
        sentences = example.get("sentences") if isinstance(example, dict) else None
        if not isinstance(sentences, list):
            raise SuiteError(f"{where} has no `sentences` list; give StereoSet's file as distributed")
        record = {f: v for f, v in example.items() if isinstance(v, (str, int, float)) and f != "sentences"}
        for sentence in sentences:
            label = sentence.get("gold_label") if isinstance(sentence, dict) else None
            if (
                label not in STEREOSET_LABELS
                or not isinstance(sentence.get("sentence"), str)
                or label in record
            ):
                raise SuiteError(
                    f"{where}: each sentence needs a `sentence` and a gold_label, one each of stereotype, "
                    "anti-stereotype and unrelated"
                )
            record[label] = sentence["sentence"]
        rows.append((line, record))
    return rows


def _intrasentence(path, doc) -> list:
    """StereoSet's data.intrasentence examples, or one line saying what the file holds instead."""
    data = doc.get("data") if isinstance(doc, dict) else None
    examples = data.get("intrasentence") if isinstance(data, dict) else None
    other = isinstance(data, dict) and bool(data.get("intersentence"))
    if isinstance(examples, list) and (examples or not other):
        return examples  # an empty list: the suite says it holds no sentences
    found = "no data.intrasentence list" if not isinstance(examples, list) else "data.intrasentence is empty"
    raise SuiteError(
        f"{path}: {found}"
        + ("; its examples are all data.intersentence (a context, then a sentence after it)" if other else "")
        + "; `columns: stereoset` reads the intrasentence examples (a sentence with a BLANK and three "
        "fillings) of StereoSet's dev.json as distributed"
    )


STEREOSET_LABELS = ("stereotype", "anti-stereotype", "unrelated")
FORMATS = {
    "stereoset": Published("columns", {label: label for label in STEREOSET_LABELS}, stereoset_rows, "id"),
    "crows_pairs": Published("columns", {"sent_more": "more", "sent_less": "less"}),
    "bbq": Published(
        "choices",
        {
            "context": "context",
            "question": "question",
            "options": ["ans0", "ans1", "ans2"],
            "answer": "label",
            "polarity": "question_polarity",
            "condition": "context_condition",
            "format": "bbq",
        },
    ),
}
