"""Templates: text with {slot} and {slot.form} references, typed `where` conditions, expansion.

Expansion is the product of a template's slots (the contrast slot varying fastest, so the prompts
of one item are neighbours), filtered by its conditions, with the character span of every slot
occurrence (a second occurrence of a slot is named `<slot>_2`, ...).
"""

from __future__ import annotations

import itertools
import math
import re

from ..schema.keys import BLOCKS
from ..schema.yamllines import Seq, line_of, number_or_text, required_str
from .types import Condition, Prompt, SlotValue, Template

_SLOT_REF = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?:\.([A-Za-z_][A-Za-z0-9_]*))?\}")
_WHERE = re.compile(r"^\s*([A-Za-z_][\w]*)(?:\.([A-Za-z_]\w*))?\s*(==|!=|<=|>=|<|>)\s*(.+?)\s*$")


def load_templates(ctx, node: Seq, slots) -> list[Template]:
    templates, ids = [], {}
    for i, item in enumerate(node):
        if not isinstance(item, dict):
            ctx.fail(node, i, "each template is a mapping with `id:` and `text:`")
        ctx.check_keys(item, BLOCKS["template"], " in a template")
        template_id = required_str(ctx, item, "id")
        if template_id in ids:
            ctx.fail(
                item,
                "id",
                f"duplicate template id '{template_id}' (first at line {ids[template_id]}); ids must be "
                "unique",
            )
        ids[template_id] = line_of(item, "id")
        text = required_str(ctx, item, "text")
        _check_template_text(ctx, item, text, slots)
        where = item.get("where") or []
        if isinstance(where, str):
            where = [where]
        if not isinstance(where, list):
            ctx.fail(
                item,
                "where",
                "`where` must be a condition or a list of conditions like 'occupation != participant'",
            )
        conditions = tuple(parse_condition(ctx, item, str(c), slots, slot_names(text)) for c in where)
        values = _own_values(ctx, item, slots, slot_names(text))
        meta = item.get("meta") or {}
        if not isinstance(meta, dict) or not all(
            isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in meta.values()
        ):
            ctx.fail(item, "meta", "`meta` maps column names to text or numbers, e.g. {answer: participant}")
        for key in meta:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(key)) or key in slots:
                ctx.fail(
                    item, "meta", f"meta name {key!r} must be letters, digits and '_' and not a slot name"
                )
        templates.append(
            Template(
                template_id,
                text,
                conditions,
                line_of(item, "id"),
                values,
                tuple((str(k), number_or_text(str(v))) for k, v in meta.items()),
            )
        )
    return templates


def _own_values(ctx, item, slots, used) -> tuple:
    """A template's `values: {slot: [value, ...]}`: a listed value that the slot has (by any form or
    label) keeps its forms and metadata; a new one is plain text (slots without forms only)."""
    node = item.get("values")
    if node is None:
        return ()
    if not isinstance(node, dict):
        ctx.fail(
            item,
            "values",
            "`values` maps slot names to the template's own values, e.g. {occupation: [nurse]}",
        )
    own = []
    for name, listed in node.items():
        if name not in slots or name not in used:
            ctx.fail(item, "values", f"values for '{name}', which this template does not use")
        listed = (
            [listed] if isinstance(listed, (str, int, float)) and not isinstance(listed, bool) else listed
        )
        if not isinstance(listed, list) or not listed:
            ctx.fail(item, "values", f"values of '{name}' must be a value or a non-empty list")
        known = {}
        for value in slots[name].values:
            for text in (*value.forms.values(), value.meta.get("label")):
                known.setdefault(str(text), value)
        chosen = []
        for value in listed:
            if str(value) in known:
                chosen.append(known[str(value)])
            elif slots[name].form_names == ("value",):
                chosen.append(SlotValue({"value": str(value)}, {}))
            else:
                ctx.fail(
                    item,
                    "values",
                    f"'{value}' is not a value of slot '{name}' (a slot with forms takes its own values by "
                    "text or label)",
                )
        own.append((name, tuple(chosen)))
    return tuple(own)


def new_value_notes(templates, slots) -> list[str]:
    """A note per template whose own `values:` include words the slot's table lacks: their prompts
    have none of the table's columns (a covariate or lookup read from it is empty there)."""
    notes = []
    for template in templates:
        for name, chosen in template.values:
            fields = sorted(set().union(*(v.meta for v in slots[name].values)))
            new = [v.forms["value"] for v in chosen if fields and v not in slots[name].values]
            if new:
                notes.append(
                    f"template '{template.id}': values of '{name}' not in its table ({', '.join(new[:3])}) "
                    f"have none of its columns ({', '.join(fields[:4])}); add them to the table if those "
                    "are used"
                )
    return notes


def _unescape_outside_slots(text: str):
    """Yield (literal text, slot match or None) pieces; `{{` and `}}` are literal braces."""
    position = 0
    pattern = re.compile(r"\{\{|\}\}|\{[^{}]*\}|[{}]")
    literal = []
    for match in pattern.finditer(text):
        literal.append(text[position : match.start()])
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


