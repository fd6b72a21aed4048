"""The head-effects declaration: which heads and layers carry the next-token contrast.

y = log p(positive) - log p(negative) at the cut, where positive and negative are candidate labels
of the next_token measure with the same cut (by default the analysis's two labels; a label with
several words at the cut counts all of them). The designs (designs.py): `SlotSwap` replaces
one slot of the item by each declared word (e.g. the occupation by "woman", "man" and "person"),
`PairSwap` patches an item's pro version into its anti version. x and x' may tokenise to different
lengths: patching aligns the slot's last token and what follows it.

Two phases (phases.py, computed in batches by engine.py). The screen, per
item in resumable chunks: the total effect, every head's and layer's attribution, all heads'
patterns jointly, and on the held-out items (every item with `exact: all`) every head and layer
patched exactly. Then, with every item screened: the suite's k heads (by attribution over the items
not held out) patched one by one on every item, and the heads chosen on one half of the units
patched jointly on the other half (cross-fitted). This module parses the suite's declaration and
summarises for the manifest; the run writes the tables.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict

from ...heads import HeadSet
from ...intervene.items import Dropped, PatchItem, Selection
from ...schema.yamllines import line_of, required_str
from .designs import (
    HELD_OUT_DEFAULT,
    SELECT_DEFAULT,
    HeadEffectsMeasure,
    PairSwap,
    SlotSwap,
    per_value_column,
)

SELECTION = ("templates", "max_items", "exact", "select", "held_out")  # which items, which heads exactly
KEYS = {  # the block's keys: a slot swap's, and counterfactual: pair's
    "head_effects": ("cut", "counterfactual", "positive", "negative", *SELECTION),
    "head_effects pair": ("counterfactual", *SELECTION),
}

HEAD_COLUMNS = ("output_in", "output_out", "pattern_in", "attribution_output", "attribution_pattern")
LAYER_COLUMNS = ("attention_in", "attention_out", "mlp_in", "mlp_out")

__all__ = ["HeadEffectsMeasure", "PairSwap", "SlotSwap", "parse", "summary", "heads_text", "plan_sha256"]


def parse(ctx, doc, slots, template_ids, next_token, analysis, choice=None) -> HeadEffectsMeasure | None:
    """The suite's `head_effects:` block as a SlotSwap or (counterfactual: pair) a PairSwap."""
    node = doc.get("head_effects")
    if node is None:
        return None
    if isinstance(node, dict) and node.get("counterfactual") == "pair":
        return _parse_pair(ctx, doc, node, template_ids, analysis, choice)
    if not isinstance(node, dict):
        ctx.fail(
            doc,
            "head_effects",
            "`head_effects` is a mapping with cut, counterfactual, positive, negative (candidate labels)",
        )
    hint = (
        "; zero and mean ablation were replaced by patching in both directions" if "ablations" in node else ""
    )
    ctx.check_keys(node, sorted(KEYS["head_effects"]), " in head_effects", hint)
    cut = required_str(ctx, node, "cut")
    if cut not in {m.cut for m in next_token}:
        ctx.fail(
            node,
            "cut",
            f"head_effects cut '{cut}' needs a next_token measure with the same cut (its candidates "
            "define y)",
        )
    slot, words = _counterfactual(ctx, node, slots)
    chosen, counts, exact = _selection(ctx, node, template_ids, analysis)
    labels = {key: _label(ctx, node, key, getattr(analysis, key)) for key in ("positive", "negative")}
    unit = analysis.unit or next((c for c in analysis.clusters if c not in ("template_id", "item_id")), None)
    return SlotSwap(
        slot,
        tuple(str(w) for w in words),
        labels["positive"],
        labels["negative"],
        tuple(chosen) if chosen else None,
        counts["max_items"],
        exact,
        counts["select"],
        unit,
        analysis.covariate if unit == analysis.unit else None,
        origin=f"{ctx.path}:{line_of(doc, 'head_effects')}",
        held_out=counts["held_out"],
        cut=cut,
    )


def _counterfactual(ctx, node, slots) -> tuple[str, list]:
    """`counterfactual: {slot: [words]}`: a slot and its distinct replacement words (a word may be a
    column of the slot's table per value, '{slot.column}')."""
    counterfactual = node.get("counterfactual")
    if not isinstance(counterfactual, dict) or len(counterfactual) != 1:
        ctx.fail(
            node,
            "counterfactual",
            "`counterfactual` names one slot and its replacement words, e.g. {occupation: [woman, man, "
            "person]}",
        )
    ((slot, words),) = counterfactual.items()
    if slot not in slots:
        ctx.fail(
            node,
            "counterfactual",
            f"counterfactual slot '{slot}' is not defined under slots: ({', '.join(slots)})",
        )
    words = [words] if isinstance(words, str) else words
    if (
        not isinstance(words, list)
        or not words
        or not all(isinstance(w, str) and w.strip() for w in words)
        or len(set(words)) != len(words)
    ):
        ctx.fail(
            node,
            "counterfactual",
            "the replacements are non-empty, distinct words, e.g. [woman, man, person], or a column of "
            "the slot's table per value, e.g. '{occupation.anti_stereotype}'",
        )
    for word in words:
        column = per_value_column(word)
        if column and not any(column == f"{slot}_{key}" for v in slots[slot].values for key in v.meta):
            ctx.fail(
                node,
                "counterfactual",
                f"{word} names no column of slot '{slot}'; write {{{slot}.COLUMN}} with a column of "
                "its table",
            )
    return slot, words


