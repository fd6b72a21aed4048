"""Slots: inline value lists and tables (TSV/CSV with provenance lines), with forms and metadata."""

from __future__ import annotations

import csv
import re
from collections import Counter

from ..errors import SuiteError
from ..schema.keys import BLOCKS
from ..schema.yamllines import Map, file_lines, line_of, number_or_text
from .types import Slot, SlotValue


def load_slots(ctx, node, doc) -> dict[str, Slot]:
    if not isinstance(node, dict):
        ctx.fail(doc, "slots", "`slots` must be a mapping from slot name to its values")
    slots = {}
    for name, spec in node.items():
        if not isinstance(name, str) or not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
            ctx.fail(
                node,
                name,
                f"slot name '{name}' must be lower-case letters, digits and '_' (write {{Name}} in a "
                "template to capitalise)",
            )
        if isinstance(spec, list):
            spec = Map(values=spec)
            spec.line, spec.key_lines = line_of(node, name), {"values": line_of(node, name)}
        if not isinstance(spec, dict):
            ctx.fail(node, name, f"slot '{name}' needs `values: [...]` or `table: FILE`")
        ctx.check_keys(spec, BLOCKS["slot"], f" in slot '{name}'")
        if ("values" in spec) == ("table" in spec):
            ctx.fail(node, name, f"slot '{name}' needs exactly one of `values:` or `table:`")
        forms = spec.get("forms")
        if forms is not None and (
            not isinstance(forms, list) or not forms or not all(isinstance(f, str) for f in forms)
        ):
            ctx.fail(spec, "forms", "`forms` must be a non-empty list of form names, e.g. [nom, acc, poss]")
        form_names = tuple(forms) if forms else ("value",)
        if "values" in spec:
            values = _inline_values(ctx, spec, name, form_names)
        else:
            values = _table_values(ctx, spec, name, form_names)
        if not values:
            ctx.fail(
                spec,
                "values" if "values" in spec else "table",
                f"slot '{name}' has no values; give at least one",
            )
        seen = set()
        for value in values:
            key = tuple(sorted(value.forms.items()))
            if key in seen:
                ctx.fail(
                    spec,
                    "values" if "values" in spec else "table",
                    f"slot '{name}' lists '{'/'.join(value.forms.values())}' twice; remove the duplicate",
                )
            seen.add(key)
        slots[name] = Slot(name, tuple(values), form_names)
    return slots


def _inline_values(ctx, spec, name, form_names) -> list[SlotValue]:
    items = spec["values"]
    if not isinstance(items, list):
        ctx.fail(spec, "values", f"`values` of slot '{name}' must be a list")
    values = []
    for i, item in enumerate(items):
        if isinstance(item, dict):
            missing = [f for f in form_names if f not in item]
            if missing:
                ctx.fail(
                    items,
                    i,
                    f"value {i + 1} of slot '{name}' lacks form '{missing[0]}' (declared forms: "
                    f"{', '.join(form_names)})",
                )
            forms = {f: _text(ctx, items, i, item[f], name) for f in form_names}
            meta = {k: v for k, v in item.items() if k not in form_names}
        else:
            if form_names != ("value",):
                ctx.fail(
                    items,
                    i,
                    f"slot '{name}' declares forms {list(form_names)}: give each value as a mapping with "
                    "those keys",
                )
            forms, meta = {"value": _text(ctx, items, i, item, name)}, {}
        values.append(SlotValue(forms, meta))
    return values


def _text(ctx, node, key, value, slot) -> str:
    if isinstance(value, bool) or value is None or not isinstance(value, (str, int, float)):
        ctx.fail(node, key, f"a value of slot '{slot}' must be text, got {type(value).__name__}")
    text = str(value)
    if not text.strip():
        ctx.fail(node, key, f"slot '{slot}' has an empty value; remove it or give text")
    return text


def _table_values(ctx, spec, name, form_names) -> list[SlotValue]:
    path, text = ctx.read_data(spec, "table", spec["table"])
    delimiter = spec.get("delimiter") or ("\t" if path.suffix in (".tsv", ".tab") else ",")
    if not isinstance(delimiter, str) or len(delimiter) != 1 or delimiter in '\r\n"':
        ctx.fail(
            spec, "delimiter", f"delimiter is one character (e.g. ';' or '|'), got {str(delimiter)[:20]!r}"
        )
    # a TSV cell is taken as written (a quote is text: "Weird Al" Yankovic), as files.rows reads TSV
    quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
    rows = list(csv.reader(file_lines(text), delimiter=delimiter, quoting=quoting))
    rows = [r for r in rows if r and not r[0].startswith("#")]  # '#' lines carry provenance
    if not rows:
        ctx.fail(spec, "table", f"table {path.name} is empty; it needs a header row and data rows")
    header = rows[0]
    repeated = next((c for c, n in Counter(header).items() if n > 1), None)
    if repeated is not None:
        ctx.fail(
            spec,
            "table",
            f"table {path.name} names column '{repeated[:40]}' twice in its header; rename one (the second "
            "would silently replace the first)",
        )
    wanted = list(form_names) if form_names != ("value",) else [spec.get("column") or header[0]]
    for column in wanted:
        if column not in header:
            ctx.fail(
                spec,
                "column" if "column" in spec else "table",
                f"table {path.name} has no column '{column}' (columns: {', '.join(header)})",
            )
    values = []
    for row_number, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise SuiteError(
                f"{path}:{row_number}: {len(row)} cells but the header has {len(header)}; fix the row"
            )
        record = dict(zip(header, row))
        forms = {f: record[c] for f, c in zip(form_names, wanted)}
        if any(not v.strip() for v in forms.values()):
            raise SuiteError(
                f"{path}:{row_number}: empty value in column '{wanted[0]}'; fill it or delete the row"
            )
        meta = {k: number_or_text(v) for k, v in record.items() if k not in wanted}
        values.append(SlotValue(forms, meta))
    return values
