"""Statistics of the head effects of a run (attnprobe.measures.head_effects, measures.head_effects).

Everything is per counterfactual word (one direction each, e.g. occupation -> woman, -> man,
-> person), on the design's cells (template x cluster units, templates weighted equally), with the
suite's declared clusters (two-way when it declares two):

- the total effect TE = y(x') - y(x), with a cluster-robust CI, and Vig et al.'s relative effect
  mean(exp(TE) - 1) (they report ratios of probability ratios; here y is a log-odds difference);
- per head: the mean patch-in effect of its output (t test, BH over the heads patched on every
  item), its patch-out effect, its pattern-alone effect and the attribution estimates; on the
  held-out items (every head patched exactly there) the exact and the attribution means, and the
  check of attribution against exact: Spearman on those items, Spearman of the ranking the suite's
  heads were chosen by (attribution on the other items) against exact there, and how many of the
  suite's k heads are among the k largest exact effects there;
- shares of TE (ratio of means, linearised CI): all heads' outputs (100% by construction: every path
  from the slot to the prediction passes through some head), all heads' patterns, each layer's
  attention and MLP output (exact on the held-out items, attribution on every item), and the
  cross-fitted set (chosen on the other half of the units).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ...schema.analysis import ITEM, TEMPLATE
from ..design import Design, items_table, pivoted, power_note, run_analysis
from ..effect_checks import attention_agreement, attribution_check, spearman
from ..inference import (
    ALPHA,
    bh_qvalues,
    cluster_mean_test,
    cluster_slope_test,
    ratio_test,
    slope_ratio_test,
)

PER = 10  # gradients are stated per 10 units of the covariate

SHARES = {
    "all_heads_in": "all heads' outputs, patched in",
    "all_heads_out": "all heads' outputs, patched out",
    "all_heads_pattern_in": "all heads' patterns alone, patched in",
    "crossfit_in": "cross-fitted top heads' outputs, patched in",
    "crossfit_out": "cross-fitted top heads' outputs, patched out",
}


class _Cells:
    """One counterfactual word's items on the design's cells: its `totals` per item, the `design`,
    the cells' weights `w`, TE per cell `te`, the covariate per cell `x` (None without one) and the
    items every head was patched exactly on (`held`)."""

    def __init__(self, word: str, totals: pd.DataFrame, design: Design, covariate, held):
        self.word, self.totals, self.design = word, totals, design
        self.w = design.cells["weight"].to_numpy()
        self.te = self.cells(totals["te"])[:, 0]
        self.x = design.cells[covariate].to_numpy(float) if covariate else None
        self.held = np.zeros(len(totals), bool) if held is None else held

    def cells(self, values) -> np.ndarray:
        """Per-item values (items, ...) as the design's cell means (cells, columns)."""
        return self.design.cell_means(np.asarray(values, float).reshape(len(self.totals), -1))

    def gradient(self, values) -> dict | None:
        """The share of TE's covariate gradient `values` (per cell) carry; None without a covariate."""
        return (
            slope_ratio_test(self.x, values, self.te, self.w, self.design.clusters)
            if self.x is not None
            else None
        )


def head_effects(run, heads: pd.DataFrame | None = None) -> dict[str, pd.DataFrame]:
    """Tables head_effects (per word and head), head_effects_layer_shares (per word, layer,
    component, direction) and head_effects_summary (per word)."""
    analysis = run_analysis(run)
    items = items_table(run.prompts, analysis)
    info = run.manifest.entry("head_effects") or {}
    per_head, per_layer, summaries = [], [], []
    for word, totals in run.head_effect_totals.groupby("counterfactual", sort=False):
        totals = totals.set_index(ITEM)
        design = Design.build(totals.index, items, analysis)
        held = totals["held_out"].fillna(False).to_numpy(bool) if "held_out" in totals else None
        c = _Cells(word, totals, design, analysis.covariate, held)
        head_table = _heads(run.head_effect_items, c)
        per_head.append(head_table)
        layer_table = _layers(run.head_effect_layers, c)
        per_layer.append(layer_table)
        summary = _summary(c, head_table, info, items, analysis, heads)
        summary.update(_gradients(c))
        summary.update(_random_null(c))
        summary.update(_top_layers(layer_table))
        summaries.append(summary)
    return {
        "head_effects": pd.concat(per_head, ignore_index=True),
        "head_effects_layer_shares": pd.concat(per_layer, ignore_index=True),
        "head_effects_summary": pd.DataFrame(summaries),
    }


