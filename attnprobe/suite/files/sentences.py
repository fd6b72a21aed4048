"""Explicit sentence files whose spans are [bracketed]: TSV, CSV or JSONL with a `text` column, or
plain text with one sentence per line (optionally numbered, as published benchmarks are).

A bracket is named inline (`[occupation: The developer]`) or by position through the entry's
`spans:` list, so lines may carry different spans. `mark: {span: slot}` marks the first word of a
slot's values that no bracket covers (a second occupation, without editing the data). Other
columns become prompt metadata. Each row is its own item, unless the entry names a `pair` column
(rows with equal values form one item) or lists several `files:` (line n of each file forms one
item, the file's key going to column `version` or the entry's `column`), compared through the
suite's analysis contrast.
"""

from __future__ import annotations

import re
from collections import Counter

from ...errors import SuiteError
from ...schema.keys import BLOCKS
from ...schema.yamllines import Seq, number_or_text, required_str
from ..types import Prompt
from .choices import choice_rows, parse_choices
from .columns import expand_rows, parse_columns
from .formats import named
from .rows import check_pairing, line_reader, read_rows

MAX_SPANS = 64  # bracketed spans in one sentence: each becomes columns of prompts.csv
_BRACKET = re.compile(r"\[([^\[\]]+)\]")


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NAMED = re.compile(r"([A-Za-z_][A-Za-z0-9_]*):\s+(.+)", re.S)  # [name: words]


def load_sentence_sets(ctx, node: Seq, template_ids, slots=None, max_lines: int | None = None) -> list[dict]:
    """The `sentences:` entries, each file read whole once (refused before parsing when it has more
    lines than `max_lines`, the suite's max_prompts)."""
    sets = []
    for i, item in enumerate(node):
        if not isinstance(item, dict):
            ctx.fail(node, i, "each `sentences` entry is a mapping with `id:`, `file:` and `spans:`")
        ctx.check_keys(item, BLOCKS["sentences"], " in a sentences entry")
        set_id = required_str(ctx, item, "id")
        if set_id in template_ids or any(s["id"] == set_id for s in sets):
            ctx.fail(item, "id", f"duplicate id '{set_id}'; template and sentence ids must be unique")
        required, names = _span_names(ctx, item)
        reader, files = line_reader(ctx, item), _files(ctx, item)
        column = str(item.get("column", "version"))
        sentence_columns, published = parse_columns(ctx, item), named(item, "columns")
        choice_roles = parse_choices(ctx, item)
        needed = (choice_roles["context"], choice_roles["question"]) if choice_roles else ("text",)
        rows = _read_files(ctx, item, files, max_lines, published, reader, tuple(sentence_columns or needed))
        pair = item.get("pair")
        if pair is not None and (not isinstance(pair, str) or pair not in rows[0][2]):
            ctx.fail(
                item,
                "pair",
                f"`pair` must name a column of the sentence file (columns: {', '.join(rows[0][2])})",
            )
        if published is not None and published.item is not None:
            pair = published.item  # an example is one item, keyed by its field whatever the file's layout
        if len(files) > 1:
            pair = "line"  # sentence n of every file is one item
            check_pairing(rows, column, reader is None)
        computed = {}
        if sentence_columns:  # a row's sentences are one item: key by the row's line number
            rows, computed = expand_rows(rows, sentence_columns, column)
        if choice_roles:  # a row's context and question are one prompt, its options metadata
            rows, computed = choice_rows(rows, choice_roles)
        sets.append(
            {
                "id": set_id,
                "names": list(names),
                "n_required": len(required),  # the others are optional: a line may leave them out, last first
                "span_counts": Counter(),  # lines by their count of unnamed spans (sentence_prompts)
                "unmarked": {},  # mark name -> lines where no word was found (sentence_prompts)
                "path": next(iter(files.values())),
                "rows": rows,
                "n_rows": len(rows),
                "pair": pair,
                "mark": _marks(ctx, item, slots or {}, "mark"),
                "lookup": _lookups(ctx, item, slots or {}),
                "computed": computed,  # spans computed from a row's sentences (columns.py), by record id
            }
        )
    return sets


