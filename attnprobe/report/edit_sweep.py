"""The report's section of an edit sweep (attnprobe edit): its tables, the frontier and goal figures,
the circuits found, as the values the template lays out. Each measure's own section is
Measure.section (attnprobe.measures)."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa

from ..analyses.circuits.runs import ATTRIBUTED
from ..analyses.circuits.tables import chosen_circuit
from ..errors import RunError
from ..plotting import figure


def edit_frontier_figure(directory, figures_dir) -> tuple[dict, pd.DataFrame]:
    """figures/edit_frontier.png (and .svg) drawn from the run's edit tables (the report's, and what
    `attnprobe edit` writes after a sweep), and the edits table it read."""
    from ..plotting import plots  # seaborn: loaded only where a figure is drawn

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
    from ..plotting import plots  # seaborn: loaded only where a figure is drawn

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
    from ..plotting import plots  # seaborn: loaded only where a figure is drawn

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
    from ..plotting import plots  # seaborn: loaded only where a figure is drawn

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