def _top_layers(layer_table: pd.DataFrame) -> dict:
    """Per component (attention, MLP): the layer whose output, patched in, carries the largest share."""
    out = {}
    for component in ("attention", "mlp"):
        rows = layer_table[(layer_table["component"] == component) & (layer_table["direction"] == "in")]
        rows = rows.dropna(subset=["share"])
        if len(rows):
            top = rows.loc[rows["share"].idxmax()]
            out[f"top_{component}_layer"] = int(top["layer"])
            out[f"top_{component}_share"] = float(top["share"])
            out[f"top_{component}_ci_low"] = float(top["search_ci_low"])
            out[f"top_{component}_ci_high"] = float(top["search_ci_high"])
    return out


def _wide(long: pd.DataFrame, word: str, index, columns: list[str], value: str) -> pd.DataFrame:
    """Items x (columns) of one value for one counterfactual word, rows in `index` order (the screen
    writes one row per item, word and head or layer: its value is the cell's)."""
    rows = long[long["counterfactual"] == word]
    return pivoted(rows, ITEM, columns, value, keep_empty=True).reindex(index)


def _heads(long, c: _Cells) -> pd.DataFrame:
    index, out = c.totals.index, None
    for column in ("output_in", "output_out", "pattern_in", "attribution_output", "attribution_pattern"):
        wide = _wide(long, c.word, index, ["layer", "head"], column)
        if out is None:
            out = wide.columns.to_frame(index=False).assign(counterfactual=c.word, n_items=len(index))
        values = wide.to_numpy()
        # heads patched on every item that has this channel (with exact: k only the suite's heads;
        # the pattern channel only on items whose x and x' have equal length)
        counts = np.isfinite(values).sum(axis=0)
        complete = (counts == counts.max()) & (counts > 0)
        test = cluster_mean_test(c.cells(values), c.w, c.design.clusters)
        name = column.removeprefix("attribution_")
        if column in ("output_in", "attribution_output"):  # the exact/attribution check on the held-out items
            on = lambda rows, values=values: cluster_mean_test(
                c.cells(np.where(rows[:, None], values, np.nan)),
                c.w,
                c.design.clusters,
            )["mean"]
            out[f"heldout_{column}"] = on(c.held) if c.held.any() else np.nan
            if column == "attribution_output":
                out["choosing_attribution_output"] = on(~c.held)
        if column.startswith("attribution"):
            out[f"mean_attribution_{name}"] = test["mean"]
            if column == "attribution_output" and (share := c.gradient(c.cells(values))) is not None:
                out["gradient_share_attribution_output"] = share["ratio"]  # every head: for the agreement
            continue
        out[f"mean_{column}"] = np.where(complete, test["mean"], np.nan)
        out[f"{column}_ci_low"] = np.where(complete, test["ci_low"], np.nan)
        out[f"{column}_ci_high"] = np.where(complete, test["ci_high"], np.nan)
        share = c.gradient(c.cells(values))
        if share is not None:  # the share of the stereotype gradient this channel carries
            for key, name in (("ratio", ""), ("ci_low", "_ci_low"), ("ci_high", "_ci_high")):
                out[f"gradient_share_{column}{name}"] = np.where(complete, share[key], np.nan)
        if column == "output_out":  # natural direct effect: TE with the head held at x's value
            direct = cluster_mean_test(
                c.cells(c.totals["te"].to_numpy()[:, None] - values), c.w, c.design.clusters
            )
            out["mean_direct"] = np.where(complete, direct["mean"], np.nan)
            out["direct_ci_low"] = np.where(complete, direct["ci_low"], np.nan)
            out["direct_ci_high"] = np.where(complete, direct["ci_high"], np.nan)
        if column == "output_in":
            # the mean patch-in effect's own test, named so (not a share's: those carry their CIs)
            out["output_in_p"] = np.where(complete, test["p"], np.nan)
            # with exact: k the k heads were chosen from every head: BH counts the whole search
            # (an untested head enters as p = 1), not the k alone
            p = out["output_in_p"].to_numpy()
            searched = np.where(np.isfinite(p), p, 1.0) if not complete.all() else p
            out["output_in_q"] = np.where(complete, bh_qvalues(searched), np.nan)
            # Vig et al. 2020's relative indirect effect, exp(IE) - 1 averaged (items, then cells)
            out["mean_relative_in"] = np.where(
                complete, cluster_mean_test(c.cells(np.expm1(values)), c.w, c.design.clusters)["mean"], np.nan
            )
    te = float(np.nansum(c.w * c.te) / c.w[np.isfinite(c.te)].sum())
    out["share_output_in"] = out["mean_output_in"] / te if te else np.nan
    out["clusters"] = c.design.cluster_text
    return out[["counterfactual", *[c for c in out.columns if c != "counterfactual"]]]


