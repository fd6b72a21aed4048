"""Probe suites: the YAML schema, validation with file and line, template expansion, and spans.

A suite (documented in probes/README.md) names slots, templates that use them, optional explicit
sentence files with bracketed spans, and the measures to take. `load_suite` validates everything
that can be checked without a model; `token_spans` maps character spans to token ranges once a
tokenizer is known. Only `yaml.safe_load`-level constructs are accepted.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from .errors import AttnprobeError

DEFAULT_MAX_PROMPTS = 1_000_000
SOURCE_AGGREGATIONS = ("mean", "sum", "first", "last")
TARGET_AGGREGATIONS = ("sum", "mean", "max")


class SuiteError(AttnprobeError):
    """A suite that cannot be run; the message is `file:line: what is wrong; how to fix it`."""


# ------------------------------------------------------------------------------ YAML with lines


class _Map(dict):
    line: int = 0
    key_lines: dict


class _Seq(list):
    line: int = 0
    item_lines: list


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that remembers the line of every mapping, key and list item."""


def _construct_map(loader, node):
    loader.flatten_mapping(node)
    result = _Map((loader.construct_object(k, deep=True), loader.construct_object(v, deep=True)) for k, v in node.value)
    result.line = node.start_mark.line + 1
    result.key_lines = {loader.construct_object(k, deep=True): k.start_mark.line + 1 for k, _ in node.value}
    return result


def _construct_seq(loader, node):
    result = _Seq(loader.construct_object(item, deep=True) for item in node.value)
    result.line = node.start_mark.line + 1
    result.item_lines = [item.start_mark.line + 1 for item in node.value]
    return result


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_map)
_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_seq)


def _safe_load_with_lines(text: str):
    """yaml.safe_load, keeping line numbers: _LineLoader is a SafeLoader, so no Python objects."""
    loader = _LineLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _line(node, key=None) -> int:
    if key is not None and isinstance(node, _Map) and key in node.key_lines:
        return node.key_lines[key]
    if key is not None and isinstance(node, _Seq) and isinstance(key, int) and key < len(node.item_lines):
        return node.item_lines[key]
    return getattr(node, "line", 1)


# ------------------------------------------------------------------------------ the suite model


@dataclass(frozen=True)
class SlotValue:
    forms: dict[str, str]  # form name -> text; a plain value has the single form "value"
    meta: dict[str, object]  # other columns or keys, e.g. bls_pct_female, label


@dataclass(frozen=True)
class Slot:
    name: str
    values: tuple[SlotValue, ...]
    form_names: tuple[str, ...]  # ("value",) for plain slots


@dataclass(frozen=True)
class Template:
    id: str
    text: str
    where: tuple[str, ...] = ()
    line: int = 0


@dataclass(frozen=True)
class AttentionMeasure:
    source: str
    targets: tuple[str, ...]
    source_agg: str = "mean"
    target_agg: str = "sum"


@dataclass(frozen=True)
class NextTokenMeasure:
    cut: str  # the span before whose first token the prompt is cut
    candidates: tuple[str, ...] | str  # explicit strings, or the name of a slot to take them from
    origin: str = ""  # file:line, for error messages


@dataclass(frozen=True)
class HeadEffectsMeasure:
    """Head interventions (see interventions.py): y = log p(positive) - log p(negative) at `cut`,
    counterfactual x' = x with `slot` replaced by `replacement`."""

    cut: str
    slot: str
    replacement: str
    positive: str = "female"
    negative: str = "male"
    templates: tuple[str, ...] | None = None  # None: every template that has the cut and the slot
    max_items: int | None = None  # at most this many items, spread over templates and slot values
    exact: str | int = "all"  # exact patching for all heads, or for the top-k heads by attribution
    origin: str = ""


