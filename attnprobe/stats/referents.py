"""Referent accuracy: does a head's source span (the pronoun) attend more to the correct referent
than to the other candidate, per prompt; declared by the analysis (`referents`, `answer`).

Per head: the accuracy over items (items averaged into cells, templates weighted equally) with a
cluster-robust test against chance (0.5), the accuracy per contrast label, and the gap between the
positive and the negative label (e.g. pro - anti) as a paired difference per item with the same
test; BH q over heads. A tie counts one half.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..analysis import ITEM
from .design import Design, items_table
from .heads import run_analysis
from .inference import bh_qvalues, cluster_mean_test

COLUMNS = ["source", "layer", "head"]


def referent_accuracy(run) -> pd.DataFrame:
    """One row per (source, layer, head); empty when the analysis declares no referents."""
    analysis = run_analysis(run)
    if not analysis.referents:
        return pd.DataFrame(columns=COLUMNS)
    first, second = analysis.referents
    prompts = run.prompts.set_index("prompt_id")
    attention = run.attention[run.attention["target"].isin(analysis.referents)]
    wide = attention.pivot_table(index=["prompt_id", *COLUMNS], columns="target", values="weight", observed=True).dropna()
    if wide.empty or first not in wide or second not in wide:
        return pd.DataFrame(columns=COLUMNS)
    ids = wide.index.get_level_values("prompt_id")
    answer = np.full(len(wide), analysis.answer) if analysis.answer in analysis.referents else prompts.loc[ids, analysis.answer].astype(str).to_numpy()
    chosen = np.where(wide[first] > wide[second], first, np.where(wide[first] < wide[second], second, ""))
    correct = pd.Series(np.where(chosen == "", 0.5, (chosen == answer).astype(float)), index=wide.index, name="correct").reset_index()
    correct[ITEM] = prompts.loc[correct["prompt_id"], ITEM].to_numpy()
    correct["label"] = prompts.loc[correct["prompt_id"], analysis.contrast].astype(str).to_numpy() if analysis.contrast else "all"
    items = items_table(run.prompts, analysis)

    def test(values: pd.DataFrame) -> dict:
        """Cluster-robust test of the per-item values (items x heads) on their design's cells."""
        design = Design.build(values.index, items, analysis)
        return cluster_mean_test(design.cell_means(values.to_numpy()), design.cells["weight"].to_numpy(), design.clusters) | {
            "clusters": design.cluster_text}

    tables = []
    for source, group in correct.groupby("source", sort=False):
        overall = group.pivot_table(index=ITEM, columns=["layer", "head"], values="correct")  # items, labels averaged
        chance = test(overall - 0.5)
        table = overall.columns.to_frame(index=False).assign(source=source)
        table["accuracy"] = chance["mean"] + 0.5
        table["ci_low"], table["ci_high"] = chance["ci_low"] + 0.5, chance["ci_high"] + 0.5
        table["p"] = chance["p"]
        table["q"] = bh_qvalues(chance["p"])
        per_label = {label: part.pivot_table(index=ITEM, columns=["layer", "head"], values="correct").reindex(columns=overall.columns)
                     for label, part in group.groupby("label", sort=False)}
        for label, values in per_label.items():
            table[f"accuracy_{label}"] = test(values)["mean"]
        if analysis.paired and analysis.positive in per_label and analysis.negative in per_label:
            gap = test((per_label[analysis.positive] - per_label[analysis.negative]).dropna(how="all"))
            table["gap"], table["gap_ci_low"], table["gap_ci_high"] = gap["mean"], gap["ci_low"], gap["ci_high"]
            table["gap_p"] = gap["p"]
            table["gap_q"] = bh_qvalues(gap["p"])
        table["n_items"] = len(overall)
        table["clusters"] = chance["clusters"]
        tables.append(table)
    out = pd.concat(tables, ignore_index=True)
    return out[[*COLUMNS, *[c for c in out.columns if c not in COLUMNS]]]
