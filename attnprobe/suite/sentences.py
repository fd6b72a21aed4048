"""Explicit sentence files (TSV, CSV or JSONL with a `text` column) whose spans are [bracketed].

Other columns become prompt metadata. Each row is its own item, unless the entry names a `pair`
column: rows with equal values there form one item (e.g. the pro- and anti-stereotypical versions
of one sentence), compared through the suite's analysis contrast (a column such as `version`).
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

from ..errors import SuiteError
from .types import Prompt
from ..yamllines import Seq, number_or_text, required_str


_BRACKET = re.compile(r"\[([^\[\]]+)\]")


def load_sentence_sets(ctx, node: Seq, template_ids) -> list[dict]:
    sets = []
    for i, item in enumerate(node):
        if not isinstance(item, dict):
            ctx.fail(node, i, "each `sentences` entry is a mapping with `id:`, `file:` and `spans:`")
        for key in item:
            if key not in ("id", "file", "spans", "pair"):
                ctx.fail(item, key, f"unknown key '{key}' in a sentences entry; allowed: file, id, pair, spans")
        set_id = required_str(ctx, item, "id")
        if set_id in template_ids or any(s["id"] == set_id for s in sets):
            ctx.fail(item, "id", f"duplicate id '{set_id}'; template and sentence ids must be unique")
        file_name = required_str(ctx, item, "file")
        names = item.get("spans")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            ctx.fail(item, "spans", "`spans` must list the names of the bracketed spans in order, e.g. [occupation, pronoun]")
        if len(set(names)) != len(names):
            ctx.fail(item, "spans", "span names must be unique")
        for name in names:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                ctx.fail(item, "spans", f"span name {name!r} must be letters, digits and '_' (it names prompts.csv columns)")
        path, text = ctx.read_data(item, "file", file_name)
        rows = _read_rows(path, text)
        if not rows:
            ctx.fail(item, "file", f"{path.name} holds no sentences")
        pair = item.get("pair")
        if pair is not None and (not isinstance(pair, str) or pair not in rows[0][1]):
            ctx.fail(item, "pair", f"`pair` must name a column of {path.name} (columns: {', '.join(rows[0][1])})")
        sets.append({"id": set_id, "names": list(names), "path": path, "rows": rows, "n_rows": len(rows), "pair": pair})
    return sets


def _read_rows(path: Path, text: str) -> list[tuple[int, dict]]:
    """(line number, record) for each sentence; JSONL objects or TSV/CSV rows with a `text` column."""
    if path.suffix == ".jsonl":
        rows = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SuiteError(f"{path}:{number}: invalid JSON ({exc.msg}); one object per line") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise SuiteError(f"{path}:{number}: each line needs a \"text\" string")
            rows.append((number, record))
        return rows
    delimiter = "\t" if path.suffix in (".tsv", ".tab") else ","
    lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip() and not line.startswith("#")]
    if not lines:
        return []
    # TSV cells are taken as written (a quote is text: "Hi," she said); CSV cells may be quoted
    quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
    header = next(csv.reader([lines[0][1]], delimiter=delimiter, quoting=quoting))
    if "text" not in header:
        raise SuiteError(f"{path}:{lines[0][0]}: the header needs a 'text' column (columns: {', '.join(header)})")
    rows = []
    for number, line in lines[1:]:
        cells = next(csv.reader([line], delimiter=delimiter, quoting=quoting))
        if len(cells) != len(header):
            raise SuiteError(f"{path}:{number}: {len(cells)} cells but the header has {len(header)}; fix the row")
        rows.append((number, dict(zip(header, cells))))
    return rows


def sentence_prompts(ctx, sentence_set, first_id) -> list[Prompt]:
    prompts = []
    names = sentence_set["names"]
    for number, record in sentence_set["rows"]:
        marked = record["text"]
        where = f"{sentence_set['path']}:{number}"
        if marked.count("[") != marked.count("]") or _BRACKET.sub("", marked).count("[") or _BRACKET.sub("", marked).count("]"):
            raise SuiteError(f"{where}: unbalanced or nested brackets; mark each span as [words]")
        found = _BRACKET.findall(marked)
        if len(found) != len(names):
            raise SuiteError(f"{where}: {len(found)} bracketed spans but `spans:` names {len(names)} ({', '.join(names)}); mark each once")
        text, spans, position, last = [], {}, 0, 0
        for name, match in zip(names, _BRACKET.finditer(marked)):
            text.append(marked[last:match.start()])
            position += match.start() - last
            spans[name] = (position, position + len(match.group(1)))
            text.append(match.group(1))
            position += len(match.group(1))
            last = match.end()
        text.append(marked[last:])
        meta = {k: number_or_text(str(v)) for k, v in record.items() if k != "text"}
        prompts.append(Prompt(
            prompt_id=first_id + len(prompts),
            item_id=f"{sentence_set['id']}|{record[sentence_set['pair']] if sentence_set['pair'] else number}",
            template_id=sentence_set["id"],
            text="".join(text),
            slots={name: marked_text for name, marked_text in zip(names, found)},
            meta=meta,
            spans=spans,
            origin=where,
        ))
    return prompts