def _layers(long, c: _Cells) -> pd.DataFrame:
    """Per layer, component (attention, mlp) and direction (in, out: exact; attribution: its estimate
    of the patch-in effect, on every item) the share of TE."""
    index, rows = c.totals.index, []
    for column in (
        "attention_in",
        "attention_out",
        "mlp_in",
        "mlp_out",
        "attention_attribution",
        "mlp_attribution",
    ):
        if column not in long:  # runs from before attribution per layer
            continue
        wide = _wide(long, c.word, index, ["layer"], column)
        share = ratio_test(c.cells(wide.to_numpy()), c.te, c.w, c.design.clusters)
        # the top layer is a maximum over every layer: its interval is Bonferroni-adjusted for that search
        search = ratio_test(c.cells(wide.to_numpy()), c.te, c.w, c.design.clusters, 1 - ALPHA / wide.shape[1])
        component, direction = column.split("_")
        table = pd.DataFrame(
            {
                "counterfactual": c.word,
                "layer": wide.columns.to_numpy(),
                "component": component,
                "direction": direction,
                "share": share["ratio"],
                "ci_low": share["ci_low"],
                "ci_high": share["ci_high"],
                "search_ci_low": search["ci_low"],
                "search_ci_high": search["ci_high"],
                "n_items": np.isfinite(wide.to_numpy()).sum(0),
            }
        )
        by_gradient = c.gradient(c.cells(wide.to_numpy()))
        if by_gradient is not None:
            table["gradient_share"] = by_gradient["ratio"]
            table["gradient_ci_low"] = by_gradient["ci_low"]
            table["gradient_ci_high"] = by_gradient["ci_high"]
        rows.append(table)
    return pd.concat(rows, ignore_index=True)


def _summary(c: _Cells, head_table, info, items, analysis, heads) -> dict:
    te = cluster_mean_test(c.te, c.w, c.design.clusters)
    out = {
        "counterfactual": c.word,
        "n_items": len(c.totals),
        "te_nonzero": bool(te["ci_low"][0] > 0 or te["ci_high"][0] < 0),
        "n_aligned": int((c.totals["n_tokens"] != c.totals["n_tokens_cf"]).sum()),
        "te_mean": float(te["mean"][0]),
        "te_ci_low": float(te["ci_low"][0]),
        "te_ci_high": float(te["ci_high"][0]),
        "te_p": float(te["p"][0]),
        "te_relative": float(
            cluster_mean_test(c.cells(np.expm1(c.totals["te"])), c.w, c.design.clusters)["mean"][0]
        ),
        "clusters": c.design.cluster_text,
        "n_clusters": " x ".join(map(str, te["n_clusters"])),
    }
    for column in SHARES:
        values = c.totals[column] if column in c.totals else pd.Series(np.nan, index=c.totals.index)
        share = ratio_test(c.cells(values), c.te, c.w, c.design.clusters)
        out.update(
            {
                f"share_{column}": float(share["ratio"][0]),
                f"share_{column}_ci_low": float(share["ci_low"][0]),
                f"share_{column}_ci_high": float(share["ci_high"][0]),
                f"n_{column}": int(share["n"][0]),
            }
        )
    halves = (info.get("crossfit_heads") or {}).get(c.word)
    out["crossfit_heads"] = " | ".join(halves) if halves else ""
    tested = head_table["output_in_p"].notna()
    out["n_heads_tested"] = int(tested.sum())
    out["n_heads_q05"] = int((head_table["output_in_q"] < ALPHA).sum())
    out["exact_heads"] = info.get("exact_heads", "all")
    out["power_note"] = power_note(
        te["n_clusters"], c.design.cluster_text
    )  # a t test has no p floor; few clusters do limit it
    out.update(attribution_check(head_table, int(c.held.sum()), info, te["mean"][0]))
    slot = next(iter(info.get("counterfactual", {})), None)
    if heads is not None and len(heads) and slot in set(heads["target"]):
        rows = heads[(heads["target"] == slot) & (heads["scope"] == "all")]
        d_z = rows.groupby(["layer", "head"])["d_z"].first()
        aligned = d_z.reindex(pd.MultiIndex.from_frame(head_table[["layer", "head"]])).to_numpy()
        out["spearman_effect_attention_difference"] = spearman(
            np.abs(head_table["mean_output_in"]), np.abs(aligned)
        )
        out.update(attention_agreement(rows, head_table))
    dropped = {
        d["item_id"]
        for d in info.get("dropped", [])
        if isinstance(d, dict) and d.get("counterfactual") in (c.word, None)
    }
    out["n_dropped"] = len(dropped)
    if analysis.covariate and analysis.covariate in items and dropped:
        covariate = items.set_index(ITEM)[analysis.covariate]
        out["covariate_kept"] = float(covariate.reindex(c.totals.index).mean())
        out["covariate_dropped"] = float(covariate.reindex(sorted(dropped)).mean())
    return out


