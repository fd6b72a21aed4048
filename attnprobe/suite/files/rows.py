"""Reading one sentence file into rows: JSONL objects, TSV/CSV rows (CSV parsed as a whole file), or
plain-text lines (numbered as published benchmarks are, or split by a declared `pattern:` run with a
time budget); and the check that the files of one entry pair sentence n with sentence n."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import regex

from ...errors import SuiteError
from ...schema.yamllines import file_lines, number_or_text

PATTERN_SECONDS = 1.0  # time budget of a line pattern on one line


def check_pairing(rows: list, column: str, by_order: bool) -> None:
    """Files of one entry pair sentence n with sentence n: verified, never assumed. Unnumbered files
    pair by order (the n-th sentence, so a blank or comment line does not shift every pair after it);
    numbered files by their numbers, which must be the same in every file, once each."""
    per_file: dict[str, list] = {}
    for path, number, record in rows:
        per_file.setdefault(record[column], []).append((path, number, record))
    for entries in per_file.values():
        seen = {}
        for ordinal, (path, number, record) in enumerate(entries, start=1):
            if by_order:
                record["line"] = ordinal
            if record["line"] in seen:
                raise SuiteError(
                    f"{path}:{number}: sentence number {record['line']} appears twice in this file (first on "
                    f"line {seen[record['line']]}); each number pairs one sentence per file"
                )
            seen[record["line"]] = number
    (first, first_rows), *others = per_file.items()
    keys = {r["line"]: (p, n) for p, n, r in first_rows}
    for version, entries in others:
        other = {r["line"]: (p, n) for p, n, r in entries}
        if keys.keys() == other.keys():
            continue
        missing = [k for k in keys if k not in other] or [k for k in other if k not in keys]
        where, theirs = (keys, other) if missing[0] in keys else (other, keys)
        path, number = where[missing[0]]
        near = _nearest(missing[0], list(theirs))
        what = "sentences" if by_order else "numbers"
        raise SuiteError(
            f"{path}:{number}: sentence {missing[0]} has no counterpart in {theirs[near][0].name} (nearest "
            f"there: sentence {near} on line {theirs[near][1]}; {len(first_rows)} {first} and {len(entries)} "
            f"{version} sentences; {what} must match one to one); fix the files"
        )


def _nearest(key, keys: list):
    """The key of `keys` closest to `key` (numbers by distance, others the first)."""
    if all(isinstance(k, int) for k in [key, *keys]):
        return min(keys, key=lambda k: (abs(k - key), k))
    return keys[0]


def line_reader(ctx, item):
    """How a plain-text line becomes (key, sentence): `numbered: true` strips a leading number (the
    line's key); `pattern:` a regex with a `text` group (and optionally `key`)."""
    if item.get("numbered") and "pattern" in item:
        ctx.fail(item, "pattern", "give `numbered: true` or `pattern:`, not both")
    if item.get("numbered"):
        return regex.compile(r"\s*(?P<key>\d+)[\s.:)]+(?P<text>.*\S)\s*")
    if "pattern" in item:
        try:
            pattern = regex.compile(str(item["pattern"]))
        except regex.error as exc:
            ctx.fail(
                item, "pattern", f"invalid regular expression ({exc}); e.g. '^(?P<key>\\d+) (?P<text>.*)$'"
            )
        if "text" not in pattern.groupindex:
            ctx.fail(item, "pattern", "the pattern needs a named group (?P<text>...) for the sentence")
        return pattern
    return None


def read_rows(path: Path, text: str, reader=None, needed=("text",)) -> list[tuple[int, dict]]:
    """(line number, record) for each sentence: by the file's suffix (FORMATS: JSONL objects, TSV/CSV
    rows with a `text` column or the `needed` sentence columns), else plain-text lines (.txt, or a
    declared line reader), whose key goes to column `line`."""
    if reader is not None or path.suffix not in FORMATS:
        return line_rows(path, text, reader)
    return FORMATS[path.suffix](path, text, needed)


def line_rows(path: Path, text: str, reader=None) -> list[tuple[int, dict]]:
    """One sentence per non-blank line not starting with '#'; with `reader` (line_reader) its key and
    text from the line's match."""
    rows = []
    for number, line in enumerate(file_lines(text), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        if reader is None:
            rows.append((number, {"text": line.strip(), "line": number}))
            continue
        try:  # a pattern that backtracks catastrophically would hang on one line
            match = reader.fullmatch(line, timeout=PATTERN_SECONDS)
        except TimeoutError:
            raise SuiteError(
                f"{path}:{number}: the entry's `pattern` took over {PATTERN_SECONDS:g} s on this line "
                "(nested repetition such as (a+)+ backtracks exponentially); simplify the pattern"
            ) from None
        if not match:
            raise SuiteError(
                f"{path}:{number}: the line does not match the entry's line format (`numbered`: a "
                "number, "
                "then the sentence; or its `pattern`); fix the line or the entry"
            )
        key = match.groupdict().get("key")
        rows.append((number, {"text": match.group("text"), "line": number_or_text(key) if key else number}))
    return rows


MAX_LINE_CHARACTERS = 2**20  # a JSONL line: BBQ's longest is under 4,000
MAX_COLUMNS = 1_000  # a CSV or TSV header


def jsonl_rows(path: Path, text: str, needed=("text",)) -> list[tuple[int, dict]]:
    """One JSON object per non-blank line, with string fields `needed`."""
    rows = []
    for number, line in enumerate(file_lines(text), start=1):
        if not line.strip():
            continue
        if len(line) > MAX_LINE_CHARACTERS:
            raise SuiteError(
                f"{path}:{number}: a line of {len(line):,} characters, more than {MAX_LINE_CHARACTERS:,}; "
                "one question or sentence per line"
            )
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SuiteError(f"{path}:{number}: invalid JSON ({exc.msg}); one object per line") from None
        except RecursionError:
            raise SuiteError(
                f"{path}:{number}: JSON nested too deep to read; one flat object per line"
            ) from None
        if not isinstance(record, dict) or not all(isinstance(record.get(c), str) for c in needed):
            raise SuiteError(f"{path}:{number}: each line needs string fields {', '.join(needed)}")
        rows.append((number, record))
    return rows


def delimited_rows(path: Path, text: str, needed=("text",)) -> list[tuple[int, dict]]:
    """(line, record) per row of a CSV or TSV file, parsed as a whole file (RFC 4180: a quoted CSV
    cell may hold commas, doubled quotes and line breaks), each row numbered by the physical line
    where it starts. Blank rows and rows whose first cell starts with '#' are skipped; a repeated
    header name, a row of the wrong width and an unclosed quote are one error naming the line."""
    tab = path.suffix in (".tsv", ".tab")
    # TSV cells are taken as written (a quote is text: "Hi," she said); CSV cells may be quoted, and
    # are read strictly: a quote that ends a quoted cell early ("a"b, which pandas reads as ab, another
    # sentence) is an error, as is a quote never closed; a quote inside an unquoted cell (a"b) is text.
    dialect = {"delimiter": "\t" if tab else ",", "quoting": csv.QUOTE_NONE if tab else csv.QUOTE_MINIMAL}
    reader = csv.reader(io.StringIO(text, newline=""), strict=not tab, **dialect)
    records, start = [], 1
    try:
        for cells in reader:
            if any(cell.strip() for cell in cells) and not cells[0].startswith("#"):
                records.append((start, cells))
            start = reader.line_num + 1
    except csv.Error as exc:
        raise SuiteError(_csv_error(path, start, reader.line_num, str(exc))) from None
    if not records:
        return []
    (header_line, header), *body = records
    if len(header) > MAX_COLUMNS:
        raise SuiteError(
            f"{path}:{header_line}: the header has {len(header):,} columns, more than {MAX_COLUMNS:,}; "
            "keep the columns the suite reads"
        )
    repeated = next((c for k, c in enumerate(header) if c in header[:k]), None)
    if repeated is not None:
        raise SuiteError(
            f"{path}:{header_line}: the header names column {repeated!r} twice; rename one so each "
            "column is read once"
        )
    missing = [c for c in needed if c not in header]
    if missing:
        raise SuiteError(
            f"{path}:{header_line}: the header needs a '{missing[0]}' column (columns: "
            f"{', '.join(header)[:200]!r})"
        )
    rows = []
    for number, cells in body:
        if len(cells) != len(header):
            raise SuiteError(
                f"{path}:{number}: {len(cells)} cells but the header has {len(header)}; fix the row"
            )
        rows.append((number, dict(zip(header, cells))))
    return rows


def _csv_error(path: Path, start: int, line: int, message: str) -> str:
    """One line for what Python's strict CSV reader refused in the row starting on line `start`."""
    if "end of data" in message:
        return (
            f"{path}:{start}: a quote opened in the row starting on this line is never closed (the "
            'rest of the file would be one cell); close it, or double a quote inside a cell ("")'
        )
    if "expected after" in message:
        return (
            f'{path}:{line}: a quote ends a quoted cell before its end ("a"b); double each quote '
            'inside a quoted cell ("a""b"), as CSV writers do'
        )
    return (
        f"{path}:{start}: {message} (a quote never closed makes the rest of the file one cell); fix the row"
    )


# One reader per file format of sentence rows, by suffix: (path, text, needed columns) -> rows.
FORMATS = {".jsonl": jsonl_rows, ".csv": delimited_rows, ".tsv": delimited_rows, ".tab": delimited_rows}
