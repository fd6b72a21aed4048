"""The suite's typed objects (slots, conditions, templates, prompts, the suite) and span helpers.

Everything here is plain data built once by the loader (`attnprobe.suite.load_suite`); the
measures a suite declares are typed in `attnprobe.measures`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SlotValue:
    forms: dict[str, str]  # form name -> text; a plain value has the single form "value"
    meta: dict[str, object]  # other columns or keys, e.g. bls_pct_female, label


@dataclass(frozen=True)
class Slot:
    name: str
    values: tuple[SlotValue, ...]
    form_names: tuple[str, ...]  # ("value",) for plain slots


_COMPARE = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    ">": operator.gt,
    "<=": operator.le,
    ">=": operator.ge,
}


@dataclass(frozen=True)
class Condition:
    """A template's `where` filter, parsed once: `slot op other_slot` (the two slots' text) or
    `slot.field op literal`. A numeric literal compares numerically (the field is checked to be
    numeric for every value of the slot when the suite loads); a text literal with == or != only."""

    text: str  # as written, for messages
    slot: str
    field: str | None
    op: str
    other_slot: str | None = None
    literal: float | str | None = None

    def holds(self, chosen: dict[str, SlotValue]) -> bool:
        value = (
            chosen[self.slot].meta[self.field] if self.field else "/".join(chosen[self.slot].forms.values())
        )
        if self.other_slot is not None:
            return _COMPARE[self.op](value, "/".join(chosen[self.other_slot].forms.values()))
        if isinstance(self.literal, float):
            return _COMPARE[self.op](float(value), self.literal)
        return _COMPARE[self.op](str(value), self.literal)


@dataclass(frozen=True)
class Template:
    id: str
    text: str
    where: tuple[Condition, ...] = ()
    line: int = 0
    values: tuple[tuple[str, tuple[SlotValue, ...]], ...] = ()  # the template's own values of some slots
    meta: tuple[
        tuple[str, object], ...
    ] = ()  # metadata of every prompt of the template, e.g. (answer, participant)

    def slot_values(self, name: str, slots) -> tuple[SlotValue, ...]:
        """The values this template expands slot `name` over: its own, else the slot's."""
        return dict(self.values).get(name, slots[name].values)


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
    candidates: dict[str, tuple[tuple[str, str], ...]] = field(
        default_factory=dict
    )  # cut -> ((text, label), ...)
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
    measures: dict  # registered kind name -> the suite's declaration of it (attnprobe.measures.MEASURES)
    skipped: tuple[str, ...]  # one line per measure/template pair left out, with the reason
    notes: tuple[str, ...]  # measured, but worth saying (e.g. an ambiguous form scored as a sum)
    analysis: object  # attnprobe.schema.analysis.Analysis: what the statistics compare
    path: str
    sha256: str  # of the YAML and every data file it reads
    first_token: str = (
        "keep"  # keep | bos (prepend the tokenizer's BOS) | exclude (never a target): attention sinks
    )
    control: object | None = None  # suite.control.Control: definitional prompts an edit should keep right
    data_files: tuple[str, ...] = ()  # every data file the suite read (resolved paths)

    def __getattr__(self, name: str):
        """A measure's declaration by its name (`suite.likelihood`): None (or () for the kinds a
        suite lists) when the suite declares none."""
        measures = self.__dict__.get("measures", {})
        if name in measures:
            return measures[name]
        raise AttributeError(f"'Suite' object has no attribute '{name}'")
