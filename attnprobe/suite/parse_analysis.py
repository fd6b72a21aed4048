"""The suite's `analysis:` section: parse, derive the defaults, check against the prompts.

    analysis:
      contrast: pronoun                       # a slot or a sentence column (default: the suite's contrast)
      positive: female                        # d = a(positive) - a(negative) within one item
      negative: male
      clusters: [occupation, template]        # one or two units of inference
      covariate: occupation.bls_pct_female    # slot.field or a numeric sentence column
      groups: {single: [said_would], two: [spoke_said]}

Defaults, used only where they are unambiguous: positive/negative when the contrast has exactly
two labels; clusters = the covariate's owner (or the one non-contrast slot every template uses)
plus `template` when there are several; no covariate; no groups. Everything is checked here, before
a model loads, and resolved to prompts.csv column names (attnprobe.schema.analysis.Analysis).
"""

from __future__ import annotations

import difflib

from ..errors import SuiteError
from ..schema.analysis import ITEM, TEMPLATE, Analysis, value_of
from ..schema.keys import BLOCKS
from ..schema.yamllines import Map, optional_str


def _spelled(column: str, slots) -> str:
    """A prompts column as a suite names it: occupation_bls_pct_female is occupation.bls_pct_female."""
    slot = next((name for name in slots if column.startswith(f"{name}_") and column != f"{name}_label"), None)
    return f"{slot}.{column[len(slot) + 1 :]}" if slot else column


def parse_analysis(ctx, doc, slots, prompts, contrast_slot: str | None) -> Analysis:
    node = doc.get("analysis") or Map()
    if not isinstance(node, dict):
        ctx.fail(
            doc,
            "analysis",
            "`analysis` is a mapping with contrast, positive, negative, clusters, covariate, groups",
        )
    ctx.check_keys(node, sorted(BLOCKS["analysis"]), " in analysis")
    words = _Words(ctx, node, slots, prompts)
    contrast_word = optional_str(ctx, node, "contrast") or contrast_slot
    contrast = words.resolve("contrast", contrast_word) if contrast_word else None
    labels = (
        tuple(dict.fromkeys(str(value_of(p, contrast)) for p in prompts if value_of(p, contrast) is not None))
        if contrast
        else ()
    )
    positive, negative = _labels(ctx, node, labels, contrast_word)
    if contrast:
        _refuse_duplicate_labels(prompts, contrast)
    covariate, unit = _covariate(words)
    templates = list(dict.fromkeys(p.template_id for p in prompts))
    clusters = _clusters(words, contrast_slot, unit, templates)
    if covariate is not None:
        unit = unit or next((c for c in clusters if _constant_within(prompts, covariate, c)), ITEM)
        if not _constant_within(prompts, covariate, unit):
            ctx.fail(
                node,
                "covariate",
                f"covariate '{words.names[covariate]}' takes several values within one {unit}",
            )
        words.names.setdefault(unit, unit)
    groups = {**_groups(ctx, node, templates), **_groups_by(words)}
    referents, answer = _referents(ctx, node, prompts, words.columns, words.resolve)
    return Analysis(
        contrast=contrast,
        positive=positive,
        negative=negative,
        labels=labels,
        clusters=clusters,
        covariate=covariate,
        unit=unit,
        groups=groups,
        names=words.names,
        referents=referents,
        answer=answer,
    )


