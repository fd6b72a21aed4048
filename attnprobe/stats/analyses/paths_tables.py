"""The path-patching tables (paths.csv, paths_edges.csv) from the raw values alone (analyses.paths).

A patch's effect on an item is y_patched - y (an attribution is already one); TE = y(x') - y(x).
Shares: of TE (ratio of means) and of TE's covariate gradient (ratio of slopes), with two-way
cluster-robust CIs (unit x template; stats.inference), p of the effect's slope on the covariate.

Each head's role, by the size of its parts, is paths_parts.py's (paths_parts.csv).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..inference import bh_qvalues, cluster_slope_test, ratio_test, slope_ratio_test

TOP, CROSSFIT = "top 5", "top 5, cross-fitted"  # the receivers that are sets (no role)
LISTED = "the heads listed (--heads)"  # the set of heads given, in place of the top 5
NULL = "top 5 reselected on a permuted covariate, draw"  # + the draw's number
NOISING, DENOISING = "noising", "denoising"  # x with an input from x'; x' with an input from x
RESAMPLED = "another occupation"  # the reference of pairs whose x' is another item (paths.resample_pairs)
FIRST_ORDER = "value, first order"  # the value path by attribution patching (intervene.gradients)


def wide_effects(raw: pd.DataFrame, key, column: str, sort: bool = False):
    """(items (item_id, covariate, unit, template_id, y, y_cf), effects (n, columns), columns): one
    column per value of `key` (a column name or a list of them). An effect is y_patched - y, or the
    value of `column` itself for any other column (an attribution)."""
    wide = raw.pivot_table(index="item_id", columns=key, values=column, dropna=False, sort=sort)
    items = raw.drop_duplicates("item_id").set_index("item_id").loc[wide.index]
    effect = wide.to_numpy()
    if column == "y_patched":
        effect = effect - items["y"].to_numpy()[:, None]
    return items, effect, list(wide.columns)


def item_design(items: pd.DataFrame):
    """(covariate, TE, weights, clusters unit x template) of the items."""
    te = (items["y_cf"] - items["y"]).to_numpy()
    clusters = [pd.factorize(items["unit"])[0], pd.factorize(items["template_id"])[0]]
    return items["covariate"].to_numpy(dtype=float), te, np.ones(len(items)), clusters


def effect_shares(items: pd.DataFrame, effect: np.ndarray) -> dict:
    """The share of TE (ratio_test) and of TE's covariate gradient (slope_ratio_test) each column of
    effect (n, k) carries, two-way cluster-robust."""
    x, te, w, clusters = item_design(items)
    return {
        "te": ratio_test(effect, te, w, clusters),
        "gradient": slope_ratio_test(x, effect, te, w, clusters),
    }


def gradient_shares(raw: pd.DataFrame, column: str, key: str = "sender") -> pd.Series:
    """Per `key` value: the share of TE's covariate gradient its `column` carries."""
    items, effect, columns = wide_effects(raw, key, column)
    x, te, w, clusters = item_design(items)
    return pd.Series(slope_ratio_test(x, effect, te, w, clusters)["ratio"], index=columns)


def share_rows(items, effect, labels: list[dict]) -> list[dict]:
    s = effect_shares(items, effect)
    x, _, w, clusters = item_design(items)
    p = cluster_slope_test(x, effect, w, clusters)["p"]
    out = []
    for j, label in enumerate(labels):
        out.append(
            {
                **label,
                "n_items": int(np.isfinite(effect[:, j]).sum()),
                "gradient_share": s["gradient"]["ratio"][j],
                "gradient_share_ci_low": s["gradient"]["ci_low"][j],
                "gradient_share_ci_high": s["gradient"]["ci_high"][j],
                "gradient_p": p[j],  # the gradient share's own test: its numerator's slope (no p for TE's)
                "te_share": s["te"]["ratio"][j],
                "te_share_ci_low": s["te"]["ci_low"][j],
                "te_share_ci_high": s["te"]["ci_high"][j],
            }
        )
    return out


def comparisons(raw: pd.DataFrame):
    """(reference, direction, rows) of a paths_items frame: each reference in the order measured (the
    reference word, then RESAMPLED), noising before denoising. A frame from before these columns is
    all noising against an unnamed reference."""
    raw = raw.assign(**{c: raw[c] if c in raw else d for c, d in (("reference", ""), ("direction", NOISING))})
    for reference in raw["reference"].unique():
        for direction in (NOISING, DENOISING):
            rows = raw[(raw["reference"] == reference) & (raw["direction"] == direction)]
            if len(rows):
                yield reference, direction, rows