def _gradients(c: _Cells) -> dict:
    """The stereotype in the causal tables: how the total effect changes per 10 units of the
    covariate (e.g. how much more replacing the occupation by "woman" raises log p(she) - log p(he)
    for an occupation with 10 points more women), and the share of that gradient each joint patch
    carries (all heads, all heads' patterns, the cross-fitted sets), with two-way CIs; and per
    template, the spread of the cross-fitted set's share of TE."""
    if c.x is None:
        return {}
    te = cluster_slope_test(c.x, c.te, c.w, c.design.clusters)
    out = {
        "te_gradient_per10": PER * float(te["slope"][0]),
        "te_gradient_ci_low": PER * float(te["ci_low"][0]),
        "te_gradient_ci_high": PER * float(te["ci_high"][0]),
        "te_gradient_p": float(te["p"][0]),
    }
    for column in SHARES:
        values = c.totals[column] if column in c.totals else pd.Series(np.nan, index=c.totals.index)
        share = c.gradient(c.cells(values))
        out[f"gradient_share_{column}"] = float(share["ratio"][0])
        out[f"gradient_share_{column}_ci_low"] = float(share["ci_low"][0])
        out[f"gradient_share_{column}_ci_high"] = float(share["ci_high"][0])
        if column.startswith("crossfit"):  # per template: does one template carry the set's share?
            by_template = pd.DataFrame({"num": c.cells(values)[:, 0], "te": c.te})
            sums = by_template.groupby(c.design.cells[TEMPLATE].to_numpy()).sum(min_count=1)
            shares = (sums["num"] / sums["te"]).dropna()
            out[f"share_{column}_template_min"] = float(shares.min()) if len(shares) else np.nan
            out[f"share_{column}_template_max"] = float(shares.max()) if len(shares) else np.nan
    return out


def _random_null(c: _Cells) -> dict:
    """The cross-fitted set against chance: on the items patched with random head sets of the same
    layers (`random_in_*`, RANDOM_DRAWS draws), each draw's share of TE (and of TE's gradient) beside
    the cross-fitted set's share on the same items; p = (1 + draws reaching it) / (1 + draws)."""
    columns = [name for name in c.totals if name.startswith("random_in_")]
    rows = c.totals[columns[0]].notna().to_numpy() if columns else np.zeros(len(c.totals), bool)
    if not rows.any():
        return {}
    on = lambda values: c.cells(
        np.where(rows[:, None], np.asarray(values, float).reshape(len(c.totals), -1), np.nan)
    )
    te = on(c.totals["te"])[:, 0]
    out = {"n_random_items": int(rows.sum()), "n_random_draws": len(columns)}
    for what, share in (
        ("share", lambda v: ratio_test(v, te, c.w, c.design.clusters)),
        ("gradient_share", c.gradient),
    ):
        chosen, draws = share(on(c.totals["crossfit_in"])), share(on(c.totals[columns].to_numpy()))
        if chosen is None:
            continue
        chosen, draws = float(chosen["ratio"][0]), draws["ratio"]
        out[f"{what}_crossfit_in_null_items"] = chosen
        out[f"{what}_random_in_mean"] = float(np.nanmean(draws))
        out[f"{what}_random_in_max"] = float(np.nanmax(draws))
        out[f"{what}_crossfit_random_p"] = float((1 + (draws >= chosen - 1e-12).sum()) / (1 + len(draws)))
    return out
