"""The report's sections beyond the attention statistics: head effects (activation patching) and
referents (attention accuracy and the model's own choice), as the values the template lays out."""

from __future__ import annotations

import re

import pandas as pd
import pyarrow as pa

from ..analyses.circuits.runs import ATTRIBUTED
from ..analyses.circuits.tables import chosen_circuit
from ..errors import RunError
from ..measures.head_effects import EffectsRecord
from ..measures.referent_choice import question_of
from ..stats import ALPHA
from . import plots
from .figures import figure


def effects_context(tables: dict, heads: pd.DataFrame, figures_dir, manifest, analysis) -> dict | None:
    """The head-effects section, when the run has them: per counterfactual word, the total effect,
    the shares of it that patches carry, the layers (figure) and the strongest heads."""
    if "head_effects" not in tables:
        return None
    info = EffectsRecord.of(manifest) or EffectsRecord({})
    slot, words = info.swap
    exact = (info.exact or "all") == "all"  # else only k heads were patched exactly: colour by attribution
    sections = [
        _word_section(tables, summary, slot, exact, figures_dir, analysis)
        for summary in tables["head_effects_summary"].to_dict("records")
    ]
    if len(heads) and slot in set(heads["target"]):
        sections[0]["figures"].append(
            figure(
                plots.head_heatmap(
                    heads, slot, "d_z", "difference_q", title=f"{slot}: attention difference d_z", label="d_z"
                ),
                figures_dir,
                f"difference_{slot}_beside_effects",
                f"attention difference, source -> {slot}",
            )
        )
    return {
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


def _word_section(tables: dict, summary: dict, slot, exact: bool, figures_dir, analysis) -> dict:
    """One counterfactual word: its summary, the heads' effects (figure), the layers' shares (figure)
    and the five strongest heads."""
    word = summary["counterfactual"]
    effects = tables["head_effects"][tables["head_effects"]["counterfactual"] == word]
    shares = tables["head_effects_layer_shares"][
        tables["head_effects_layer_shares"]["counterfactual"] == word
    ]
    name = "".join(c if c.isalnum() else "_" for c in str(word))
    shown = word_name(word)
    figures = [
        figure(
            plots.head_heatmap(
                effects.assign(target=word),
                word,
                "mean_output_in" if exact else "mean_attribution_output",
                "output_in_q",
                title=f"{slot} -> {shown}: head output patched in"
                + ("" if exact else " (attribution;\nexact for the suite's heads)"),
                label=f"change of log p({analysis.positive}) - log p({analysis.negative})",
            ),
            figures_dir,
            f"head_effects_{name}",
            f"layer x head mean effect of patching each head's output, {slot} -> {shown}",
        ),
    ]
    if summary.get("te_nonzero", True):  # shares of a total effect near 0 say nothing: no figure
        figures.append(
            figure(
                plots.layer_shares(shares, f"{slot} -> {shown}: share of the total effect per layer"),
                figures_dir,
                f"layer_shares_{name}",
                f"per-layer shares of the total effect, {slot} -> {shown}",
            )
        )
    ranked = effects.dropna(subset=["mean_output_in"])
    direction = 1.0 if summary["te_mean"] >= 0 else -1.0
    top = (
        ranked.assign(score=direction * ranked["mean_output_in"])
        .sort_values("score", ascending=False)
        .head(5)
    )
    return {
        "word": word,
        "name": shown,
        "summary": summary,
        "figures": figures,
        "top": top.to_dict("records"),
    }


def word_name(word) -> str:
    """A counterfactual as a reader names it: a word as it is, a per-value template such as
    {occupation.anti_stereotype} as "each occupation's anti-stereotype"."""
    return re.sub(r"\{(\w+)\.(\w+)\}", lambda m: f"each {m[1]}'s {m[2].replace('_', '-')}", str(word))


def referents_context(tables: dict, figures_dir, analysis) -> dict | None:
    """Referent accuracy, when the analysis declares referents: the model's own choice in a scored
    continuation (when the suite asks), and per source the heads above chance."""
    table = tables.get("referent_accuracy")
    choice = tables.get("referent_choice_accuracy")
    choice_groups = choice.iloc[1:].to_dict("records") if choice is not None and len(choice) else []
    choice = choice.iloc[0].to_dict() if choice is not None and len(choice) else None
    if (table is None or not len(table)) and choice is None:
        return None
    table = table if table is not None else pd.DataFrame(columns=["source"])
    first, second = analysis.referents
    sections = []
    for source, rows in table.groupby("source", sort=False):
        shown = rows.assign(target=source, above_chance=rows["accuracy"] - 0.5)
        fig = figure(
            plots.head_heatmap(
                shown,
                source,
                "above_chance",
                "q",
                title=f"{source}: accuracy - 0.5 ({first} vs {second})",
                label="accuracy - 0.5",
                limit=0.5,
            ),
            figures_dir,
            f"referent_accuracy_{source}",
            f"layer x head referent accuracy of {source}",
        )
        top = rows.sort_values("accuracy", ascending=False).head(5)
        gap = rows["gap_q"] < ALPHA if "gap_q" in rows else pd.Series(False, index=rows.index)
        sections.append(
            {
                "source": source,
                "figure": fig,
                "top": top.to_dict("records"),
                "n_heads": len(rows),
                "n_above": int(((rows["q"] < ALPHA) & (rows["accuracy"] > 0.5)).sum()),
                "n_below": int(((rows["q"] < ALPHA) & (rows["accuracy"] < 0.5)).sum()),
                "n_gap": int(gap.sum()),
                "clusters": rows["clusters"].iloc[0],
            }
        )
    labels = [
        c.removeprefix("accuracy_")
        for c in (table if len(table) else pd.DataFrame(columns=list(choice or ()))).columns
        if c.startswith("accuracy_")
    ]
    return {
        "first": first,
        "second": second,
        "answer": analysis.name(analysis.answer),
        "sections": sections,
        "choice": choice,
        "choice_groups": choice_groups,
        "labels": labels,
        "paired": "gap" in table or "gap" in (choice or {}),
    }


def edit_frontier_figure(directory, figures_dir) -> tuple[dict, pd.DataFrame]:
    """figures/edit_frontier.png (and .svg) drawn from the run's edit tables (the report's, and what
    `attnprobe edit` writes after a sweep), and the edits table it read."""
    try:
        summary = pd.read_parquet(directory / "edits.parquet")
        draws = pd.read_parquet(directory / "edits_draws.parquet")
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise RunError(
            f"{directory}: the edit tables are missing or damaged ({str(exc).splitlines()[0][:99]}); rebuild "
            f"them by rerunning `attnprobe edit {directory}` with its options (finished kinds are reused)"
        ) from None
    return figure(
        plots.edit_frontier(summary, draws), figures_dir, "edit_frontier", plots.FRONTIER_ALT
    ), summary


def goal_figure(directory, figures_dir, goal: list[dict] | None = None) -> dict | None:
    """figures/edit_goal.png (and .svg): the goal table (its records, read from `directory` unless
    given) as a frontier, when the sweep wrote one."""
    goal = pd.DataFrame(_optional(directory, "edits_goal") if goal is None else goal)
    if not len(goal):
        return None
    return figure(plots.goal_frontier(goal), figures_dir, "edit_goal", plots.GOAL_ALT)


def edits_context(directory, figures_dir) -> dict | None:
    """The head-edit section, when `attnprobe edit` has written edits.parquet into the run."""
    if not (directory / "edits.parquet").is_file():
        return None
    frontier, summary = edit_frontier_figure(directory, figures_dir)
    goal = _optional(directory, "edits_goal")
    # the values of analyses.paths_tables' NOISING and RESAMPLED (importing it would load torch)
    main = lambda r: r.get("direction", "noising") == "noising" and r.get("reference") != "another occupation"
    paths = [r for r in _optional(directory, "paths") if main(r)]
    parts = [  # one table: each comparison's rows after the main one's, their receivers so labelled
        {**r, "receiver": ", ".join([r["receiver"]] + ([] if main(r) else [r["reference"], r["direction"]]))}
        for r in _optional(directory, "paths_parts")
    ]
    return {
        "rows": summary.to_dict("records"),
        "figure": frontier,
        "reference": summary["reference"].iloc[0],
        "heads": _optional(directory, "edits_heads"),
        "stream": _optional(directory, "edits_stream"),
        "goal": goal,
        "goal_figure": goal_figure(directory, figures_dir, goal),
        "tracing": _side_by_side(_optional(directory, "tracing"), "layer", "position"),
        "paths": _side_by_side(paths, "receiver", "path"),
        "parts": _side_by_side(parts, "receiver", "part", ("role", "n_items")),
        "paths_sets": {r["receiver"]: r for r in paths if r["path"] == "value"},
        "edges": _optional(directory, "paths_edges"),
        "circuit": _optional(directory, "paths_circuit"),
        "circuits": _circuits(directory, figures_dir),
        "readout": _readout_summary(_optional(directory, "readout")),
        "transfer": _transfer_rows(_optional(directory, "edits_transfer")),
    }


def _circuits(directory, figures_dir) -> dict | None:
    """The circuit search's size curve (figure) and its rows, when `edit --circuits` wrote them."""
    rows = _optional(directory, "circuits")
    if not rows:
        return None
    table = pd.DataFrame(rows)
    curve = figure(plots.circuit_curve(table, ATTRIBUTED), figures_dir, "circuit_curve", plots.CIRCUIT_ALT)
    chosen = _drawn_circuits(directory, table)
    graph = chosen and figure(
        plots.circuit_graph(chosen), figures_dir, "circuit_graph", plots.CIRCUIT_GRAPH_ALT
    )
    return {"rows": rows, "figure": curve, "graph": graph}


def _drawn_circuits(directory, table: pd.DataFrame) -> list[tuple[str, str, pd.DataFrame]]:
    """Per comparison the circuit found that the graph draws: the smallest meeting the target short
    of the whole model, else the one with the best held-out faithfulness short of it; its units are
    those ranked 1 to its size on every item (circuit_parts, or circuit_edges before pruning)."""
    edges = "grain" in table and (table["grain"] == "edges").any()
    path = directory / ("circuit_edges.parquet" if edges else "circuit_parts.parquet")
    if not path.is_file():
        return []
    units, out = pd.read_parquet(path), []
    if "rank" not in units:
        return []
    found = table[(table["circuit"] == ATTRIBUTED) & (table["size"] > 0)]  # size 0: nothing to draw
    for reference, rows in found.groupby("reference", sort=False):
        row, met = chosen_circuit(rows)
        if row is None:
            continue
        unit = f"edges ({plots.DRAWN_EDGES} largest drawn, before pruning)" if edges else "parts"
        why = "the smallest meeting the target" if met else "none meets the target; the best held-out"
        title = f"{why}\n{row['size']:,} {unit}, held-out {row['held_out']:.0%}"
        own = units[(units["reference"] == reference) & (units["rank"] <= row["size"])]
        out.append((reference, title, own))
    return out


def _side_by_side(rows: list[dict], key: str, column: str, keep: tuple = ()) -> list[dict]:
    """One row per `key` (a layer, a receiver) holding each of its rows under that row's `column`
    (a position group, a path), with the `keep` fields of its first row."""
    out: dict = {}
    for r in rows:
        out.setdefault(r[key], {key: r[key], **{k: r.get(k) for k in keep}})[r[column]] = r
    return list(out.values())


def _readout_summary(rows: list[dict]) -> dict | None:
    """The linear readout's landmarks: the embeddings (layer 0), the first layer whose held-out R2
    passes (Holm p < 0.05 and CI above 0) and the largest R2 (not adjusted for being the largest)."""
    if not rows:
        return None
    passing = [r for r in rows if r["p_holm"] < 0.05 and r["ci_low"] > 0]
    return {
        "embeddings": rows[0],
        "first": passing[0] if passing else None,
        "best": max(rows, key=lambda r: r["r2"]),
        "n_units": rows[0]["n_units"],
        "floor": rows[0]["p_floor"] * len(rows),
    }


def _optional(directory, name: str) -> list[dict]:
    """The records of a table `attnprobe edit` may have written (none when it did not)."""
    path = directory / f"{name}.parquet"
    return pd.read_parquet(path).to_dict("records") if path.is_file() else []


TRANSFER_KEYS = ("cut", "quantity", "label", "score", "condition")  # what a comparison row is about


def _transfer_rows(rows: list[dict]) -> list[dict]:
    """Transfer rows with what each compares in one column ("correct gap", "pronoun")."""
    return [
        {
            **r,
            "what": " ".join(
                str(r[k]) for k in TRANSFER_KEYS if k in r and r[k] == r[k] and r[k] is not None
            ),
        }
        for r in rows
    ]
