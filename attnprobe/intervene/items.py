"""What patching works on, typed: an item (x and its counterfactuals), and the heads chosen.

Shapes: x is (T,) token ids; a counterfactual's x' is (T',); positions from `at` (in x) and
`at_cf` (in x') on are aligned one to one and are where patching acts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # items are made (designs) and read (phases) where torch is loaded
    import torch


@dataclass(frozen=True)
class Counterfactual:
    """x' of one item: the word that replaced the slot (or the other version's label), its tokens,
    and the first aligned position in x and in x' (patching runs from there to the end)."""

    word: str
    x_cf: torch.Tensor  # (T',)
    at: int  # first aligned position in x
    at_cf: int  # the same position in x'


@dataclass(frozen=True)
class PatchItem:
    """One item to patch: x (the prompt's tokens before the cut), its counterfactuals, the token ids
    of the positive and negative labels (y = log p(positive) - log p(negative) after x), and the
    unit and covariate that split the items into halves."""

    item_id: str
    template_id: str
    original: str  # the slot's words in x (or the positive label)
    unit: str
    covariate: float  # NaN when the suite has none
    x: torch.Tensor  # (T,)
    counterfactuals: tuple[Counterfactual, ...]
    positive: tuple[int, ...]
    negative: tuple[int, ...]

    def same_length(self, cf: Counterfactual) -> bool:
        """x and x' of equal length: a donor's pattern applies to the base's keys."""
        return len(cf.x_cf) == len(self.x)


@dataclass(frozen=True)
class Dropped:
    """An (item, counterfactual) pair left out, and why."""

    item_id: str
    counterfactual: str | None
    reason: str


@dataclass(frozen=True)
class Selection:
    """The heads the second phase patches: per item its fold (unit half x template half, see
    selection.folds); per counterfactual word one cross-fitted set per fold, chosen on the opposite
    fold (the other units and the other templates), so no item tests heads chosen on its own unit
    or its own template; the suite's k heads (None with exact: all). Heads are flat indices l H + h."""

    folds: dict[str, int]
    crossfit: dict[str, tuple[tuple[int, ...], ...]]  # word -> the set each fold is tested with
    suite: tuple[int, ...] | None
    # the null of the cross-fitted share: word -> per fold, random head sets of the same layers,
    # patched on `random_items` only
    random: dict[str, tuple[tuple[tuple[int, ...], ...], ...]] = field(default_factory=dict)
    random_items: frozenset[str] = frozenset()

    def crossfit_for(self, item: PatchItem, word: str) -> tuple[int, ...]:
        """The set chosen on the fold opposite the item's."""
        return self.crossfit[word][self.folds[item.item_id]]

    def random_for(self, item: PatchItem, word: str) -> tuple[tuple[int, ...], ...]:
        """The random sets this item is patched with (none unless it is one of `random_items`)."""
        if item.item_id not in self.random_items or word not in self.random:
            return ()
        return self.random[word][self.folds[item.item_id]]