@dataclass(frozen=True)
class Prompt:
    """One filled sentence with its named character spans [start, end)."""

    prompt_id: int
    item_id: str  # equal for prompts that differ only in the contrast slot
    template_id: str
    text: str
    slots: dict[str, str]
    meta: dict[str, object]
    spans: dict[str, tuple[int, int]]
    candidates: dict[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)  # cut -> ((text, label), ...)
    origin: str = ""  # file:line of its template or sentence, for error messages
    span_forms: dict[str, str] = field(default_factory=dict)  # span -> slot form used there (e.g. acc)


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    model: str | None
    contrast: str | None
    slots: dict[str, Slot]
    templates: tuple[Template, ...]
    prompts: tuple[Prompt, ...]
    attention: tuple[AttentionMeasure, ...]
    next_token: tuple[NextTokenMeasure, ...]
    skipped: tuple[str, ...]  # one line per measure/template pair left out, with the reason
    head_effects: HeadEffectsMeasure | None
    path: str
    sha256: str  # of the YAML and every data file it reads


# ------------------------------------------------------------------------------ loading


_TOP_KEYS = {"name", "description", "model", "contrast", "slots", "templates", "sentences", "attention",
             "next_token", "head_effects", "max_prompts"}
_SLOT_REF = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?:\.([A-Za-z_][A-Za-z0-9_]*))?\}")
_WHERE = re.compile(r"^\s*([A-Za-z_][\w]*)(?:\.([A-Za-z_]\w*))?\s*(==|!=|<=|>=|<|>)\s*(.+?)\s*$")


class _Context:
    """Where errors point: the suite file, plus the data files read."""

    def __init__(self, path: Path):
        self.path = path
        self.digest = hashlib.sha256()

    def fail(self, node, key, message: str):
        raise SuiteError(f"{self.path}:{_line(node, key)}: {message}")

    def read_data(self, node, key, relative: str) -> tuple[Path, str]:
        path = (self.path.parent / str(relative)).resolve()
        if not path.is_file():
            self.fail(node, key, f"data file '{relative}' not found (looked in {path.parent}); give a path relative to the suite file")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            self.fail(node, key, f"data file '{relative}' is not UTF-8 text; save it as UTF-8")
        self.digest.update(path.name.encode() + b"\0" + text.encode())
        return path, text


def load_suite(path: str | Path, max_prompts: int | None = None) -> Suite:
    """Read, validate and expand a suite file. Raises SuiteError with `file:line: ...`."""
    path = Path(path)
    if not path.is_file():
        raise SuiteError(f"{path}: suite file not found; give the path of a .yaml suite (e.g. probes/gender.yaml)")
    ctx = _Context(path)
    try:
        raw_text = path.read_text(encoding="utf-8")
        doc = _safe_load_with_lines(raw_text)
    except UnicodeDecodeError:
        raise SuiteError(f"{path}:1: not UTF-8 text; save the suite as UTF-8") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else 1
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SuiteError(f"{path}:{line}: invalid YAML ({problem}); check indentation and quoting") from None
    ctx.digest.update(raw_text.encode())
    if not isinstance(doc, _Map):
        raise SuiteError(f"{path}:1: a suite is a YAML mapping with at least `name` and `templates` or `sentences`")
    for key in doc:
        if key not in _TOP_KEYS:
            ctx.fail(doc, key, f"unknown key '{key}'; allowed: {', '.join(sorted(_TOP_KEYS))}")
    name = _required_str(ctx, doc, "name")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        ctx.fail(doc, "name", f"name '{name}' must be letters, digits, '_', '-' or '.' (it names the output directory)")
    slots = _load_slots(ctx, doc.get("slots") or _Map(), doc)
    contrast = _optional_str(ctx, doc, "contrast")
    if contrast is not None and contrast not in slots:
        ctx.fail(doc, "contrast", f"contrast slot '{contrast}' is not defined under slots: ({', '.join(slots) or 'none'})")
    limit = doc.get("max_prompts", DEFAULT_MAX_PROMPTS) if max_prompts is None else max_prompts
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        ctx.fail(doc, "max_prompts", "max_prompts must be a positive integer")

    templates = _load_templates(ctx, _as_list(ctx, doc, "templates", "templates {id, text}"), slots)
    sentence_sets = _load_sentence_sets(ctx, _as_list(ctx, doc, "sentences", "sentence files {id, file, spans}"),
                                        {t.id for t in templates})
    if not templates and not sentence_sets:
        ctx.fail(doc, None, "the suite has no templates and no sentences; add a `templates:` list")
    _check_size(ctx, doc, templates, slots, sentence_sets, limit)

    prompts: list[Prompt] = []
    for template in templates:
        prompts.extend(_expand(ctx, template, slots, contrast, len(prompts)))
    for sentence_set in sentence_sets:
        prompts.extend(_sentence_prompts(ctx, sentence_set, len(prompts)))

    attention = _load_attention(ctx, _as_list(ctx, doc, "attention", "measures {source, targets}"))
    next_token = _load_next_token(ctx, _as_list(ctx, doc, "next_token", "measures {cut, candidates}"), slots)
    prompts, skipped = _attach_measures(ctx, doc, prompts, attention, next_token, slots)
    head_effects = _load_head_effects(ctx, doc, slots, templates, next_token)
    return Suite(
        name=name,
        description=str(doc.get("description", "")),
        model=_optional_str(ctx, doc, "model"),
        contrast=contrast,
        slots=slots,
        templates=tuple(templates),
        prompts=tuple(prompts),
        attention=attention,
        next_token=next_token,
        skipped=tuple(skipped),
        head_effects=head_effects,
        path=str(path),
        sha256=ctx.digest.hexdigest(),
    )


