"""Head-level attention statistics: the interaction first, the plain difference beside it.

For each (scope, source, target, layer, head), on the cells of the design (stats.design):

- difference: the weighted mean of d = a(positive prompt) - a(negative prompt), e.g. she - he.
  Two different tokens make almost every head differ, so this is a lexical difference, not bias.
  Tested with a cluster-robust t (two-way when two clusters are declared), BH over the heads.
- interaction (when the suite declares a covariate): does d change with the covariate? The slope
  and Pearson r of the per-unit mean d (e.g. per occupation, templates weighted equally) on the
  covariate (e.g. BLS percent female), p from permuting the covariate across units (template
  effects are shared by every unit, so they cancel in the slope), BH over the heads; with I^2 and
  the share of templates whose own slope has the pooled sign, for heterogeneity across templates;
  and r on two fixed halves of the units (split along the covariate) for held-out selection.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..analysis import ITEM, TEMPLATE, Analysis
from .design import Design, items_table, paired, resolve, scopes
from .inference import (
    ALPHA,
    N_BOOT,
    bh_qvalues,
    cluster_mean_test,
    n_permutations,
    pearson_columns,
    power_note,
    slope_permutation_test,
    split_halves,
)

KEYS = ["source", "target", "layer", "head"]


def run_analysis(run) -> Analysis:
    return resolve(Analysis.from_manifest(run.manifest, run.prompts.columns), run.prompts)


def head_stats(run, n_boot: int = N_BOOT, n_perm: int | None = None, seed: int = 0) -> pd.DataFrame:
    """One row per (scope, source, target, layer, head); empty when the suite compares no two labels."""
    analysis = run_analysis(run)
    if not analysis.paired:
        return pd.DataFrame(columns=["scope", *KEYS])
    pairs = paired(run.attention, run.prompts, analysis, KEYS, "weight")
    items = items_table(run.prompts, analysis)
    tables = []
    for (source, target), group in pairs.groupby(["source", "target"], sort=False):
        wide = {
            v: group.pivot(index=ITEM, columns=["layer", "head"], values=v)
            for v in ("d", "positive", "negative")
        }
        heads = wide["d"].columns
        for scope, templates in scopes(analysis, items.loc[wide["d"].index, TEMPLATE].unique()).items():
            keep = items.loc[wide["d"].index, TEMPLATE].isin(templates).to_numpy()
            if not keep.any():
                continue
            design = Design.build(wide["d"].index[keep], items, analysis)
            table = pd.DataFrame(
                {
                    "scope": scope,
                    "source": source,
                    "target": target,
                    "layer": heads.get_level_values(0),
                    "head": heads.get_level_values(1),
                }
            )
            table = table.assign(
                **_difference(design, {v: m.to_numpy()[keep] for v, m in wide.items()}, analysis)
            )
            if analysis.covariate:
                cells = design.cell_means(wide["d"].to_numpy()[keep])
                table = table.assign(**_interaction(design, cells, analysis, n_boot, n_perm, seed))
            tables.append(table)
    return pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=["scope", *KEYS])


def _difference(design: Design, values: dict, analysis: Analysis) -> dict:
    cells = {v: design.cell_means(m) for v, m in values.items()}
    w = design.cells["weight"].to_numpy()
    test = cluster_mean_test(cells["d"], w, design.clusters)
    sd = (
        np.nanstd(cells["d"], axis=0, ddof=1) if len(cells["d"]) > 1 else np.full(cells["d"].shape[1], np.nan)
    )
    means = {v: cluster_mean_test(cells[v], w, design.clusters[:1])["mean"] for v in ("positive", "negative")}
    by_template = pd.DataFrame(cells["d"]).groupby(design.cells[TEMPLATE].to_numpy()).mean()
    return {
        "n_items": design.n_items,
        "n_cells": len(design.cells),
        "clusters": design.cluster_text,
        "n_clusters": " x ".join(map(str, test["n_clusters"])),
        f"mean_{analysis.positive}": means["positive"],
        f"mean_{analysis.negative}": means["negative"],
        "difference": test["mean"],
        "difference_ci_low": test["ci_low"],
        "difference_ci_high": test["ci_high"],
        "d_z": np.divide(test["mean"], sd, out=np.full_like(sd, np.nan), where=sd > 0),
        "difference_p": test["p"],
        "difference_q": bh_qvalues(test["p"]),
        "difference_templates_same_sign": (np.sign(by_template) == np.sign(test["mean"]))
        .mean(axis=0)
        .to_numpy(),
        "difference_test": f"cluster-robust t, CR1 by {design.cluster_text}, df {test['df']}",
        "difference_power_note": power_note(test["n_clusters"], design.cluster_text),
    }


def _interaction(
    design: Design, cells: np.ndarray, analysis: Analysis, n_boot: int, n_perm: int | None, seed: int
) -> dict:
    units, x, y = design.unit_means(cells, analysis.unit, analysis.covariate)
    k = cells.shape[1]
    draws = n_perm or n_permutations(k)
    test = slope_permutation_test(x, y, draws, n_boot, seed)
    i2, same_sign = template_heterogeneity(design, cells, analysis.covariate, test["slope"])
    half = split_halves(x)  # for held-out selection: choose heads on one half of the units, test on the other
    unit = analysis.name(analysis.unit)
    return {
        "interaction_slope": test["slope"],
        "interaction_r": test["r"],
        "interaction_r_ci_low": test["r_ci_low"],
        "interaction_r_ci_high": test["r_ci_high"],
        "interaction_p": test["p"],
        "interaction_q": bh_qvalues(test["p"]),
        "interaction_i2_templates": i2,
        "interaction_templates_same_sign": same_sign,
        "interaction_r_half_a": pearson_columns(x[half], y[half]),
        "interaction_r_half_b": pearson_columns(x[~half], y[~half]),
        "interaction_test": f"{analysis.name(analysis.covariate)} permuted across {len(units)} {unit}s "
        f"({'all ' if test['exact'] else ''}{test['n_draws']} permutations)",
        "interaction_power_note": power_note([len(units)], unit, test["min_p"], k),
    }


def template_heterogeneity(design: Design, cells: np.ndarray, covariate: str, pooled: np.ndarray):
    """Per column: I^2 of the per-template least-squares slopes (Cochran's Q with each slope's OLS
    variance) and the share of templates whose slope has the sign of the pooled slope."""
    x_all = design.cells[covariate].to_numpy(dtype=float)
    slopes, variances = [], []
    for rows in design.cells.groupby(TEMPLATE, sort=False).indices.values():
        x, y = x_all[rows], cells[rows]
        if len(rows) < 4 or np.std(x) == 0:
            continue
        xc = x - x.mean()
        sxx = (xc**2).sum()
        yc = np.nan_to_num(y - np.nanmean(y, 0))
        b = xc @ yc / sxx
        residual = yc - np.outer(xc, b)
        slopes.append(b)
        variances.append((residual**2).sum(0) / (len(rows) - 2) / sxx)
    k = cells.shape[1]
    if len(slopes) < 2:
        return np.full(k, np.nan), np.full(k, np.nan)
    B, V = np.array(slopes), np.array(variances)
    with np.errstate(invalid="ignore", divide="ignore"):
        w = 1 / V
        mean = (w * B).sum(0) / w.sum(0)
        q = (w * (B - mean) ** 2).sum(0)
        i2 = np.clip((q - (len(B) - 1)) / q, 0, 1)
    return i2, (np.sign(B) == np.sign(pooled)).mean(0)


def held_out_interaction(heads: pd.DataFrame, k: int = 5) -> dict:
    """Selection on one half of the units, test on the other, both ways round: of the k heads with
    the largest |r| on one half, how many keep their sign on the other, and their mean r there
    (signed by the selection). Honest where "the strongest head" is chosen and reported on the same data."""
    same, signed = 0, []
    for pick, test in (
        ("interaction_r_half_a", "interaction_r_half_b"),
        ("interaction_r_half_b", "interaction_r_half_a"),
    ):
        top = heads.reindex(heads[pick].abs().sort_values(ascending=False).index).head(k)
        direction = np.sign(top[pick].to_numpy())
        same += int((direction == np.sign(top[test].to_numpy())).sum())
        signed += list(direction * top[test].to_numpy())
    return {
        "k": k,
        "n_selected": 2 * min(k, len(heads)),
        "n_same_sign": same,
        "mean_held_out_r": float(np.nanmean(signed)) if np.isfinite(signed).any() else np.nan,
    }


def layer_stats(heads: pd.DataFrame) -> pd.DataFrame:
    """Per (scope, layer, source, target): mean difference over heads and heads with q < 0.05."""
    if heads.empty:
        return pd.DataFrame(columns=["scope", "layer", "source", "target", "n_heads"])
    grouped = heads.groupby(["scope", "layer", "source", "target"], sort=False)
    columns = {
        "mean_difference": ("difference", "mean"),
        "max_abs_d_z": ("d_z", lambda v: v.abs().max()),
        "n_heads": ("head", "size"),
        "n_difference_q05": ("difference_q", lambda v: int((v < ALPHA).sum())),
    }
    if "interaction_q" in heads:
        columns.update(
            max_abs_interaction_r=("interaction_r", lambda v: v.abs().max()),
            n_interaction_q05=("interaction_q", lambda v: int((v < ALPHA).sum())),
        )
    return grouped.agg(**columns).reset_index()


def condition_means(run) -> pd.DataFrame:
    """Mean attention by (layer, head, source, target, contrast label, unit), with n."""
    analysis = run_analysis(run)
    if not analysis.contrast:
        return pd.DataFrame(columns=["layer", "head", "source", "target", "label", "mean", "n"])
    unit = analysis.unit or next((c for c in analysis.clusters if c not in (TEMPLATE, ITEM)), None)
    keys = ["prompt_id", analysis.contrast] + ([unit] if unit in run.prompts else [])
    merged = run.attention.merge(run.prompts[keys], on="prompt_id")
    group = KEYS[2:] + KEYS[:2] + keys[1:]
    out = merged.groupby(group)["weight"].agg(mean="mean", n="size").reset_index()
    return out.rename(columns={analysis.contrast: "label"})
