"""Probe suites: the YAML schema, validation with file and line, expansion into prompts.

A suite (documented in probes/README.md) names slots, templates that use them, optional explicit
sentence files with bracketed spans, and the measures to take. `load_suite` validates everything
that can be checked without a model and expands the prompts once; `token_spans` maps character
spans to token ranges once a tokenizer is known. Only `yaml.safe_load`-level constructs are
accepted. The rooms: attnprobe.schema (YAML with lines, the error context, spans), types (the typed
objects), slots, templates (typed conditions, expansion), sentences; measures parse in attnprobe.measures.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import yaml

from ..errors import SuiteError
from ..measures import MEASURES, AttentionMeasure, HeadEffectsMeasure, NextTokenMeasure, ParseScope
from ..schema.analysis import candidate_notes, contrast_notes, covariate_notes, few_levels_notes
from ..schema.keys import BLOCKS
from ..schema.spans import spread_key, token_spans
from ..schema.yamllines import Context, Map, as_list, optional_str, required_str, safe_load_with_lines
from .control import parse_control
from .files.sentences import load_sentence_sets, sentence_prompts
from .parse_analysis import parse_analysis, value_of
from .slots import load_slots
from .templates import check_size, expand, load_templates, new_value_notes
from .types import Condition, Prompt, Slot, SlotValue, Suite, Template

DEFAULT_MAX_PROMPTS = 1_000_000
MAX_SUITE_BYTES = 2**20  # PyYAML parses about 0.4 MB/s here: a larger suite would take seconds to read
FIRST_TOKEN = ("keep", "bos", "exclude")

__all__ = [
    "Condition",
    "Prompt",
    "Slot",
    "SlotValue",
    "Suite",
    "SuiteError",
    "Template",
    "key_table",
    "load_suite",
    "spread_key",
    "token_spans",
    "AttentionMeasure",
    "HeadEffectsMeasure",
    "NextTokenMeasure",
]


def key_table() -> dict[str, tuple[str, ...]]:
    """Every block's allowed keys: the suite's own (schema.keys) and each registered measure's."""
    table = {**BLOCKS, "suite": (*BLOCKS["suite"], *MEASURES)}
    for kind in MEASURES.values():
        table.update(kind.KEYS)
    return table


def load_suite(path: str | Path, max_prompts: int | None = None, data_roots=()) -> Suite:
    """Read, validate and expand a suite file. Raises SuiteError with `file:line: ...`. Data files
    are read from the suite's directory, or from `data_roots` (directories) when given."""
    ctx, doc = _read_document(Path(path), data_roots)
    ctx.check_keys(doc, sorted(key_table()["suite"]))
    name = required_str(ctx, doc, "name")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or set(name) == {"."}:
        ctx.fail(
            doc,
            "name",
            f"name '{name}' must be letters, digits, '_', '-' or '.', not only dots (it names the output "
            "directory)",
        )
    description = optional_str(ctx, doc, "description") or ""
    slots = load_slots(ctx, doc.get("slots") or Map(), doc)
    contrast = optional_str(ctx, doc, "contrast")
    if contrast is not None and contrast not in slots:
        ctx.fail(
            doc,
            "contrast",
            f"contrast slot '{contrast}' is not defined under slots: ({', '.join(slots) or 'none'})",
        )
    templates, sentence_sets, prompts = _expanded(ctx, doc, slots, contrast, max_prompts)
    span_names = set().union(*(p.spans for p in prompts)) if prompts else set()
    analysis = parse_analysis(ctx, doc, slots, prompts, contrast)
    template_ids = {t.id for t in templates} | {s["id"] for s in sentence_sets}
    columns = {c for p in prompts for c in (*p.meta, *p.slots)} | {"template_id"}
    measures, kind_notes = {}, []
    for key, kind in MEASURES.items():  # in registry order: a kind may read those before it
        scope = ParseScope(slots, span_names, template_ids, analysis, columns, dict(measures), kind_notes)
        measures[key] = kind.parse(ctx, doc, scope)
    attention, next_token = measures["attention"], measures["next_token"]
    _check_measure_spans(ctx, doc, prompts, (*attention, *next_token))
    skipped, notes = _left_out(prompts, attention, next_token, slots)
    prompts = _with_candidates(prompts, next_token, slots, analysis)
    notes += _suite_notes(analysis, prompts, templates, slots, sentence_sets) + kind_notes
    return Suite(
        first_token=_first_token(ctx, doc, measures),
        measures=measures,
        control=parse_control(ctx, doc, analysis),
        name=name,
        description=description,
        model=optional_str(ctx, doc, "model"),
        contrast=contrast,
        slots=slots,
        templates=tuple(templates),
        prompts=tuple(prompts),
        skipped=tuple(skipped),
        notes=tuple(notes),
        analysis=analysis,
        path=str(path),
        sha256=ctx.digest.hexdigest(),
        data_files=tuple(str(f) for f in ctx.files),
    )