def _required_str(ctx, node, key) -> str:
    if node.get(key) is None:
        ctx.fail(node, key if key in node else None, f"missing `{key}:`; add it")
    return _optional_str(ctx, node, key)


def _optional_str(ctx, node, key) -> str | None:
    value = node.get(key)
    if value is None:
        return None
    if not isinstance(value, (str, int, float)) or isinstance(value, bool) or str(value).strip() == "":
        ctx.fail(node, key, f"`{key}` must be a non-empty string")
    return str(value)


def _as_list(ctx, node, key, what) -> _Seq:
    """`node[key]` as a non-empty list (an absent key is an empty list); errors point at the key."""
    value = node.get(key)
    if value is None:
        return _Seq()
    if not isinstance(value, list):
        ctx.fail(node, key, f"`{key}` must be a list of {what}")
    if len(value) == 0:
        ctx.fail(node, key, f"`{key}` is an empty list; give at least one entry ({what}) or remove the key")
    return value


# ------------------------------------------------------------------------------ slots


def _load_slots(ctx, node, doc) -> dict[str, Slot]:
    if not isinstance(node, dict):
        ctx.fail(doc, "slots", "`slots` must be a mapping from slot name to its values")
    slots = {}
    for name, spec in node.items():
        if not isinstance(name, str) or not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
            ctx.fail(node, name, f"slot name '{name}' must be lower-case letters, digits and '_' (write {{Name}} in a template to capitalise)")
        if isinstance(spec, list):
            spec = _Map(values=spec)
            spec.line, spec.key_lines = _line(node, name), {"values": _line(node, name)}
        if not isinstance(spec, dict):
            ctx.fail(node, name, f"slot '{name}' needs `values: [...]` or `table: FILE`")
        unknown = set(spec) - {"values", "table", "column", "forms", "delimiter"}
        if unknown:
            ctx.fail(spec, sorted(unknown)[0], f"unknown key '{sorted(unknown)[0]}' in slot '{name}'; allowed: values, table, column, forms")
        if ("values" in spec) == ("table" in spec):
            ctx.fail(node, name, f"slot '{name}' needs exactly one of `values:` or `table:`")
        forms = spec.get("forms")
        if forms is not None and (not isinstance(forms, list) or not forms or not all(isinstance(f, str) for f in forms)):
            ctx.fail(spec, "forms", "`forms` must be a non-empty list of form names, e.g. [nom, acc, poss]")
        form_names = tuple(forms) if forms else ("value",)
        if "values" in spec:
            values = _inline_values(ctx, spec, name, form_names)
        else:
            values = _table_values(ctx, spec, name, form_names)
        if not values:
            ctx.fail(spec, "values" if "values" in spec else "table", f"slot '{name}' has no values; give at least one")
        seen = set()
        for value in values:
            key = tuple(sorted(value.forms.items()))
            if key in seen:
                ctx.fail(spec, "values" if "values" in spec else "table", f"slot '{name}' lists '{'/'.join(value.forms.values())}' twice; remove the duplicate")
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
                ctx.fail(items, i, f"value {i + 1} of slot '{name}' lacks form '{missing[0]}' (declared forms: {', '.join(form_names)})")
            forms = {f: _text(ctx, items, i, item[f], name) for f in form_names}
            meta = {k: v for k, v in item.items() if k not in form_names}
        else:
            if form_names != ("value",):
                ctx.fail(items, i, f"slot '{name}' declares forms {list(form_names)}: give each value as a mapping with those keys")
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
    rows = list(csv.reader(text.splitlines(), delimiter=delimiter))
    rows = [r for r in rows if r and not r[0].startswith("#")]  # '#' lines carry provenance
    if not rows:
        ctx.fail(spec, "table", f"table {path.name} is empty; it needs a header row and data rows")
    header = rows[0]
    wanted = list(form_names) if form_names != ("value",) else [spec.get("column") or header[0]]
    for column in wanted:
        if column not in header:
            ctx.fail(spec, "column" if "column" in spec else "table", f"table {path.name} has no column '{column}' (columns: {', '.join(header)})")
    values = []
    for row_number, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise SuiteError(f"{path}:{row_number}: {len(row)} cells but the header has {len(header)}; fix the row")
        record = dict(zip(header, row))
        forms = {f: record[c] for f, c in zip(form_names, wanted)}
        if any(not v.strip() for v in forms.values()):
            raise SuiteError(f"{path}:{row_number}: empty value in column '{wanted[0]}'; fill it or delete the row")
        meta = {k: _number_or_text(v) for k, v in record.items() if k not in wanted}
        values.append(SlotValue(forms, meta))
    return values