class _Words:
    """The section's words resolved to prompts columns (`names`: column -> the word the suite used)."""

    def __init__(self, ctx, node, slots, prompts):
        self.ctx, self.node, self.slots, self.prompts = ctx, node, slots, prompts
        self.columns = {TEMPLATE, ITEM}.union(*({*p.meta, *p.slots} for p in prompts))
        self.names: dict[str, str] = {}

    def resolve(self, key: str, word: str, owner=None) -> str:
        if word in ("template", "item"):
            return {"template": TEMPLATE, "item": ITEM}[word]
        column = word.replace(".", "_", 1) if "." in word else word
        if key == "contrast" and word in self.slots and f"{word}_label" in self.columns:
            column = f"{word}_label"
        if column not in self.columns:  # named as the YAML writes them: a slot's field as slot.field
            known = [
                "template",
                "item",
                *sorted(_spelled(c, self.slots) for c in self.columns if c not in (TEMPLATE, ITEM)),
            ]
            near = difflib.get_close_matches(word, known, n=1, cutoff=0.75)
            meant = f"; did you mean '{near[0]}'?" if near else ""
            self.ctx.fail(
                self.node if owner is None else owner,
                key,
                f"'{word}' is not a slot, slot.field or sentence column{meant} (known: {', '.join(known)})",
            )
        self.names[column] = word.split(".")[0] if key == "contrast" else word
        return column


def _labels(ctx, node, labels: tuple, contrast_word) -> tuple[str | None, str | None]:
    """`positive` and `negative`: both given, or both the contrast's two labels."""
    positive, negative = optional_str(ctx, node, "positive"), optional_str(ctx, node, "negative")
    if (positive is None) != (negative is None):
        ctx.fail(
            node,
            "positive" if positive is None else "negative",
            "give both `positive` and `negative` (two contrast labels)",
        )
    if positive is None and len(labels) == 2:
        positive, negative = labels
    for key, label in (("positive", positive), ("negative", negative)):
        if label is not None and label not in labels:
            ctx.fail(
                node,
                key,
                f"label '{label}' is not a label of the contrast '{contrast_word}' (labels: "
                f"{', '.join(labels) or 'none'})",
            )
    if positive is not None and positive == negative:
        ctx.fail(node, "negative", "positive and negative must be two different labels")
    return positive, negative


def _covariate(words: _Words) -> tuple[str | None, str | None]:
    """The covariate's column (numeric wherever present) and its owner when written slot.field."""
    ctx, node = words.ctx, words.node
    if "covariate" not in node:
        return None, None
    word = optional_str(ctx, node, "covariate")
    covariate = words.resolve("covariate", word)
    values = [value_of(p, covariate) for p in words.prompts if value_of(p, covariate) is not None]
    if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        ctx.fail(node, "covariate", f"covariate '{word}' must be numeric in every prompt that has it")
    return covariate, (word.split(".")[0] if "." in word else None)


def _clusters(words: _Words, contrast_slot, unit, templates) -> tuple[str, ...]:
    """The declared units of inference (one or two, present in every prompt), else the defaults."""
    ctx, node, prompts = words.ctx, words.node, words.prompts
    if "clusters" in node:
        raw = node["clusters"] if isinstance(node["clusters"], list) else [node["clusters"]]
        if not 1 <= len(raw) <= 2 or not all(isinstance(w, str) for w in raw):
            ctx.fail(node, "clusters", "`clusters` names one or two units, e.g. [occupation, template]")
        clusters = tuple(words.resolve("clusters", w) for w in raw)
    else:
        clusters = _default_clusters(words.slots, prompts, contrast_slot, unit, templates)
        words.names.update({c: c for c in clusters if c not in (TEMPLATE, ITEM)})
    for column in clusters:
        lacking = sorted({p.template_id for p in prompts if value_of(p, column) is None})
        if lacking:
            ctx.fail(
                node,
                "clusters",
                f"cluster '{words.names.get(column, column)}' is missing in {', '.join(lacking[:5])}; "
                "clusters must be present in every prompt",
            )
    return clusters


def _groups(ctx, node, templates: list) -> dict[str, tuple]:
    """`groups:` name -> template ids, each id a template, no name taken by a scope."""
    groups = {}
    raw_groups = node.get("groups") or Map()
    if not isinstance(raw_groups, dict):
        ctx.fail(node, "groups", "`groups` maps a group name to a list of template ids")
    for group, ids in raw_groups.items():
        if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
            ctx.fail(raw_groups, group, f"group '{group}' must list template ids")
        if str(group) == "all" or str(group) in templates:
            ctx.fail(
                raw_groups,
                group,
                f"group name '{group}' is taken (the tables name the pooled scope 'all' and each template "
                "by its id); rename the group",
            )
        unknown = [i for i in ids if i not in templates]
        if unknown:
            ctx.fail(
                raw_groups,
                group,
                f"group '{group}' names unknown template(s) {', '.join(unknown)} (templates: "
                f"{', '.join(templates)})",
            )
        groups[str(group)] = tuple(ids)
    return groups


