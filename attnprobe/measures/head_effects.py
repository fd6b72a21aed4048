"""The head-effects measure: which heads and layers carry the next-token contrast (interventions.py).

y = log p(positive) - log p(negative) at the cut, where positive and negative are candidate labels
of the next_token measure with the same cut (by default the analysis's two labels; a label with
several words at the cut counts all of them). Each counterfactual x' replaces one slot of the item
by one of the declared words (e.g. the occupation by "woman", "man" and "person"): one direction per
word. x and x' may tokenise to different lengths: patching aligns the slot's last token and what
follows it.

Two phases (measures/head_effect_phases.py, computed in batches by patching.py). The screen, per
item in resumable chunks: the total effect, every head's and layer's attribution, all heads'
patterns jointly, and on the held-out items (every item with `exact: all`) every head and layer
patched exactly. Then, with every item screened: the suite's k heads (by attribution over the items
not held out) patched one by one on every item, and the heads chosen on one half of the units
patched jointly on the other half (cross-fitted). This module chooses the items, checks everything a
tokenizer can tell before any weights load, and summarises; the run writes the tables.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..errors import SuiteError
from ..spans import spread_key, token_spans
from ..yamllines import line_of, required_str

HEAD_COLUMNS = ("output_in", "output_out", "pattern_in", "attribution_output", "attribution_pattern")
LAYER_COLUMNS = ("attention_in", "attention_out", "mlp_in", "mlp_out")
SELECT_DEFAULT = 5  # heads per cross-fitted set
HELD_OUT_DEFAULT = 8  # items on which every head is patched exactly, to check attribution against
# Seconds per (item, counterfactual) pair for SmolLM2-135M (106M parameters besides the embeddings)
# on 2 CPU cores, measured by make demo on 2026-11-23 (x of 5.6 tokens on average): the screen, every
# head and layer exact (held-out items, exact: all), each head of exact: k, the cross-fitted set.
PAIR_SECONDS = {"screen": 0.041, "every_head": 2.9, "head": 0.008, "set": 0.01, "tokens": 5.6, "parameters": 106e6}


@dataclass(frozen=True)
class HeadEffectsMeasure:
    """Activation patching: y = log p(positive) - log p(negative) at `cut`; counterfactuals
    x' = x with `slot` replaced by each of `replacements`."""

    cut: str
    slot: str
    replacements: tuple[str, ...]
    positive: str  # candidate labels at the cut, e.g. female / male
    negative: str
    templates: tuple[str, ...] | None = None  # None: every template that has the cut and the slot
    max_items: int | None = None  # at most this many items, spread over templates and slot values
    exact: str | int = "all"  # single heads patched exactly: all, or the suite's top k by attribution
    select: int = SELECT_DEFAULT  # size of the head set chosen on one half and patched on the other
    unit: str | None = None  # prompts.csv column whose values split the items into halves (the analysis unit)
    covariate: str | None = None  # the halves both span it
    origin: str = ""
    design: str = "slot"  # slot: x' replaces a slot's words; pair: x' is the item's other version (pro -> anti)
    choice: object | None = None  # with design pair: the ReferentChoiceMeasure whose question ends x and x'
    referents: tuple[str, ...] = ()  # with design pair: y = log p(answer's first token) - log p(the other's)
    answer: str | None = None
    held_out: int = HELD_OUT_DEFAULT  # with exact: k, items patched exactly everywhere and left out of choosing the k heads

    @staticmethod
    def parse(ctx, doc, slots, template_ids, next_token, analysis, choice=None) -> HeadEffectsMeasure | None:
        node = doc.get("head_effects")
        if node is None:
            return None
        if isinstance(node, dict) and node.get("counterfactual") == "pair":
            return HeadEffectsMeasure._parse_pair(ctx, doc, node, template_ids, analysis, choice)
        if not isinstance(node, dict):
            ctx.fail(doc, "head_effects", "`head_effects` is a mapping with cut, counterfactual, positive, negative (candidate labels)")
        allowed = {"cut", "counterfactual", "positive", "negative", "templates", "max_items", "exact", "select", "held_out"}
        unknown = set(node) - allowed
        if unknown:
            hint = "; zero and mean ablation were replaced by patching in both directions" if unknown & {"ablations"} else ""
            ctx.fail(node, sorted(unknown)[0], f"unknown key '{sorted(unknown)[0]}' in head_effects; allowed: {', '.join(sorted(allowed))}{hint}")
        cut = required_str(ctx, node, "cut")
        if cut not in {m.cut for m in next_token}:
            ctx.fail(node, "cut", f"head_effects cut '{cut}' needs a next_token measure with the same cut (its candidates define y)")
        counterfactual = node.get("counterfactual")
        if not isinstance(counterfactual, dict) or len(counterfactual) != 1:
            ctx.fail(node, "counterfactual", "`counterfactual` names one slot and its replacement words, e.g. {occupation: [woman, man, person]}")
        (slot, words), = counterfactual.items()
        if slot not in slots:
            ctx.fail(node, "counterfactual", f"counterfactual slot '{slot}' is not defined under slots: ({', '.join(slots)})")
        words = [words] if isinstance(words, str) else words
        if not isinstance(words, list) or not words or not all(isinstance(w, str) and w.strip() for w in words) or len(set(words)) != len(words):
            ctx.fail(node, "counterfactual", "the replacements are non-empty, distinct words, e.g. [woman, man, person]")
        chosen, counts, exact = _selection(ctx, node, template_ids, analysis)
        labels = {}
        for key in ("positive", "negative"):
            default = getattr(analysis, key)
            if key not in node and default is None:
                ctx.fail(node, "cut", f"head_effects needs `{key}`: a candidate label at the cut (the analysis declares none)")
            labels[key] = str(node[key]) if key in node else default
            if key in node:
                required_str(ctx, node, key)
        unit = analysis.unit or next((c for c in analysis.clusters if c not in ("template_id", "item_id")), None)
        return HeadEffectsMeasure(cut, slot, tuple(str(w) for w in words), labels["positive"], labels["negative"],
                                  tuple(chosen) if chosen else None, counts["max_items"], exact, counts["select"],
                                  unit, analysis.covariate if unit == analysis.unit else None,
                                  origin=f"{ctx.path}:{line_of(doc, 'head_effects')}", held_out=counts["held_out"])

    @staticmethod
    def _parse_pair(ctx, doc, node, template_ids, analysis, choice) -> HeadEffectsMeasure:
        """`counterfactual: pair`: x is an item's positive version (pro) and x' its negative one (anti),
        each followed by the referent_choice question; y is the model's referent choice."""
        allowed = {"counterfactual", "templates", "max_items", "exact", "select", "held_out"}
        for key in node:
            if key not in allowed:
                ctx.fail(node, key, f"unknown key '{key}' in head_effects with counterfactual: pair; allowed: {', '.join(sorted(allowed))}")
        if not analysis.paired or choice is None:
            ctx.fail(node, "counterfactual", "counterfactual: pair patches an item's positive version into its negative one "
                     "and needs paired versions (analysis positive/negative) and a `referent_choice:` question for y")
        chosen, counts, exact = _selection(ctx, node, template_ids, analysis)
        unit = analysis.unit or next((c for c in analysis.clusters if c not in ("template_id", "item_id")), None)
        return HeadEffectsMeasure("", analysis.contrast, (analysis.negative,), analysis.positive, analysis.negative,
                                  tuple(chosen) if chosen else None, counts["max_items"], exact,
                                  counts["select"], unit, None, origin=f"{ctx.path}:{line_of(doc, 'head_effects')}",
                                  design="pair", choice=choice, referents=analysis.referents, answer=analysis.answer,
                                  held_out=counts["held_out"])

    def for_prompts(self, n_selected: int, n_total: int) -> HeadEffectsMeasure:
        """The measure for a run of n_selected of the suite's n_total prompts (--limit): max_items
        shrinks in proportion, so a small run stays small (items come from the selected prompts)."""
        if not self.max_items or n_selected >= n_total:
            return self
        return replace(self, max_items=math.ceil(self.max_items * n_selected / n_total))

    def held_out_ids(self, items: list[dict]) -> set[str]:
        """With exact: k, the items patched exactly everywhere: the first `held_out` of the plan (a
        spread over templates and slot values), at most half of the items; none with exact: all."""
        if self.exact == "all":
            return set()
        return {i["item_id"] for i in items[: min(self.held_out, len(items) // 2)]}

    def estimate_seconds(self, items: list[dict], parameters: float = PAIR_SECONDS["parameters"]) -> float:
        """The expected seconds of both phases on 2 CPU cores, from SmolLM2's measured speed scaled
        by sequence length and by the model's parameters besides the embeddings."""
        c, held = PAIR_SECONDS, self.held_out_ids(items)
        per_pair = c["screen"] + c["set"] + c["head"] * (0 if self.exact == "all" else self.exact)
        seconds = sum(len(i["counterfactuals"]) * len(i["x"]) / c["tokens"]
                      * (per_pair + c["every_head"] * (self.exact == "all" or i["item_id"] in held)) for i in items)
        return seconds * parameters / c["parameters"]

    def check_family(self, routes_attention: bool, spec: str) -> None:
        """Interventions run inside attnprobe's attention function: refuse a family that bypasses it."""
        if not routes_attention:
            raise SuiteError(f"{self.origin}: head_effects need a model whose attention goes through attnprobe's attention "
                             f"function, and '{spec}' bypasses it (eager-only family); run it with --no-head-effects "
                             "or remove `head_effects:` from the suite")

    def items(self, tokenizer, encoded) -> tuple[list[dict], list[dict]]:
        """The items to patch, each with one counterfactual per replacement word, and the
        (item, word) pairs dropped with the reason; tokenizer only.

        x is the prompt's tokens before the cut; x' the same sentence with the slot replaced
        (capitalised like the original), tokenised and cut the same way. Patching aligns the slot's
        last token and every later one; a pair is dropped only when the words after the slot
        tokenise differently in x and x'."""
        from ..suite.analysis import value_of

        if self.design == "pair":
            return self._pair_items(tokenizer, encoded)
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
                dropped.append({"item_id": p.item_id, "counterfactual": None, "reason": f"the {self.slot} comes after the cut"})
                continue
            x = torch.tensor(e.ids[: e.spans[self.cut][0]])
            last = e.spans[self.slot][1] - 1  # the slot's last token in x
            counterfactuals = []
            for word in self.replacements:
                original = p.text[s0:s1]
                replacement = word[:1].upper() + word[1:] if original[:1].isupper() else word
                text_cf = p.text[:s0] + replacement + p.text[s1:]
                shift = len(replacement) - len(original)
                spans_cf = {self.cut: tuple(c + shift for c in p.spans[self.cut]), self.slot: (s0, s0 + len(replacement))}
                enc = tokenizer(text_cf, return_offsets_mapping=True)
                spans = token_spans([tuple(o) for o in enc["offset_mapping"]], spans_cf)
                x_cf = torch.tensor(enc["input_ids"][: spans[self.cut][0]])
                last_cf = spans[self.slot][1] - 1
                if not torch.equal(x[last + 1:], x_cf[last_cf + 1:]):
                    dropped.append({"item_id": p.item_id, "counterfactual": word,
                                    "reason": f"the words after {replacement!r} tokenise differently than after {original!r}"})
                    continue
                counterfactuals.append({"word": word, "x_cf": x_cf, "at": torch.arange(last, len(x)),
                                        "at_cf": torch.arange(last_cf, len(x_cf))})
            if not counterfactuals:
                continue
            covariate = value_of(p, self.covariate) if self.covariate else None
            items.append({"item_id": p.item_id, "template_id": p.template_id, "original": p.slots.get(self.slot, p.text[s0:s1]),
                          "unit": str(value_of(p, self.unit)) if self.unit else p.item_id,
                          "covariate": float(covariate) if isinstance(covariate, (int, float)) else np.nan,
                          "x": x, "counterfactuals": counterfactuals, "positive": ids["positive"], "negative": ids["negative"]})
            if self.max_items and len(items) >= self.max_items:
                break
        return items, dropped

    def _pair_items(self, tokenizer, encoded) -> tuple[list[dict], list[dict]]:
        """Items of a paired suite: x = the positive version + the question, x' = the negative version +
        its question; y compares the first tokens of the two referents' words at the question's end.
        Patching starts at the first token where x and x' differ; they must have equal length."""
        from ..suite.analysis import value_of
        from .referent_choice import candidate_words

        versions: dict[str, dict] = {}
        for e in encoded:
            if not self.templates or e.prompt.template_id in self.templates:
                versions.setdefault(e.prompt.item_id, {})[str(value_of(e.prompt, self.slot))] = e
        items, dropped = [], []
        for item_id in sorted(versions, key=spread_key):
            pair = versions[item_id]
            if self.positive not in pair or self.negative not in pair:
                continue
            e, e_cf = pair[self.positive], pair[self.negative]
            p = e.prompt
            questions = [self.choice.question(v.prompt) for v in (e, e_cf)]
            answer = self.answer if self.answer in self.referents else str(value_of(p, self.answer))
            other = next((r for r in self.referents if r != answer), None)
            words = [candidate_words(p, r) for r in (answer, other)]
            if None in questions or None in words or other is None:
                dropped.append({"item_id": item_id, "counterfactual": self.negative, "reason": "a referent or the question's span is missing"})
                continue
            x, x_cf = (torch.tensor(list(v.ids) + tokenizer.encode(q, add_special_tokens=False)) for v, q in zip((e, e_cf), questions))
            if len(x) != len(x_cf):
                dropped.append({"item_id": item_id, "counterfactual": self.negative,
                                "reason": f"the {self.positive} and {self.negative} versions tokenise to different lengths"})
                continue
            differ = (x != x_cf).nonzero()
            start = int(differ[0]) if len(differ) else len(x) - 1
            ids = [tokenizer.encode(w, add_special_tokens=False)[0] for w in words]  # first token of each referent's words
            if ids[0] == ids[1]:
                dropped.append({"item_id": item_id, "counterfactual": self.negative, "reason": "both referents start with the same token"})
                continue
            items.append({"item_id": item_id, "template_id": p.template_id, "original": self.positive,
                          "unit": str(value_of(p, self.unit)) if self.unit else item_id, "covariate": np.nan, "x": x,
                          "counterfactuals": [{"word": self.negative, "x_cf": x_cf, "at": torch.arange(start, len(x)),
                                               "at_cf": torch.arange(start, len(x))}],
                          "positive": [ids[0]], "negative": [ids[1]]})
            if self.max_items and len(items) >= self.max_items:
                break
        return items, dropped

    def _label_ids(self, tokenizer, prompt) -> dict[str, list[int]]:
        """The token ids of the positive and of the negative words at this prompt's cut (several
        words for a label count together, e.g. " him" and " his" against " her")."""
        words: dict[str, list[str]] = {}
        for text, label in prompt.candidates.get(self.cut, ()):
            words.setdefault(label, []).append(text)
        if self.positive not in words or self.negative not in words:
            raise SuiteError(f"{self.origin}: candidates at '{self.cut}' have no label '{self.positive}' "
                             f"or '{self.negative}' (labels: {', '.join(words)}); set positive/negative to two of them")
        ids = {}
        for which in ("positive", "negative"):
            ids[which] = []
            for text in words[getattr(self, which)]:
                token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                if len(token_ids) != 1:
                    raise SuiteError(f"{self.origin}: candidate {text!r} is {len(token_ids)} tokens; head effects need single-token candidates")
                ids[which].append(token_ids[0])
        return ids


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
    for key, default, least in (("max_items", None, 1), ("select", SELECT_DEFAULT, 1), ("held_out", HELD_OUT_DEFAULT, 0)):
        value = node.get(key, default)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            ctx.fail(node, key, f"{key} must be an integer of at least {least}")
        counts[key] = value
    exact = node.get("exact", "all")
    if exact != "all" and (not isinstance(exact, int) or isinstance(exact, bool) or exact < 1):
        ctx.fail(node, "exact", "exact is 'all' or the number k of heads (the suite's top k by attribution) to patch exactly")
    return chosen, counts, exact


def summary(measure: HeadEffectsMeasure, items: list[dict], dropped: list[dict], seconds: float, selection: dict | None = None,
            n_heads: int = 0) -> dict:
    """What the manifest records about the head effects of a run."""
    out = {"n_items": len(items), "n_pairs": sum(len(i["counterfactuals"]) for i in items), "dropped": dropped,
           "seconds": round(seconds, 3), "counterfactual": {measure.slot: list(measure.replacements)}, "exact": measure.exact,
           "select": measure.select, "held_out": len(measure.held_out_ids(items)), "halves_by": measure.unit, "positive": measure.positive, "negative": measure.negative,
           "design": measure.design}
    if selection is not None:
        out["crossfit_heads"] = {w: [heads_text(s, n_heads) for s in sets] for w, sets in selection["crossfit"].items()}
        out["exact_heads"] = heads_text(selection["suite"], n_heads) if selection["suite"] is not None else "all"
    return out


def heads_text(flat: list[int], n_heads: int) -> str:
    """Flat head indices l H + h as text: "L10H6 L23H5"."""
    return " ".join(f"L{i // n_heads}H{i % n_heads}" for i in flat)


def plan_sha256(items: list[dict], measure: HeadEffectsMeasure | None = None) -> str:
    """A hash of the head-effects plan (item ids, x and x' token ids, aligned positions, labels,
    selection settings): chunks of another plan are redone."""
    digest = hashlib.sha256(repr((measure.exact, measure.select, measure.held_out) if measure else None).encode())
    for item in items:
        cfs = [(c["word"], c["x_cf"].tolist(), int(c["at"][0]), int(c["at_cf"][0])) for c in item["counterfactuals"]]
        digest.update(f"{item['item_id']}|{item['x'].tolist()}|{cfs}|{item['positive']}|{item['negative']}|{item['unit']};".encode())
    return digest.hexdigest()
