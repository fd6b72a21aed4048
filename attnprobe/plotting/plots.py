"""Figures of a run's statistics (seaborn); each returns a matplotlib Figure and computes nothing new."""

from __future__ import annotations

import textwrap

import matplotlib.pyplot as plt  # no backend switch: Jupyter's inline backend shows figures, scripts get Agg
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.ticker import MaxNLocator

from .figures import largest_abs

Q_LEVEL = 0.05


def _title(ax, text: str) -> None:
    """A title wrapped to the figure's width (about 11 characters an inch at 9 points), never cut."""
    width = max(20, int(11 * ax.figure.get_figwidth()))
    lines = [
        w for line in text.split("\n") for w in textwrap.wrap(line, width, break_on_hyphens=False) or [""]
    ]
    ax.set_title("\n".join(lines), fontsize=9)


def head_heatmap(
    heads: pd.DataFrame,
    target: str,
    value: str,
    q: str | None,
    title: str,
    label: str,
    limit: float | None = None,
):
    """Layer x head heatmap of `value` for one target, every head coloured; a dot marks q < 0.05
    (a masked cell would look like a value near zero; `q` None: no test, no dots). `limit`: the
    colour range +-limit (shared by compared runs; correlations use 1); default the largest |value| shown."""
    sub = heads[heads["target"] == target]
    grid = sub.pivot(index="layer", columns="head", values=value)
    significant = (
        (sub.pivot(index="layer", columns="head", values=q) < Q_LEVEL if q else grid * 0 > 0)
        .reindex_like(grid)
        .fillna(False)
    )
    limit = limit or largest_abs(sub[value])
    fig, ax = plt.subplots(figsize=(1.2 + 0.45 * grid.shape[1], 1.0 + 0.22 * grid.shape[0]))
    sns.heatmap(
        grid,
        cmap="RdBu_r",
        center=0,
        vmin=-limit,
        vmax=limit,
        ax=ax,
        cbar_kws={"label": label},
        linewidths=0.3,
        linecolor="#eeeeee",
    )
    ax.tick_params(axis="y", rotation=0)  # layer numbers read across (upright, two digits crowd a row)
    rows, columns = np.nonzero(significant.to_numpy(dtype=bool))
    ax.scatter(
        columns + 0.5, rows + 0.5, s=9, color="white", edgecolors="black", marker="o", linewidths=0.5
    )  # seen on any colour
    _title(ax, f"{title}\ndots: q < {Q_LEVEL} (BH)" if q else title)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    fig.tight_layout()
    return fig