def _groups_by(words: _Words) -> dict[str, tuple]:
    """`group_by: column`: a group per value of a column constant within each template (e.g. answer)."""
    ctx, node, names = words.ctx, words.node, words.names
    if "group_by" not in node:
        return {}
    column = words.resolve("group_by", optional_str(ctx, node, "group_by"))
    if not _constant_within(words.prompts, column, TEMPLATE):
        ctx.fail(
            node,
            "group_by",
            f"'{names[column]}' varies within a template; group_by takes a column constant per template",
        )
    by_value: dict[str, list[str]] = {}
    for p in words.prompts:
        value = value_of(p, column)
        if value is not None and p.template_id not in by_value.setdefault(f"{names[column]}={value}", []):
            by_value[f"{names[column]}={value}"].append(p.template_id)
    return {name: tuple(ids) for name, ids in by_value.items()}


def _referents(ctx, node, prompts, columns, resolve) -> tuple[tuple[str, ...], str | None]:
    """`referents: [referent, other]` (two spans) and `answer:` (one of them, or a column whose value
    names one of them in each prompt): for referent accuracy."""
    if "referents" not in node and "answer" not in node:
        return (), None
    raw = node.get("referents")
    spans = set().union(*(p.spans for p in prompts))
    if (
        not isinstance(raw, list)
        or len(raw) != 2
        or not all(isinstance(r, str) and r in spans for r in raw)
        or raw[0] == raw[1]
    ):
        ctx.fail(
            node,
            "referents" if "referents" in node else "answer",
            f"`referents` names the two spans a pronoun may refer to (spans: {', '.join(sorted(spans))})",
        )
    answer = optional_str(ctx, node, "answer")
    if answer is None:
        ctx.fail(
            node,
            "referents",
            "`answer` says which referent is correct: one of them, or a column naming it per prompt",
        )
    if answer not in raw:
        column = resolve("answer", answer)
        wrong = sorted({str(value_of(p, column)) for p in prompts} - set(raw))
        if wrong:
            ctx.fail(
                node,
                "answer",
                f"column '{answer}' must name one of {', '.join(raw)} in every prompt (found "
                f"{', '.join(wrong[:3])})",
            )
        answer = column
    return tuple(raw), answer


def _default_clusters(slots, prompts, contrast_slot, unit, templates) -> tuple[str, ...]:
    """The covariate's owner, else the one non-contrast slot with several values that every
    template uses; plus `template` for several templates; `item` when nothing else applies."""
    first = unit
    if first is None:
        shared = [
            name
            for name, slot in slots.items()
            if name != contrast_slot and len(slot.values) > 1 and all(name in p.slots for p in prompts)
        ]
        first = shared[0] if len(shared) == 1 else None
    clusters = tuple(c for c in (first, TEMPLATE if len(templates) > 1 else None) if c)
    return clusters or (ITEM,)


def _constant_within(prompts, column: str, unit: str) -> bool:
    seen: dict = {}
    for p in prompts:
        value = value_of(p, column)
        if value is not None and seen.setdefault(value_of(p, unit), value) != value:
            return False
    return True


def _refuse_duplicate_labels(prompts, contrast: str) -> None:
    seen: dict = {}
    for p in prompts:
        key = (p.item_id, str(value_of(p, contrast)))
        if key in seen:
            raise SuiteError(
                f"{p.origin}: item {p.item_id} has two prompts labelled '{key[1]}' ({seen[key]!r} and "
                f"{p.text!r}); "
                "give each contrast value its own label"
            )
        seen[key] = p.text