def _number_or_text(value: str):
    """Table cells that read as numbers become int or float; everything else stays text."""
    for kind in (int, float):
        try:
            number = kind(value)
        except ValueError:
            continue
        return number if kind is int or math.isfinite(number) else value
    return value


# ------------------------------------------------------------------------------ templates


def _load_templates(ctx, node: _Seq, slots) -> list[Template]:
    templates, ids = [], {}
    for i, item in enumerate(node):
        if not isinstance(item, dict):
            ctx.fail(node, i, "each template is a mapping with `id:` and `text:`")
        unknown = set(item) - {"id", "text", "where"}
        if unknown:
            ctx.fail(item, sorted(unknown)[0], f"unknown key '{sorted(unknown)[0]}' in a template; allowed: id, text, where")
        template_id = _required_str(ctx, item, "id")
        if template_id in ids:
            ctx.fail(item, "id", f"duplicate template id '{template_id}' (first at line {ids[template_id]}); ids must be unique")
        ids[template_id] = _line(item, "id")
        text = _required_str(ctx, item, "text")
        _check_template_text(ctx, item, text, slots)
        where = item.get("where") or []
        if isinstance(where, str):
            where = [where]
        if not isinstance(where, list):
            ctx.fail(item, "where", "`where` must be a condition or a list of conditions like 'occupation != participant'")
        for condition in where:
            _parse_where(ctx, item, str(condition), slots, _slot_names(text))
        templates.append(Template(template_id, text, tuple(str(w) for w in where), _line(item, "id")))
    return templates


def _unescape_outside_slots(text: str):
    """Yield (literal text, slot match or None) pieces; `{{` and `}}` are literal braces."""
    position = 0
    pattern = re.compile(r"\{\{|\}\}|\{[^{}]*\}|[{}]")
    literal = []
    for match in pattern.finditer(text):
        literal.append(text[position:match.start()])
        token = match.group(0)
        position = match.end()
        if token == "{{":
            literal.append("{")
        elif token == "}}":
            literal.append("}")
        else:
            yield "".join(literal), token
            literal = []
    literal.append(text[position:])
    yield "".join(literal), None


