"""The two phases of the head-effects measure, computed in batches (patching.py).

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

import numpy as np
import pandas as pd
import torch

from .. import patching
from ..attribution import Pairs, estimate
from ..interventions import behaviour_rows, label_ids
from .head_effects import HEAD_COLUMNS, LAYER_COLUMNS, HeadEffectsMeasure, heads_text

LAYER_ATTRIBUTION = ("attention_attribution", "mlp_attribution")


class _Builder:
    """Collects the variants of a chunk, block by block; each block is named by (pair, what, direction)."""

    def __init__(self, L: int, H: int):
        self.L, self.H, self.blocks = L, H, []

    def add(self, key, ends, labels, output=None, pattern=None, mlp=None) -> None:
        n = len(next(m for m in (output, pattern, mlp) if m is not None))
        zeros = torch.zeros(n, self.L, self.H, dtype=torch.bool)
        self.blocks.append((key, n, ends, labels, output if output is not None else zeros, pattern if pattern is not None else zeros,
                            mlp if mlp is not None else torch.zeros(n, self.L, dtype=torch.bool)))

    def run(self, pm, bank, share_prefix: bool) -> dict:
        """y of every block: key -> (n,) float64."""
        if not self.blocks:
            return {}
        ends = torch.tensor([e for _, n, e, *_ in self.blocks for _ in range(n)])  # (V, 4) base, donor, at, donor_at
        labels = [l for _, n, _, l, *_ in self.blocks for _ in range(n)]
        variants = patching.Variants(*ends.T, *(torch.cat([b[i] for b in self.blocks]) for i in (4, 5, 6)),
                                     label_ids([l[0] for l in labels]), label_ids([l[1] for l in labels]))
        y = patching.patched(pm, bank, variants, share_prefix)
        out, start = {}, 0
        for key, n, *_ in self.blocks:
            out[key] = y[start:start + n]
            start += n
        return out


def _recorded(pm, items: list[dict]) -> tuple[list[tuple], patching.Bank, torch.Tensor]:
    """The chunk's pairs (item, counterfactual, x index, x' index), its sequences (each x, then its
    x') recorded once, and the clean y of every sequence."""
    sequences, pairs, labels = [], [], []
    for item in items:
        x = len(sequences)
        sequences.append(item["x"])
        for cf in item["counterfactuals"]:
            pairs.append((item, cf, x, len(sequences)))
            sequences.append(cf["x_cf"])
        labels += [(item["positive"], item["negative"])] * (1 + len(item["counterfactuals"]))
    bank = patching.record(pm, sequences)
    clean = behaviour_rows(bank.logits, *(label_ids([l[i] for l in labels]) for i in (0, 1))).double().cpu()
    return pairs, bank, clean


def _directions(cf, x: int, x_cf: int) -> dict[str, tuple]:
    """(base, donor, at, donor_at) of patching in (x' into x) and out (x into x')."""
    at, at_cf = int(cf["at"][0]), int(cf["at_cf"][0])
    return {"in": (x, x_cf, at, at_cf), "out": (x_cf, x, at_cf, at)}


def screen(pm, measure: HeadEffectsMeasure, items: list[dict], held_out: set, bar, share_prefix: bool = True) -> dict[str, pd.DataFrame]:
    """The first phase of a chunk of items: tables items (per pair and head), layers (per pair and
    layer) and totals (per pair). `held_out`: item ids patched exactly, every head and layer."""
    L, H = pm.info.n_layers, pm.info.n_heads
    pairs, bank, clean = _recorded(pm, items)
    xs = torch.tensor([p[2] for p in pairs]).unique()  # each x once, in item order
    which = Pairs(torch.searchsorted(xs, torch.tensor([p[2] for p in pairs])), torch.tensor([p[3] for p in pairs]),
                  torch.tensor([int(cf["at"][0]) for _, cf, *_ in pairs]), torch.tensor([int(cf["at_cf"][0]) for _, cf, *_ in pairs]),
                  torch.tensor([len(cf["x_cf"]) == len(item["x"]) for item, cf, *_ in pairs]))
    attribution = estimate(pm, bank, xs, *(label_ids([i[side] for i in items]) for side in ("positive", "negative")), which)
    one_head = torch.eye(L * H, dtype=torch.bool).view(L * H, L, H)
    layer_heads = torch.eye(L, dtype=torch.bool)[:, :, None].expand(L, L, H)
    every = torch.ones(1, L, H, dtype=torch.bool)
    builder = _Builder(L, H)
    for k, (item, cf, x, x_cf) in enumerate(pairs):
        ends, label = _directions(cf, x, x_cf), (item["positive"], item["negative"])
        same_length = len(cf["x_cf"]) == len(item["x"])
        if same_length:
            builder.add((k, "all_heads_pattern", "in"), ends["in"], label, pattern=every)
        if measure.exact == "all" or item["item_id"] in held_out:
            for direction in ("in", "out"):
                builder.add((k, "output", direction), ends[direction], label, output=one_head)
                builder.add((k, "attention", direction), ends[direction], label, output=layer_heads)
                if bank.mlp is not None:
                    builder.add((k, "mlp", direction), ends[direction], label, mlp=torch.eye(L, dtype=torch.bool))
                builder.add((k, "all_heads", direction), ends[direction], label, output=every)
            if same_length:
                builder.add((k, "pattern", "in"), ends["in"], label, pattern=one_head)
    ys = builder.run(pm, bank, share_prefix)
    heads, per_layer, totals = [], [], []
    nan = lambda n: np.full(n, np.nan)  # noqa: E731
    for k, (item, cf, x, x_cf) in enumerate(pairs):
        effect = lambda what, direction: _delta(ys.get((k, what, direction)), direction, clean[x], clean[x_cf])  # noqa: E731
        key = {"item_id": item["item_id"], "counterfactual": cf["word"]}
        totals.append({**key, "template_id": item["template_id"], measure.slot: item["original"], "n_tokens": len(item["x"]),
                       "n_tokens_cf": len(cf["x_cf"]), "y": float(clean[x]), "y_cf": float(clean[x_cf]), "te": float(clean[x_cf] - clean[x]),
                       "held_out": item["item_id"] in held_out,
                       **{f"all_heads_{d}": _first(effect("all_heads", d)) for d in ("in", "out")},
                       "all_heads_pattern_in": _first(effect("all_heads_pattern", "in"))})
        columns = {"output_in": effect("output", "in"), "output_out": effect("output", "out"), "pattern_in": effect("pattern", "in"),
                   "attribution_output": attribution["attribution_output"][k].reshape(-1).numpy(),
                   "attribution_pattern": attribution["attribution_pattern"][k].reshape(-1).numpy()}
        heads.append(pd.DataFrame({**key, "layer": np.repeat(np.arange(L), H), "head": np.tile(np.arange(H), L),
                                   **{c: nan(L * H) if columns[c] is None else columns[c] for c in HEAD_COLUMNS}}))
        layers = {f"{what}_{d}": effect(what, d) for what in ("attention", "mlp") for d in ("in", "out")}
        per_layer.append(pd.DataFrame({**key, "layer": np.arange(L), **{c: nan(L) if layers[c] is None else layers[c] for c in LAYER_COLUMNS},
                                       "attention_attribution": attribution["attribution_output"][k].sum(-1).numpy(),
                                       "mlp_attribution": attribution["attribution_mlp"][k].numpy()}))
    bar.update(len(items))
    return {"items": pd.concat(heads, ignore_index=True), "layers": pd.concat(per_layer, ignore_index=True), "totals": pd.DataFrame(totals)}


def _delta(ys: torch.Tensor | None, direction: str, y: torch.Tensor, y_cf: torch.Tensor) -> np.ndarray | None:
    """Patch in: how far the patch moves y(x) toward y(x'); patch out: how much of y(x') it removes."""
    if ys is None:
        return None
    return (ys - y if direction == "in" else y_cf - ys).numpy()


def _first(values: np.ndarray | None) -> float:
    return float(values[0]) if values is not None else float("nan")


def selected(pm, measure: HeadEffectsMeasure, items: list[dict], selection: dict, bar, share_prefix: bool = True) -> dict[str, pd.DataFrame]:
    """The second phase of a chunk: per pair the suite's heads one by one (output in and out, pattern
    in) and the cross-fitted set jointly; tables items (the suite's heads only) and totals."""
    L, H = pm.info.n_layers, pm.info.n_heads
    singles = head_mask(selection["suite"], L, H) if selection["suite"] is not None else torch.zeros(L, H, dtype=torch.bool)
    chosen = torch.eye(L * H, dtype=torch.bool).view(L * H, L, H)[singles.flatten()]
    pairs, bank, clean = _recorded(pm, items)
    builder, sets = _Builder(L, H), []  # sets: each pair's cross-fitted heads (flat indices)
    for k, (item, cf, x, x_cf) in enumerate(pairs):
        ends, label = _directions(cf, x, x_cf), (item["positive"], item["negative"])
        sets.append(selection["crossfit"][cf["word"]][1 - selection["halves"][item["item_id"]]])
        crossfit = head_mask(sets[-1], L, H)
        for direction in ("in", "out"):
            builder.add((k, "crossfit", direction), ends[direction], label, output=crossfit[None])
            if len(chosen):
                builder.add((k, "output", direction), ends[direction], label, output=chosen)
        if len(chosen) and len(cf["x_cf"]) == len(item["x"]):
            builder.add((k, "pattern", "in"), ends["in"], label, pattern=chosen)
    ys = builder.run(pm, bank, share_prefix)
    heads, totals = [], []
    layer, head = singles.nonzero(as_tuple=True)
    for k, (item, cf, x, x_cf) in enumerate(pairs):
        effect = lambda what, direction: _delta(ys.get((k, what, direction)), direction, clean[x], clean[x_cf])  # noqa: E731
        key = {"item_id": item["item_id"], "counterfactual": cf["word"]}
        totals.append({**key, "crossfit_in": _first(effect("crossfit", "in")), "crossfit_out": _first(effect("crossfit", "out")),
                       "crossfit_heads": heads_text(sets[k], H)})
        columns = {c: effect(*c.split("_")) for c in ("output_in", "output_out", "pattern_in")}
        heads.append(pd.DataFrame({**key, "layer": layer.numpy(), "head": head.numpy(),
                                   **{c: np.full(len(layer), np.nan) if v is None else v for c, v in columns.items()}}))
    bar.update(len(items))
    empty = pd.DataFrame(columns=["item_id", "counterfactual", "layer", "head", "output_in", "output_out", "pattern_in"])
    return {"items": pd.concat(heads, ignore_index=True) if heads else empty, "totals": pd.DataFrame(totals)}


def halves(items: list[dict]) -> dict[str, int]:
    """Item id -> half (0 or 1): units (e.g. occupations) sorted by the covariate, or by name,
    alternately assigned, so both halves span it; every item of a unit lies in one half."""
    units = pd.DataFrame({"unit": [i["unit"] for i in items], "x": [i["covariate"] for i in items]}).drop_duplicates("unit")
    units = units.sort_values(["x", "unit"], na_position="last", kind="stable").reset_index(drop=True)
    half = dict(zip(units["unit"], units.index % 2))
    return {i["item_id"]: int(half[i["unit"]]) for i in items}


def select(measure: HeadEffectsMeasure, items: list[dict], totals: pd.DataFrame, head_items: pd.DataFrame,
           n_layers: int, n_heads: int) -> dict:
    """The head sets of the second phase, from the screen's tables: per counterfactual word and
    half, the `select` heads with the largest mean effect in the direction of the total effect on
    that half (exact patch-in effect with exact: all, else attribution); and with exact: k the
    suite's k heads (mean over words of the attribution in the direction of each word's effect),
    chosen on the items that are not held out."""
    half = halves(items)
    held_out = set(totals.loc[totals["held_out"], "item_id"]) if "held_out" in totals else set()
    score_column = "output_in" if measure.exact == "all" else "attribution_output"
    frame = head_items.assign(half=head_items["item_id"].map(half))
    te = totals.assign(half=totals["item_id"].map(half))
    grid = pd.MultiIndex.from_product([range(n_layers), range(n_heads)])
    chosen: dict[str, list[list[int]]] = {}
    suite_score = np.zeros(n_layers * n_heads)
    for word, rows in frame.groupby("counterfactual", sort=False):
        chosen[word] = []
        for h in (0, 1):
            part = rows[rows["half"] == h]
            sign = np.sign(te.loc[(te["counterfactual"] == word) & (te["half"] == h), "te"].mean()) or 1.0
            means = part.groupby(["layer", "head"])[score_column].mean().reindex(grid).to_numpy()
            chosen[word].append(_top(sign * means, measure.select, n_layers, n_heads))
        choosing = rows[~rows["item_id"].isin(held_out)]
        sign = np.sign(te.loc[(te["counterfactual"] == word) & ~te["item_id"].isin(held_out), "te"].mean()) or 1.0
        suite_score += sign * choosing.groupby(["layer", "head"])["attribution_output"].mean().reindex(grid).to_numpy()
    suite = _top(suite_score, measure.exact, n_layers, n_heads) if measure.exact != "all" else None
    return {"halves": half, "crossfit": chosen, "suite": suite}


def _top(score: np.ndarray, k: int, n_layers: int, n_heads: int) -> list[int]:
    """Flat indices l H + h of the k largest finite scores."""
    score = np.where(np.isfinite(score), score, -np.inf)
    return sorted(np.argsort(-score, kind="stable")[:min(k, n_layers * n_heads)].tolist())


def head_mask(flat: list[int], n_layers: int, n_heads: int) -> torch.Tensor:
    """Flat head indices l H + h -> an (L, H) bool mask."""
    mask = torch.zeros(n_layers * n_heads, dtype=torch.bool)
    mask[flat] = True
    return mask.view(n_layers, n_heads)
