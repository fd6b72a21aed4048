"""The head-effects measure: which heads carry the next-token contrast (see interventions.py).

y = log p(positive) - log p(negative) at the cut, where positive and negative are candidate
labels of the next_token measure with the same cut; the counterfactual x' replaces one slot of
the item (e.g. the occupation by "woman"). This module chooses the items, checks everything a
tokenizer can tell before any weights load (labels, single-token candidates, a family whose
attention goes through attnprobe's function), and runs the interventions item by item; the run
writes what it returns.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from ..errors import SuiteError
from ..spans import spread_key, token_spans
from ..yamllines import line_of, required_str

INTERVENTIONS = ("pattern", "zero", "mean", "attribution")


@dataclass(frozen=True)
class HeadEffectsMeasure:
    """Head interventions: y = log p(positive) - log p(negative) at `cut`, counterfactual
    x' = x with `slot` replaced by `replacement`."""

    cut: str
    slot: str
    replacement: str
    positive: str  # candidate labels at the cut, e.g. female / male
    negative: str
    templates: tuple[str, ...] | None = None  # None: every template that has the cut and the slot
    max_items: int | None = None  # at most this many items, spread over templates and slot values
    exact: str | int = "all"  # exact patching for all heads, or for the top-k heads by attribution
    origin: str = ""

    @staticmethod
    def parse(ctx, doc, slots, templates, next_token) -> HeadEffectsMeasure | None:
        node = doc.get("head_effects")
        if node is None:
            return None
        if not isinstance(node, dict):
            ctx.fail(doc, "head_effects", "`head_effects` is a mapping with cut, counterfactual, positive, negative (candidate labels)")
        allowed = {"cut", "counterfactual", "positive", "negative", "templates", "max_items", "exact"}
        unknown = set(node) - allowed
        if unknown:
            ctx.fail(node, sorted(unknown)[0], f"unknown key '{sorted(unknown)[0]}' in head_effects; allowed: {', '.join(sorted(allowed))}")
        cut = required_str(ctx, node, "cut")
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
        for key in ("positive", "negative"):
            required_str(ctx, node, key)
        return HeadEffectsMeasure(cut, slot, replacement, str(node["positive"]), str(node["negative"]),
                                  tuple(chosen) if chosen else None, max_items, exact, origin=f"{ctx.path}:{line_of(doc, 'head_effects')}")



    def check_family(self, routes_attention: bool, spec: str) -> None:
        """Interventions run inside attnprobe's attention function: refuse a family that bypasses it."""
        if not routes_attention:
            raise SuiteError(f"{self.origin}: head_effects need a model whose attention goes through attnprobe's attention "
                             f"function, and '{spec}' bypasses it (eager-only family); run it with --no-head-effects "
                             "or remove `head_effects:` from the suite")

    def items(self, tokenizer, encoded) -> tuple[list[dict], list[str]]:
        """The (x, x') pairs to intervene on, and the items dropped with the reason; tokenizer only.

        One pair per item (prompts that differ only in the contrast slot share the prefix before the
        cut). x is the prompt's tokens before the cut; x' is the same sentence with the counterfactual
        slot replaced (capitalised like the original), tokenised and cut the same way."""
        items, dropped, seen = [], [], set()
        for e in sorted(encoded, key=lambda e: spread_key(e.prompt.item_id)):
            p = e.prompt
            if p.item_id in seen or self.cut not in p.spans or self.slot not in p.spans:
                continue
            if self.templates and p.template_id not in self.templates:
                continue
            seen.add(p.item_id)
            ids = self._label_ids(tokenizer, p)
            s0, s1 = p.spans[self.slot]
            if s0 >= p.spans[self.cut][0]:
                dropped.append(f"{p.item_id}: the {self.slot} comes after the cut")
                continue
            original = p.text[s0:s1]
            replacement = self.replacement[:1].upper() + self.replacement[1:] if original[:1].isupper() else self.replacement
            text_cf = p.text[:s0] + replacement + p.text[s1:]
            shift = len(replacement) - len(original)
            spans_cf = {self.cut: tuple(c + shift for c in p.spans[self.cut])}
            enc = tokenizer(text_cf, return_offsets_mapping=True)
            cut_cf = token_spans([tuple(o) for o in enc["offset_mapping"]], spans_cf)[self.cut][0]
            x = torch.tensor(e.ids[: e.spans[self.cut][0]])
            x_cf = torch.tensor(enc["input_ids"][:cut_cf])
            if len(x) != len(x_cf):
                dropped.append(f"{p.item_id}: x has {len(x)} tokens but x' ({replacement!r} for {original!r}) has {len(x_cf)}")
                continue
            items.append({"item_id": p.item_id, "template_id": p.template_id, "original": p.slots.get(self.slot, original),
                          "x": x, "x_cf": x_cf, "positive": ids["positive"], "negative": ids["negative"]})
            if self.max_items and len(items) >= self.max_items:
                break
        return items, dropped

    def _label_ids(self, tokenizer, prompt) -> dict[str, int]:
        """The single token id of the positive and of the negative candidate of this prompt."""
        labels: dict[str, str] = {}
        for text, label in prompt.candidates.get(self.cut, ()):
            if label in labels and label in (self.positive, self.negative):
                raise SuiteError(f"{self.origin}: template {prompt.template_id} compares several words for '{label}' "
                                 f"({labels[label]!r}, {text!r}: an ambiguous form); list templates whose form is unambiguous")
            labels[label] = text
        if self.positive not in labels or self.negative not in labels:
            raise SuiteError(f"{self.origin}: candidates at '{self.cut}' have no label '{self.positive}' "
                             f"or '{self.negative}' (labels: {', '.join(labels)}); set positive/negative to two of them")
        ids = {}
        for which in ("positive", "negative"):
            token_ids = tokenizer(labels[getattr(self, which)], add_special_tokens=False)["input_ids"]
            if len(token_ids) != 1:
                raise SuiteError(f"{self.origin}: candidate {labels[getattr(self, which)]!r} is {len(token_ids)} "
                                 "tokens; head effects need single-token candidates")
            ids[which] = token_ids[0]
        return ids


