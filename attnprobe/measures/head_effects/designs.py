"""The counterfactual designs of the head-effects measure, one class each.

`SlotSwap`: x' is x with one slot's words replaced by each declared word (the occupation -> "woman",
"man", "person"); y = log p(positive) - log p(negative) at the next_token cut. `PairSwap`: x is an
item's positive version (pro) and x' its negative one (anti), each followed by the referent_choice
question; y compares the first tokens of the two referents' words. Both share how items are chosen
(templates, max_items, held-out items) and build typed `PatchItem`s from the tokenizer alone, before
any weights load.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from ...errors import SuiteError
from ...intervene.items import Counterfactual, Dropped, PatchItem
from ...schema.analysis import value_of
from ...schema.spans import candidate_words, spread_key, token_spans

SELECT_DEFAULT = 5  # heads per cross-fitted set
HELD_OUT_DEFAULT = 8  # items on which every head is patched exactly, to check attribution against


def per_value_column(word: str) -> str | None:
    """The prompts' column a replacement written `{slot.column}` reads per item (e.g.
    {occupation.anti_stereotype}: each occupation replaced by its own anti-stereotypical partner),
    None for a literal word."""
    match = re.fullmatch(r"\{(\w+)\.(\w+)\}", word)
    return f"{match[1]}_{match[2]}" if match else None


def replacement_text(prompt, word: str) -> str | None:
    """What replaces the slot in this prompt: the word, or the prompt's value of its column."""
    column = per_value_column(word)
    if column is None:
        return word
    value = value_of(prompt, column)
    return str(value).strip() if value is not None and str(value).strip() else None


