"""Multiple-choice rows: a context, a question and answer options, read as distributed.

A sentences entry with `choices:` reads each row as one item of one prompt, the context and the
question joined by a space (spans `context` and `question`), its options and their roles kept as
metadata for the multiple_choice measure: `option_0`, `option_1`, ... (the options' words),
`answer` (the correct option's index), and, where the benchmark says, `target` (the option naming
the group the question's stereotype is about), `unknown` (the "can't be determined" option),
`polarity` (neg / nonneg question) and `condition` (ambig / disambig context).

`choices: bbq` takes BBQ's own JSONL fields (Parrish et al., Findings of ACL 2022): context,
question, ans0-ans2, label, question_polarity, context_condition, and the target and unknown
options from answer_info's group labels against additional_metadata.stereotyped_groups (a group
label matches when it, or one of its '-'-separated parts, equals a stereotyped group, ignoring
case). Otherwise `choices:` maps the roles to columns:
{context: c, question: q, options: [a, b, c], answer: label, target: t, unknown: u, polarity: p,
condition: k}.
"""

from __future__ import annotations

from ...errors import SuiteError
from ...schema.keys import BLOCKS
from .formats import named, names

ROLES = BLOCKS["choices"]


def parse_choices(ctx, item) -> dict | None:
    """The entry's `choices:` declaration as {role: column(s)}, or None."""
    node = item.get("choices")
    if node is None:
        return None
    published = named(item, "choices")
    if published is not None:
        return dict(published.mapping)
    hint = (
        f"`choices` names a published format ({names('choices')}) or maps roles to columns, e.g. "
        "{context: context, "
    )
    if not isinstance(node, dict) or not {"context", "question", "options", "answer"} <= set(node):
        ctx.fail(item, "choices", hint + "question: question, options: [ans0, ans1, ans2], answer: label}")
    ctx.check_keys(node, ROLES, " in choices")
    for key, value in node.items():
        ok = isinstance(value, list) and len(value) >= 2 if key == "options" else isinstance(value, str)
        if not ok or (key == "options" and not all(isinstance(v, str) for v in value)):
            ctx.fail(node, key, "`options` lists two or more columns; every other role names one column")
    if "spans" in item or "optional_spans" in item or "columns" in item or "files" in item:
        ctx.fail(item, "choices", "an entry with `choices` takes one `file:`; its spans are computed")
    return dict(node)


def choice_rows(rows: list, roles: dict) -> tuple[list, dict]:
    """One record per row: text = context + " " + question, the options and roles as metadata;
    and the computed spans (context, question) of each record, keyed by the record's id."""
    out, spans = [], {}
    for path, number, record in rows:
        where = f"{path}:{number}" + (
            f" (example_id {record['example_id']})" if "example_id" in record else ""
        )
        text = {k: _text(record, roles[k], where) for k in ("context", "question")}
        options = [_text(record, column, where) for column in roles["options"]]
        meta = {k: v for k, v in record.items() if not isinstance(v, (dict, list))}
        for column in (roles["context"], roles["question"], *roles["options"]):
            meta.pop(column, None)
        meta.update({f"option_{i}": option for i, option in enumerate(options)})
        meta["answer"] = _index(record.get(roles["answer"]), len(options), where, roles["answer"])
        if roles.get("format") == "bbq":
            meta.update(_bbq_roles(record, len(options), where))
            meta.update(_bbq_scopes(record, options, roles, where))
        else:
            for role in ("target", "unknown"):
                if role in roles:
                    meta[role] = _index(record.get(roles[role]), len(options), where, roles[role])
        for role in ("polarity", "condition"):
            if role in roles and role not in meta:
                meta[role] = str(record.get(roles[role], ""))
        meta.pop(roles["answer"], None)
        new = {**meta, "text": f"{text['context']} {text['question']}"}
        out.append((path, number, new))
        start = len(text["context"]) + 1
        spans[id(new)] = {
            "context": (0, len(text["context"])),
            "question": (start, start + len(text["question"])),
        }
    return out, spans


def _text(record: dict, column: str, where: str) -> str:
    value = record.get(column)
    if not isinstance(value, str) or not value.strip():
        raise SuiteError(f"{where}: column '{column}' holds no text; fill it or drop the row")
    return value.strip()


def _index(value, n: int, where: str, column: str) -> int:
    """An option index from a column (0-based, as BBQ's label)."""
    try:
        index = int(str(value).strip())
    except ValueError:
        index = -1
    if not 0 <= index < n:
        raise SuiteError(
            f"{where}: column '{column}' is {value!r}, not an option index 0-{n - 1}; fix the row"
        )
    return index


# BBQ's published values (case ignored): another spelling would silently form another scope
BBQ_VALUES = {"polarity": ("neg", "nonneg"), "condition": ("ambig", "disambig")}


def _bbq_scopes(record: dict, options: list[str], roles: dict, where: str) -> dict:
    """polarity and condition as BBQ spells them (lower case), and options that differ: each a
    file:line error otherwise (a tie between identical options has no answer to score)."""
    out = {}
    for role, allowed in BBQ_VALUES.items():
        value = str(record.get(roles[role], "")).strip().lower()
        if value not in allowed:
            raise SuiteError(
                f"{where}: {roles[role]} is {record.get(roles[role])!r}; BBQ's values are "
                f"{' and '.join(allowed)} (any case); fix the row"
            )
        out[role] = value
    for i, option in enumerate(options):
        if option in options[:i]:  # scored alike, a tie that would go to the first
            raise SuiteError(f"{where}: two options read {option!r}; a question needs distinct answers")
    return out


def _bbq_roles(record: dict, n: int, where: str) -> dict:
    """target and unknown from BBQ's answer_info groups and stereotyped_groups (-1 where none)."""
    for key in ("answer_info", "additional_metadata"):
        if key not in record:
            raise SuiteError(
                f"{where}: no {key}; BBQ's target and unknown answers are read from answer_info and "
                "additional_metadata.stereotyped_groups: keep them in the row"
            )
    info = record.get("answer_info") or {}
    meta = record.get("additional_metadata") or {}
    stereotyped = meta.get("stereotyped_groups", []) if isinstance(meta, dict) else None
    answers = [info.get(f"ans{i}") for i in range(n)] if isinstance(info, dict) else None
    if answers is None or not all(isinstance(a, list) and a and str(a[-1]).strip() for a in answers):
        raise SuiteError(
            f"{where}: answer_info must map ans0..ans{n - 1} to [words, group] lists as BBQ publishes it "
            f"(found {type(info).__name__}); fix the row"
        )
    if not isinstance(stereotyped, list):
        raise SuiteError(
            f"{where}: additional_metadata.stereotyped_groups must be a list of group labels as BBQ "
            "publishes it; fix the row"
        )
    stereotyped = {str(g).lower() for g in stereotyped}
    groups = [str(a[-1]).lower() for a in answers]
    matches = lambda g: g in stereotyped or bool(set(g.split("-")) & stereotyped)
    target = next((i for i, g in enumerate(groups) if g != "unknown" and matches(g)), -1)
    unknown = next((i for i, g in enumerate(groups) if g == "unknown"), -1)
    return {"target": target, "unknown": unknown}
