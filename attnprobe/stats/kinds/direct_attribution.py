"""Statistics of the direct attribution: which parts write the logit difference, and its gradient.

Per item (the mean over its prompts; the prompts of an item that share the text before the cut read
the same values), per part (embedding; each head's share from each class of source positions; each
MLP; biases): the mean value (its part of y, the logit difference in nats) with a cluster-robust CI,
and, when the suite declares a covariate, the slope per 10 units of it with CI, p and BH q over the
parts, and its share of y's own slope (slope ratio, linearised CI). Rows also for each class of
source positions summed over every head and layer, for all MLPs (position `mlp`), and for y and the
error (y minus the sum of the parts: the frozen-norm approximation's residual): these sums have no
layer and no head (NA), so `layer` and `head` are integers (-1: not a layer's or not a head's part).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ...schema.analysis import ITEM
from ..design import PER, Design, items_table, pivoted, run_analysis
from ..inference import bh_qvalues, cluster_mean_test, cluster_slope_test, slope_ratio_test

TOTAL, ERROR, MLP = "logit_difference", "error", "mlp"
SUM = "all"  # the layer and head of a row summed over layers and heads while computing; NA in the table
KEYS = ["layer", "head", "position"]


def item_values(run, cut: str) -> pd.DataFrame:
    """Items x parts (columns (layer, head, position)): each prompt takes the values computed for a
    prompt with the same text before the cut, and an item the mean of its prompts'."""
    table, prompts = run.direct_attribution, run.prompts
    start = prompts[f"{cut}_char_start"]
    key = [text[: int(s)] if s == s else None for text, s in zip(prompts["text"], start)]
    computed = set(table["prompt_id"])
    by_key = {}
    for prompt_id, k in zip(prompts["prompt_id"], key):
        if prompt_id in computed and k is not None:
            by_key.setdefault(k, prompt_id)
    source = pd.Series([by_key.get(k) for k in key], index=prompts["prompt_id"]).dropna().astype(int)
    wide = pivoted(table, "prompt_id", KEYS, "value")
    per_prompt = wide.reindex(source.to_numpy())
    per_prompt.index = prompts.set_index("prompt_id").loc[source.index, ITEM].to_numpy()
    return per_prompt.groupby(level=0).mean()


def direct_attribution(run) -> pd.DataFrame:
    """One row per part and per summary (see the module doc)."""
    if run.direct_attribution is None or run.direct_attribution.empty:
        return pd.DataFrame()
    analysis, cut = run_analysis(run), run.manifest.entry("direct_attribution")["cut"]
    values = item_values(run, cut)
    parts = [c for c in values.columns if c[2] not in (TOTAL, ERROR)]
    summed = {
        (SUM, SUM, position): values[[c for c in parts if c[1] >= 0 and c[2] == position]].sum(axis=1)
        for position in sorted({c[2] for c in parts if c[1] >= 0})
    }
    summed[(SUM, SUM, MLP)] = values[[c for c in parts if c[2] == MLP]].sum(axis=1)
    columns = {**{c: values[c] for c in parts}, **summed, (SUM, SUM, TOTAL): values[(-1, -1, TOTAL)]}
    columns[(SUM, SUM, ERROR)] = values[(-1, -1, ERROR)]
    matrix = pd.DataFrame(columns)
    items = items_table(run.prompts, analysis)
    design = Design.build(matrix.index, items, analysis)
    cells = design.cell_means(matrix.to_numpy(dtype=float))
    w = design.cells["weight"].to_numpy()
    mean = cluster_mean_test(cells, w, design.clusters)
    out = pd.DataFrame(list(matrix.columns), columns=KEYS)
    out["mean"], out["mean_ci_low"], out["mean_ci_high"] = mean["mean"], mean["ci_low"], mean["ci_high"]
    if analysis.covariate and analysis.covariate in design.cells:
        x = design.cells[analysis.covariate].to_numpy(dtype=float)
        slope = cluster_slope_test(x, cells, w, design.clusters)
        total = cells[:, list(matrix.columns).index((SUM, SUM, TOTAL))]
        share = slope_ratio_test(x, cells, total, w, design.clusters)
        out["gradient_per10"] = PER * slope["slope"]
        out["gradient_ci_low"], out["gradient_ci_high"] = PER * slope["ci_low"], PER * slope["ci_high"]
        out["gradient_p"] = slope["p"]
        is_part = np.array([isinstance(c[0], (int, np.integer)) for c in matrix.columns])
        q = np.full(len(out), np.nan)
        q[is_part] = bh_qvalues(slope["p"][is_part])
        out["gradient_q"] = q
        out["gradient_share"], out["share_ci_low"], out["share_ci_high"] = (
            share["ratio"],
            share["ci_low"],
            share["ci_high"],
        )
    out["n_items"] = len(matrix)
    out["clusters"] = design.cluster_text
    sums = out["layer"] == SUM
    out.loc[sums, ["layer", "head"]] = pd.NA
    return out.astype({"layer": "Int64", "head": "Int64"})


