"""The head-effects measure: which heads and layers carry the next-token contrast (interventions.py).

y = log p(positive) - log p(negative) at the cut, where positive and negative are candidate labels
of the next_token measure with the same cut (by default the analysis's two labels; a label with
several words at the cut counts all of them). Each counterfactual x' replaces one slot of the item
by one of the declared words (e.g. the occupation by "woman", "man" and "person"): one direction per
word. x and x' may tokenise to different lengths: patching aligns the slot's last token and what
follows it.

Two phases. Per item (in resumable chunks): the total effect, every head's attribution, the
exactly patched single heads (all of them with `exact: all`), each layer's attention and MLP
output, and all heads jointly. Then, with every item done: the heads chosen on one half of the
units (by exact effect, or by attribution with `exact: k`) are patched jointly on the other half
(cross-fitted), and with `exact: k` the suite's k heads (by attribution over all items) are
patched one by one on every item. This module chooses the items, checks everything a tokenizer can
tell before any weights load, and computes; the run writes what it returns.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
import torch

from ..errors import SuiteError
from ..spans import spread_key, token_spans
from ..yamllines import line_of, required_str

HEAD_COLUMNS = ("output_in", "output_out", "pattern_in", "attribution_output", "attribution_pattern")
LAYER_COLUMNS = ("attention_in", "attention_out", "mlp_in", "mlp_out")
SELECT_DEFAULT = 5  # heads per cross-fitted set


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

    @staticmethod
    def parse(ctx, doc, slots, template_ids, next_token, analysis, choice=None) -> HeadEffectsMeasure | None:
        node = doc.get("head_effects")
        if node is None:
            return None
        if isinstance(node, dict) and node.get("counterfactual") == "pair":
            return HeadEffectsMeasure._parse_pair(ctx, doc, node, template_ids, analysis, choice)
        if not isinstance(node, dict):
            ctx.fail(doc, "head_effects", "`head_effects` is a mapping with cut, counterfactual, positive, negative (candidate labels)")
        allowed = {"cut", "counterfactual", "positive", "negative", "templates", "max_items", "exact", "select"}
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
        chosen, counts, exact = _selection(ctx, node, template_ids)
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
                                  origin=f"{ctx.path}:{line_of(doc, 'head_effects')}")

    @staticmethod
    def _parse_pair(ctx, doc, node, template_ids, analysis, choice) -> HeadEffectsMeasure:
        """`counterfactual: pair`: x is an item's positive version (pro) and x' its negative one (anti),
        each followed by the referent_choice question; y is the model's referent choice."""
        allowed = {"counterfactual", "templates", "max_items", "exact", "select"}
        for key in node:
            if key not in allowed:
                ctx.fail(node, key, f"unknown key '{key}' in head_effects with counterfactual: pair; allowed: {', '.join(sorted(allowed))}")
        if not analysis.paired or choice is None:
            ctx.fail(node, "counterfactual", "counterfactual: pair patches an item's positive version into its negative one "
                     "and needs paired versions (analysis positive/negative) and a `referent_choice:` question for y")
        chosen, counts, exact = _selection(ctx, node, template_ids)
        unit = analysis.unit or next((c for c in analysis.clusters if c not in ("template_id", "item_id")), None)
        return HeadEffectsMeasure("", analysis.contrast, (analysis.negative,), analysis.positive, analysis.negative,
                                  tuple(chosen) if chosen else None, counts["max_items"], exact,
                                  counts["select"], unit, None, origin=f"{ctx.path}:{line_of(doc, 'head_effects')}",
                                  design="pair", choice=choice, referents=analysis.referents, answer=analysis.answer)

    def for_prompts(self, n_selected: int, n_total: int) -> HeadEffectsMeasure:
        """The measure for a run of n_selected of the suite's n_total prompts (--limit): max_items
        shrinks in proportion, so a small run stays small (items come from the selected prompts)."""
        if not self.max_items or n_selected >= n_total:
            return self
        return replace(self, max_items=math.ceil(self.max_items * n_selected / n_total))

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