def _read_document(path: Path, data_roots) -> tuple[Context, Map]:
    """The suite file parsed with lines (and its error context), or one line saying why not."""
    try:
        found = path.is_file()
    except OSError as exc:  # e.g. a name longer than the file system allows
        raise SuiteError(f"{str(path)[:120]}: cannot be read ({exc.strerror}); give a shorter path") from None
    if not found:
        what = "is a folder" if path.is_dir() else "is not a regular file" if path.exists() else "not found"
        raise SuiteError(
            f"{path}: suite file {what}; give the path of a .yaml suite (e.g. probes/gender.yaml)"
        )
    if path.stat().st_size > MAX_SUITE_BYTES:
        raise SuiteError(
            f"{path}:1: the suite file has {path.stat().st_size / 2**20:.1f} MB, more than "
            f"{MAX_SUITE_BYTES // 2**20} MB of YAML; move long lists into data files (`table:` for a slot, "
            "`sentences:`)"
        )
    ctx = Context(path, data_roots)
    try:
        raw_text = path.read_text(encoding="utf-8")
        doc = safe_load_with_lines(raw_text)
    except UnicodeDecodeError:
        raise SuiteError(f"{path}:1: not UTF-8 text; save the suite as UTF-8") from None
    except RecursionError:
        raise SuiteError(
            f"{path}:1: nested too deeply; a suite is a few levels of mappings and lists"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else 1
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SuiteError(f"{path}:{line}: invalid YAML ({problem}); check indentation and quoting") from None
    ctx.digest.update(raw_text.encode())
    if not isinstance(doc, Map):
        raise SuiteError(
            f"{path}:1: a suite is a YAML mapping with at least `name` and `templates` or `sentences`"
        )
    return ctx, doc


def _expanded(ctx, doc, slots, contrast, max_prompts) -> tuple[list, list, list[Prompt]]:
    """The templates, the sentence sets and every prompt they expand to (at most max_prompts)."""
    limit = doc.get("max_prompts", DEFAULT_MAX_PROMPTS) if max_prompts is None else max_prompts
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        ctx.fail(doc, "max_prompts", "max_prompts must be a positive integer")
    templates = load_templates(ctx, as_list(ctx, doc, "templates", "templates {id, text}"), slots)
    sentence_sets = load_sentence_sets(
        ctx,
        as_list(ctx, doc, "sentences", "sentence files {id, file, spans}"),
        {t.id for t in templates},
        slots,
        limit,
    )
    if not templates and not sentence_sets:
        ctx.fail(doc, None, "the suite has no templates and no sentences; add a `templates:` list")
    check_size(ctx, doc, templates, slots, sentence_sets, limit)
    prompts: list[Prompt] = []
    for template in templates:
        prompts.extend(expand(ctx, template, slots, contrast, len(prompts)))
    for sentence_set in sentence_sets:
        prompts.extend(sentence_prompts(ctx, sentence_set, len(prompts)))
    _refuse_reserved_names(ctx, doc, slots, prompts, sentence_sets)
    return templates, sentence_sets, prompts


def _suite_notes(analysis, prompts, templates, slots, sentence_sets) -> list[str]:
    """What a user should know about the design before a model runs (run.py prints them)."""
    notes = [_span_count_note(s) for s in sentence_sets if s["n_required"] < len(s["names"])]
    notes += [
        f"sentences '{s['id']}': `mark: {name}` found no word in {len(lines)} of {len(s['rows'])} lines "
        f"(first: {lines[0]}); those prompts have no span '{name}' and drop out of measures that need it"
        for s in sentence_sets
        for name, lines in s["unmarked"].items()
    ]
    notes += few_levels_notes(
        analysis, {c: len({value_of(p, c) for p in prompts} - {None}) for c in analysis.clusters}
    )
    notes += covariate_notes(analysis, prompts) + contrast_notes(analysis, prompts)
    return notes + new_value_notes(templates, slots) + candidate_notes(analysis, prompts)


def _first_token(ctx, doc, measures: dict) -> str:
    """How the first position (an attention sink) is treated: as the suite says, else as a declared
    kind prefers (likelihood: scored sentences start after the BOS or end-of-text token, as lm-eval
    scores them), else kept."""
    preferred = [k.FIRST_TOKEN for n, k in MEASURES.items() if k.FIRST_TOKEN and measures[n] is not None]
    first_token = optional_str(ctx, doc, "first_token") or (preferred[0] if preferred else "keep")
    if first_token not in FIRST_TOKEN:
        ctx.fail(
            doc,
            "first_token",
            f"first_token is one of {', '.join(FIRST_TOKEN)} (how the first position, an attention sink, is "
            "treated)",
        )
    return first_token


RESERVED_COLUMNS = (
    "prompt_id",
    "item_id",
    "template_id",
    "text",
    "n_tokens",
)  # prompts.csv columns of every run
SPAN_COLUMNS = ("_char_start", "_char_end", "_tok_start", "_tok_end")  # per span: <span><suffix>


def _span_count_note(sentence_set: dict) -> str:
    """How many lines of a sentence set with optional spans carry each count of unnamed spans."""
    counts = sorted(sentence_set["span_counts"].items())
    carried = ", ".join(f"{n:,} line{'s' * (n != 1)} with {k}" for k, n in counts)
    optional = ", ".join(sentence_set["names"][sentence_set["n_required"] :])
    return f"sentences '{sentence_set['id']}': {carried} unnamed [bracketed] spans (optional: {optional})"


def _refuse_reserved_names(ctx, doc, slots, prompts, sentence_sets) -> None:
    """Slot names, span names and metadata keys become prompts.csv columns: a name that equals a
    column the run writes, or another name's column, would overwrite it and join results to the wrong
    prompts. Refused here, before anything runs."""
    for name in slots:
        if (
            name in RESERVED_COLUMNS
            or name.endswith(SPAN_COLUMNS)
            or re.fullmatch(rf"({'|'.join(map(re.escape, slots))})_\d+", name)
        ):
            ctx.fail(
                doc["slots"],
                name,
                f"slot name '{name}' is reserved (it names a column every run writes, or a second "
                "occurrence of another slot); rename the slot",
            )
    for sentence_set in sentence_sets:
        for path, number, record in sentence_set["rows"]:
            for column in record:
                if column != "text" and (
                    column in RESERVED_COLUMNS
                    or column.endswith(SPAN_COLUMNS)
                    or column in sentence_set["names"]
                ):
                    raise SuiteError(
                        f"{path}:{number}: column '{column}' is a column every run writes or "
                        "the name of a span; rename the column"
                    )
    for prompt in prompts:
        spans = [n for n in prompt.spans if n in RESERVED_COLUMNS or n.endswith(SPAN_COLUMNS)]
        if spans:
            raise SuiteError(
                f"{prompt.origin}: span name '{spans[0]}' is reserved (run columns: "
                f"{', '.join(RESERVED_COLUMNS)}; names ending in {', '.join(SPAN_COLUMNS)}); rename the span"
            )
        clash = set(prompt.meta) & (set(RESERVED_COLUMNS) | set(prompt.slots))
        clash |= {k for k in prompt.meta if k.endswith(SPAN_COLUMNS)}
        if clash:
            raise SuiteError(
                f"{prompt.origin}: metadata '{sorted(clash)[0]}' would overwrite a column of prompts.csv "
                "(a run column or a slot); rename it"
            )


def _check_measure_spans(ctx, doc, prompts, measures) -> None:
    """Every span a measure names occurs in some template or sentence."""
    span_names = set().union(*(p.spans for p in prompts)) if prompts else set()
    for measure in measures:
        for name in measure.spans:
            if name not in span_names:
                ctx.fail(
                    doc,
                    measure.KEY,
                    f"span '{name}' does not occur in any template or sentence (spans: "
                    f"{', '.join(sorted(span_names))})",
                )


def _left_out(prompts, attention, next_token, slots) -> tuple[list[str], list[str]]:
    """What is left out (skipped) and what is measured but worth saying (notes), grouped: one line per
    measure and reason, naming the templates."""
    first_of_template = {}
    for prompt in prompts:
        first_of_template.setdefault(prompt.template_id, prompt)
    lacking: dict[str, list[str]] = {}  # reason -> templates left out
    noted: dict[str, list[str]] = {}  # measured, but worth saying
    for template_id, example in first_of_template.items():
        for m in (*attention, *next_token):
            for name in m.spans:
                if name not in example.spans:
                    lacking.setdefault(m.missing(name), []).append(template_id)
        for m in next_token:
            if m.cut in example.spans and example.spans[m.cut][0] == 0:
                lacking.setdefault(
                    f"next_token at '{m.cut}': not measured where the span starts the text", []
                ).append(template_id)
            elif (
                m.cut in example.spans
                and m.candidates in slots
                and len(forms := m.compared_forms(example, slots)) > 1
            ):
                where = lacking if m.ambiguous == "exclude" else noted
                how = (
                    "excluded" if m.ambiguous == "exclude" else "scored against the sum of each label's words"
                )
                where.setdefault(
                    f"next_token at '{m.cut}': a form is both {' and '.join(forms)}; {how}", []
                ).append(template_id)
    skipped, notes = (
        [f"{reason} ({len(ids)} template(s): {', '.join(ids)})" for reason, ids in found.items()]
        for found in (lacking, noted)
    )
    return skipped, notes


def _with_candidates(prompts, next_token, slots, analysis) -> list[Prompt]:
    """Each prompt with the candidate words of every next_token cut it carries."""
    items: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        items.setdefault(prompt.item_id, []).append(prompt)

    def label_of(p: Prompt) -> str:  # a candidate word's label: its prompt's contrast label, else the word
        if analysis.contrast and value_of(p, analysis.contrast) is not None:
            return str(value_of(p, analysis.contrast))
        return p.text[slice(*p.spans[m.candidates])].strip()

    result = []
    for prompt in prompts:
        candidates = {}
        for m in next_token:
            if m.cut not in prompt.spans or prompt.spans[m.cut][0] == 0:
                continue
            if (
                isinstance(m.candidates, str) and m.candidates not in slots
            ):  # a sentence span: the item's words
                candidates[m.cut] = m.candidates_from_item(prompt, items[prompt.item_id], label_of)
            else:
                candidates[m.cut] = m.candidates_for(prompt, slots)
        result.append(replace(prompt, candidates={cut: c for cut, c in candidates.items() if c}))
    return result
