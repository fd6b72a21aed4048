"""Referent accuracy: does a head's source span (the pronoun) attend more to the correct referent
than to the other candidate, per prompt; declared by the analysis (`referents`, `answer`).

Per head: the accuracy over items (items averaged into cells, templates weighted equally) with a
cluster-robust test against chance (0.5), the accuracy per contrast label, and the gap between the
positive and the negative label (e.g. pro - anti) as a paired difference per item with the same
test; BH q over heads. A tie counts one half. Accuracy intervals are clipped to [0, 1]. The same statistics
for the model's own choice in a
scored continuation (`referent_choice`), with the log-probability margin of the answer.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ...schema.analysis import ITEM, TEMPLATE
from ..design import Design, items_table, run_analysis, scopes
from ..inference import bh_qvalues, cluster_mean_test

COLUMNS = ["source", "layer", "head"]


def referent_accuracy(run) -> pd.DataFrame:
    """One row per (source, layer, head); empty when the analysis declares no referents."""
    analysis = run_analysis(run)
    if not analysis.referents:
        return pd.DataFrame(columns=COLUMNS)
    first, second = analysis.referents
    attention = run.attention[run.attention["target"].isin(analysis.referents)]
    wide = attention.pivot_table(
        index=["prompt_id", *COLUMNS], columns="target", values="weight", observed=True
    ).dropna()
    if wide.empty or first not in wide or second not in wide:
        return pd.DataFrame(columns=COLUMNS)
    correct = _correct(run, analysis, wide[first], wide[second])
    items = items_table(run.prompts, analysis)
    tables = [
        _accuracy(group, ["layer", "head"], items, analysis).assign(source=source)
        for source, group in correct.groupby("source", sort=False)
    ]
    out = pd.concat(tables, ignore_index=True)
    return out[[*COLUMNS, *[c for c in out.columns if c not in COLUMNS]]]


def referent_choice(run) -> pd.DataFrame:
    """The model's own choice in the scored continuation (measures/referent_choice.py): a row per
    scope (all templates, then each declared group) with the accuracy as above, plus the mean
    log-probability margin of the answer over the other referent."""
    table = run.referent_choice
    analysis = run_analysis(run)
    if table is None or table.empty or not analysis.referents:
        return pd.DataFrame(columns=["question"])
    first, second = analysis.referents
    wide = table.pivot_table(index="prompt_id", columns="referent", values="logprob").dropna()
    if wide.empty or first not in wide or second not in wide:
        return pd.DataFrame(columns=["question"])
    correct = _correct(run, analysis, wide[first], wide[second]).assign(
        question=run.manifest.entry("referent_choice", "")
    )
    correct["margin"] = np.where(correct["answer"] == first, 1, -1) * (wide[first] - wide[second]).to_numpy()
    template = run.prompts.set_index("prompt_id").loc[correct["prompt_id"], TEMPLATE].to_numpy()
    items, rows = items_table(run.prompts, analysis), []
    for scope, templates in scopes(analysis, pd.unique(template)).items():  # all, then each declared group
        part = correct[np.isin(template, templates)]
        out = _accuracy(part, ["question"], items, analysis)
        tested = _accuracy(part.assign(correct=part["margin"]), ["question"], items, analysis, chance=0.0)
        out["margin"], out["margin_ci_low"], out["margin_ci_high"] = (
            tested["accuracy"],
            tested["ci_low"],
            tested["ci_high"],
        )
        rows.append(out.assign(scope=scope))
    out = pd.concat(rows, ignore_index=True)
    return out[["scope", *[c for c in out.columns if c != "scope"]]]


def item_choices(run) -> pd.DataFrame | None:
    """Per item (index item_id), columns (quantity, label): the model's own choice in the scored
    continuation, `correct` (1, 0, 0.5 for a tie) and the log-probability `margin` of the answer over
    the other referent, per contrast label, and the positive - negative `gap` of each (e.g. pro -
    anti); None where the run has no referent choice."""
    table, analysis = run.referent_choice, run_analysis(run)
    if table is None or table.empty or not analysis.referents:
        return None
    first, second = analysis.referents
    wide = table.pivot_table(index="prompt_id", columns="referent", values="logprob").dropna()
    if wide.empty or first not in wide or second not in wide:
        return None
    correct = _correct(run, analysis, wide[first], wide[second])
    correct["margin"] = np.where(correct["answer"] == first, 1, -1) * (wide[first] - wide[second]).to_numpy()
    frames = []
    for quantity in ("correct", "margin"):
        per = correct.pivot_table(index=ITEM, columns="label", values=quantity)
        if analysis.paired and {analysis.positive, analysis.negative} <= set(per.columns):
            per["gap"] = per[analysis.positive] - per[analysis.negative]
        per.columns = pd.MultiIndex.from_tuples(
            [(quantity, c) for c in per.columns], names=["quantity", "label"]
        )
        frames.append(per)
    return pd.concat(frames, axis=1)


def _correct(run, analysis, first_score: pd.Series, second_score: pd.Series) -> pd.DataFrame:
    """Per row of the scores (indexed by prompt_id first): 1 when the answer scores higher, 0 when
    the other does, 0.5 for a tie; with the prompt's item, contrast label and answer."""
    first, second = analysis.referents
    prompts = run.prompts.set_index("prompt_id")
    ids = first_score.index.get_level_values("prompt_id")
    answer = (
        np.full(len(ids), analysis.answer)
        if analysis.answer in analysis.referents
        else prompts.loc[ids, analysis.answer].astype(str).to_numpy()
    )
    chosen = np.where(first_score > second_score, first, np.where(first_score < second_score, second, ""))
    correct = pd.Series(
        np.where(chosen == "", 0.5, (chosen == answer).astype(float)), index=first_score.index, name="correct"
    ).reset_index()
    correct[ITEM] = prompts.loc[correct["prompt_id"], ITEM].to_numpy()
    correct["label"] = (
        prompts.loc[correct["prompt_id"], analysis.contrast].astype(str).to_numpy()
        if analysis.contrast
        else "all"
    )
    correct["answer"] = answer
    return correct