def _label(ctx, node, key: str, default) -> str:
    """`positive` or `negative`: a candidate label at the cut, else the analysis's."""
    if key not in node and default is None:
        ctx.fail(
            node,
            "cut",
            f"head_effects needs `{key}`: a candidate label at the cut (the analysis declares none)",
        )
    if key in node:
        required_str(ctx, node, key)
    return str(node[key]) if key in node else default


def _parse_pair(ctx, doc, node, template_ids, analysis, choice) -> PairSwap:
    """`counterfactual: pair`: x is an item's positive version (pro) and x' its negative one (anti),
    each followed by the referent_choice question; y is the model's referent choice."""
    ctx.check_keys(node, sorted(KEYS["head_effects pair"]), " in head_effects with counterfactual: pair")
    if not analysis.paired or choice is None:
        ctx.fail(
            node,
            "counterfactual",
            "counterfactual: pair patches an item's positive version into its negative one "
            "and needs paired versions (analysis positive/negative) and a `referent_choice:` question "
            "for y",
        )
    chosen, counts, exact = _selection(ctx, node, template_ids, analysis)
    unit = analysis.unit or next((c for c in analysis.clusters if c not in ("template_id", "item_id")), None)
    return PairSwap(
        analysis.contrast,
        (analysis.negative,),
        analysis.positive,
        analysis.negative,
        tuple(chosen) if chosen else None,
        counts["max_items"],
        exact,
        counts["select"],
        unit,
        None,
        origin=f"{ctx.path}:{line_of(doc, 'head_effects')}",
        choice=choice,
        referents=analysis.referents,
        answer=analysis.answer,
        held_out=counts["held_out"],
    )


def _selection(ctx, node, template_ids, analysis) -> tuple[list | None, dict, str | int]:
    """The keys both designs share: `templates` (ids of templates or sentence sets, or names of the
    analysis's groups), `max_items`, `select`, `held_out`, `exact`."""
    chosen = node.get("templates")
    if chosen is not None:
        if not isinstance(chosen, list) or not chosen:
            ctx.fail(node, "templates", "`templates` lists template ids or group names")
        expanded = []
        for name in chosen:
            if name not in template_ids and name not in analysis.groups:
                groups = f" or a group ({', '.join(analysis.groups)})" if analysis.groups else ""
                ctx.fail(node, "templates", f"unknown template id '{name}'; use a template id{groups}")
            expanded += [t for t in analysis.groups.get(name, (name,)) if t not in expanded]
        chosen = expanded
    counts = {}
    for key, default, least in (
        ("max_items", None, 1),
        ("select", SELECT_DEFAULT, 1),
        ("held_out", HELD_OUT_DEFAULT, 0),
    ):
        value = node.get(key, default)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            ctx.fail(node, key, f"{key} must be an integer of at least {least}")
        counts[key] = value
    exact = node.get("exact", "all")
    if exact != "all" and (not isinstance(exact, int) or isinstance(exact, bool) or exact < 1):
        ctx.fail(
            node,
            "exact",
            "exact is 'all' or the number k of heads (the suite's top k by attribution) to patch exactly",
        )
    return chosen, counts, exact


def summary(
    measure: HeadEffectsMeasure,
    items: list[PatchItem],
    dropped: list[Dropped],
    seconds: float,
    selection: Selection | None = None,
    n_heads: int = 0,
) -> dict:
    """What the manifest records about the head effects of a run."""
    out = {
        "n_items": len(items),
        "n_pairs": sum(len(i.counterfactuals) for i in items),
        "dropped": [asdict(d) for d in dropped],
        "seconds": round(seconds, 3),
        "counterfactual": {measure.slot: list(measure.replacements)},
        "exact": measure.exact,
        "select": measure.select,
        "held_out": len(measure.held_out_ids(items)),
        "halves_by": measure.unit,
        "positive": measure.positive,
        "negative": measure.negative,
        "design": measure.design,
    }
    if selection is not None:
        crossfit = selection.crossfit.items()
        out["crossfit_heads"] = {w: [heads_text(s, n_heads) for s in sets] for w, sets in crossfit}
        out["exact_heads"] = heads_text(selection.suite, n_heads) if selection.suite is not None else "all"
    return out


def heads_text(flat, n_heads: int) -> str:
    """Flat head indices l H + h as text: "L10H6 L23H5"."""
    return str(HeadSet.from_flat(flat, n_heads))


def plan_sha256(items: list[PatchItem], measure: HeadEffectsMeasure | None = None) -> str:
    """A hash of the head-effects plan (item ids, x and x' token ids, aligned positions, labels,
    selection settings): chunks of another plan are redone."""
    settings = (measure.exact, measure.select, measure.held_out) if measure else None
    digest = hashlib.sha256(repr(settings).encode())
    for item in items:
        cfs = [(c.word, c.x_cf.tolist(), c.at, c.at_cf) for c in item.counterfactuals]
        labels = f"{list(item.positive)}|{list(item.negative)}"
        digest.update(f"{item.item_id}|{item.x.tolist()}|{cfs}|{labels}|{item.unit};".encode())
    return digest.hexdigest()