def report_section(table: pd.DataFrame, cut: str, analysis: dict) -> dict:
    """The report's words and table: y and its gradient, the shares of the gradient written by the
    heads by source position, the MLPs and the embedding, the error, and the 12 largest parts."""
    sums = table[table["layer"].isna()]  # over every layer and head
    row = lambda position: sums[sums["position"] == position].iloc[0]
    total, error = row(TOTAL), row(ERROR)
    pos, neg = analysis.get("positive"), analysis.get("negative")
    mean, low, high = total["mean"], total["mean_ci_low"], total["mean_ci_high"]
    text = (
        f"At the token before '{cut}', y = logit({pos}) - logit({neg}) (the first token of each label's "
        f"words) is {mean:+.3f} nats on average [{low:+.3f}, {high:+.3f}] over {total['n_items']} items "
        f"(clusters {total['clusters']}). It is split into what each part wrote into the residual there, "
        "through the final norm with its scale frozen (direct effects only: what a part writes for later "
        f"layers to read is not counted). y minus the sum of the parts is {error['mean']:+.2g} on average "
        "(the error row)."
    )
    has_gradient = "gradient_per10" in table and total["gradient_per10"] == total["gradient_per10"]
    if has_gradient:
        covariate = analysis.get("names", {}).get(analysis.get("covariate"), analysis.get("covariate"))
        shares = [
            f"heads reading {r['position']} {100 * r['gradient_share']:.0f}% [{100 * r['share_ci_low']:.0f}, "
            f"{100 * r['share_ci_high']:.0f}]"
            for _, r in sums.iterrows()
            if r["position"] not in (TOTAL, ERROR, MLP)
        ]
        mlp = row(MLP)
        shares.append(
            f"all MLPs {100 * mlp['gradient_share']:.0f}% [{100 * mlp['share_ci_low']:.0f}, "
            f"{100 * mlp['share_ci_high']:.0f}]"
        )
        text += (
            f" Per 10 points of {covariate}, y changes by {total['gradient_per10']:+.3f} nats "
            f"[{total['gradient_ci_low']:+.3f}, {total['gradient_ci_high']:+.3f}]; of that gradient, "
            + ", ".join(shares)
            + " (shares of the gradient, CIs by linearisation). Below: the 12 parts with the largest share."
        )
    parts = table[table["layer"].notna()]
    order = (parts["gradient_share"] if has_gradient else parts["mean"]).abs().sort_values(ascending=False)
    columns = [
        ("layer", "layer", ""),
        ("head", "head", ""),
        ("position", "source positions", ""),
        ("mean", "mean (nats)", "%+.3f"),
    ]
    if has_gradient:
        columns += [
            ("gradient_per10", "gradient per 10", "%+.3f"),
            ("gradient_q", "q", "%.2g"),
            ("gradient_share", "share of the gradient", "%.2f"),
            ("share_ci_low", "CI low", "%.2f"),
            ("share_ci_high", "CI high", "%.2f"),
        ]
    return {
        "title": "Direct attribution of the prediction (direct_attribution)",
        "text": text,
        "columns": columns,
        "rows": parts.loc[order.index[:12]].to_dict("records"),
        "figures": [],
    }
