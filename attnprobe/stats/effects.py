"""Statistics of the head interventions of a run (attnprobe.interventions, measures.head_effects).

Per head: the mean indirect effect of the pattern swap with a cluster-robust CI and t p-value
(the suite's declared clusters, on the design's cells, templates weighted equally), BH q over the
heads that were patched on every item; mean zero- and mean-ablation and attribution estimates.
Summary: the total effect with the same CI, the share carried by the top-k heads (ranked by mean IE
in the direction of the total effect), and rank agreements (attribution vs exact patching; |IE| vs
|d_z| of the attention difference to the counterfactual slot's span).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import stats as sps

from ..analysis import ITEM
from .design import Design, items_table
from .heads import run_analysis
from .inference import ALPHA, bh_qvalues, cluster_mean_test


def head_effects(run, heads: pd.DataFrame | None = None, top_k: int = 5) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per head, summary) of the run's head interventions."""
    analysis = run_analysis(run)
    items = items_table(run.prompts, analysis)
    totals = run.head_effect_totals.set_index(ITEM)
    design = Design.build(totals.index, items, analysis)
    w = design.cells["weight"].to_numpy()
    total = cluster_mean_test(design.cell_means(totals[["te"]].to_numpy()), w, design.clusters)
    ie = run.head_effect_items.pivot_table(index=ITEM, columns=["layer", "head"], values="pattern", dropna=False)
    ie = ie.reindex(totals.index)
    computed = ie.notna().all(axis=0).to_numpy()  # with exact: k, only some heads were patched on every item
    test = cluster_mean_test(design.cell_means(ie.to_numpy()), w, design.clusters)
    table = ie.columns.to_frame(index=False)
    table["n_items"] = len(totals)
    table["mean_ie"] = np.where(computed, test["mean"], np.nan)
    table["ie_ci_low"] = np.where(computed, test["ci_low"], np.nan)
    table["ie_ci_high"] = np.where(computed, test["ci_high"], np.nan)
    table["p"] = np.where(computed, test["p"], np.nan)
    table["q"] = bh_qvalues(table["p"].to_numpy())
    for mode in ("zero", "mean", "attribution"):
        table[f"mean_{mode}"] = run.head_effect_items.groupby(["layer", "head"])[mode].mean().reindex(ie.columns).to_numpy()
    table["clusters"] = design.cluster_text
    te = float(total["mean"][0])
    direction = np.sign(te) or 1.0
    ranked = table[computed].assign(score=lambda t: direction * t["mean_ie"]).sort_values("score", ascending=False)
    summary = {
        "n_items": len(totals), "te_mean": te, "te_ci_low": float(total["ci_low"][0]), "te_ci_high": float(total["ci_high"][0]),
        "clusters": design.cluster_text, "n_clusters": " x ".join(map(str, total["n_clusters"])),
        "top_k": top_k, "top_heads": " ".join(f"L{int(r.layer)}H{int(r.head)}" for r in ranked.head(top_k).itertuples()),
        "share_top_k": ranked["mean_ie"].head(top_k).sum() / te if te else np.nan,
        "n_heads_q05": int((table["q"] < ALPHA).sum()),
        "spearman_attribution_exact": _spearman(table.loc[computed, "mean_attribution"], table.loc[computed, "mean_ie"]),
    }
    slot = next(iter((run.manifest.get("head_effects") or {}).get("counterfactual", {})), None)
    if heads is not None and len(heads) and slot in set(heads["target"]):
        rows = heads[(heads["target"] == slot) & (heads["scope"] == "all")]
        bias = rows.groupby(["layer", "head"])["d_z"].first().reindex(ie.columns).to_numpy()
        summary["spearman_ie_attention_difference"] = _spearman(np.abs(table["mean_ie"]), np.abs(bias))
    return table, pd.DataFrame([summary])


def _spearman(a, b) -> float:
    a, b = np.asarray(a, float), np.asarray(b, float)
    ok = np.isfinite(a) & np.isfinite(b)
    return float(sps.spearmanr(a[ok], b[ok]).statistic) if ok.sum() > 2 else float("nan")
