"""The two phases of the head-effects measure, computed in batches (attnprobe.measures.head_effects).

Screen (every item, in resumable chunks): y(x), y(x') and the total effect; the attribution of
every head (output and pattern) and every layer (attention: the sum of its heads'; MLP output);
all heads' patterns patched in jointly. On the held-out items, and on every item with `exact: all`,
also every head (output in and out, pattern in), every layer's attention and MLP output (in and out)
and all heads jointly, patched exactly: the held-out items are what attribution is checked against,
and they take no part in choosing the suite's heads.

Selected (every item, once the screen is complete): the suite's k heads one by one (output in and
out, pattern in) and the cross-fitted set chosen on the other half of the units, jointly (in, out).

Patch in: y(x with the activation from x') - y(x); patch out: y(x') - y(x' with it from x).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from ...intervene.engine import Bank, Variants, patched, record
from ...intervene.items import Counterfactual, PatchItem, Selection
from ...intervene.selection import RANDOM_DRAWS, head_mask
from ...intervene.sites import behaviour_rows, label_ids
from .attribution import Pairs, estimate
from .declaration import HEAD_COLUMNS, LAYER_COLUMNS, HeadEffectsMeasure, heads_text


@dataclass(frozen=True)
class _Pair:
    """One (item, counterfactual) of a chunk and where its x and x' sit in the chunk's Bank."""

    item: PatchItem
    cf: Counterfactual
    x: int
    x_cf: int

    def ends(self, direction: str) -> tuple[int, int, int, int]:
        """(base, donor, at, donor_at) of patching in (x' into x) or out (x into x')."""
        if direction == "in":
            return self.x, self.x_cf, self.cf.at, self.cf.at_cf
        return self.x_cf, self.x, self.cf.at_cf, self.cf.at

    @property
    def labels(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.item.positive, self.item.negative


@dataclass(frozen=True)
class _Block:
    """n variants of one pair that share their ends and labels: what each of them patches."""

    key: tuple  # (pair index, what, direction)
    ends: tuple[int, int, int, int]
    labels: tuple
    output: torch.Tensor  # (n, L, H)
    pattern: torch.Tensor  # (n, L, H)
    mlp: torch.Tensor  # (n, L)


class _Builder:
    """Collects the variants of a chunk, block by block; each block is named by (pair, what, direction)."""

    def __init__(self, L: int, H: int):
        self.L, self.H, self.blocks = L, H, []

    def add(self, key, pair: _Pair, direction: str, output=None, pattern=None, mlp=None) -> None:
        n = len(next(m for m in (output, pattern, mlp) if m is not None))
        zeros = torch.zeros(n, self.L, self.H, dtype=torch.bool)
        self.blocks.append(
            _Block(
                key,
                pair.ends(direction),
                pair.labels,
                output if output is not None else zeros,
                pattern if pattern is not None else zeros,
                mlp if mlp is not None else torch.zeros(n, self.L, dtype=torch.bool),
            )
        )

    def run(self, pm, bank: Bank, share_prefix: bool) -> dict:
        """y of every block: key -> (n,) float64."""
        if not self.blocks:
            return {}
        sizes = [len(b.output) for b in self.blocks]
        ends = torch.tensor([b.ends for b, n in zip(self.blocks, sizes) for _ in range(n)])  # (V, 4)
        labels = [b.labels for b, n in zip(self.blocks, sizes) for _ in range(n)]
        variants = Variants(
            *ends.T,  # base, donor, at, donor_at
            torch.cat([b.output for b in self.blocks]),
            torch.cat([b.pattern for b in self.blocks]),
            torch.cat([b.mlp for b in self.blocks]),
            label_ids([positive for positive, _ in labels]),
            label_ids([negative for _, negative in labels]),
        )
        y = patched(pm, bank, variants, share_prefix)
        out, start = {}, 0
        for block, n in zip(self.blocks, sizes):
            out[block.key] = y[start : start + n]
            start += n
        return out


def _recorded(pm, items: list[PatchItem]) -> tuple[list[_Pair], Bank, torch.Tensor]:
    """The chunk's pairs, its sequences (each x, then its x') recorded once, and the clean y of
    every sequence."""
    sequences, pairs, labels = [], [], []
    for item in items:
        x = len(sequences)
        sequences.append(item.x)
        for cf in item.counterfactuals:
            pairs.append(_Pair(item, cf, x, len(sequences)))
            sequences.append(cf.x_cf)
        labels += [(item.positive, item.negative)] * (1 + len(item.counterfactuals))
    bank = record(pm, sequences)
    positive, negative = label_ids([p for p, _ in labels]), label_ids([n for _, n in labels])
    return pairs, bank, behaviour_rows(bank.logits, positive, negative).double().cpu()


def screen(
    pm, measure: HeadEffectsMeasure, items: list[PatchItem], held_out: set, share_prefix: bool = True
) -> dict[str, pd.DataFrame]:
    """The first phase of a chunk of items: tables items (per pair and head), layers (per pair and
    layer) and totals (per pair). `held_out`: item ids patched exactly, every head and layer."""
    L, H = pm.info.n_layers, pm.info.n_heads
    pairs, bank, clean = _recorded(pm, items)
    xs = torch.tensor([p.x for p in pairs]).unique()  # each x once, in item order
    which = Pairs(
        torch.searchsorted(xs, torch.tensor([p.x for p in pairs])),
        torch.tensor([p.x_cf for p in pairs]),
        torch.tensor([p.cf.at for p in pairs]),
        torch.tensor([p.cf.at_cf for p in pairs]),
        torch.tensor([p.item.same_length(p.cf) for p in pairs]),
    )
    positive, negative = label_ids([i.positive for i in items]), label_ids([i.negative for i in items])
    attribution = estimate(pm, bank, xs, positive, negative, which)
    ys = _patches(pairs, L, H, bank, measure.exact == "all", held_out).run(pm, bank, share_prefix)
    attribution["attention_attribution"] = attribution["attribution_output"].sum(-1)  # (n, L)
    attribution = {name: values.cpu().numpy() for name, values in attribution.items()}  # one copy each
    totals, exact = [], {}  # exact: column -> {pair: its L*H or L values}
    for k, pair in enumerate(pairs):
        effect = lambda what, direction, k=k, pair=pair: _delta(
            ys.get((k, what, direction)), direction, clean[pair.x], clean[pair.x_cf]
        )
        key = {"item_id": pair.item.item_id, "counterfactual": pair.cf.word}
        totals.append({**key, **_total(pair, measure.slot, clean, held_out, effect)})
        _collect(exact, k, effect, (*PATCHED, *LAYER_COLUMNS))
    return {
        "items": _head_rows(pairs, L, H, exact, attribution),
        "layers": _layer_rows(pairs, L, exact, attribution),
        "totals": pd.DataFrame(totals),
    }


def _patches(pairs, L: int, H: int, bank, every_item: bool, held_out: set) -> _Builder:
    """The patched passes of a chunk: every heads' pattern on each pair of equal lengths; on the items
    patched exactly (all of them, or the held-out ones) each head, layer, MLP and all heads, both ways."""
    one_head = torch.eye(L * H, dtype=torch.bool).view(L * H, L, H)
    layer_heads = torch.eye(L, dtype=torch.bool)[:, :, None].expand(L, L, H)
    every = torch.ones(1, L, H, dtype=torch.bool)
    builder = _Builder(L, H)
    for k, pair in enumerate(pairs):
        same_length = pair.item.same_length(pair.cf)
        if same_length:
            builder.add((k, "all_heads_pattern", "in"), pair, "in", pattern=every)
        if every_item or pair.item.item_id in held_out:
            for direction in ("in", "out"):
                builder.add((k, "output", direction), pair, direction, output=one_head)
                builder.add((k, "attention", direction), pair, direction, output=layer_heads)
                if bank.mlp is not None:
                    builder.add((k, "mlp", direction), pair, direction, mlp=torch.eye(L, dtype=torch.bool))
                builder.add((k, "all_heads", direction), pair, direction, output=every)
            if same_length:
                builder.add((k, "pattern", "in"), pair, "in", pattern=one_head)
    return builder


def _total(pair, slot: str, clean, held_out: set, effect) -> dict:
    """A pair's totals row (after its item id and counterfactual word)."""
    item, cf, x, x_cf = pair.item, pair.cf, pair.x, pair.x_cf
    return {
        "template_id": item.template_id,
        slot: item.original,
        "n_tokens": len(item.x),
        "n_tokens_cf": len(cf.x_cf),
        "y": float(clean[x]),
        "y_cf": float(clean[x_cf]),
        "te": float(clean[x_cf] - clean[x]),
        "held_out": item.item_id in held_out,
        **{f"all_heads_{d}": _first(effect("all_heads", d)) for d in ("in", "out")},
        "all_heads_pattern_in": _first(effect("all_heads_pattern", "in")),
    }