def _selection(ctx, node, template_ids) -> tuple[list | None, dict, str | int]:
    """The keys both designs share: `templates` (ids of templates or sentence sets), `max_items`,
    `select`, `exact`."""
    chosen = node.get("templates")
    if chosen is not None:
        if not isinstance(chosen, list) or not chosen:
            ctx.fail(node, "templates", "`templates` lists template ids")
        for template_id in chosen:
            if template_id not in template_ids:
                ctx.fail(node, "templates", f"unknown template id '{template_id}'")
    counts = {}
    for key, default in (("max_items", None), ("select", SELECT_DEFAULT)):
        value = node.get(key, default)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            ctx.fail(node, key, f"{key} must be a positive integer")
        counts[key] = value
    exact = node.get("exact", "all")
    if exact != "all" and (not isinstance(exact, int) or isinstance(exact, bool) or exact < 1):
        ctx.fail(node, "exact", "exact is 'all' or the number k of heads (the suite's top k by attribution) to patch exactly")
    return chosen, counts, exact


def compute(pm, measure: HeadEffectsMeasure, items: list[dict], bar, singles=None, sets=None, first_phase=True) -> dict[str, pd.DataFrame]:
    """Patch some items: tables `items` (per item, counterfactual, layer and head), `layers` (per
    item, counterfactual and layer) and `totals` (per item and counterfactual). `singles` (L, H)
    are the heads patched one by one (default: all with exact: all, none otherwise); `sets(item,
    word)` gives named head sets patched jointly. The first phase adds each layer, all heads and the
    attribution. `bar` counts items."""
    from ..interventions import effects

    L, H = pm.info.n_layers, pm.info.n_heads
    if singles is None:
        singles = torch.full((L, H), measure.exact == "all")
    heads, per_layer, totals = [], [], []
    for item in items:
        for cf in item["counterfactuals"]:
            key = {"item_id": item["item_id"], "counterfactual": cf["word"]}
            r = effects(pm, item["x"], cf["x_cf"], cf["at"], cf["at_cf"], item["positive"], item["negative"], singles,
                        sets(item, cf["word"]) if sets else None, layers=first_phase, every=first_phase)
            totals.append({**key, "template_id": item["template_id"], measure.slot: item["original"],
                           "n_tokens": len(item["x"]), "n_tokens_cf": len(cf["x_cf"]), "y": r["y"], "y_cf": r["y_cf"], "te": r["te"],
                           **{k: r[k] for k in r if k.endswith(("_in", "_out")) and np.ndim(r[k]) == 0}})
            frame = pd.DataFrame({**key, "layer": np.repeat(np.arange(L), H), "head": np.tile(np.arange(H), L)})
            for column in HEAD_COLUMNS:
                frame[column] = r[column].reshape(-1).numpy()
            heads.append(frame)
            if first_phase:
                per_layer.append(pd.DataFrame({**key, "layer": np.arange(L), **{c: r[c].numpy() for c in LAYER_COLUMNS}}))
        bar.update(1)
    empty = lambda columns: pd.DataFrame(columns=["item_id", "counterfactual", *columns])  # noqa: E731
    return {"items": pd.concat(heads, ignore_index=True) if heads else empty(["layer", "head", *HEAD_COLUMNS]),
            "layers": pd.concat(per_layer, ignore_index=True) if per_layer else empty(["layer", *LAYER_COLUMNS]),
            "totals": pd.DataFrame(totals)}


def halves(items: list[dict]) -> dict[str, int]:
    """Item id -> half (0 or 1): units (e.g. occupations) sorted by the covariate, or by name,
    alternately assigned, so both halves span it; every item of a unit lies in one half."""
    units = pd.DataFrame({"unit": [i["unit"] for i in items], "x": [i["covariate"] for i in items]}).drop_duplicates("unit")
    units = units.sort_values(["x", "unit"], na_position="last", kind="stable").reset_index(drop=True)
    half = dict(zip(units["unit"], units.index % 2))
    return {i["item_id"]: int(half[i["unit"]]) for i in items}


def heads_text(mask: torch.Tensor) -> str:
    return " ".join(f"L{int(l)}H{int(h)}" for l, h in mask.nonzero().tolist())


