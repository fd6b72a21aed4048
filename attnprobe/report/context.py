"""What the report says about one run: the headline sentence and the values its template lays out.

Words come from the run's declared analysis (the contrast labels, the covariate, the units), so a
suite about any contrast reads right. Order of importance: behaviour (with its CI), then the heads
whose difference changes with the covariate (the interaction), then the plain difference between
the two labels, which is a token difference and is labelled as one.
"""

from __future__ import annotations

import json

import pandas as pd

from ..heads import HeadSet
from ..measures import MEASURES
from ..run.files.reader import RunFiles
from ..stats import ALPHA, run_analysis
from ..stats.kinds.multiple_choice import choice_setting
from . import plots
from .figures import figure
from .headline import headline
from .sections import edits_context, effects_context, referents_context
from .summary import head_test, pooled_row, split_levels, strongest_head, summary


def _records(tables: dict, name: str) -> list[dict]:
    return tables[name].to_dict("records") if name in tables else []


def run_context(run: RunFiles, tables: dict, limits: dict | None = None) -> dict:
    """The template's values for one run; `limits` (statistic -> colour range) is shared by the
    runs of one report so that equal colours mean equal values."""
    manifest, analysis = run.manifest, run_analysis(run)
    heads, levels = split_levels(tables["head_stats"])
    figures_dir = run.directory / "figures"
    behavior = tables["behavior"]
    behavior_figures = _behavior_figures(analysis, behavior, tables["behavior_by_unit"], figures_dir)
    b = pooled_row(behavior)
    examples = (
        json.loads((run.directory / "examples.json").read_text())
        if (run.directory / "examples.json").is_file()
        else []
    )
    texts = manifest.suite.templates  # recorded by the run: the suite file is not re-read
    return {
        "analysis": analysis,
        "pos": analysis.positive,
        "neg": analysis.negative,
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
        "model": manifest.model.spec,
        "directory": run.directory.name,
        "suite": manifest.suite.name,
        "family": manifest.model.family,
        "description": manifest.suite.description,
        "n_prompts": manifest.n_prompts,
        "n_items": int(run.prompts["item_id"].nunique()),
        "n_layers": manifest.model.n_layers,
        "n_heads_per_layer": manifest.model.n_heads,
        "n_heads": manifest.model.n_layers * manifest.model.n_heads,
        "dtype": manifest.dtype,
        "suite_sha": manifest.suite.sha256,
        "finished": manifest.finished or "",
        "headline": headline(run, tables),
        "summary": summary(run, tables),
        "heatmaps": _heatmaps(analysis, heads, levels, tables["layer_stats"], figures_dir, limits or {}),
        "main_figure": behavior_figures[0] if behavior_figures else None,  # beside the key findings
        "behavior_figures": behavior_figures[1:],
        "behavior": behavior.to_dict("records"),
        "behavior_pooled": b.to_dict() if b is not None else None,
        **_head_findings(analysis, heads),
        "examples": examples,
        "skipped": manifest.skipped,
        "notes": manifest.notes,
        "templates": [{"id": t, "text": texts.get(t, "")} for t in dict.fromkeys(run.prompts["template_id"])],
        "groups": analysis.groups,
    }


def _head_findings(analysis, heads: pd.DataFrame) -> dict:
    """The heads that pass, ordered by the rule that names the strongest head (summary.strongest_head),
    their counts per target, and the strongest one."""
    q_column, rank = head_test(bool(analysis.covariate))
    significant = heads[heads[q_column] < ALPHA] if len(heads) else heads
    top = (
        significant.reindex(significant[rank].abs().sort_values(ascending=False).index).head(12)
        if len(heads)
        else heads
    )
    strongest = strongest_head(heads, bool(analysis.covariate))
    return {
        "top_heads": top.to_dict("records"),
        "n_interaction": significant.groupby("target").size().to_dict()
        if analysis.covariate and len(heads)
        else {},
        "n_difference": heads[heads["difference_q"] < ALPHA].groupby("target").size().to_dict()
        if len(heads)
        else {},
        "strongest": f"{HeadSet.name(strongest['layer'], strongest['head'])} -> {strongest['target']}, "
        f"{rank} = {strongest[rank]:.4g}"
        if strongest is not None
        else "-",
        "view_start": f"{int(strongest['layer'])},{int(strongest['head'])},{strongest['target']}"
        if strongest is not None
        else "0,0",
    }


def _behavior_figures(analysis, behavior: pd.DataFrame, per_unit: pd.DataFrame, figures_dir) -> list:
    """The per-unit log-ratio against the covariate (the report's first figure) and the per-template
    breakdown; none without a covariate."""
    if not (analysis.covariate and len(per_unit)):
        return []
    pos, neg, xlabel = analysis.positive, analysis.negative, analysis.name(analysis.covariate)
    return [
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


def _heatmaps(analysis, heads, levels, layer_stats, figures_dir, limits: dict) -> list:
    """Per attention pair: the interaction and the difference heatmaps; the level slopes; the layer
    profile."""
    maps = []
    for name, source, target, heads_of in attention_pairs(heads):
        if analysis.covariate:
            maps.append(_interaction_map(analysis, name, source, target, heads_of, figures_dir))
        maps.append(_difference_map(analysis, name, source, target, heads_of, figures_dir, limits))
    for (source, target), group in levels.groupby(["source", "target"], sort=False):
        if "level_per10" in group and group["level_per10"].notna().any():
            maps.append(
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
    if len(layer_stats):
        columns = {"n_interaction_q05": "interaction", "n_difference_q05": "difference"}
        maps.append(
            figure(
                plots.layer_profile(layer_stats, columns, "where in depth: heads with q < 0.05 per layer"),
                figures_dir,
                "layer_profile",
                "heads with q < 0.05 per layer",
            )
        )
    return maps


def _interaction_map(analysis, name, source, target, heads_of, figures_dir) -> dict:
    pos, neg = analysis.positive, analysis.negative
    return figure(
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


def _difference_map(analysis, name, source, target, heads_of, figures_dir, limits: dict) -> dict:
    pos, neg = analysis.positive, analysis.negative
    lexical = "lexical difference\n(token identity, not bias)" if analysis.covariate else "paired difference"
    return figure(
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