def _slot_names(text: str) -> list[str]:
    names = []
    for _, token in _unescape_outside_slots(text):
        match = token and _SLOT_REF.fullmatch(token)
        if match:
            names.append(match.group(1).lower())
    return names


def _check_template_text(ctx, item, text, slots):
    for _, token in _unescape_outside_slots(text):
        if token is None:
            continue
        match = _SLOT_REF.fullmatch(token)
        if not match:
            ctx.fail(item, "text", f"'{token}' is not a slot reference; write {{slot}} or {{slot.form}}, and {{{{ }}}} for literal braces")
        name, form = match.group(1).lower(), match.group(2)
        if name not in slots:
            ctx.fail(item, "text", f"unknown slot '{{{match.group(1)}}}'; defined slots: {', '.join(slots) or 'none'}")
        forms = slots[name].form_names
        if form is None and forms != ("value",):
            ctx.fail(item, "text", f"slot '{name}' has forms ({', '.join(forms)}): write {{{name}.{forms[0]}}}")
        if form is not None and form not in forms:
            ctx.fail(item, "text", f"slot '{name}' has no form '{form}' (forms: {', '.join(forms)})")


def _parse_where(ctx, item, condition, slots, used):
    match = _WHERE.match(condition)
    if not match:
        ctx.fail(item, "where", f"cannot read condition '{condition}'; write e.g. 'occupation != participant' or 'occupation.bls_pct_female > 50'")
    left, field_name, op, right = match.groups()
    if left not in slots or left not in used:
        ctx.fail(item, "where", f"condition '{condition}' names '{left}', which this template does not use")
    if field_name is None and right not in used and op not in ("==", "!="):
        ctx.fail(item, "where", f"condition '{condition}': compare two slots with == or != only")
    return left, field_name, op, right


def _evaluate(condition: str, chosen: dict[str, SlotValue]) -> bool:
    left, field_name, op, right = _WHERE.match(condition).groups()
    value = chosen[left].meta.get(field_name) if field_name else "/".join(chosen[left].forms.values())
    if field_name is None and right in chosen:
        other = "/".join(chosen[right].forms.values())
    else:
        other = _number_or_text(right.strip("'\""))
    if isinstance(value, float) != isinstance(other, float):
        value, other = str(value), str(other)
    return {"==": value == other, "!=": value != other, "<": value < other, ">": value > other,
            "<=": value <= other, ">=": value >= other}[op]


def _check_size(ctx, doc, templates, slots, sentence_sets, limit):
    total = sum(s["n_rows"] for s in sentence_sets)
    for template in templates:
        names = list(dict.fromkeys(_slot_names(template.text)))
        total += math.prod(len(slots[n].values) for n in names)
        if total > limit:
            ctx.fail(doc, "templates", f"the suite would expand to more than {limit:,} prompts (before filters); "
                                       "shrink the slot lists or raise `max_prompts`")


def _expand(ctx, template: Template, slots, contrast, first_id) -> list[Prompt]:
    """Every combination of the template's slots, the contrast slot varying fastest."""
    names = list(dict.fromkeys(_slot_names(template.text)))
    order = [n for n in names if n != contrast] + ([contrast] if contrast in names else [])
    prompts = []
    for combination in itertools.product(*(slots[n].values for n in order)):
        chosen = dict(zip(order, combination))
        if not all(_evaluate(c, chosen) for c in template.where):
            continue
        text, spans, span_forms = _fill(template.text, chosen)
        fixed = [f"{n}={'/'.join(chosen[n].forms.values())}" for n in order if n != contrast]
        meta = {f"{n}_{k}": v for n in order for k, v in chosen[n].meta.items()}
        prompts.append(Prompt(
            prompt_id=first_id + len(prompts),
            item_id=template.id + ("|" + "|".join(fixed) if fixed else ""),
            template_id=template.id,
            text=text,
            slots={n: "/".join(chosen[n].forms.values()) for n in order},
            meta=meta,
            spans=spans,
            origin=f"{ctx.path}:{template.line}",
            span_forms=span_forms,
        ))
    return prompts


