"""Choosing heads from the screen's tables: the folds (unit half x template half), the cross-fitted
sets and the suite's k heads (flat indices l H + h), as a typed `Selection`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from ..heads import HeadSet
from .items import PatchItem, Selection

if TYPE_CHECKING:
    import torch

RANDOM_DRAWS = 20  # random head sets per cross-fitted set: the null of its share (p resolves to 1/21)
RANDOM_EVERY = 4  # ... patched on every 4th item: about a sixth more work in the selected phase


def folds(items: list[PatchItem]) -> dict[str, int]:
    """Item id -> fold 2 u + t: u the unit's half (units, e.g. occupations, sorted by the covariate or
    by name and alternately assigned, so both halves span it), t the template's half (template ids
    sorted and alternately assigned). Every item of a unit shares u, every item of a template t."""
    units = pd.DataFrame(
        {"unit": [i.unit for i in items], "x": [i.covariate for i in items]}
    ).drop_duplicates("unit")
    units = units.sort_values(["x", "unit"], na_position="last", kind="stable").reset_index(drop=True)
    unit_half = dict(zip(units["unit"], units.index % 2))
    template_half = {t: k % 2 for k, t in enumerate(sorted({i.template_id for i in items}))}
    return {i.item_id: 2 * int(unit_half[i.unit]) + template_half[i.template_id] for i in items}


def opposite(fold: int, n_templates: int) -> int:
    """The fold a fold's heads are chosen on: the other units and (with two or more templates) the
    other templates."""
    unit, template = divmod(fold, 2)
    return 2 * (1 - unit) + (1 - template if n_templates > 1 else template)


def select(
    measure,
    items: list[PatchItem],
    totals: pd.DataFrame,
    head_items: pd.DataFrame,
    n_layers: int,
    n_heads: int,
) -> Selection:
    """The head sets of the second phase, from the screen's tables: per counterfactual word and fold,
    the `select` heads with the largest mean effect in the direction of the total effect on the
    opposite fold (exact patch-in effect with exact: all, else attribution; a fold without items
    borrows the other unit half); and with exact: k the suite's k heads (mean over words of the
    attribution in the direction of each word's effect), chosen on the items that are not held out."""
    fold = folds(items)
    n_templates = len({i.template_id for i in items})
    held_out = set(totals.loc[totals["held_out"], "item_id"]) if "held_out" in totals else set()
    score_column = "output_in" if measure.exact == "all" else "attribution_output"
    frame = head_items.assign(fold=head_items["item_id"].map(fold))
    te = totals.assign(fold=totals["item_id"].map(fold))
    grid = pd.MultiIndex.from_product([range(n_layers), range(n_heads)])
    chosen: dict[str, list[tuple[int, ...]]] = {}
    suite_score = np.zeros(n_layers * n_heads)
    for word, rows in frame.groupby("counterfactual", sort=False):
        scores = quarter_scores(rows, te[te["counterfactual"] == word], score_column, n_templates, grid)
        chosen[word] = [tuple(top_heads(scores[f], measure.select, n_layers, n_heads)) for f in range(4)]
        choosing = rows[~rows["item_id"].isin(held_out)]
        sign = (
            np.sign(te.loc[(te["counterfactual"] == word) & ~te["item_id"].isin(held_out), "te"].mean())
            or 1.0
        )
        suite_score += (
            sign * choosing.groupby(["layer", "head"])["attribution_output"].mean().reindex(grid).to_numpy()
        )
    suite = (
        tuple(top_heads(suite_score, measure.exact, n_layers, n_heads)) if measure.exact != "all" else None
    )
    rng = np.random.default_rng(0)
    random = {
        word: tuple(random_sets(chosen_set, n_heads, rng) for chosen_set in sets)
        for word, sets in chosen.items()
    }
    sample = frozenset(i.item_id for n, i in enumerate(items) if n % RANDOM_EVERY == 0)
    return Selection(fold, {word: tuple(sets) for word, sets in chosen.items()}, suite, random, sample)


def quarter_scores(
    rows: pd.DataFrame, totals: pd.DataFrame, column: str, n_templates: int, grid: pd.MultiIndex
) -> list[np.ndarray]:
    """Per tested fold (0-3), each head's score from the opposite fold (or, when it has no items, the
    other unit half): the mean of `column` over those items of one word, in the direction of their
    mean total effect. `rows`: per item and head, with `fold`; `totals`: per item, with te and fold."""
    out = []
    for tested in range(4):
        on = [opposite(tested, n_templates)]
        if not (rows["fold"] == on[0]).any():  # e.g. one unit half has no item of a template half
            on = [f for f in range(4) if f // 2 != tested // 2]
        sign = np.sign(totals.loc[totals["fold"].isin(on), "te"].mean()) or 1.0
        means = rows[rows["fold"].isin(on)].groupby(["layer", "head"])[column].mean().reindex(grid)
        out.append(sign * means.to_numpy())
    return out


def random_sets(
    heads: tuple[int, ...], n_heads: int, rng, draws: int = RANDOM_DRAWS
) -> tuple[tuple[int, ...], ...]:
    """`draws` sets of heads drawn at random layer for layer from the layers of `heads` (a set with
    two heads of layer 25 gets two distinct random heads of layer 25): what a set of that size and
    depth carries without being chosen (the edits' null, distinct sets: edits.sweep.measure.null_sets)."""
    out = []
    for _ in range(draws):
        picked: set[int] = set()
        for head in heads:
            layer = head // n_heads
            options = [layer * n_heads + h for h in range(n_heads) if layer * n_heads + h not in picked]
            picked.add(int(rng.choice(options)))
        out.append(tuple(sorted(picked)))
    return tuple(out)


def top_heads(score: np.ndarray, k: int, n_layers: int, n_heads: int) -> list[int]:
    """Flat indices l H + h of the k largest finite scores."""
    score = np.where(np.isfinite(score), score, -np.inf)
    return sorted(np.argsort(-score, kind="stable")[: min(k, n_layers * n_heads)].tolist())


def head_mask(flat, n_layers: int, n_heads: int) -> torch.Tensor:
    """Flat head indices l H + h -> an (L, H) bool mask (HeadSet.mask)."""
    return HeadSet.from_flat(flat, n_heads).mask(n_layers, n_heads)


def chosen_heads(scores: np.ndarray, k: int, n_heads: int) -> tuple[tuple[int, int], ...]:
    """The k heads with the largest finite scores (flat l H + h) as (layer, head) pairs."""
    return tuple((i // n_heads, i % n_heads) for i in top_heads(scores, k, len(scores) // n_heads, n_heads))