def _accuracy(
    correct: pd.DataFrame, by: list[str], items: pd.DataFrame, analysis, chance: float = 0.5
) -> pd.DataFrame:
    """Per combination of `by`: the mean of `correct` over items (labels averaged within an item;
    `items`: the run's items_table), tested against `chance`; the mean per contrast label; the
    paired positive - negative gap."""

    def test(values: pd.DataFrame) -> dict:
        """Cluster-robust test of the per-item values (items x heads) on their design's cells."""
        design = Design.build(values.index, items, analysis)
        return cluster_mean_test(
            design.cell_means(values.to_numpy()), design.cells["weight"].to_numpy(), design.clusters
        ) | {"clusters": design.cluster_text}

    overall = correct.pivot_table(index=ITEM, columns=by, values="correct")  # items, labels averaged
    tested = test(overall - chance)
    table = overall.columns.to_frame(index=False)
    table["accuracy"] = tested["mean"] + chance
    table["ci_low"], table["ci_high"] = tested["ci_low"] + chance, tested["ci_high"] + chance
    if chance == 0.5:  # an accuracy: the t interval (few clusters) may pass 0 or 1, which no accuracy can
        table["ci_low"], table["ci_high"] = table["ci_low"].clip(0, 1), table["ci_high"].clip(0, 1)
    table["p"] = tested["p"]
    table["q"] = bh_qvalues(tested["p"])
    per_label = {
        label: part.pivot_table(index=ITEM, columns=by, values="correct").reindex(columns=overall.columns)
        for label, part in correct.groupby("label", sort=False)
    }
    for label, values in per_label.items():
        table[f"accuracy_{label}"] = test(values)["mean"]
    if analysis.paired and analysis.positive in per_label and analysis.negative in per_label:
        gap = test((per_label[analysis.positive] - per_label[analysis.negative]).dropna(how="all"))
        table["gap"], table["gap_ci_low"], table["gap_ci_high"] = gap["mean"], gap["ci_low"], gap["ci_high"]
        table["gap_p"] = gap["p"]
        table["gap_q"] = bh_qvalues(gap["p"])
    table["n_items"] = len(overall)
    table["clusters"] = tested["clusters"]
    return table
