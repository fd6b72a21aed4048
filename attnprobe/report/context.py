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
from ..measures.sections import attention_pairs, head_test, pooled_row, split_levels, strongest_head
from ..plotting import Figures, figure, file_name
from ..run.files.reader import RunFiles
from ..stats import ALPHA, run_analysis
from .edit_sweep import edits_context
from .headline import headline
from .summary import summary


def run_context(run: RunFiles, tables: dict, limits: dict | None = None) -> dict:
    """The template's values for one run; `limits` (statistic -> colour range) is shared by the
    runs of one report so that equal colours mean equal values. Each measure lays out its own
    section (Measure.section); the report renders them in the registry's order."""
    manifest, analysis = run.manifest, run_analysis(run)
    heads = split_levels(tables["head_stats"])[0]
    figures = Figures(run.directory / "figures", limits)
    sections = [section for kind in MEASURES.values() if (section := kind.section(run, tables, figures))]
    lead = next((s["lead_figure"] for s in sections if s.get("lead_figure")), None)
    b = pooled_row(tables["behavior"])
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
        "measure_sections": sections,
        "edits": edits_context(run.directory, figures.directory),
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
        "main_figure": lead,  # beside the key findings
        "behavior_pooled": b.to_dict() if b is not None else None,
        **_head_findings(analysis, heads),
        "examples": examples,
        "skipped": manifest.skipped,
        "notes": manifest.notes,
        "templates": [{"id": t, "text": texts.get(t, "")} for t in dict.fromkeys(run.prompts["template_id"])],
        "groups": analysis.groups,
    }


def _head_findings(analysis, heads: pd.DataFrame) -> dict:
    """The heads that pass per target and the strongest one (measures.sections.strongest_head), for the
    side-by-side table of compared runs and the attention view's start."""
    q_column, rank = head_test(bool(analysis.covariate))
    strongest = strongest_head(heads, bool(analysis.covariate))
    return {
        "n_interaction": heads[heads[q_column] < ALPHA].groupby("target").size().to_dict()
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
    from ..plotting import plots  # seaborn: loaded only where a figure is drawn

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
            name = file_name(f"{context['label']}_{pair}")
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