def _fill(text: str, chosen: dict[str, SlotValue]) -> tuple[str, dict[str, tuple[int, int]], dict[str, str]]:
    """The filled text, each slot occurrence's character span, and the form used in each span."""
    out, spans, span_forms, position = [], {}, {}, 0
    for literal, token in _unescape_outside_slots(text):
        out.append(literal)
        position += len(literal)
        if token is None:
            continue
        match = _SLOT_REF.fullmatch(token)
        raw_name, form = match.group(1), match.group(2) or "value"
        name = raw_name.lower()
        value = chosen[name].forms[form]
        if raw_name[0].isupper():
            value = value[:1].upper() + value[1:]
        span_name = name
        suffix = 2
        while span_name in spans:
            span_name, suffix = f"{name}_{suffix}", suffix + 1
        spans[span_name] = (position, position + len(value))
        span_forms[span_name] = form
        out.append(value)
        position += len(value)
    return "".join(out), spans, span_forms


# ------------------------------------------------------------------------------ explicit sentences


_BRACKET = re.compile(r"\[([^\[\]]+)\]")


def _load_sentence_sets(ctx, node: _Seq, template_ids) -> list[dict]:
    sets = []
    for i, item in enumerate(node):
        if not isinstance(item, dict):
            ctx.fail(node, i, "each `sentences` entry is a mapping with `id:`, `file:` and `spans:`")
        set_id = _required_str(ctx, item, "id")
        if set_id in template_ids or any(s["id"] == set_id for s in sets):
            ctx.fail(item, "id", f"duplicate id '{set_id}'; template and sentence ids must be unique")
        file_name = _required_str(ctx, item, "file")
        names = item.get("spans")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            ctx.fail(item, "spans", "`spans` must list the names of the bracketed spans in order, e.g. [occupation, pronoun]")
        if len(set(names)) != len(names):
            ctx.fail(item, "spans", "span names must be unique")
        path, text = ctx.read_data(item, "file", file_name)
        rows = _read_rows(path, text)
        if not rows:
            ctx.fail(item, "file", f"{path.name} holds no sentences")
        sets.append({"id": set_id, "names": list(names), "path": path, "rows": rows, "n_rows": len(rows)})
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
    header = next(csv.reader([lines[0][1]], delimiter=delimiter))
    if "text" not in header:
        raise SuiteError(f"{path}:{lines[0][0]}: the header needs a 'text' column (columns: {', '.join(header)})")
    rows = []
    for number, line in lines[1:]:
        cells = next(csv.reader([line], delimiter=delimiter))
        if len(cells) != len(header):
            raise SuiteError(f"{path}:{number}: {len(cells)} cells but the header has {len(header)}; fix the row")
        rows.append((number, dict(zip(header, cells))))
    return rows


def _sentence_prompts(ctx, sentence_set, first_id) -> list[Prompt]:
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
        meta = {k: _number_or_text(str(v)) for k, v in record.items() if k != "text"}
        prompts.append(Prompt(
            prompt_id=first_id + len(prompts),
            item_id=f"{sentence_set['id']}|{number}",
            template_id=sentence_set["id"],
            text="".join(text),
            slots={name: marked_text for name, marked_text in zip(names, found)},
            meta=meta,
            spans=spans,
            origin=where,
        ))
    return prompts


# ------------------------------------------------------------------------------ measures


def _load_attention(ctx, node: _Seq) -> tuple[AttentionMeasure, ...]:
    measures = []
    for i, item in enumerate(node):
        if not isinstance(item, dict):
            ctx.fail(node, i, "each attention measure is a mapping with `source:` and `targets:`")
        unknown = set(item) - {"source", "targets", "source_agg", "target_agg"}
        if unknown:
            ctx.fail(item, sorted(unknown)[0], f"unknown key '{sorted(unknown)[0]}'; allowed: source, targets, source_agg, target_agg")
        source = _required_str(ctx, item, "source")
        targets = item.get("targets")
        if isinstance(targets, str):
            targets = [targets]
        if not isinstance(targets, list) or not targets:
            ctx.fail(item, "targets", "`targets` must list one or more span names")
        source_agg = item.get("source_agg", "mean")
        target_agg = item.get("target_agg", "sum")
        if source_agg not in SOURCE_AGGREGATIONS:
            ctx.fail(item, "source_agg", f"source_agg must be one of {', '.join(SOURCE_AGGREGATIONS)}")
        if target_agg not in TARGET_AGGREGATIONS:
            ctx.fail(item, "target_agg", f"target_agg must be one of {', '.join(TARGET_AGGREGATIONS)}")
        measures.append(AttentionMeasure(source, tuple(str(t) for t in targets), source_agg, target_agg))
    return tuple(measures)


