"""What the report says about one run: the headline sentence and the values its template lays out.

Words come from the run's declared analysis (the contrast labels, the covariate, the units), so a
suite about any contrast reads right. Order of importance: behaviour (with its CI), then the heads
whose difference changes with the covariate (the interaction), then the plain difference between
the two labels, which is a token difference and is labelled as one.
"""

from __future__ import annotations

import json
import math

import pandas as pd

from ..heads import HeadSet
from ..measures import MEASURES
from ..run.reader import RunFiles
from ..schema.analysis import few_levels_notes
from ..stats import ALPHA, held_out_interaction, run_analysis
from ..stats.multiple_choice import choice_setting
from . import plots
from .figures import figure
from .sections import edits_context, effects_context, referents_context


def _pooled(behavior: pd.DataFrame):
    rows = behavior[behavior["scope"] == "all"] if len(behavior) else behavior
    return rows.iloc[0] if len(rows) else None


def _records(tables: dict, name: str) -> list[dict]:
    return tables[name].to_dict("records") if name in tables else []


def _fmt(value, digits=2) -> str:
    return (
        "nan" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"
    )


def split_levels(head_stats: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(paired rows, level rows) of the pooled scope: level rows are measures read before the
    contrast (no paired difference; stats.attention._level)."""
    heads = head_stats[head_stats["scope"] == "all"] if len(head_stats) else head_stats
    if "level" not in heads:
        return heads, heads.iloc[0:0]
    level = heads["level"].notna()
    return heads[~level], heads[level]


def _chosen_interval(row, column: str, m: int) -> tuple[float, float]:
    """The 95% interval of a value chosen as the largest of m, Bonferroni-adjusted: its t interval's
    standard error (from the unadjusted interval and df) times t at 1 - 0.025 / m."""
    from scipy.stats import t

    df = float(row.get("interaction_df", float("nan")))
    half = (row[f"{column}_ci_high"] - row[f"{column}_ci_low"]) / 2
    if not df > 0 or m < 1:
        return float("nan"), float("nan")
    se = half / t.ppf(0.975, df)
    wide = se * t.ppf(1 - 0.025 / m, df)
    return row[column] - wide, row[column] + wide


def _not_absence(q: pd.Series) -> str:
    """What "no head at q < 0.05" does not say, with the smallest q the heads had."""
    smallest = q.min()
    shown = f"the smallest q is {smallest:.2g}; " if smallest == smallest else ""
    return f" ({shown}not passing a test is not evidence that no head does)"


def headline(run: RunFiles, tables: dict) -> str:
    """One sentence with the run's main numbers: behaviour, interaction heads, then the lexical difference."""
    analysis = run_analysis(run)
    if not analysis.paired:
        labels = ", ".join(analysis.labels) or "none"
        return (
            f"This suite compares no two labels (contrast labels: {labels}); declare analysis.positive and "
            "analysis.negative for paired statistics. Descriptive means are in condition_means.csv."
        )
    model, pos, neg = run.manifest["model"]["spec"], analysis.positive, analysis.negative
    parts = []
    b = _pooled(tables["behavior"])
    if b is not None and analysis.covariate:
        per = f"per 10 {analysis.name(analysis.covariate)} points"
        parts.append(
            f"Across {int(b['n_units'])} {analysis.name(analysis.unit)}s, {model}'s log p({pos}) - log "
            f"p({neg}) at the token before '{b['cut']}' changes by {_fmt(b['slope_per10'], 3)} nats {per} "
            f"(95% CI [{_fmt(b['slope_per10_ci_low'], 3)}, {_fmt(b['slope_per10_ci_high'], 3)}], "
            f"cluster-robust by {b['clusters']}, p = {b['slope_p']:.2g}; Pearson r of the "
            f"{analysis.name(analysis.unit)} means {_fmt(b['pearson_r'])})"
        )
    elif b is not None:
        parts.append(
            f"{model}'s mean log p({pos}) - log p({neg}) at the token before '{b['cut']}' is "
            f"{_fmt(b['mean_log_ratio'], 3)} nats (95% CI [{_fmt(b['mean_ci_low'], 3)}, "
            f"{_fmt(b['mean_ci_high'], 3)}], clusters: {b['clusters']})"
        )
    counts = {c: run.prompts[c].nunique() for c in analysis.clusters if c in run.prompts}
    parts += [f"note: {note}" for note in few_levels_notes(analysis, counts)]
    heads, levels = split_levels(tables["head_stats"])
    for target, group in heads.groupby("target", sort=False):
        if analysis.covariate:
            hits = group[group["interaction_q"] < ALPHA]
            held = held_out_interaction(group)
            check = (
                f"; held out ({held['split']}), the top {held['k']} heads chosen on one half keep their "
                f"sign on the other in {held['n_same_sign']} of {held['n_selected']} (random heads of "
                f"the same layers: {_fmt(held['n_same_sign_null'], 1)}), mean r there "
                f"{_fmt(held['mean_held_out_r'])} against {_fmt(held['mean_held_out_r_null'])} "
                f"(p = {held['held_out_p']:.2g})"
            )
            if len(hits):
                top = hits.loc[hits["interaction_per10"].abs().idxmax()]
                low, high = _chosen_interval(top, "interaction_per10", len(group))
                parts.append(
                    f"in {len(hits)} of {len(group)} heads the {pos} - {neg} attention to the {target} "
                    f"changes with {analysis.name(analysis.covariate)} (q < {ALPHA}, cluster-robust by "
                    f"{top['clusters']}), most strongly {HeadSet.name(top['layer'], top['head'])} "
                    f"({_fmt(top['interaction_per10'], 4)} attention weight per 10 points "
                    f"[{_fmt(top['interaction_per10_ci_low'], 4)}, "
                    f"{_fmt(top['interaction_per10_ci_high'], 4)}]; chosen as the largest of {len(group)}, "
                    f"its interval adjusted for that choice (Bonferroni) is [{_fmt(low, 4)}, "
                    f"{_fmt(high, 4)}]; r = {_fmt(top['interaction_r'])}){check}"
                )
            else:
                note = group["interaction_power_note"].iloc[0]
                parts.append(
                    f"no head's {pos} - {neg} attention to the {target} changes with "
                    f"{analysis.name(analysis.covariate)} at q < {ALPHA}"
                    + _not_absence(group["interaction_q"])
                    + (f" ({note})" if note else "")
                    + check
                )
        lexical = int((group["difference_q"] < ALPHA).sum())
        kind = "a token difference, not bias" if analysis.covariate else "the paired difference"
        parts.append(
            f"{lexical} of {len(group)} heads attend to the {target} differently from {pos} and {neg} "
            f"prompts ({kind})"
        )
    for (source, target), group in levels.groupby(["source", "target"], sort=False):
        if "level_q" not in group:
            continue
        hits = group[group["level_q"] < ALPHA]
        where = source.removeprefix("before_")
        text = f"at the token before the {where}, " if where != source else ""
        if len(hits):
            top = hits.loc[hits["level_per10"].abs().idxmax()]
            parts.append(
                f"{text}the attention to the {target} changes with {analysis.name(analysis.covariate)} in "
                f"{len(hits)} of {len(group)} heads (q < {ALPHA}), most strongly "
                f"{HeadSet.name(top['layer'], top['head'])} ({_fmt(top['level_per10'], 4)} attention weight "
                "per 10 points)"
            )
        else:
            parts.append(
                f"{text}no head's attention to the {target} changes with "
                f"{analysis.name(analysis.covariate)} at q < {ALPHA}" + _not_absence(group["level_q"])
            )
    if not parts:
        return (
            f"Nothing here compares {pos} with {neg}: no attention measure has paired prompts and no "
            "next-token "
            f"candidates carry those labels; the raw tables are attention.parquet and logprobs.csv."
        )
    return "; ".join(parts) + "."


def run_context(run: RunFiles, tables: dict, limits: dict | None = None) -> dict:
    """The template's values for one run; `limits` (statistic -> colour range) is shared by the
    runs of one report so that equal colours mean equal values."""
    limits = limits or {}
    manifest = run.manifest
    analysis = run_analysis(run)
    heads, levels = split_levels(tables["head_stats"])
    figures_dir = run.directory / "figures"
    pos, neg = analysis.positive, analysis.negative
    heatmaps = []
    for name, source, target, heads_of in attention_pairs(heads):
        if analysis.covariate:
            heatmaps.append(
                figure(
                    plots.head_heatmap(
                        heads_of,
                        target,
                        "interaction_r",
                        "interaction_q",
                        title=f"{name}: r of {pos} - {neg}\nwith {analysis.name(analysis.covariate)}",
                        label="interaction r",
                        limit=1.0,
                    ),
                    figures_dir,
                    f"interaction_{_file_name(name)}",
                    f"layer x head interaction r, {source} -> {target}",
                )
            )
        lexical = (
            "lexical difference\n(token identity, not bias)" if analysis.covariate else "paired difference"
        )
        heatmaps.append(
            figure(
                plots.head_heatmap(
                    heads_of,
                    target,
                    "d_z",
                    "difference_q",
                    title=f"{name}: {lexical}",
                    label=f"d_z ({pos} - {neg})",
                    limit=limits.get("d_z"),
                ),
                figures_dir,
                f"difference_{_file_name(name)}",
                f"layer x head d_z of the {pos} - {neg} difference, {source} -> {target}",
            )
        )
    for (source, target), group in levels.groupby(["source", "target"], sort=False):
        if "level_per10" in group and group["level_per10"].notna().any():
            heatmaps.append(
                figure(
                    plots.head_heatmap(
                        group,
                        target,
                        "level_per10",
                        "level_q",
                        title=f"{source} -> {target}: attention change\nper 10 points of "
                        f"{analysis.name(analysis.covariate)}",
                        label="attention per 10 points",
                    ),
                    figures_dir,
                    f"level_{source}_{target}",
                    f"layer x head slope of the attention {source} -> {target} on the covariate",
                )
            )
    if len(tables["layer_stats"]):
        columns = {"n_interaction_q05": "interaction", "n_difference_q05": "difference"}
        heatmaps.append(
            figure(
                plots.layer_profile(
                    tables["layer_stats"], columns, "where in depth: heads with q < 0.05 per layer"
                ),
                figures_dir,
                "layer_profile",
                "heads with q < 0.05 per layer",
            )
        )
    behavior, per_unit = tables["behavior"], tables["behavior_by_unit"]
    behavior_figures = []
    if analysis.covariate and len(per_unit):
        xlabel = analysis.name(analysis.covariate)
        behavior_figures = [
            figure(
                plots.behavior_scatter(per_unit, behavior, xlabel, f"log p({pos}) - log p({neg})"),
                figures_dir,
                "behavior_vs_covariate",
                f"per-{analysis.name(analysis.unit)} log-ratio against {xlabel}",
            ),
            figure(
                plots.template_breakdown(behavior, xlabel),
                figures_dir,
                "behavior_by_template",
                "behaviour r by template",
            ),
        ]
    rank = "interaction_r" if analysis.covariate else "d_z"
    q_column = "interaction_q" if analysis.covariate else "difference_q"
    significant = heads[heads[q_column] < ALPHA] if len(heads) else heads
    top = (
        significant.reindex(significant[rank].abs().sort_values(ascending=False).index).head(12)
        if len(heads)
        else heads
    )
    strongest = top.iloc[0] if len(top) else None
    b = _pooled(behavior)
    examples = (
        json.loads((run.directory / "examples.json").read_text())
        if (run.directory / "examples.json").is_file()
        else []
    )
    texts = manifest["suite"].get("templates", {})  # recorded by the run: the suite file is not re-read
    return {
        "analysis": analysis,
        "pos": pos,
        "neg": neg,
        "covariate": analysis.name(analysis.covariate) if analysis.covariate else None,
        "unit": analysis.name(analysis.unit) if analysis.unit else None,
        "effects": effects_context(tables, heads, figures_dir, manifest, analysis),
        "edits": edits_context(run.directory, figures_dir),
        "referents": referents_context(tables, figures_dir, analysis),
        "measure_sections": [
            section for kind in MEASURES.values() if (section := kind.section(run, tables, figures_dir))
        ],
        "preference": _records(tables, "sentence_preference"),
        "choices": _records(tables, "choice_accuracy"),
        "choice_prompt": choice_setting(manifest, "prompt"),
        "model": manifest["model"]["spec"],
        "directory": run.directory.name,
        "suite": manifest["suite"]["name"],
        "family": manifest["model"]["family"],
        "description": manifest["suite"].get("description", ""),
        "n_prompts": manifest["n_prompts"],
        "n_items": int(run.prompts["item_id"].nunique()),
        "n_layers": manifest["model"]["n_layers"],
        "n_heads_per_layer": manifest["model"]["n_heads"],
        "n_heads": manifest["model"]["n_layers"] * manifest["model"]["n_heads"],
        "dtype": manifest["dtype"],
        "suite_sha": manifest["suite"]["sha256"],
        "finished": manifest.get("finished", ""),
        "headline": headline(run, tables),
        "heatmaps": heatmaps,
        "behavior_figures": behavior_figures,
        "top_heads": top.to_dict("records"),
        "behavior": behavior.to_dict("records"),
        "behavior_pooled": b.to_dict() if b is not None else None,
        "n_interaction": significant.groupby("target").size().to_dict()
        if analysis.covariate and len(heads)
        else {},
        "n_difference": heads[heads["difference_q"] < ALPHA].groupby("target").size().to_dict()
        if len(heads)
        else {},
        "strongest": f"{HeadSet.name(strongest['layer'], strongest['head'])} -> {strongest['target']}, "
        f"{rank} = {strongest[rank]:.2f}"
        if strongest is not None
        else "-",
        "view_start": f"{int(strongest['layer'])},{int(strongest['head'])},{strongest['target']}"
        if strongest is not None
        else "0,0",
        "examples": examples,
        "skipped": manifest.get("skipped", []),
        "notes": manifest.get("notes", []),
        "templates": [{"id": t, "text": texts.get(t, "")} for t in dict.fromkeys(run.prompts["template_id"])],
        "groups": analysis.groups,
    }


def run_labels(contexts: list[dict]) -> list[str]:
    """A label per compared run: its model, plus whatever tells apart runs of the same model
    (dtype, suite, else the run directory's name)."""
    labels = []
    for context in contexts:
        same = [c for c in contexts if c["model"] == context["model"]]
        extra = [key for key in ("dtype", "suite") if len({c[key] for c in same}) > 1]
        if len(same) > 1 and not extra:
            extra = ["directory"]
        labels.append(
            context["model"] + (f" ({', '.join(str(context[key]) for key in extra)})" if extra else "")
        )
    return labels


def difference_context(contexts: list[dict], tables: list[dict], figures_dir) -> dict:
    """Per-head differences between compared runs (each run minus the first) of the statistic
    that ranks heads, when they share a layers x heads grid and a declared analysis; else why not."""
    grids = {(c["n_layers"], c["n_heads_per_layer"]) for c in contexts}
    if len(grids) > 1:
        shapes = " and ".join(f"{layers} x {heads}" for layers, heads in sorted(grids))
        return {
            "figures": [],
            "note": f"No per-head difference: the runs have different head grids ({shapes} layers x heads); "
            "compare their counts, intervals and layer profiles.",
        }
    if len({bool(c["covariate"]) for c in contexts}) > 1:
        return {
            "figures": [],
            "note": "No per-head difference: only some of these runs declare a covariate, so they rank heads "
            "by different statistics.",
        }
    statistic = "interaction_r" if contexts[0]["covariate"] else "d_z"
    base = split_levels(tables[0]["head_stats"])[0]  # the paired rows of the pooled scope
    figures = []
    for context, table in zip(contexts[1:], tables[1:]):
        other = split_levels(table["head_stats"])[0]
        theirs = {name: of for name, *_, of in attention_pairs(other)}
        for pair, source, target, ours in attention_pairs(base):
            if pair not in theirs:
                continue
            keys = ["layer", "head"]
            a = ours.set_index(keys)[statistic]
            b = theirs[pair].set_index(keys)[statistic]
            diff = (b - a).rename(statistic).reset_index().assign(target=target)
            name = _file_name(f"{context['label']}_{pair}")
            figures.append(
                figure(
                    plots.head_heatmap(
                        diff,
                        target,
                        statistic,
                        None,
                        title=f"{pair}: {statistic},\n{context['label']} - {contexts[0]['label']}",
                        label=f"difference of {statistic}",
                    ),
                    figures_dir,
                    f"difference_{name}",
                    f"per-head {statistic} of {context['label']} minus {contexts[0]['label']}, {source} -> "
                    f"{target}",
                )
            )
    return {
        "figures": figures,
        "note": f"Per head: {statistic} of each run minus that of {contexts[0]['label']} (no test: "
        "a difference of two estimates; read the intervals in each run's table).",
    }


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


def _file_name(text: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in text)
