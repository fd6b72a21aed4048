"""Figures of a run's statistics (seaborn); each returns a matplotlib Figure and computes nothing new."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

Q_LEVEL = 0.05


def head_heatmap(heads: pd.DataFrame, target: str, value: str = "d_z", title: str | None = None, label: str | None = None):
    """Layer x head heatmap of `value` for one target; heads with q >= 0.05 are masked (blank)."""
    sub = heads[heads["target"] == target]
    grid = sub.pivot(index="layer", columns="head", values=value)
    significant = sub.pivot(index="layer", columns="head", values="q") < Q_LEVEL
    limit = float(np.nanmax(np.abs(grid.to_numpy()))) or 1.0
    fig, ax = plt.subplots(figsize=(1.2 + 0.45 * grid.shape[1], 1.0 + 0.22 * grid.shape[0]))
    sns.heatmap(grid, mask=~significant, cmap="RdBu_r", center=0, vmin=-limit, vmax=limit, ax=ax,
                cbar_kws={"label": label or f"{value} (she - he)"}, linewidths=0.3, linecolor="#eeeeee")
    ax.set_facecolor("#f4f4f4")  # masked (non-significant) cells show as light grey
    ax.set_title(title or f"pronoun -> {target}: {value}, heads with q < {Q_LEVEL}")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    fig.tight_layout()
    return fig


def behavior_scatter(per_occupation: pd.DataFrame, summary: pd.DataFrame):
    """Per-occupation log p(she)/p(he) against BLS percent female, with a least-squares fit and CI band."""
    data = per_occupation[per_occupation["template_id"] == "all"]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    sns.regplot(data=data, x="bls_pct_female", y="log_ratio", ax=ax, scatter_kws={"s": 18}, line_kws={"color": "#b2182b"})
    for row in data.itertuples():
        ax.annotate(row.occupation, (row.bls_pct_female, row.log_ratio), fontsize=6, alpha=0.7,
                    xytext=(2, 2), textcoords="offset points")
    overall = summary[summary["scope"] == "all"].iloc[0]
    ax.set_title(f"log p(she) - log p(he) vs BLS % female: r = {overall.pearson_r:.2f} "
                 f"[{overall.pearson_ci_low:.2f}, {overall.pearson_ci_high:.2f}], n = {overall.n}")
    ax.set_xlabel("BLS percent female")
    ax.set_ylabel("mean log p(she) - log p(he)")
    ax.axhline(0, color="#888888", linewidth=0.8)
    fig.tight_layout()
    return fig


def template_breakdown(summary: pd.DataFrame):
    """Per template: the behaviour-BLS correlation with its bootstrap CI."""
    data = summary[summary["scope"] != "all"].sort_values("pearson_r")
    fig, ax = plt.subplots(figsize=(6.5, 0.6 + 0.32 * len(data)))
    y = np.arange(len(data))
    ax.errorbar(data["pearson_r"], y, xerr=[data["pearson_r"] - data["pearson_ci_low"], data["pearson_ci_high"] - data["pearson_r"]],
                fmt="o", color="#2166ac", ecolor="#92c5de", capsize=2)
    ax.set_yticks(y, data["scope"])
    ax.axvline(0, color="#888888", linewidth=0.8)
    ax.set_xlabel("Pearson r with BLS % female (95% bootstrap CI)")
    ax.set_title("behaviour by template")
    fig.tight_layout()
    return fig
