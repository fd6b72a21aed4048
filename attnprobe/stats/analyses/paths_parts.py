"""Each receiver's output effect split into parts that add up (paths_parts.csv), and each head's role
by the size of its parts (issue 53).

On the pairs where x and x' have equal length, the receiver's inputs form a 2 x 2 design: its values
(x's or x''s) and its pattern (x's or x''s); its output from x' is both at once. With the values split
at the occupation's position p, the output effect is, item by item, exactly

  value at the occupation   y(v'_p) - y                            (the value path)
  value elsewhere           y(every v') - y(v'_p)
  pattern                   y(A') - y                              (the pattern path)
  interaction               y(A', every v') - y(every v') - y(A') + y

where y(A', every v') is the output path (patching both inputs gives the output, a test checks it).
Each part is a share of TE's covariate gradient and a fraction of the receiver's own output gradient
(ratios of slopes, with CIs by inverting the part's own slope test: a CI excludes 0 exactly when
the part's p is below 0.05).

A head's role, by size (sets have none). A head *carries* the gradient when its output path's p,
Holm over the table's heads, is below 0.05. It *moves* the signal when its value at the occupation
is at least 70% of its output (CI low at least 50%) and every other part is within 20% of it (CI
within 30%); it *reads elsewhere* when its value elsewhere is, and *computes* it from where it attends
when its pattern is; *mixed* when it carries and no part dominates by that rule; *none shown* when it
does not carry. Every row of a head uses the same items: the equal-length ones on which the head was
chosen without the item (its cross-fitted top 5 holds it), all of them for heads given by --heads.

In every comparison (paths.py): denoising runs x' with the receiver's inputs from x, so y, y' swap
roles above and each part is what restoring that input brings back; x' is the reference word's
version or another occupation's sentence. A role holds in one comparison; the table gives each.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ...heads import HeadSet
from ..inference import cluster_slope_test, holm, slope_ratio_test
from .paths_tables import (
    CROSSFIT,
    DENOISING,
    LISTED,
    NOISING,
    NULL,
    TOP,
    comparisons,
    item_design,
    share_rows,
)

PARTS = ("value at the occupation", "value elsewhere", "pattern", "interaction", "output")
DOMINANT, DOMINANT_LOW = 0.7, 0.5  # a role's part: at least this fraction of the output, CI low at least
SMALL, SMALL_CI = 0.2, 0.3  # every other part within +-SMALL, its CI within +-SMALL_CI
ROLES = {"value at the occupation": "moves", "value elsewhere": "reads elsewhere", "pattern": "computes"}
CIRCUIT, WITHOUT = "circuit", "circuit without"  # the circuit test's head sets (paths.measure_circuits)
FAITHFUL, FAITHFUL_LOW, LEFT, COST = 0.8, 0.6, 0.2, 0.05  # its targets (issue 53; circuit_table)


def part_effects(raw: pd.DataFrame, receiver: str) -> tuple[pd.DataFrame, np.ndarray]:
    """(items, effects (n, 5) in PARTS order) of one receiver on the items with every path measured."""
    rows = raw[raw["receiver"] == receiver]
    wide = rows.pivot_table(index="item_id", columns="path", values="y_patched", sort=False)
    paths = ["value", "all values", "pattern", "output"]
    if not set(paths) <= set(wide.columns):
        return rows.iloc[[]], np.zeros((0, len(PARTS)))
    wide = wide[paths].dropna()
    items = rows.drop_duplicates("item_id").set_index("item_id").loc[wide.index]
    y = items["y"].to_numpy()[:, None]
    value, every, pattern, output = (wide.to_numpy() - y).T
    effects = np.c_[value, every - value, pattern, output - every - pattern, output]
    return items, effects


def parts_table(raw: pd.DataFrame) -> pd.DataFrame:
    """One row per reference, direction, receiver and part, in PARTS order, with each head's role
    (paths_items' raw rows); a head's rows on the items it was chosen without, in every comparison."""
    chosen = _chosen_without(raw)
    tables = []
    for reference, direction, rows in comparisons(raw):
        table = _direction_parts(rows, chosen)
        if len(table):
            table.insert(0, "direction", direction)
            table.insert(0, "reference", reference)
            tables.append(table)
    return pd.concat(tables, ignore_index=True) if tables else pd.DataFrame()


def _direction_parts(raw: pd.DataFrame, chosen: dict | None) -> pd.DataFrame:
    raw = raw[~raw["receiver"].str.startswith(NULL) & (raw["receiver"] != CROSSFIT)]
    rows = []
    for receiver in raw["receiver"].unique():
        items, effects = part_effects(raw, receiver)
        is_head = receiver not in (TOP, LISTED)
        if is_head and chosen is not None:  # selection-free items only
            keep = np.array([receiver in chosen.get(i, ()) for i in items.index], dtype=bool)
            items, effects = items[keep], effects[keep]
        if len(items) < 3:
            continue
        rows.extend(_receiver_rows(receiver, items, effects, is_head, chosen is not None))
    table = pd.DataFrame(rows)
    return _roles(table) if len(table) else table


def _chosen_without(raw: pd.DataFrame) -> dict | None:
    """Per item id, the heads of its cross-fitted top 5 (chosen without it); None when the run has none
    (heads given by --heads)."""
    rows = raw[(raw["receiver"] == CROSSFIT) & (raw["path"] == "value")]
    if "heads" not in raw or not len(rows):
        return None
    return {item: set(str(heads).split()) for item, heads in zip(rows["item_id"], rows["heads"])}


def _receiver_rows(receiver: str, items, effects: np.ndarray, is_head: bool, crossfit: bool) -> list[dict]:
    x, te, w, clusters = item_design(items)
    of_te = slope_ratio_test(x, effects, te, w, clusters)
    of_output = slope_ratio_test(x, effects, effects[:, -1], w, clusters)
    p = cluster_slope_test(x, effects, w, clusters)["p"]
    note = "equal length" + (", chosen without the item" if is_head and crossfit else "")
    return [
        {
            "receiver": receiver,
            "part": part,
            "items": note,
            "n_items": len(items),
            "gradient_share": of_te["ratio"][j],
            "gradient_share_ci_low": of_te["ci_low"][j],
            "gradient_share_ci_high": of_te["ci_high"][j],
            "gradient_p": p[j],  # the test of both shares' numerator, the part's slope
            "of_output": of_output["ratio"][j],
            "of_output_ci_low": of_output["ci_low"][j],
            "of_output_ci_high": of_output["ci_high"][j],
            "is_head": is_head,
        }
        for j, part in enumerate(PARTS)
    ]


def _roles(table: pd.DataFrame) -> pd.DataFrame:
    """Each head's role by the size rule, its output p Holm-adjusted over the table's heads."""
    output = table[(table["part"] == "output") & table["is_head"]].set_index("receiver")
    p_holm = pd.Series(holm(output["gradient_p"].to_numpy()), index=output.index)
    roles = {
        r: role_by_size(table[table["receiver"] == r].set_index("part"), p_holm[r]) for r in output.index
    }
    table["output_p_holm"] = table["receiver"].map(p_holm)
    table["role"] = table["receiver"].map(roles)
    return table.drop(columns="is_head")


def role_by_size(parts: pd.DataFrame, output_p_holm: float) -> str:
    """The rule in the module's docstring, on one head's rows (indexed by part)."""
    if not output_p_holm < 0.05:
        return "none shown"
    f, low, high = (parts[c] for c in ("of_output", "of_output_ci_low", "of_output_ci_high"))
    for part, role in ROLES.items():
        others = [o for o in PARTS[:4] if o != part]
        dominant = f[part] >= DOMINANT and low[part] >= DOMINANT_LOW
        small = all(abs(f[o]) <= SMALL and low[o] >= -SMALL_CI and high[o] <= SMALL_CI for o in others)
        if dominant and small:
            return role
    return "mixed"


def circuit_heads(parts: pd.DataFrame, reference: str) -> list[tuple[int, int]]:
    """The circuit hypothesis against `reference`: the heads that move the signal (role "moves") in
    its noising parts, in the table's order."""
    if not len(parts):
        return []
    movers = parts[
        (parts["reference"] == reference) & (parts["direction"] == NOISING) & (parts["role"] == "moves")
    ]
    return [head for name in movers["receiver"].unique() for head in HeadSet.parse(name)]


NO_CIRCUIT = "no head meets the mover rule, so there is no circuit to test (paths.csv says why)"


def circuit_table(raw: pd.DataFrame) -> pd.DataFrame:
    """paths_circuit.csv, per comparison (x' the reference word's version or another occupation's):
    the circuit C (its movers' value input at the occupation) path-patched alone, as shares of TE's
    covariate gradient with CIs and p (paths_tables.share_rows), each against its target:

      faithfulness          restoring C alone in x' brings back  >= 80%, CI low >= 60%
      left after knockout   1 - what knocking C out of x removes  <= 20%
      cost of a head        faithfulness lost without that head   >= 5 points (minimality)

    (Wang et al. 2022's faithfulness, completeness and minimality, on the gradient.)"""
    rows = []
    for reference in raw["reference"].unique() if len(raw) else ():
        own = raw[raw["reference"] == reference]
        rows += _faithful_and_minimal(reference, own[own["direction"] == DENOISING])
        rows += _knocked_out(reference, own[own["direction"] == NOISING])
    return pd.DataFrame(rows)


def _faithful_and_minimal(reference: str, raw: pd.DataFrame) -> list[dict]:
    wide = raw.pivot_table(index="item_id", columns="receiver", values="y_patched", sort=False).dropna()
    items = raw.drop_duplicates("item_id").set_index("item_id").loc[wide.index]
    restored = wide.to_numpy() - items["y"].to_numpy()[:, None]  # y(x' + C's values from x) - y(x')
    whole = restored[:, list(wide.columns).index(CIRCUIT)]
    heads = raw.loc[raw["receiver"] == CIRCUIT, "heads"].iloc[0]
    names = str(heads).split()
    costs = [  # what C brings back less what C without the head does (C itself for a lone head)
        whole - restored[:, list(wide.columns).index(f"{WITHOUT} {n}")] if len(names) > 1 else whole
        for n in names
    ]
    labels = [{"measure": "faithfulness", "target": f">= {FAITHFUL:.0%}, CI low >= {FAITHFUL_LOW:.0%}"}]
    labels += [{"measure": f"cost of {n}", "target": f">= {COST:.0%}"} for n in names]
    out = share_rows(items, np.column_stack([whole, *costs]), labels)
    for row in out:
        share = row["gradient_share"]
        row["met"] = (
            bool(share >= FAITHFUL and row["gradient_share_ci_low"] >= FAITHFUL_LOW)
            if row["measure"] == "faithfulness"
            else bool(share >= COST)
        )
    return [{"reference": reference, "heads": heads, **row} for row in out]


def _knocked_out(reference: str, raw: pd.DataFrame) -> list[dict]:
    rows = raw[raw["receiver"] == CIRCUIT].set_index("item_id")
    items = rows.drop(columns=["y_patched"])
    te = (items["y_cf"] - items["y"]).to_numpy()
    left = te - (rows["y_patched"] - items["y"]).to_numpy()  # TE less what knocking C out removes
    (row,) = share_rows(
        items, left[:, None], [{"measure": "left after knockout", "target": f"<= {LEFT:.0%}"}]
    )
    row["met"] = bool(row["gradient_share"] <= LEFT)
    return [{"reference": reference, "heads": rows["heads"].iloc[0], **row}]
