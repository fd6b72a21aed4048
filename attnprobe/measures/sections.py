"""The built-in kinds' report sections (Measure.section): the values each lays out, its figures and
the Jinja file under measures/templates/ that lays them out. The report renders every kind's
section the same way (attnprobe.report); a kind without a template of its own gets the generic
layout of title, text, figures and one table. The drawing functions import plotting.plots (seaborn)
when they draw: the table readers here serve the CLI's summary too, which draws nothing.

The strongest head, everywhere it is named (the report's first sentence, its head table, its
attention view, summary.json), is chosen by one rule (`strongest_head`): among the heads whose
paired attention to a target passes q < 0.05, the one with the largest |slope on the covariate|
(attention weight per 10 covariate points); without a covariate, the largest |d_z| of the paired
difference.
"""

from __future__ import annotations

from importlib.resources import files

import pandas as pd

from ..plotting import Figures, file_name
from ..stats import ALPHA, run_analysis

MAX_TOP_HEADS = 12


def template(name: str):
    """A built-in kind's section layout, measures/templates/NAME.html.j2 (a Traversable: read_text)."""
    return files(__package__).joinpath("templates", f"{name}.html.j2")


def split_levels(head_stats: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(paired rows, level rows) of the pooled scope: level rows are measures read before the
    contrast (no paired difference; stats.kinds.attention._level)."""
    heads = head_stats[head_stats["scope"] == "all"] if len(head_stats) else head_stats
    if "level" not in heads:
        return heads, heads.iloc[0:0]
    level = heads["level"].notna()
    return heads[~level], heads[level]


def head_test(covariate: bool, level: bool = False) -> tuple[str, str]:
    """(q column, size column) of the head test the summary reports."""
    if level:
        return "level_q", "level_per10"
    return ("interaction_q", "interaction_per10") if covariate else ("difference_q", "d_z")


def strongest_head(heads: pd.DataFrame, covariate: bool, level: bool = False) -> pd.Series | None:
    """The strongest head of `heads` (paired rows of one or more targets, or with `level` the rows
    read before the contrast) by the module's rule, or None where no head passes."""
    if not len(heads):
        return None
    q, size = head_test(covariate, level)
    passing = heads[heads[q] < ALPHA]
    return passing.loc[passing[size].abs().idxmax()] if len(passing) else None


def pooled_row(behavior: pd.DataFrame) -> pd.Series | None:
    """The behaviour table's row over all templates (scope `all`), or None."""
    rows = behavior[behavior["scope"] == "all"] if len(behavior) else behavior
    return rows.iloc[0] if len(rows) else None


def attention_pairs(heads: pd.DataFrame) -> list[tuple[str, str, str, pd.DataFrame]]:
    """(name, source, target, rows) per attention entry of the head table: the name is the target, or
    "source -> target" where several sources reach one target (each gets its own heatmap)."""
    if not len(heads):
        return []
    pairs = heads[["source", "target"]].drop_duplicates()
    shared = pairs["target"].duplicated(keep=False)
    return [
        (
            f"{source} -> {target}" if many else target,
            source,
            target,
            heads[(heads["source"] == source) & (heads["target"] == target)],
        )
        for (source, target), many in zip(pairs.itertuples(index=False), shared)
    ]


def attention_section(run, tables: dict, figures: Figures) -> dict:
    """The heads: heatmaps of the interaction and the difference, the level slopes and the layer
    profile; the heads that pass, strongest first (at most MAX_TOP_HEADS); per source, the heads that
    attend to the correct referent (when the analysis declares referents)."""
    from ..plotting import plots

    analysis = run_analysis(run)
    heads, levels = split_levels(tables["head_stats"])
    maps = []
    for name, source, target, heads_of in attention_pairs(heads):
        if analysis.covariate:
            maps.append(_interaction_map(analysis, name, source, target, heads_of, figures))
        maps.append(_difference_map(analysis, name, source, target, heads_of, figures))
    for (source, target), group in levels.groupby(["source", "target"], sort=False):
        if "level_per10" in group and group["level_per10"].notna().any():
            covariate = analysis.name(analysis.covariate)
            title = f"{source} -> {target}: attention change\nper 10 points of {covariate}"
            fig = plots.head_heatmap(
                group, target, "level_per10", "level_q", title=title, label="attention per 10 points"
            )
            alt = f"layer x head slope of the attention {source} -> {target} on the covariate"
            maps.append(figures.save(fig, f"level_{source}_{target}", alt))
    if len(tables["layer_stats"]):
        columns = {f"n_{test}_q05": test for test in ("interaction", "difference", "level")}
        title = "where in depth: heads with q < 0.05 per layer"
        fig = plots.layer_profile(tables["layer_stats"], columns, title)
        maps.append(figures.save(fig, "layer_profile", "heads with q < 0.05 per layer"))
    q_column, rank = head_test(bool(analysis.covariate))
    passing = heads[heads[q_column] < ALPHA] if len(heads) else heads
    top = passing.reindex(passing[rank].abs().sort_values(ascending=False).index) if len(heads) else heads
    return {
        "template": template("attention"),
        "heatmaps": maps,
        "top_heads": top.head(MAX_TOP_HEADS).to_dict("records"),
        "referents": _referent_heads(tables.get("referent_accuracy"), figures, analysis),
    }


def _interaction_map(analysis, name, source, target, heads_of, figures: Figures) -> dict:
    from ..plotting import plots

    pos, neg = analysis.positive, analysis.negative
    title = f"{name}: r of {pos} - {neg}\nwith {analysis.name(analysis.covariate)}"
    fig = plots.head_heatmap(
        heads_of, target, "interaction_r", "interaction_q", title=title, label="interaction r", limit=1.0
    )
    return figures.save(
        fig, f"interaction_{file_name(name)}", f"layer x head interaction r, {source} -> {target}"
    )


def _difference_map(analysis, name, source, target, heads_of, figures: Figures) -> dict:
    from ..plotting import plots

    pos, neg = analysis.positive, analysis.negative
    lexical = "lexical difference\n(token identity, not bias)" if analysis.covariate else "paired difference"
    fig = plots.head_heatmap(
        heads_of,
        target,
        "d_z",
        "difference_q",
        title=f"{name}: {lexical}",
        label=f"d_z ({pos} - {neg})",
        limit=figures.limits.get("d_z"),
    )
    alt = f"layer x head d_z of the {pos} - {neg} difference, {source} -> {target}"
    return figures.save(fig, f"difference_{file_name(name)}", alt)


def _referent_heads(table, figures: Figures, analysis) -> dict | None:
    """Per source: does it attend more to the correct referent than to the other, head by head."""
    if table is None or not len(table):
        return None
    from ..plotting import plots

    first, second = analysis.referents
    sources = []
    for source, rows in table.groupby("source", sort=False):
        shown = rows.assign(target=source, above_chance=rows["accuracy"] - 0.5)
        title = f"{source}: accuracy - 0.5 ({first} vs {second})"
        fig = plots.head_heatmap(
            shown, source, "above_chance", "q", title=title, label="accuracy - 0.5", limit=0.5
        )
        gap = rows["gap_q"] < ALPHA if "gap_q" in rows else pd.Series(False, index=rows.index)
        significant = rows["q"] < ALPHA
        sources.append(
            {
                "source": source,
                "figure": figures.save(
                    fig, f"referent_accuracy_{source}", f"layer x head referent accuracy of {source}"
                ),
                "top": rows.sort_values("accuracy", ascending=False).head(5).to_dict("records"),
                "n_heads": len(rows),
                "n_above": int((significant & (rows["accuracy"] > 0.5)).sum()),
                "n_below": int((significant & (rows["accuracy"] < 0.5)).sum()),
                "n_gap": int(gap.sum()),
                "clusters": rows["clusters"].iloc[0],
            }
        )
    return {
        "first": first,
        "second": second,
        "answer": analysis.name(analysis.answer),
        "sources": sources,
        "labels": _accuracy_labels(table.columns),
        "paired": "gap" in table,
    }


def _accuracy_labels(columns) -> list[str]:
    return [c.removeprefix("accuracy_") for c in columns if c.startswith("accuracy_")]


def behaviour_section(run, tables: dict, figures: Figures) -> dict:
    """What the model predicts: the next-token log-ratio per scope; with a covariate the per-unit
    log-ratio against it (the report's lead figure, beside the key findings) and per template."""
    analysis, behavior, per_unit = run_analysis(run), tables["behavior"], tables["behavior_by_unit"]
    shown = []
    if analysis.covariate and len(per_unit):
        from ..plotting import plots

        pos, neg, xlabel = analysis.positive, analysis.negative, analysis.name(analysis.covariate)
        scatter = plots.behavior_scatter(per_unit, behavior, xlabel, f"log p({pos}) - log p({neg})")
        alt = f"per-{analysis.name(analysis.unit)} log-ratio against {xlabel}"
        shown = [
            figures.save(scatter, "behavior_vs_covariate", alt),
            figures.save(
                plots.template_breakdown(behavior, xlabel), "behavior_by_template", "behaviour r by template"
            ),
        ]
    return {
        "template": template("next_token"),
        "lead_figure": shown[0] if shown else None,
        "figures": shown[1:],
        "rows": behavior.to_dict("records"),
    }


def choice_section(run, tables: dict, figures: Figures) -> dict | None:
    """The model's own choice of referent in a scored continuation: accuracy against chance, per
    label and group (the first row pools them)."""
    table = tables.get("referent_choice_accuracy")
    if table is None or not len(table):
        return None
    choice = table.iloc[0].to_dict()
    return {
        "template": template("referent_choice"),
        "choice": choice,
        "groups": table.iloc[1:].to_dict("records"),
        "labels": _accuracy_labels(table.columns),
        "paired": "gap" in choice,
    }


def records_section(name: str, tables: dict, table: str, **values) -> dict | None:
    """A kind whose layout reads its one table's records (sentence preference, multiple choice),
    with `values` beside them."""
    rows = tables.get(table)
    if rows is None or not len(rows):
        return None
    return {"template": template(name), "rows": rows.to_dict("records"), **values}