def _span_names(ctx, item) -> tuple[list[str], list[str]]:
    """(the required span names, every span name: `spans:` then `optional_spans:`), each a column name."""
    names = item.get("spans", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        ctx.fail(
            item,
            "spans",
            "`spans` lists the names of the unnamed [bracketed] spans in order, e.g. [occupation, pronoun]",
        )
    optional = item.get("optional_spans", [])
    if not isinstance(optional, list) or not all(isinstance(n, str) for n in optional):
        ctx.fail(
            item,
            "optional_spans",
            "`optional_spans` lists the names of unnamed spans that follow `spans:` in some lines only, "
            "e.g. [pronoun_2]",
        )
    required, names = list(names), list(names) + list(optional)
    if len(set(names)) != len(names):
        ctx.fail(item, "spans", "span names must be unique")
    for name in names:
        if not _NAME.fullmatch(name):
            ctx.fail(
                item,
                "spans",
                f"span name {name!r} must be letters, digits and '_' (it names prompts.csv columns)",
            )
    return required, names


def _read_files(ctx, item, files: dict, max_lines, published, reader, needed) -> list:
    """(path, line number, record) of every row of the entry's files (a file's key, when several, in
    the entry's `column`)."""
    rows, column = [], str(item.get("column", "version"))
    for key, file_name in files.items():
        path, text = ctx.read_data(
            item, "files" if "files" in item else "file", file_name, max_lines=max_lines
        )
        if published is not None and published.read is not None:  # a file that is not rows
            file_rows = published.read(path, text)
        else:
            file_rows = read_rows(path, text, reader, needed)
        if not file_rows:
            ctx.fail(item, "files" if "files" in item else "file", f"{path.name} holds no sentences")
        for number, record in file_rows:
            if key is not None:
                record[column] = key
            rows.append((path, number, record))
    return rows


def _files(ctx, item) -> dict:
    """{key: file}: one file (key None), or `files: {pro: a.txt, anti: b.txt}`."""
    if ("file" in item) == ("files" in item):
        ctx.fail(
            item, None, "a sentences entry names one `file:` or several `files: {pro: a.txt, anti: b.txt}`"
        )
    if "file" in item:
        return {None: required_str(ctx, item, "file")}
    files = item["files"]
    if not isinstance(files, dict) or len(files) < 2 or not all(isinstance(f, str) for f in files.values()):
        ctx.fail(
            item,
            "files",
            "`files` maps each version to its file, e.g. {pro: type1-pro.txt, anti: type1-anti.txt}",
        )
    return {str(k): v for k, v in files.items()}


def _marks(ctx, item, slots, key) -> dict[str, list[str]]:
    """`mark: {other: occupation}` -> {other: words of the slot's values, longest first}."""
    marks = item.get(key) or {}
    if not isinstance(marks, dict):
        ctx.fail(item, key, f"`{key}` maps a span name to a slot, e.g. {{other: occupation}}")
    out = {}
    for name, slot in marks.items():
        if not _NAME.fullmatch(str(name)):
            ctx.fail(item, key, f"span name {name!r} must be letters, digits and '_'")
        if slot not in slots:
            ctx.fail(
                item,
                key,
                f"{key} '{name}' names slot '{slot}', which is not defined under slots: "
                f"({', '.join(slots) or 'none'})",
            )
        words = {text for value in slots[slot].values for text in value.forms.values()}
        out[str(name)] = sorted(words, key=len, reverse=True)
    return out


def _lookups(ctx, item, slots) -> dict[str, tuple[str, dict]]:
    """`lookup: {referent: occupation}` -> {referent: (slot, {lowercase word: slot value})}: a span's
    metadata from the slot value its words contain (referent_occupation, referent_bls_pct_female)."""
    spans = _marks(ctx, item, slots, "lookup")
    return {
        name: (
            str(item["lookup"][name]),
            {
                text.lower(): value
                for value in slots[item["lookup"][name]].values
                for text in value.forms.values()
            },
        )
        for name in spans
    }


def sentence_prompts(ctx, sentence_set, first_id) -> list[Prompt]:
    prompts = []
    for path, number, record in sentence_set["rows"]:
        where = f"{path}:{number}"
        if id(record) in sentence_set["computed"]:  # a sentence of a row (columns.py): taken literally
            text, spans = record["text"], dict(sentence_set["computed"][id(record)])
            found = {name: text[a:b] for name, (a, b) in spans.items()}
        else:
            text, spans, found = _parse_brackets(
                record["text"], sentence_set["names"], where, sentence_set["n_required"]
            )
        sentence_set["span_counts"][
            sum(not _NAMED.fullmatch(m.group(1)) for m in _BRACKET.finditer(record["text"]))
        ] += 1
        for name, words in sentence_set["mark"].items():
            if name in spans:
                raise SuiteError(f"{where}: span '{name}' is both bracketed and marked by `mark:`; keep one")
            hit = _find_word(text, words, spans.values())
            if hit:
                spans[name] = hit
                found[name] = text[hit[0] : hit[1]]
            else:
                sentence_set["unmarked"].setdefault(name, []).append(where)
        meta = {k: number_or_text(str(v)) for k, v in record.items() if k != "text"}
        for name, (slot, values) in sentence_set["lookup"].items():
            if name in found:
                value = _contained(found[name], values)
                if value is None:
                    raise SuiteError(
                        f"{where}: span '{name}' ({found[name][:80]!r}) contains no value of slot '{slot}'; "
                        "add it to the slot"
                    )
                meta[f"{name}_{slot}"] = "/".join(value.forms.values())
                meta.update({f"{name}_{k}": v for k, v in value.meta.items()})
        key = record[sentence_set["pair"]] if sentence_set["pair"] else number
        prompts.append(
            Prompt(
                prompt_id=first_id + len(prompts),
                item_id=f"{sentence_set['id']}|{key}",
                template_id=sentence_set["id"],
                text=text,
                slots=found,
                meta=meta,
                spans=spans,
                origin=where,
            )
        )
    return prompts


def _parse_brackets(
    marked: str, names: list[str], where: str, n_required: int | None = None
) -> tuple[str, dict, dict]:
    """Text without brackets, each span's character range, and its words. `[name: words]` names a
    span inline; the unnamed brackets of a line take `names` in order, at least the first
    `n_required` of them (default: all); a repeated name becomes name_2, ..."""
    n_required = len(names) if n_required is None else n_required
    if (
        marked.count("[") != marked.count("]")
        or _BRACKET.sub("", marked).count("[")
        or _BRACKET.sub("", marked).count("]")
    ):
        raise SuiteError(
            f"{where}: unbalanced or nested brackets; mark each span as [words] or [name: words]"
        )
    matches = list(_BRACKET.finditer(marked))
    if len(matches) > MAX_SPANS:
        raise SuiteError(
            f"{where}: {len(matches):,} bracketed spans, more than {MAX_SPANS} in one sentence; mark only "
            "the words a measure reads"
        )
    unnamed = [m for m in matches if not _NAMED.fullmatch(m.group(1))]
    # a line may also name every span inline
    if (unnamed or not matches) and not n_required <= len(unnamed) <= len(names):
        count = f"{n_required} to {len(names)}" if n_required < len(names) else f"{len(names)}"
        listed = f"`spans:` names {count} ({', '.join(names)})" if names else "the entry lists no `spans:`"
        raise SuiteError(
            f"{where}: {len(unnamed)} unnamed bracketed span(s) but {listed}; name them inline as [name: "
            "words] or list them"
        )
    positional = iter(names)
    text, spans, found, position, last = [], {}, {}, 0, 0
    occurrences: dict[str, int] = {}  # the next suffix to try per name: linear in repeated names
    for match in matches:
        named = _NAMED.fullmatch(match.group(1))
        name, words = (named.group(1), named.group(2)) if named else (next(positional), match.group(1))
        base = name
        while name in spans:
            occurrences[base] = occurrences.get(base, 1) + 1
            name = f"{base}_{occurrences[base]}"
        text.append(marked[last : match.start()])
        position += match.start() - last
        spans[name] = (position, position + len(words))
        found[name] = words
        text.append(words)
        position += len(words)
        last = match.end()
    text.append(marked[last:])
    return "".join(text), spans, found


def parse_marked(marked: str, where: str) -> tuple[str, dict, dict]:
    """A sentence with [brackets] outside any suite (attnprobe.probe): unnamed brackets are named
    span1, span2, ... in order; `[name: words]` keeps its name."""
    unnamed = [m for m in _BRACKET.finditer(marked) if not _NAMED.fullmatch(m.group(1))]
    return _parse_brackets(marked, [f"span{k + 1}" for k in range(len(unnamed))], where)


def _contained(words: str, values: dict):
    """The slot value whose text occurs in `words` as a whole word (the longest), or None."""
    hits = [text for text in values if re.search(rf"(?<!\w){re.escape(text)}(?!\w)", words, re.I)]
    return values[max(hits, key=len)] if hits else None


def _find_word(text: str, words: list[str], taken) -> tuple[int, int] | None:
    """The first whole-word, case-insensitive occurrence of any of `words` (longest first at a
    position) that overlaps no span in `taken`."""
    best = None
    for word in words:
        for match in re.finditer(rf"(?<!\w){re.escape(word)}(?!\w)", text, re.I):
            if not any(s < match.end() and match.start() < e for s, e in taken):
                if best is None or match.start() < best[0]:
                    best = (match.start(), match.end())
                break
    return best
