"""The held-out search over every edit one sweep measured: which edit (head kind and k, the stream or
an MLP mode at its chosen layer, several layers at their chosen count and a rank) a user would pick,
picked without the rows it is judged on, and its placebo with the pick repeated.

The candidates are each head kind's found edit at each k and each per-layer edit's chosen row (its
layer or count already chosen without the rows it is judged on: layers.stream_table). They are
chosen among as a per-layer edit's layers are (layers.chosen_layers and picked_layers: the same gate
and score): an item's values are those of the candidate chosen on the other quarters' items, a
control prompt's and a generated text's those of the candidate whose gate was judged on the other
half of the words and texts. So every figure of the "search" row of the goal table is judged on rows
its choice of kind, site, k, layer and rank did not see.

Its placebo (with `edit --placebo N`): per permutation of the covariate, each candidate fitted on the
covariate is its refit (placebo-KIND rows: heads chosen again, a per-layer edit's layer chosen again),
the others are themselves, and each quarter's candidate is chosen again on the other quarters (the
gate, which the covariate does not choose, is the real candidates'); p = (1 + #refits removing at
least as much of the gradient) / (1 + N), as placebo.placebo_table's.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..edits import MLP, SINGLE, STREAM, edit_tables
from ..placebo import PLACEBO_PREFIX, gradient_removal, placebo_columns
from .layers import chosen_layers, described, picked_layers

SEARCH = "search"  # the candidates' raw kind inside the search: k indexes the candidates
CHOSEN = "search-chosen"  # the kind of the search's chosen rows (and its goal-table row)


def candidates(raw: pd.DataFrame) -> list[tuple[str, int]]:
    """(kind, k) of every head kind's found edit and every per-layer edit's chosen row (KIND-chosen)
    measured on the items, the control prompts and the texts (not the clean rows, random head sets,
    the top heads each zeroed alone, placebo refits or a per-layer edit's single layers)."""
    kinds = raw["kind"].astype(str)
    one_layer = kinds.str.startswith((STREAM, MLP)) & ~kinds.str.endswith("-chosen")
    skipped = kinds.isin(["none", SINGLE]) | kinds.str.startswith(PLACEBO_PREFIX) | one_layer
    targets = raw[(raw["draw"] == -1) & ~skipped].groupby(["kind", "k"])["target"].agg(set)
    return [key for key, seen in targets.items() if {"bias", "control", "text"} <= seen]


def _relabelled(rows: pd.DataFrame, options: list) -> pd.DataFrame:
    """`rows` of the candidates as kind SEARCH, k the candidate's index."""
    index = {key: c for c, key in enumerate(options)}
    return rows.assign(kind=SEARCH, k=[index[key] for key in zip(rows["kind"], rows["k"])])


def search_table(raw: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the search's chosen row, as edit_tables summarises an edit, with `choices` naming what each
    quarter and word half took and its placebo's columns where the sweep has refits; its raw rows,
    kind CHOSEN), both empty with under two candidates. `raw`: the sweep's raw rows with the
    per-layer edits' chosen rows."""
    options = candidates(raw)
    if len(options) < 2:
        return pd.DataFrame(), raw.iloc[:0]
    none = raw[raw["kind"] == "none"]
    keys = pd.MultiIndex.from_frame(raw[["kind", "k"]])
    rows = _relabelled(raw[keys.isin(options) & (raw["draw"] == -1).to_numpy()], options)
    frame = pd.concat([none, rows], ignore_index=True)
    chosen = chosen_layers(frame, SEARCH)
    name = lambda c: f"{options[c][0]} {options[c][1]}"
    picked = rows[rows["k"].to_numpy() == picked_layers(frame, rows, chosen)]
    quarters, halves = described(chosen, name)
    picked = picked.assign(kind=CHOSEN, k=chosen["all"], heads=f"{quarters} | {halves}")
    summary, _ = edit_tables(pd.concat([none, picked], ignore_index=True))
    summary = summary.assign(choices=f"{quarters} | {halves}; on every item: {name(chosen['all'])}")
    summary = summary.assign(**_placebo(raw, options, frame, picked))
    drawn = ("random", "n_random", "n_sampled", "gradient_removed_s", "note", "heads_all")
    return summary[[c for c in summary.columns if not c.startswith(drawn)]], picked


def _placebo(raw: pd.DataFrame, options: list, frame: pd.DataFrame, picked: pd.DataFrame) -> dict:
    """The search's placebo columns (the module's docstring), or none where the sweep has no refits
    or a refitted candidate lacks a permutation."""
    bias = raw[raw["target"] == "bias"]
    refits = bias[bias["kind"].astype(str).str.startswith(PLACEBO_PREFIX)]
    if refits.empty:
        return {}
    refits = refits.assign(kind=refits["kind"].str[len(PLACEBO_PREFIX) :])
    refitted, draws = set(refits["kind"]), sorted(refits["draw"].unique())
    removed = gradient_removal(bias)
    kept = frame[(frame["kind"] != SEARCH) | (frame["target"] != "bias")]  # the clean rows and the gates
    own = frame[(frame["kind"] == SEARCH) & (frame["target"] == "bias")]
    null = []
    for d in draws:
        parts = [
            _relabelled(
                refits[(refits["kind"] == kind) & (refits["k"] == k) & (refits["draw"] == d)], options
            )
            if kind in refitted  # fitted on the covariate: its refit on permutation d
            else own[own["k"] == c]
            for c, (kind, k) in enumerate(options)
        ]
        if any(part.empty for part in parts):
            return {}
        drawn = pd.concat(parts, ignore_index=True)
        permuted = pd.concat([kept, drawn], ignore_index=True)  # each item's quarter picks again
        picks = picked_layers(permuted, drawn, chosen_layers(permuted, SEARCH))
        null.append(removed(drawn[drawn["k"].to_numpy() == picks]))
    return placebo_columns(removed(picked[picked["target"] == "bias"]), np.array(null))