def item_means(pm, items: list[dict]) -> dict:
    """Each head's mean output over the x of every item (for mean ablation): computed from all items,
    so every chunk and shard ablates with the same means."""
    from ..interventions import head_means

    return head_means(pm, [item["x"] for item in items], pm.info.n_layers) if items else {}


def compute(pm, measure: HeadEffectsMeasure, items: list[dict], means: dict, bar) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Run the interventions of some items: (per item and head table, per item totals). `bar`
    counts items."""
    from ..interventions import item_effects

    L, H = pm.info.n_layers, pm.info.n_heads
    rows, totals = [], []
    for item in items:
        effects = item_effects(pm, item["x"], item["x_cf"], item["positive"], item["negative"], L, H, means,
                               top_k=None if measure.exact == "all" else measure.exact)
        totals.append({"item_id": item["item_id"], "template_id": item["template_id"], measure.slot: item["original"],
                       "y": effects["y"], "y_cf": effects["y_cf"], "te": effects["te"]})
        frame = pd.DataFrame({"item_id": item["item_id"], "layer": np.repeat(np.arange(L), H), "head": np.tile(np.arange(H), L)})
        for mode in INTERVENTIONS:
            frame[mode] = effects[mode].reshape(-1).numpy().astype("float64") if mode in effects else np.nan
        rows.append(frame)
        bar.update(1)
    table = pd.concat(rows, ignore_index=True) if rows else pd.DataFrame(columns=["item_id", "layer", "head", *INTERVENTIONS])
    return table, pd.DataFrame(totals)


def summary(measure: HeadEffectsMeasure, items: list[dict], dropped: list[str], seconds: float) -> dict:
    """What the manifest records about the head effects of a run."""
    return {"n_items": len(items), "dropped": dropped, "seconds": round(seconds, 3),
            "counterfactual": {measure.slot: measure.replacement}, "exact": measure.exact}


def plan_sha256(items: list[dict]) -> str:
    """A hash of the head-effects plan (item ids and their x, x' token ids): chunks of another plan are redone."""
    digest = hashlib.sha256()
    for item in items:
        digest.update(f"{item['item_id']}|{item['x'].tolist()}|{item['x_cf'].tolist()}|{item['positive']}|{item['negative']};".encode())
    return digest.hexdigest()