def layer_profile(layers: pd.DataFrame, columns: dict[str, str], title: str):
    """Per layer, for each target: heads with q < 0.05 (one line per statistic and target)."""
    data = layers[layers["scope"] == "all"]
    keys = [key for key in ("source", "target") if key in data]  # one line per attention entry
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    for key, group in data.groupby(keys, sort=False):
        group = group.sort_values("layer")  # a line runs through the layers once, never back
        entry = " -> ".join(key) if len(keys) > 1 else key[0]
        for column, name in columns.items():
            if column in group and group[column].notna().any():
                counts = group[column].astype(float)  # <NA> where the test was not run: NaN
                ax.plot(group["layer"], counts, marker="o", markersize=3, label=f"{name}: {entry}")
    ax.set_xlabel("layer")
    ax.set_ylabel(f"heads with q < {Q_LEVEL}")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts of heads
    _title(ax, title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def layer_shares(shares: pd.DataFrame, title: str):
    """Per layer: the share of the total effect carried by its attention output and by its MLP
    output, patched in and patched out, with 95% CIs as bands."""
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    for (component, direction), group in shares.groupby(["component", "direction"], sort=False):
        style = {"in": "-", "out": "--"}.get(direction, ":")
        name = (
            f"{component}, patched {direction}"
            if direction in ("in", "out")
            else f"{component}, {direction} (every item)"
        )
        (line,) = ax.plot(group["layer"], group["share"], style, marker="o", markersize=3, label=name)
        ax.fill_between(
            group["layer"], group["ci_low"], group["ci_high"], color=line.get_color(), alpha=0.12, linewidth=0
        )
    ax.axhline(0, color="#888888", linewidth=0.8)
    ax.set_xlabel("layer")
    ax.set_ylabel("share of the total effect")
    _title(ax, title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def behavior_scatter(per_unit: pd.DataFrame, summary: pd.DataFrame, xlabel: str, ylabel: str):
    """Per-unit mean log-ratio against the covariate (all templates, weighted equally), with a fit and CI
    band."""
    overall = summary[summary["scope"] == "all"].iloc[0]
    data = per_unit[(per_unit["scope"] == "all") & (per_unit["cut"] == overall["cut"])]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    sns.regplot(
        data=data, x="covariate", y="log_ratio", ax=ax, scatter_kws={"s": 18}, line_kws={"color": "#b2182b"}
    )
    for row in data.itertuples():
        ax.annotate(
            str(row.unit),
            (row.covariate, row.log_ratio),
            fontsize=6,
            alpha=0.7,
            xytext=(2, 2),
            textcoords="offset points",
        )
    ax.set_title(
        f"{ylabel} vs {xlabel}: r = {overall.pearson_r:.2f} "
        f"[{overall.pearson_ci_low:.2f}, {overall.pearson_ci_high:.2f}], n = {int(overall.n_units)}",
        fontsize=9,
    )
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"mean {ylabel}")
    ax.axhline(0, color="#888888", linewidth=0.8)
    fig.tight_layout()
    return fig


def template_breakdown(summary: pd.DataFrame, xlabel: str):
    """Per template and group: the behaviour-covariate correlation with its bootstrap CI."""
    data = summary[summary["scope"] != "all"].sort_values(["kind", "pearson_r"])
    fig, ax = plt.subplots(figsize=(6.5, max(2.2, 0.6 + 0.32 * len(data))))
    y = np.arange(len(data))
    ax.errorbar(
        data["pearson_r"],
        y,
        xerr=[data["pearson_r"] - data["pearson_ci_low"], data["pearson_ci_high"] - data["pearson_r"]],
        fmt="o",
        color="#2166ac",
        ecolor="#92c5de",
        capsize=2,
    )
    ax.set_yticks(y, [f"{s} ({k})" if k == "group" else s for s, k in zip(data["scope"], data["kind"])])
    ax.axvline(0, color="#888888", linewidth=0.8)
    ax.set_xlabel(f"Pearson r with {xlabel} (95% bootstrap CI)")
    ax.set_title("behaviour by template group and template")
    fig.tight_layout()
    return fig


FRONTIER_ALT = (
    "share of the stereotype gradient removed against the KL cost, found heads against random heads"
)


def edit_frontier(summary: pd.DataFrame, draws: pd.DataFrame):
    """Share of the stereotype gradient removed (on the sampled items) against the KL cost: per edit
    kind the found heads for each k (a line, points labelled k), random head sets (same layers first)
    as grey points (the chance band)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    floor = 1e-6  # KL of an edit that changes nothing, for the log axis
    if len(draws):
        ax.scatter(
            draws["kl"].clip(lower=floor),
            draws["gradient_removed_sampled"],
            s=10,
            color="#bbbbbb",
            label="random heads (same layers first)",
        )
    for kind, rows in summary.groupby("kind", sort=False):
        rows = rows.sort_values("k")
        ax.plot(
            rows["kl"].clip(lower=floor),
            rows["gradient_removed_sampled"],
            marker="o",
            label=f"{kind}: found heads",
        )
        for r in rows.itertuples():
            ax.annotate(
                f"k={r.k}",
                (max(r.kl, floor), r.gradient_removed_sampled),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
    ax.set_xscale("log")
    ax.axhline(0, color="#888888", linewidth=0.8)
    ax.set_xlabel("cost: KL(original || edited) per token of neutral text (nats)")
    # the random head sets run on a sample of the items; the found heads are shown on the same sample
    # (edits.csv's gradient_removed is over every item: another figure where the gradient is small)
    sampled = int(summary["n_sampled"].max()) if "n_sampled" in summary and len(summary) else None
    on = f"\n(on the {sampled} items the random heads ran on)" if sampled else ""
    ax.set_ylabel(f"share of the stereotype gradient removed{on}")
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


GOAL_ALT = (
    "every edit's stereotype term removed against its factual term kept on held-out nouns, KL's upper "
    "bound as colour, DAMA's projection over several MLP layers as stars, 2DAMA's rule as crosses, other "
    "modes over several MLP layers as pentagons, several stream layers as plus signs, the held-out "
    "search's choice as a diamond, the goal's box dashed"
)
GOAL_MARKERS = {
    "heads": "o",
    "stream": "s",
    "mlp": "^",
    "DAMA (project, mlp layers)": "*",
    "2DAMA (dual, mlp layers)": "X",
    "mlp layers": "p",
    "stream layers": "P",
    "search": "D",
}


def _goal_group(site: str, kind: str) -> str:
    """A goal row's group in the figure: its site, DAMA's and 2DAMA's edits of several layers apart."""
    for mode, group in (("project", "DAMA (project, mlp layers)"), ("dual", "2DAMA (dual, mlp layers)")):
        if site == "mlp layers" and str(kind).startswith(f"mlp-layers-{mode}"):
            return group
    return site


def goal_frontier(goal: pd.DataFrame):
    """The goal table (stats.keeping.goal) as a frontier: per edit the stereotype term removed against
    the factual term kept on held-out nouns, both from the joint regression; colour log10 of KL's upper
    bound; marker by site (DAMA's and 2DAMA's several-layer edits apart); the goal's box (kept
    0.9-1.1, removed 50-150%). An edit meeting the goal lies in the box with KL's colour at -3 or
    below (and its other conditions, the table's)."""
    from matplotlib.patches import Rectangle

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    log_kl = np.log10(goal["kl_ci_high"].astype(float).clip(lower=1e-6))
    top = max(0.0, float(np.nanmax(log_kl))) if len(goal) else 0.0
    points = None
    groups = [_goal_group(site, kind) for site, kind in zip(goal["site"], goal["kind"])]
    for group, rows in goal.groupby(pd.Series(groups, index=goal.index), sort=False):
        points = ax.scatter(
            rows["nouns_kept"].astype(float).clip(-0.5, 2.0),
            rows["stereotype_removed"].astype(float).clip(-1.0, 2.0),
            c=log_kl[rows.index],
            cmap="viridis_r",
            vmin=-6,
            vmax=top,
            marker=GOAL_MARKERS.get(group, "o"),
            s=28 if group in ("heads", "stream", "mlp", "search") else 70,
            edgecolors="black",
            linewidths=0.3,
            label=group,
        )
    box = Rectangle((0.9, 0.5), 0.2, 1.0, fill=False, linestyle="--", edgecolor="#c0392b", label="the goal")
    ax.add_patch(box)
    ax.axhline(0, color="#888888", linewidth=0.8)
    ax.axvline(1, color="#888888", linewidth=0.8)
    ax.set_xlabel("factual term kept on held-out nouns (1: kept; clipped to -0.5..2)")
    ax.set_ylabel("stereotype term removed (1: all; clipped to -1..2)")
    if points is not None:
        fig.colorbar(points, ax=ax, label="KL upper bound, log10 nats (goal: -3 or below)")
    ax.legend(fontsize=8, frameon=False, loc="best")
    fig.tight_layout()
    return fig


CIRCUIT_ALT = (
    "share of the covariate gradient a circuit restores against its size: in-sample, held-out, random"
)


def circuit_curve(table: pd.DataFrame, found_by: str):
    """Faithfulness against circuit size (parts beside the embeddings or edges, log axis; size 0
    drawn at 0.5), per comparison: the circuits found (rows of circuit `found_by`) held-out with its
    interval, in-sample, the random circuits' range; each hypothesis judged beside them as one
    held-out point; the target at 80%."""
    references = list(dict.fromkeys(table["reference"]))
    fig, axes = plt.subplots(1, len(references), figsize=(5.2 * len(references), 3.8), squeeze=False)
    found = table["circuit"] == found_by
    unit = (
        "edges" if "grain" in table and (table["grain"] == "edges").any() else "parts beside the embeddings"
    )
    for ax, reference in zip(axes[0], references):
        own = table[table["reference"] == reference]
        for name, row in own[~found].set_index("circuit").iterrows():
            ax.plot(
                max(row["size"], 0.5), row["held_out"], marker="D", linestyle="", label=f"{name} (held-out)"
            )
        rows = own[found].sort_values("size")
        size = rows["size"].clip(lower=0.5)
        ax.fill_between(
            size, rows["random_low"], rows["random_high"], color="#dddddd", label="random circuits"
        )
        ax.fill_between(size, rows["held_out_ci_low"], rows["held_out_ci_high"], color="#9ecae1", alpha=0.6)
        ax.plot(size, rows["held_out"], marker="o", color="#08519c", label="held-out (95% CI)")
        ax.plot(size, rows["in_sample"], marker=".", linestyle="--", color="#e6550d", label="in-sample")
        ax.axhline(0.8, color="#888888", linewidth=0.8, linestyle=":")
        ax.set_xscale("log")
        ax.set_xlabel(unit)
        _title(ax, f"against {reference}")
    axes[0][0].set_ylabel("faithfulness (share of the gradient)")
    axes[0][0].legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


CIRCUIT_GRAPH_ALT = "the circuit of each comparison drawn over the layers: its heads and MLPs, edges by score"
DRAWN_EDGES = 150  # edges drawn per circuit at the grain of edges (those of largest score)
POSITION_COLOURS = {"occupation": "#d95f02", "between": "#7570b3", "last": "#1b9e77"}


def circuit_graph(chosen: list[tuple[str, str, pd.DataFrame]]):
    """Per comparison, one circuit drawn: layers left to right, the heads of a layer in a column (MLPs
    in a row below, the embeddings at left, the logits at right), the circuit's parts filled, their
    area by |EAP-IG share|; at the grain of edges its DRAWN_EDGES edges of largest |share| as lines
    whose width is the share, coloured by position group, a part's area the sum over its drawn edges
    out. `chosen`: (comparison, title, rows): circuit_parts' rows (part, eap_ig_share) or
    circuit_edges' (sender, receiver, positions, eap_ig_share) of the circuit's units."""
    fig, axes = plt.subplots(1, len(chosen), figsize=(6.4 * len(chosen), 4.2), squeeze=False)
    for ax, (reference, title, rows) in zip(axes[0], chosen):
        edges = "part" not in rows
        if edges:
            rows = rows.iloc[np.argsort(-rows["eap_ig_share"].abs().to_numpy(), kind="stable")[:DRAWN_EDGES]]
        names = [*rows["sender"], *rows["receiver"]] if edges else list(rows["part"])
        parsed = [_parsed(n) for n in names]
        shape = tuple(1 + max([i for k, _, i in parsed if k == kind] + [0]) for kind in ("head", "kv"))
        layers = 1 + max(layer for _, layer, _ in parsed)
        at = lambda name, layers=layers, shape=shape: _node(_parsed(name), layers, *shape)
        grid = [(l, h) for l in range(layers) for h in range(shape[0])] + [
            (l + 0.5, -1.5) for l in range(layers)
        ]
        ax.scatter(*zip(*grid), s=6, color="#cccccc", zorder=1)
        if edges:
            top = rows["eap_ig_share"].abs().max() or 1.0
            for sender, receiver, group, share in rows[
                ["sender", "receiver", "positions", "eap_ig_share"]
            ].itertuples(index=False):
                (x0, y0), (x1, y1) = at(sender), at(receiver)
                colour = POSITION_COLOURS.get(group, "#999999")
                ax.plot([x0, x1], [y0, y1], color=colour, lw=0.3 + 3 * abs(share) / top, alpha=0.6, zorder=2)
        score = rows.groupby("sender" if edges else "part")["eap_ig_share"].apply(lambda s: s.abs().sum())
        for name, value in score.items():
            ax.scatter(*at(name), s=20 + 280 * value / (score.max() or 1.0), color="#08519c", zorder=3)
        for name in ("embedding", "logits"):
            ax.annotate(name, at(name), fontsize=7, ha="center", va="bottom")
        ax.set_xlim(-1.6, layers + 0.8)
        ax.set_xlabel("layer (MLPs in the bottom row)")
        ax.set_ylabel("head")
        _title(ax, f"against {reference}: {title}")
    if any("part" not in rows for _, _, rows in chosen):
        for group, colour in POSITION_COLOURS.items():
            axes[0][0].plot([], [], color=colour, label=f"at {group}")
        axes[0][0].legend(fontsize=7, frameon=False, loc="upper left")
    fig.tight_layout()
    return fig


def _parsed(name: str) -> tuple[str, int, int]:
    """(kind, layer, index) of a part or receiver name: ("head", l, h) for LlHh (and its .q/.k/.v),
    ("kv", l, g) for LlKVg.k/.v, ("mlp", l, 0), ("embedding" or "logits", -1, 0)."""
    base = name.split(".")[0]
    if base in ("embedding", "logits"):
        return base, -1, 0
    if base.startswith("MLP"):
        return "mlp", int(base[3:]), 0
    kind, (layer, index) = ("kv", base[1:].split("KV")) if "KV" in base else ("head", base[1:].split("H"))
    return kind, int(layer), int(index)


def _node(parsed: tuple[str, int, int], n_layers: int, n_heads: int, n_kv: int) -> tuple[float, float]:
    """Where a part or receiver sits in circuit_graph: (layer, head); a key/value head amid its group's
    query heads; an MLP at (layer + 0.5, -1.5)."""
    kind, layer, index = parsed
    middle = (n_heads - 1) / 2
    return {
        "embedding": (-1.0, middle),
        "logits": (n_layers + 0.3, middle),
        "mlp": (layer + 0.5, -1.5),
        "kv": (layer, (index + 0.5) * n_heads / max(n_kv, 1) - 0.5),
    }.get(kind, (layer, index))