def _load_next_token(ctx, node: _Seq, slots) -> tuple[NextTokenMeasure, ...]:
    measures = []
    for i, item in enumerate(node):
        if not isinstance(item, dict):
            ctx.fail(node, i, "each next_token measure is a mapping with `cut:` and `candidates:`")
        cut = _required_str(ctx, item, "cut")
        candidates = item.get("candidates")
        if isinstance(candidates, str):
            if candidates not in slots:
                ctx.fail(item, "candidates", f"candidates '{candidates}' is not a slot; give a slot name or a list like [\" he\", \" she\"]")
        elif isinstance(candidates, list) and candidates:
            for j, candidate in enumerate(candidates):
                if not isinstance(candidate, str) or candidate == "":
                    ctx.fail(candidates, j, f"candidate {j + 1} is empty; give the word with its leading space, e.g. \" she\"")
            candidates = tuple(candidates)
        else:
            ctx.fail(item, "candidates", "`candidates` must be a slot name or a non-empty list of strings")
        measures.append(NextTokenMeasure(cut, candidates, origin=f"{ctx.path}:{_line(item, 'candidates')}"))
    return tuple(measures)


def _load_head_effects(ctx, doc, slots, templates, next_token) -> HeadEffectsMeasure | None:
    node = doc.get("head_effects")
    if node is None:
        return None
    if not isinstance(node, dict):
        ctx.fail(doc, "head_effects", "`head_effects` is a mapping with cut, counterfactual, positive, negative")
    allowed = {"cut", "counterfactual", "positive", "negative", "templates", "max_items", "exact"}
    unknown = set(node) - allowed
    if unknown:
        ctx.fail(node, sorted(unknown)[0], f"unknown key '{sorted(unknown)[0]}' in head_effects; allowed: {', '.join(sorted(allowed))}")
    cut = _required_str(ctx, node, "cut")
    if cut not in {m.cut for m in next_token}:
        ctx.fail(node, "cut", f"head_effects cut '{cut}' needs a next_token measure with the same cut (its candidates define y)")
    counterfactual = node.get("counterfactual")
    if not isinstance(counterfactual, dict) or len(counterfactual) != 1:
        ctx.fail(node, "counterfactual", "`counterfactual` names one slot and its replacement, e.g. {occupation: woman}")
    (slot, replacement), = counterfactual.items()
    if slot not in slots:
        ctx.fail(node, "counterfactual", f"counterfactual slot '{slot}' is not defined under slots: ({', '.join(slots)})")
    if not isinstance(replacement, str) or not replacement.strip():
        ctx.fail(node, "counterfactual", "the replacement must be non-empty text, e.g. woman")
    chosen = node.get("templates")
    if chosen is not None:
        if not isinstance(chosen, list) or not chosen:
            ctx.fail(node, "templates", "`templates` lists template ids")
        known = {t.id for t in templates}
        for template_id in chosen:
            if template_id not in known:
                ctx.fail(node, "templates", f"unknown template id '{template_id}'")
    max_items = node.get("max_items")
    if max_items is not None and (not isinstance(max_items, int) or isinstance(max_items, bool) or max_items < 1):
        ctx.fail(node, "max_items", "max_items must be a positive integer")
    exact = node.get("exact", "all")
    if exact != "all" and (not isinstance(exact, int) or isinstance(exact, bool) or exact < 1):
        ctx.fail(node, "exact", "exact is 'all' or the number k of top heads (by attribution) to patch exactly")
    return HeadEffectsMeasure(cut, slot, replacement, str(node.get("positive", "female")), str(node.get("negative", "male")),
                              tuple(chosen) if chosen else None, max_items, exact, origin=f"{ctx.path}:{_line(doc, 'head_effects')}")