PATCHED = HEAD_COLUMNS[:3]  # the exact patches per head (the rest: the attribution)


def _keys(pairs, per: int) -> dict:
    """Each pair's item id and counterfactual word, repeated over its `per` rows."""
    return {
        "item_id": np.repeat(np.array([p.item.item_id for p in pairs], dtype=object), per),
        "counterfactual": np.repeat(np.array([p.cf.word for p in pairs], dtype=object), per),
    }


def _collect(exact: dict, k: int, effect, columns) -> None:
    """Pair k's exact patches of `columns` (named WHAT_DIRECTION) into exact[column][k], where patched."""
    for column in columns:
        if (values := effect(*column.rsplit("_", 1))) is not None:
            exact.setdefault(column, {})[k] = values


def _columns(n: int, width: int, exact: dict, names) -> dict:
    """(n * width,) values per column: each pair's exact patches in its rows, NaN where not patched."""
    out = {}
    for name in names:
        values = np.full((n, width), np.nan)
        for k, row in exact.get(name, {}).items():
            values[k] = row
        out[name] = values.reshape(-1)
    return out


def _head_rows(pairs, L: int, H: int, exact: dict, attribution: dict) -> pd.DataFrame:
    """Every pair's rows per head, pairs in order: the exact patches (NaN where not patched) and the
    attribution."""
    n = len(pairs)
    return pd.DataFrame(
        {
            **_keys(pairs, L * H),
            "layer": np.tile(np.repeat(np.arange(L), H), n),
            "head": np.tile(np.arange(H), n * L),
            **_columns(n, L * H, exact, PATCHED),
            **{c: attribution[c].reshape(-1) for c in HEAD_COLUMNS[3:]},
        }
    )