@dataclass(frozen=True)
class HeadEffectsMeasure:
    """What both designs share: x' replaces `slot` by each of `replacements`; y = log p(positive)
    - log p(negative) (candidate labels); which items, and how the heads are chosen."""

    design: ClassVar[str]
    slot: str
    replacements: tuple[str, ...]
    positive: str
    negative: str
    templates: tuple[str, ...] | None = None  # None: every template that has what the design needs
    max_items: int | None = None  # at most this many items, spread over templates and slot values
    exact: str | int = "all"  # single heads patched exactly: all, or the suite's top k by attribution
    select: int = SELECT_DEFAULT  # size of the head set chosen on one half and patched on the other
    unit: str | None = None  # prompts.csv column whose values split the items into halves
    covariate: str | None = None  # the halves both span it
    origin: str = ""
    # with exact: k, items patched exactly everywhere and left out of choosing the k heads
    held_out: int = HELD_OUT_DEFAULT

    def for_prompts(self, n_selected: int, n_total: int) -> HeadEffectsMeasure:
        """The measure for a run of n_selected of the suite's n_total prompts (--limit): max_items
        shrinks in proportion, so a small run stays small (items come from the selected prompts)."""
        if not self.max_items or n_selected >= n_total:
            return self
        return replace(self, max_items=math.ceil(self.max_items * n_selected / n_total))

    def held_out_ids(self, items: list[PatchItem]) -> set[str]:
        """With exact: k, the items patched exactly everywhere: the first `held_out` of the plan (a
        spread over templates and slot values), at most half of the items; none with exact: all."""
        if self.exact == "all":
            return set()
        return {i.item_id for i in items[: min(self.held_out, len(items) // 2)]}

    def check_family(self, routes_attention: bool, spec: str) -> None:
        """Interventions run inside attnprobe's attention function: refuse a family that bypasses it."""
        if not routes_attention:
            raise SuiteError(
                f"{self.origin}: head_effects need a model whose attention goes through attnprobe's "
                f"attention function, and '{spec}' bypasses it (eager-only family); run it with "
                "--no-head-effects or remove `head_effects:` from the suite"
            )

    def items(self, tokenizer, encoded) -> tuple[list[PatchItem], list[Dropped]]:
        raise NotImplementedError

    def some_items(self, tokenizer, encoded) -> tuple[list[PatchItem], list[Dropped]]:
        """`items`, refused in one line (before any weights load) when every pair was dropped."""
        items, dropped = self.items(tokenizer, encoded)
        if not items:
            reasons = "; ".join(sorted({d.reason for d in dropped})[:2]) or "no prompt has the spans it needs"
            raise SuiteError(
                f"{self.origin}: head_effects have no item to patch ({len(dropped)} dropped: {reasons}); "
                "change the templates or the counterfactual, or run with --no-head-effects"
            )
        return items, dropped

    def wanted(self, prompt) -> bool:
        return not self.templates or prompt.template_id in self.templates

    def unit_of(self, prompt) -> str:
        return str(value_of(prompt, self.unit)) if self.unit else prompt.item_id


@dataclass(frozen=True)
class SlotSwap(HeadEffectsMeasure):
    """x' = x with `slot` replaced by each of `replacements`; y at the next_token cut `cut`."""

    design: ClassVar[str] = "slot"
    cut: str = ""

    def items(self, tokenizer, encoded) -> tuple[list[PatchItem], list[Dropped]]:
        """The items to patch, each with one counterfactual per replacement word, and the
        (item, word) pairs dropped with the reason.

        x is the prompt's tokens before the cut; x' the same sentence with the slot replaced
        (capitalised like the original), tokenised and cut the same way. Patching aligns the slot's
        last token and every later one; a pair is dropped only when the words after the slot
        tokenise differently in x and x'."""
        import torch  # items hold token tensors; a suite's parse does not load torch

        items, dropped, seen = [], [], set()
        for e in sorted(encoded, key=lambda e: spread_key(e.prompt.item_id)):
            p = e.prompt
            if p.item_id in seen or self.cut not in p.spans or self.slot not in p.spans or not self.wanted(p):
                continue
            seen.add(p.item_id)
            ids = self._label_ids(tokenizer, p)
            s0, s1 = p.spans[self.slot]
            if s0 >= p.spans[self.cut][0]:
                dropped.append(Dropped(p.item_id, None, f"the {self.slot} comes after the cut"))
                continue
            x = torch.tensor(e.ids[: e.spans[self.cut][0]])
            last = e.spans[self.slot][1] - 1  # the slot's last token in x
            counterfactuals = []
            for word in self.replacements:
                made = self._counterfactual(tokenizer, p, x, last, word)
                if isinstance(made, str):
                    dropped.append(Dropped(p.item_id, word, made))
                else:
                    counterfactuals.append(made)
            if not counterfactuals:
                continue
            covariate = value_of(p, self.covariate) if self.covariate else None
            items.append(
                PatchItem(
                    p.item_id,
                    p.template_id,
                    p.slots.get(self.slot, p.text[s0:s1]),
                    self.unit_of(p),
                    float(covariate) if isinstance(covariate, (int, float)) else np.nan,
                    x,
                    tuple(counterfactuals),
                    tuple(ids["positive"]),
                    tuple(ids["negative"]),
                )
            )
            if self.max_items and len(items) >= self.max_items:
                break
        return items, dropped

    def _counterfactual(self, tokenizer, p, x, last: int, word: str) -> Counterfactual | str:
        """x' of prompt `p` (tokens `x`, the slot's last at `last`) with the slot replaced by `word`, or
        why the pair is dropped."""
        import torch

        s0, s1 = p.spans[self.slot]
        original = p.text[s0:s1]
        text = replacement_text(p, word)
        if not text:
            return f"the {self.slot} has no value of {word}"
        replacement = text[:1].upper() + text[1:] if original[:1].isupper() else text
        text_cf = p.text[:s0] + replacement + p.text[s1:]
        shift = len(replacement) - len(original)
        spans_cf = {
            self.cut: tuple(c + shift for c in p.spans[self.cut]),
            self.slot: (s0, s0 + len(replacement)),
        }
        enc = tokenizer(text_cf, return_offsets_mapping=True)
        spans = token_spans([tuple(o) for o in enc["offset_mapping"]], spans_cf)
        x_cf = torch.tensor(enc["input_ids"][: spans[self.cut][0]])
        last_cf = spans[self.slot][1] - 1
        if not torch.equal(x[last + 1 :], x_cf[last_cf + 1 :]):
            return f"the words after {replacement!r} tokenise differently than after {original!r}"
        return Counterfactual(word, x_cf, last, last_cf)

    def _label_ids(self, tokenizer, prompt) -> dict[str, list[int]]:
        """The token ids of the positive and of the negative words at this prompt's cut (several
        words for a label count together, e.g. " him" and " his" against " her")."""
        words: dict[str, list[str]] = {}
        for text, label in prompt.candidates.get(self.cut, ()):
            words.setdefault(label, []).append(text)
        if self.positive not in words or self.negative not in words:
            raise SuiteError(
                f"{self.origin}: candidates at '{self.cut}' have no label '{self.positive}' or "
                f"'{self.negative}' (labels: {', '.join(words)}); set positive/negative to two of them"
            )
        ids = {}
        for which in ("positive", "negative"):
            ids[which] = []
            for text in words[getattr(self, which)]:
                token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                if len(token_ids) != 1:
                    raise SuiteError(
                        f"{self.origin}: candidate {text!r} is {len(token_ids)} tokens; head effects "
                        "need single-token candidates"
                    )
                ids[which].append(token_ids[0])
        return ids


@dataclass(frozen=True)
class PairSwap(HeadEffectsMeasure):
    """x = an item's positive version + the referent_choice question, x' = its negative version +
    its question; y = log p(the answer's first token) - log p(the other referent's)."""

    design: ClassVar[str] = "pair"
    choice: object | None = None  # the ReferentChoiceMeasure whose question ends x and x'
    referents: tuple[str, ...] = ()
    answer: str | None = None

    def items(self, tokenizer, encoded) -> tuple[list[PatchItem], list[Dropped]]:
        """Patching starts at the first token where x and x' differ; they must have equal length."""
        import torch  # items hold token tensors; a suite's parse does not load torch

        versions: dict[str, dict] = {}
        for e in encoded:
            if self.wanted(e.prompt):
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
                dropped.append(
                    Dropped(item_id, self.negative, "a referent or the question's span is missing")
                )
                continue
            x, x_cf = (
                torch.tensor(list(v.ids) + tokenizer.encode(q, add_special_tokens=False))
                for v, q in zip((e, e_cf), questions)
            )
            if len(x) != len(x_cf):
                reason = f"the {self.positive} and {self.negative} versions tokenise to different lengths"
                dropped.append(Dropped(item_id, self.negative, reason))
                continue
            differ = (x != x_cf).nonzero()
            start = int(differ[0]) if len(differ) else len(x) - 1
            # the first token of each referent's words
            ids = [tokenizer.encode(w, add_special_tokens=False)[0] for w in words]
            if ids[0] == ids[1]:
                dropped.append(Dropped(item_id, self.negative, "both referents start with the same token"))
                continue
            cf = Counterfactual(self.negative, x_cf, start, start)
            item = PatchItem(
                item_id, p.template_id, self.positive, self.unit_of(p), np.nan, x, (cf,), (ids[0],), (ids[1],)
            )
            items.append(item)
            if self.max_items and len(items) >= self.max_items:
                break
        return items, dropped