def select(measure: HeadEffectsMeasure, items: list[dict], totals: pd.DataFrame, head_items: pd.DataFrame,
           n_layers: int, n_heads: int) -> dict:
    """The head sets of the second phase, from the first phase's tables: per counterfactual word
    and half, the `select` heads with the largest mean effect in the direction of the total effect
    on that half (exact patch-in effect with exact: all, else attribution); and with exact: k the
    suite's k heads (mean over words of the attribution in the direction of each word's effect)."""
    half = halves(items)
    score_column = "output_in" if measure.exact == "all" else "attribution_output"
    frame = head_items.assign(half=head_items["item_id"].map(half))
    te = totals.assign(half=totals["item_id"].map(half))
    chosen: dict[str, list[str]] = {}
    suite_score = np.zeros(n_layers * n_heads)
    for word, rows in frame.groupby("counterfactual", sort=False):
        chosen[word] = []
        for h in (0, 1):
            part = rows[rows["half"] == h]
            sign = np.sign(te.loc[(te["counterfactual"] == word) & (te["half"] == h), "te"].mean()) or 1.0
            means = part.groupby(["layer", "head"])[score_column].mean().reindex(
                pd.MultiIndex.from_product([range(n_layers), range(n_heads)])).to_numpy()
            chosen[word].append(_top(sign * means, measure.select, n_layers, n_heads))
        sign = np.sign(te.loc[te["counterfactual"] == word, "te"].mean()) or 1.0
        suite_score += sign * rows.groupby(["layer", "head"])["attribution_output"].mean().reindex(
            pd.MultiIndex.from_product([range(n_layers), range(n_heads)])).to_numpy()
    suite = _top(suite_score, measure.exact, n_layers, n_heads) if measure.exact != "all" else None
    return {"halves": half, "crossfit": chosen, "suite": suite}


def _top(score: np.ndarray, k: int, n_layers: int, n_heads: int) -> list[int]:
    """Flat indices l H + h of the k largest finite scores."""
    score = np.where(np.isfinite(score), score, -np.inf)
    return sorted(np.argsort(-score, kind="stable")[:min(k, n_layers * n_heads)].tolist())


def _mask(flat: list[int], n_layers: int, n_heads: int) -> torch.Tensor:
    mask = torch.zeros(n_layers * n_heads, dtype=torch.bool)
    mask[flat] = True
    return mask.view(n_layers, n_heads)


def compute_selected(pm, measure: HeadEffectsMeasure, items: list[dict], selection: dict, bar) -> dict[str, pd.DataFrame]:
    """Second phase: per item and word, the cross-fitted set (chosen on the other half) patched
    jointly, and with exact: k the suite's heads one by one."""
    L, H = pm.info.n_layers, pm.info.n_heads
    singles = _mask(selection["suite"], L, H) if selection["suite"] is not None else torch.zeros(L, H, dtype=torch.bool)

    def sets(item, word):
        return {"crossfit": _mask(selection["crossfit"][word][1 - selection["halves"][item["item_id"]]], L, H)}

    tables = compute(pm, measure, items, bar, singles=singles, sets=sets, first_phase=False)
    tables["items"] = tables["items"][np.tile(singles.flatten().numpy(), len(tables["items"]) // (L * H))]
    totals = tables["totals"][["item_id", "counterfactual", "crossfit_in", "crossfit_out"]].copy()
    totals["crossfit_heads"] = [heads_text(_mask(selection["crossfit"][w][1 - selection["halves"][i]], L, H))
                                for i, w in zip(totals["item_id"], totals["counterfactual"])]
    return {"items": tables["items"][["item_id", "counterfactual", "layer", "head", "output_in", "output_out", "pattern_in"]],
            "totals": totals}


def summary(measure: HeadEffectsMeasure, items: list[dict], dropped: list[dict], seconds: float, selection: dict | None = None,
            n_heads: int = 0) -> dict:
    """What the manifest records about the head effects of a run."""
    out = {"n_items": len(items), "n_pairs": sum(len(i["counterfactuals"]) for i in items), "dropped": dropped,
           "seconds": round(seconds, 3), "counterfactual": {measure.slot: list(measure.replacements)}, "exact": measure.exact,
           "select": measure.select, "halves_by": measure.unit, "positive": measure.positive, "negative": measure.negative,
           "design": measure.design}
    if selection is not None:
        heads = lambda flat: " ".join(f"L{i // n_heads}H{i % n_heads}" for i in flat)  # noqa: E731
        out["crossfit_heads"] = {w: [heads(s) for s in sets] for w, sets in selection["crossfit"].items()}
        out["exact_heads"] = heads(selection["suite"]) if selection["suite"] is not None else "all"
    return out


def plan_sha256(items: list[dict], measure: HeadEffectsMeasure | None = None) -> str:
    """A hash of the head-effects plan (item ids, x and x' token ids, aligned positions, labels,
    selection settings): chunks of another plan are redone."""
    digest = hashlib.sha256(repr((measure.exact, measure.select) if measure else None).encode())
    for item in items:
        cfs = [(c["word"], c["x_cf"].tolist(), int(c["at"][0]), int(c["at_cf"][0])) for c in item["counterfactuals"]]
        digest.update(f"{item['item_id']}|{item['x'].tolist()}|{cfs}|{item['positive']}|{item['negative']}|{item['unit']};".encode())
    return digest.hexdigest()
