"""The head effects' report section: per counterfactual word, the total effect, the shares of it
that patches carry, the layers (figure) and the strongest heads (laid out by
measures/templates/head_effects.html.j2)."""

from __future__ import annotations

import re

from ...plotting import Figures, file_name, plots
from ...schema.analysis import BEFORE
from ...stats import run_analysis
from ..referent_choice import question_of
from ..sections import split_levels, template


def effects_section(run, tables: dict, figures: Figures, info) -> dict:
    """`info`: the run's EffectsRecord (what was patched, how the heads were chosen); the run has the
    head-effect tables (HeadEffects.section asks)."""
    manifest, analysis = run.manifest, run_analysis(run)
    slot, words = info.swap
    exact = (info.exact or "all") == "all"  # else only k heads were patched exactly: colour by attribution
    sections = [
        _word_section(tables, summary, slot, exact, figures, analysis)
        for summary in tables["head_effects_summary"].to_dict("records")
    ]
    heads = split_levels(tables["head_stats"])[0] if "head_stats" in tables else []
    heads = heads[heads["target"] == slot] if len(heads) else heads
    if len(heads) and sections:  # one source reading the slot with a paired difference: the span's own first
        sources = list(dict.fromkeys(heads["source"]))
        source = next((s for s in sources if not s.startswith(BEFORE)), sources[0])
        fig = plots.head_heatmap(
            heads[heads["source"] == source],
            slot,
            "d_z",
            "difference_q",
            title=f"{source} -> {slot}: attention difference d_z",
            label="d_z",
        )
        alt = f"attention difference, {source} -> {slot}"
        sections[0]["figures"].append(figures.save(fig, f"difference_{slot}_beside_effects", alt))
    return {
        "template": template("head_effects"),
        "slot": slot,
        "words": [word_name(w) for w in words],  # as a reader names them
        "sections": sections,
        "seconds": info.seconds,
        "dropped": info.dropped,
        "exact": info.exact,
        "select": info.select,
        "halves_by": analysis.name(info.halves_by),
        "design": info.design,
        "question": question_of(manifest),
        "referents": analysis.referents,
        "answer": analysis.name(analysis.answer) if analysis.answer else None,
    }


def _word_section(tables: dict, summary: dict, slot, exact: bool, figures: Figures, analysis) -> dict:
    """One counterfactual word: its summary, the heads' effects (figure), the layers' shares (figure)
    and the five strongest heads."""
    word = summary["counterfactual"]
    effects = tables["head_effects"][tables["head_effects"]["counterfactual"] == word]
    shares = tables["head_effects_layer_shares"][
        tables["head_effects_layer_shares"]["counterfactual"] == word
    ]
    name, shown = file_name(word), word_name(word)
    heatmap = plots.head_heatmap(
        effects.assign(target=word),
        word,
        "mean_output_in" if exact else "mean_attribution_output",
        "output_in_q",
        title=f"{slot} -> {shown}: head output patched in"
        + ("" if exact else " (attribution;\nexact for the suite's heads)"),
        label=f"change of log p({analysis.positive}) - log p({analysis.negative})",
    )
    alt = f"layer x head mean effect of patching each head's output, {slot} -> {shown}"
    shown_figures = [figures.save(heatmap, f"head_effects_{name}", alt)]
    if summary.get("te_nonzero", True):  # shares of a total effect near 0 say nothing: no figure
        fig = plots.layer_shares(shares, f"{slot} -> {shown}: share of the total effect per layer")
        alt = f"per-layer shares of the total effect, {slot} -> {shown}"
        shown_figures.append(figures.save(fig, f"layer_shares_{name}", alt))
    ranked = effects.dropna(subset=["mean_output_in"])
    direction = 1.0 if summary["te_mean"] >= 0 else -1.0
    top = ranked.assign(score=direction * ranked["mean_output_in"]).sort_values("score", ascending=False)
    return {
        "word": word,
        "name": shown,
        "summary": summary,
        "figures": shown_figures,
        "top": top.head(5).to_dict("records"),
    }


def word_name(word) -> str:
    """A counterfactual as a reader names it: a word as it is, a per-value template such as
    {occupation.anti_stereotype} as "each occupation's anti-stereotype"."""
    return re.sub(r"\{(\w+)\.(\w+)\}", lambda m: f"each {m[1]}'s {m[2].replace('_', '-')}", str(word))