def _layer_rows(pairs, L: int, exact: dict, attribution: dict) -> pd.DataFrame:
    """Every pair's rows per layer: attention and MLP patched both ways, and their attribution."""
    n = len(pairs)
    return pd.DataFrame(
        {
            **_keys(pairs, L),
            "layer": np.tile(np.arange(L), n),
            **_columns(n, L, exact, LAYER_COLUMNS),
            "attention_attribution": attribution["attention_attribution"].reshape(-1),
            "mlp_attribution": attribution["attribution_mlp"].reshape(-1),
        }
    )


def _delta(ys: torch.Tensor | None, direction: str, y: torch.Tensor, y_cf: torch.Tensor) -> np.ndarray | None:
    """Patch in: how far the patch moves y(x) toward y(x'); patch out: how much of y(x') it removes."""
    if ys is None:
        return None
    return (ys - y if direction == "in" else y_cf - ys).cpu().numpy()


def _random_columns(values: np.ndarray | None) -> dict:
    """random_in_0 ... random_in_{RANDOM_DRAWS - 1}: NaN on items without the random draws."""
    values = np.full(RANDOM_DRAWS, np.nan) if values is None else values
    return {f"random_in_{r}": float(v) for r, v in enumerate(values)}


def _first(values: np.ndarray | None) -> float:
    return float(values[0]) if values is not None else float("nan")


def selected(
    pm, items: list[PatchItem], selection: Selection, share_prefix: bool = True
) -> dict[str, pd.DataFrame]:
    """The second phase of a chunk: per pair the suite's heads one by one (output in and out, pattern
    in) and the cross-fitted set jointly; tables items (the suite's heads only) and totals."""
    L, H = pm.info.n_layers, pm.info.n_heads
    singles = head_mask(selection.suite or (), L, H)
    chosen = torch.eye(L * H, dtype=torch.bool).view(L * H, L, H)[singles.flatten()]
    pairs, bank, clean = _recorded(pm, items)
    builder, sets = _Builder(L, H), []  # sets: each pair's cross-fitted heads (flat indices)
    for k, pair in enumerate(pairs):
        sets.append(selection.crossfit_for(pair.item, pair.cf.word))
        crossfit = head_mask(sets[-1], L, H)
        for direction in ("in", "out"):
            builder.add((k, "crossfit", direction), pair, direction, output=crossfit[None])
            if len(chosen):
                builder.add((k, "output", direction), pair, direction, output=chosen)
        draws = selection.random_for(pair.item, pair.cf.word)
        if draws:  # the null of the cross-fitted share: random sets of the same layers
            masks = torch.stack([head_mask(d, L, H) for d in draws])
            builder.add((k, "random", "in"), pair, "in", output=masks)
        if len(chosen) and pair.item.same_length(pair.cf):
            builder.add((k, "pattern", "in"), pair, "in", pattern=chosen)
    ys = builder.run(pm, bank, share_prefix)
    totals, exact = [], {}
    layer, head = singles.nonzero(as_tuple=True)
    for k, pair in enumerate(pairs):
        item, cf, x, x_cf = pair.item, pair.cf, pair.x, pair.x_cf
        effect = lambda what, direction, k=k, x=x, x_cf=x_cf: _delta(
            ys.get((k, what, direction)), direction, clean[x], clean[x_cf]
        )
        key = {"item_id": item.item_id, "counterfactual": cf.word}
        totals.append(
            {
                **key,
                "crossfit_in": _first(effect("crossfit", "in")),
                "crossfit_out": _first(effect("crossfit", "out")),
                "crossfit_heads": heads_text(sets[k], H),
                **_random_columns(effect("random", "in")),
            }
        )
        _collect(exact, k, effect, PATCHED)
    n, chosen_heads = len(pairs), len(layer)
    heads = pd.DataFrame(
        {
            **_keys(pairs, chosen_heads),
            "layer": np.tile(layer.cpu().numpy(), n),
            "head": np.tile(head.cpu().numpy(), n),
            **_columns(n, chosen_heads, exact, PATCHED),
        }
    )
    return {"items": heads, "totals": pd.DataFrame(totals)}