def _attach_measures(ctx, doc, prompts, attention, next_token, slots):
    """Check every measure names spans that exist, derive candidates, and list what is skipped."""
    span_names = set().union(*(p.spans for p in prompts)) if prompts else set()
    for measures, key in ((attention, "attention"), (next_token, "next_token")):
        for measure in measures:
            names = [measure.source, *measure.targets] if key == "attention" else [measure.cut]
            for name in names:
                if name not in span_names:
                    ctx.fail(doc, key, f"span '{name}' does not occur in any template or sentence (spans: {', '.join(sorted(span_names))})")
    # What is left out, grouped: one line per measure and missing span, naming the templates.
    first_of_template = {}
    for prompt in prompts:
        first_of_template.setdefault(prompt.template_id, prompt)
    lacking: dict[str, list[str]] = {}
    for template_id, example in first_of_template.items():
        for m in attention:
            for name in (m.source, *m.targets):
                if name not in example.spans:
                    what = (f"attention {m.source} -> {', '.join(m.targets)}" if name == m.source
                            else f"attention {m.source} -> {name}")
                    lacking.setdefault(f"{what}: not measured where span '{name}' is absent", []).append(template_id)
        for m in next_token:
            if m.cut not in example.spans:
                lacking.setdefault(f"next_token at '{m.cut}': not measured where span '{m.cut}' is absent", []).append(template_id)
            elif example.spans[m.cut][0] == 0:
                lacking.setdefault(f"next_token at '{m.cut}': not measured where the span starts the text", []).append(template_id)
    skipped = [f"{reason} ({len(ids)} template(s): {', '.join(ids)})" for reason, ids in lacking.items()]
    result = []
    for prompt in prompts:
        candidates = {}
        for m in next_token:
            if m.cut not in prompt.spans or prompt.spans[m.cut][0] == 0:
                continue
            candidates[m.cut] = _candidates_for(prompt, m, slots)
        result.append(replace(prompt, candidates=candidates))
    return result, skipped


def _candidates_for(prompt: Prompt, measure: NextTokenMeasure, slots) -> tuple[tuple[str, str], ...]:
    """(text, label) pairs. From a slot: each value in the form and case used at the cut, with the
    space that precedes the span in this prompt (so " she" after "said that", "She" at the start)."""
    if not isinstance(measure.candidates, str):
        return tuple((c, c.strip()) for c in measure.candidates)
    start, end = prompt.spans[measure.cut]
    shown = prompt.text[start:end]
    space = prompt.text[max(0, start - 1):start] if start > 0 and prompt.text[start - 1].isspace() else ""
    slot = slots[measure.candidates]
    form = prompt.span_forms.get(measure.cut)  # the form shown at the cut, e.g. nom for "she"
    form = form if form in slot.form_names else slot.form_names[0]
    out = []
    for value in slot.values:
        word = value.forms[form]
        if shown[:1].isupper():
            word = word[:1].upper() + word[1:]
        label = str(value.meta.get("label", "/".join(value.forms.values())))
        out.append((space + word, label))
    return tuple(dict.fromkeys(out))


# ------------------------------------------------------------------------------ token spans


def spread_key(item_id: str) -> str:
    """A fixed pseudo-random order of items (by hash), so a subset spreads over slot values."""
    return hashlib.sha256(item_id.encode()).hexdigest()


def token_spans(offsets: list[tuple[int, int]], spans: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """Token range [start, end) of each character span: the tokens that overlap it.

    `offsets` are the tokenizer's (char_start, char_end) per token; special tokens have (0, 0)
    and never belong to a span. A span no token overlaps maps to (-1, -1).
    """
    result = {}
    for name, (char_start, char_end) in spans.items():
        hits = [i for i, (s, e) in enumerate(offsets) if e > s and s < char_end and e > char_start]
        result[name] = (hits[0], hits[-1] + 1) if hits else (-1, -1)
    return result
