"""The circuit tables from the raw rows alone (runs.py): circuits.csv, circuit_parts.csv and
circuit_agreement.csv, and the raw rows as circuit_runs.parquet and circuit_attribution.parquet.

Shares are of TE's covariate gradient (ratio of slopes, TE = y(x) - y(x')), with two-way
cluster-robust Fieller intervals (unit x template, paths_tables.effect_shares); the interval is the
share's own inference, so no p stands beside it.

  faithfulness          slope of y(circuit) - y(x') over the slope of y(x) - y(x')
  left after knockout   slope of y(x') - y(x without C) over the same: what C's absence leaves
  worst subset          for subsets K of C (random halves, the top half, and where C meets the
                        target otherwise the greedy worst subset: search.py), the share C less K
                        keeps minus the share the model less K keeps; the K of largest |difference|
  random                the faithfulness of RANDOM_CIRCUITS circuits of n random parts (point
                        estimates: their median and range)

A circuit meets the target where its held-out faithfulness is 80% to 120% (restoring more than the
model does is no credit) with the interval's low end >= 60%, at most 20% is left after knocking
it out, and no subset's difference exceeds 20% either way (Hanna et al. 2024's and Wang et al.
2022's measures). In-sample figures choose and judge on the same items: the held-out ones are the
ones to quote.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ...stats.analyses.paths_tables import effect_shares, gradient_shares, wide_effects
from ...store import atomic_write, write_parquet, write_table
from .graph import EMBEDDING, size_ranks
from .runs import (
    ALONE,
    ATTRIBUTED,
    EDGES,
    FAITHFULNESS,
    GREEDY,
    HELD_OUT,
    IN_SAMPLE,
    KNOCKED_OUT,
    LESS_C,
    LESS_M,
    RANDOM,
)

FAITHFUL, FAITHFUL_LOW, OVERSHOOT, LEFT = 0.8, 0.6, 1.2, 0.2
RAW = ("circuit_runs", "circuit_attribution", "circuit_edges")
NO_RUNS = "no comparison had pairs to patch"
OTHER_GRAIN = "the circuits were searched at the grain of {} (see circuits.csv)"


def write_circuits(directory, raw: pd.DataFrame) -> list[str]:
    """The raw frames and the tables made from them into the run directory; returns a line per
    comparison naming its smallest circuit that meets the target (smallest_met)."""
    frames = {t: raw.loc[raw["table"] == t].drop(columns="table").dropna(axis=1, how="all") for t in RAW}
    for t, frame in frames.items():
        atomic_write(Path(directory) / f"{t}.parquet", lambda p, frame=frame: write_parquet(frame, p))
    runs, attribution, edges = (frames[t] for t in RAW)
    table = circuits_table(runs)
    write_table(directory, "circuits", table, NO_RUNS)
    parts = parts_table(attribution)
    write_table(directory, "circuit_parts", parts, OTHER_GRAIN.format("edges") if len(edges) else NO_RUNS)
    shares = edges.rename(columns={"edge": "part"}) if len(edges) else parts
    write_table(directory, "circuit_agreement", agreement_table(runs, shares), NO_RUNS)
    found = table[table["circuit"] == ATTRIBUTED] if len(table) else table
    return [smallest_met(rows) for _, rows in found.groupby("reference", sort=False)]


def smallest_met(rows: pd.DataFrame) -> str:
    """One comparison's verdict: its smallest circuit meeting the target short of the whole model
    (which restores everything by construction), or the best held-out faithfulness short of it."""
    reference, parts = rows["reference"].iloc[0], rows["size"].max()
    unit = rows["grain"].iloc[0] if "grain" in rows else "parts"
    row, met = chosen_circuit(rows)
    if met:
        left = round(row["left_after_knockout"], 2) + 0.0  # no "-0%"
        return (
            f"circuits against {reference!r}: the smallest meeting the target has {row['size']} of {parts} "
            f"{unit}{_touching(row, unit)}, held-out faithfulness {row['held_out']:.0%} "
            f"[{row['held_out_ci_low']:.0%}, {row['held_out_ci_high']:.0%}], {left:.0%} left after "
            f"knockout, {_worst(row)}; area under the held-out curve {row['area_held_out']:.2f} "
            f"(random circuits {row['area_random']:.2f})"
        )
    plateau = "" if row is None else f"; the best held-out is {row['held_out']:.0%} at {row['size']}"
    return f"circuits against {reference!r}: no circuit short of all {parts} {unit} meets the target{plateau}"


def chosen_circuit(rows: pd.DataFrame) -> tuple[pd.Series | None, bool]:
    """(row, met) of the circuit one comparison's found circuits (rows in size order) are summed up
    by: the smallest meeting the target short of the whole model (which restores everything by
    construction), else the one of best held-out faithfulness short of it (None where none has a
    held-out figure). The verdict line, the saved circuit and the report's graph read it."""
    short = rows[rows["size"] < rows["size"].max()]
    met = short[short["met"]]
    if len(met):
        return met.iloc[0], True
    return (short.loc[short["held_out"].idxmax()] if short["held_out"].notna().any() else None), False