def paths_table(raw: pd.DataFrame) -> pd.DataFrame:
    """One row per reference, direction, receiver and path, in the order measured; the cross-fitted
    set's row with its selection null."""
    tables = []
    for reference, direction, rows in comparisons(raw):
        is_null = rows["receiver"].str.startswith(NULL)
        null, rows = rows[is_null], rows[~is_null]
        rows = rows.assign(column=rows["receiver"] + "\x1f" + rows["path"])
        items, effect, columns = wide_effects(rows, "column", "y_patched")
        labels = [
            dict(reference=reference, direction=direction, **dict(zip(("receiver", "path"), c.split("\x1f"))))
            for c in columns
        ]
        tables.append(_selection_null(pd.DataFrame(share_rows(items, effect, labels)), null))
    return pd.concat(tables, ignore_index=True)


def _selection_null(table: pd.DataFrame, null: pd.DataFrame) -> pd.DataFrame:
    """On the cross-fitted set's value row: the sets reselected on permuted covariates, each's value
    share against the real covariate. selection_*: every draw to first order, against the cross-fitted
    set's own share to first order (mean, 95th percentile, p = (1 + draws at or above) / (1 + draws),
    draws); selection_*_exact: the draws also measured exactly, against its exact share; and
    first_order_r / first_order_max_diff: how the two measures of those draws agree."""
    at = table.index[(table["receiver"] == CROSSFIT) & (table["path"] == "value")]
    if not len(null) or not len(at):
        return table
    at = at[0]
    first = table.index[(table["receiver"] == CROSSFIT) & (table["path"] == FIRST_ORDER)]
    observed = {"value": table.at[at, "gradient_share"]}
    if len(first):
        observed[FIRST_ORDER] = table.at[first[0], "gradient_share"]
    shares = {}
    for path, suffix in ((FIRST_ORDER, ""), ("value", "_exact")):
        rows = null[null["path"] == path]
        if path not in observed or not len(rows):
            continue
        shares[path] = gradient_shares(rows, "y_patched", key="receiver")
        drawn = shares[path].to_numpy()
        table.loc[at, f"selection_null_mean{suffix}"] = np.nanmean(drawn)
        table.loc[at, f"selection_null_q95{suffix}"] = np.nanquantile(drawn, 0.95)
        table.loc[at, f"selection_p{suffix}"] = (1 + np.sum(drawn >= observed[path])) / (1 + len(drawn))
        table.loc[at, f"selection_draws{suffix}"] = len(drawn)
    if len(shares) == 2:
        both = pd.concat(shares.values(), axis=1, join="inner").to_numpy()
        if len(both) >= 3:
            table.loc[at, "first_order_r"] = np.corrcoef(both.T)[0, 1]
            table.loc[at, "first_order_max_diff"] = np.abs(both[:, 0] - both[:, 1]).max()
    return table


def edges_table(screen: pd.DataFrame, confirmed: pd.DataFrame, paths: pd.DataFrame) -> pd.DataFrame:
    """One row per confirmed edge (receiver, sender): its attribution share on the screening half,
    its exact shares on the confirming half (CI, p, BH q over the table's rows) and the receiver's
    whole value path on those same items."""
    rows = []
    for receiver, exact in confirmed.groupby("receiver", sort=False):
        screened = gradient_shares(screen[screen["receiver"] == receiver], "attribution")
        items, effect, senders = wide_effects(exact, "sender", "y_patched")
        value = next(rows for ref, d, rows in comparisons(paths) if d == NOISING and ref != RESAMPLED)
        value = value[(value["receiver"] == receiver) & (value["path"] == "value")]
        value = (
            value.set_index("item_id")["y_patched"].reindex(items.index).to_numpy() - items["y"].to_numpy()
        )
        whole = share_rows(items, value[:, None], [{}])[0]
        labels = [{"receiver": receiver, "sender": s, "screen_share": screened[s]} for s in senders]
        for row in share_rows(items, effect, labels):
            rows.append({**row, "value_path_share": whole["gradient_share"]})
    table = pd.DataFrame(rows)
    if len(table):
        table.insert(
            table.columns.get_loc("gradient_p") + 1, "gradient_q", bh_qvalues(table["gradient_p"].to_numpy())
        )
    return table