def slot_names(text: str) -> list[str]:
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
            ctx.fail(
                item,
                "text",
                f"'{token}' is not a slot reference; write {{slot}} or {{slot.form}}, and {{{{ }}}} for "
                "literal braces",
            )
        name, form = match.group(1).lower(), match.group(2)
        if name not in slots:
            ctx.fail(
                item,
                "text",
                f"unknown slot '{{{match.group(1)}}}'; defined slots: {', '.join(slots) or 'none'}",
            )
        forms = slots[name].form_names
        if form is None and forms != ("value",):
            ctx.fail(
                item, "text", f"slot '{name}' has forms ({', '.join(forms)}): write {{{name}.{forms[0]}}}"
            )
        if form is not None and form not in forms:
            ctx.fail(item, "text", f"slot '{name}' has no form '{form}' (forms: {', '.join(forms)})")


def parse_condition(ctx, item, text: str, slots, used) -> Condition:
    """A `where` condition as a typed Condition; every problem is a `file:line:` error."""
    match = _WHERE.match(text)
    if not match:
        ctx.fail(
            item,
            "where",
            f"cannot read condition '{text}'; write e.g. 'occupation != participant' or "
            "'occupation.bls_pct_female > 50'",
        )
    left, field_name, op, right = match.groups()
    if left not in slots or left not in used:
        ctx.fail(item, "where", f"condition '{text}' names '{left}', which this template does not use")
    if field_name is None and right in used:  # slot against slot: their texts
        if op not in ("==", "!="):
            ctx.fail(item, "where", f"condition '{text}': compare two slots with == or != only")
        return Condition(text, left, None, op, other_slot=right)
    literal = number_or_text(right.strip("'\""))
    if field_name is not None:
        lacking = [v for v in slots[left].values if field_name not in v.meta]
        if lacking:
            known = sorted(set().union(*(v.meta for v in slots[left].values))) or ["none"]
            ctx.fail(
                item,
                "where",
                f"condition '{text}': slot '{left}' has no field '{field_name}' "
                f"(for '{'/'.join(lacking[0].forms.values())}'; fields: {', '.join(known)})",
            )
    if isinstance(literal, (int, float)) and field_name is not None:
        not_numbers = [
            v
            for v in slots[left].values
            if isinstance(v.meta[field_name], bool) or not isinstance(v.meta[field_name], (int, float))
        ]
        if not_numbers:
            ctx.fail(
                item,
                "where",
                f"condition '{text}': '{left}.{field_name}' is not a number for "
                f"'{'/'.join(not_numbers[0].forms.values())}'; compare text with == or !=",
            )
        return Condition(text, left, field_name, op, literal=float(literal))
    if op not in ("==", "!="):
        ctx.fail(item, "where", f"condition '{text}': '{right}' is text; compare text with == or != only")
    return Condition(text, left, field_name, op, literal=right.strip("'\""))


def check_size(ctx, doc, templates, slots, sentence_sets, limit):
    total = sum(s["n_rows"] for s in sentence_sets)
    for template in templates:
        names = list(dict.fromkeys(slot_names(template.text)))
        total += math.prod(len(template.slot_values(n, slots)) for n in names)
        if total > limit:
            ctx.fail(
                doc,
                "templates",
                f"the suite would expand to more than {limit:,} prompts (before filters); "
                "shrink the slot lists or raise `max_prompts`",
            )


def expand(ctx, template: Template, slots, contrast, first_id) -> list[Prompt]:
    """Every combination of the template's slots, the contrast slot varying fastest."""
    names = list(dict.fromkeys(slot_names(template.text)))
    order = [n for n in names if n != contrast] + ([contrast] if contrast in names else [])
    prompts = []
    for combination in itertools.product(*(template.slot_values(n, slots) for n in order)):
        chosen = dict(zip(order, combination))
        if not all(c.holds(chosen) for c in template.where):
            continue
        text, spans, span_forms = _fill(template.text, chosen)
        fixed = [f"{n}={'/'.join(chosen[n].forms.values())}" for n in order if n != contrast]
        meta = {**{f"{n}_{k}": v for n in order for k, v in chosen[n].meta.items()}, **dict(template.meta)}
        prompts.append(
            Prompt(
                prompt_id=first_id + len(prompts),
                item_id=template.id + ("|" + "|".join(fixed) if fixed else ""),
                template_id=template.id,
                text=text,
                slots={n: "/".join(chosen[n].forms.values()) for n in order},
                meta=meta,
                spans=spans,
                origin=f"{ctx.path}:{template.line}",
                span_forms=span_forms,
            )
        )
    return prompts


def _fill(text: str, chosen: dict[str, SlotValue]) -> tuple[str, dict[str, tuple[int, int]], dict[str, str]]:
    """The filled text, each slot occurrence's character span, and the form used in each span."""
    out, spans, span_forms, position = [], {}, {}, 0
    occurrences: dict[str, int] = {}  # per slot: how many times it has appeared so far
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
        occurrences[name] = occurrences.get(name, 0) + 1
        span_name = name if occurrences[name] == 1 else f"{name}_{occurrences[name]}"  # linear, not a search
        spans[span_name] = (position, position + len(value))
        span_forms[span_name] = form
        out.append(value)
        position += len(value)
    return "".join(out), spans, span_forms