def _worst(row) -> str:
    """The worst subset's difference, and whether the greedy search was among the subsets."""
    if not row["worst_subset"]:
        return "no subset (one part)"
    searched = "greedy searched" if row["greedy_searched"] else "greedy not searched at this size"
    return f"worst subset {row['worst_subset_difference']:+.0%} ({row['worst_subset']}; {searched})"


def _touching(row, unit: str) -> str:
    """For an edge circuit: how many edges survive pruning and how many parts they join."""
    if unit != "edges":
        return ""
    return f" ({row['edges']:.0f} after pruning, joining {row['parts']:.0f} parts with the embeddings)"


def _shares(items: pd.DataFrame, effect: np.ndarray) -> dict:
    """Share of TE's covariate gradient each column of effect carries, TE = y(x) - y(x')."""
    flipped = items.rename(columns={"y": "y_cf", "y_cf": "y"})  # te = y_cf - y in effect_shares
    return effect_shares(flipped, effect)["gradient"]


def circuits_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per comparison, family (the circuits found, a hypothesis) and size: faithfulness in-sample and
    held out, left after knocking the held-out circuit out, the random circuits of that size, and
    whether the target is met."""
    out = []
    runs = runs.astype({"size": int})
    for reference, own in runs.groupby("reference", sort=False):
        key = ["family", "measure", "circuit", "size"]
        items, effect, columns = wide_effects(own[own["measure"] != ALONE], key, "y_patched")
        measured = ~np.isnan(effect).all(0)  # the pivot crosses every level of the key: keep runs made
        effect, columns = effect[:, measured], [c for c, kept in zip(columns, measured) if kept]
        # y(run) - y(x'): a circuit's restored effect; for a knockout, what is left without C
        share = _shares(items, effect + (items["y"] - items["y_cf"]).to_numpy()[:, None])
        at = {c: j for j, c in enumerate(columns)}
        random = pd.DataFrame(
            [(c[3], share["ratio"][j]) for c, j in at.items() if c[2].startswith(RANDOM)],
            columns=["size", "f"],
        ).groupby("size")["f"]
        counts = own.drop_duplicates(["family", "size"]).set_index(["family", "size"])
        for family, n in dict.fromkeys((c[0], c[3]) for c in at if not c[2].startswith(RANDOM)):
            row = {
                "reference": reference,
                "grain": counts.loc[(family, n), "grain"] if "grain" in counts else "parts",
                "circuit": family,
                "size": n,
                "edges": np.nan,  # after pruning, at the grain of edges
                "parts": int(counts.loc[(family, n), "parts"]) if "parts" in counts else n + 1,
                "n_items": len(items),
            }
            if row["grain"] == EDGES:
                row["edges"] = int(counts.loc[(family, n), "kept"])
            for name, circuit in (("in_sample", IN_SAMPLE), ("held_out", HELD_OUT)):
                j = at[(family, FAITHFULNESS, circuit, n)]
                row[name] = share["ratio"][j]
                row[f"{name}_ci_low"], row[f"{name}_ci_high"] = share["ci_low"][j], share["ci_high"][j]
            j = at[(family, KNOCKED_OUT, HELD_OUT, n)]
            for column, k in (
                ("left_after_knockout", "ratio"),
                ("left_ci_low", "ci_low"),
                ("left_ci_high", "ci_high"),
            ):
                row[column] = share[k][j] if n else np.nan  # size 0 knocks nothing out
            row.update(_worst_subset(items, effect, at, family, n))
            drawn = random.get_group(n) if n in random.groups else pd.Series(dtype=float)
            row["random_median"], row["random_low"], row["random_high"] = (
                drawn.median(),
                drawn.min(),
                drawn.max(),
            )
            row["met"] = bool(
                FAITHFUL <= row["held_out"] <= OVERSHOOT  # restoring more than the model is no credit
                and row["held_out_ci_low"] >= FAITHFUL_LOW
                and row["left_after_knockout"] <= LEFT
                and not abs(row["worst_subset_difference"]) > LEFT  # not measured (under 2 parts): no test
            )
            out.append(row)
    return _with_areas(pd.DataFrame(out))


def _worst_subset(items: pd.DataFrame, effect: np.ndarray, at: dict, family: str, n: int) -> dict:
    """Completeness over subsets K of the held-out circuit (runs._subsets; Wang et al. 2022): per K
    the share of the gradient C less K keeps minus the share the model less K keeps, with its
    interval; the K of largest |difference| (a complete circuit keeps as much as the model)."""
    names = sorted({c[2] for c in at if c[0] == family and c[1] == LESS_C and c[3] == n})
    out = {"worst_subset": "", "worst_subset_difference": np.nan, "greedy_searched": GREEDY in names}
    out.update({f"worst_subset_difference_ci_{end}": np.nan for end in ("low", "high")})
    if not names:
        return out
    difference = [  # y(C less K) - y(model less K)
        effect[:, at[(family, LESS_C, k, n)]] - effect[:, at[(family, LESS_M, k, n)]] for k in names
    ]
    share = _shares(items, np.column_stack(difference))
    j = int(np.nanargmax(np.abs(share["ratio"])))
    out["worst_subset"], out["worst_subset_difference"] = names[j], share["ratio"][j]
    out["worst_subset_difference_ci_low"], out["worst_subset_difference_ci_high"] = (
        share["ci_low"][j],
        share["ci_high"][j],
    )
    return out


def _with_areas(table: pd.DataFrame) -> pd.DataFrame:
    """Per comparison, the area under faithfulness against the fraction of parts in the circuit
    (trapezoids over the sizes measured, 0 to every part; MIB's summary of a circuit method), held
    out, in-sample and for the random circuits' median, on the found circuits' rows: 1 is a circuit
    that restores everything with no part, 0.5 a straight line."""
    if not len(table):
        return table
    found = table["circuit"] == ATTRIBUTED
    for reference, rows in table[found].groupby("reference", sort=False):
        x = rows["size"].to_numpy(dtype=float) / rows["size"].max()
        on = found & (table["reference"] == reference)
        for name, column in (
            ("held_out", "held_out"),
            ("in_sample", "in_sample"),
            ("random", "random_median"),
        ):
            y = rows[column].to_numpy(dtype=float)
            table.loc[on, f"area_{name}"] = float(((y[1:] + y[:-1]) / 2 * np.diff(x)).sum())
    return table


def parts_table(attribution: pd.DataFrame) -> pd.DataFrame:
    """Per comparison and part: its EAP and EAP-IG attribution's share of TE's covariate gradient on
    every item (paths_tables.gradient_shares: the ratio of slopes, as graph.part_scores ranks them),
    and its rank by |EAP-IG| (the circuit of size n on every item: the embeddings and the parts
    ranked below n)."""
    out = []
    if "reference" not in attribution:  # searched at the grain of edges: no part was attributed
        return pd.DataFrame()
    for reference, own in attribution.groupby("reference", sort=False):
        table = pd.DataFrame({"reference": reference, "part": own["part"].unique()})
        for method in ("eap", "eap_ig"):
            table[f"{method}_share"] = gradient_shares(own, method, "part").reindex(table["part"]).to_numpy()
        ranks = size_ranks(table["eap_ig_share"].where(table["part"] != EMBEDDING))
        table["rank"] = pd.array(ranks, dtype="Int64")
        out.append(table.sort_values("rank", na_position="first", kind="stable"))
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame()


def agreement_table(runs: pd.DataFrame, shares: pd.DataFrame) -> pd.DataFrame:
    """Per comparison and part patched alone (runs.ALONE): its exact share of TE's covariate gradient
    (the effect of x with the part from x'), with its interval, beside EAP's and EAP-IG's first-order
    shares (`shares`: parts_table's, or the edges' with the edge as `part`); and, repeated on each
    row, the rank correlation of each method with the exact shares (Spearman over the parts patched)
    and the part whose share each misses most."""
    out = []
    parts = shares.set_index(["reference", "part"])
    for reference, own in runs[runs["measure"] == ALONE].groupby("reference", sort=False):
        items, effect, columns = wide_effects(own, "circuit", "y_patched")  # y(x, part from x') - y(x)
        share = effect_shares(items, effect)["gradient"]
        table = pd.DataFrame(
            {"reference": reference, "part": columns, "exact_share": share["ratio"],
             "exact_ci_low": share["ci_low"], "exact_ci_high": share["ci_high"]}
        )  # fmt: skip
        for method in ("eap", "eap_ig"):
            table[f"{method}_share"] = parts.loc[
                [(reference, p) for p in table["part"]], f"{method}_share"
            ].to_numpy()
            gap = (table[f"{method}_share"] - table["exact_share"]).abs()
            table[f"{method}_spearman"] = table["exact_share"].corr(
                table[f"{method}_share"], method="spearman"
            )
            table[f"{method}_worst_part"] = table["part"].iloc[int(gap.to_numpy().argmax())]
        out.append(table.sort_values("exact_share", key=abs, ascending=False, kind="stable"))
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame()
