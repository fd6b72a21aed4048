"""Head-level attention statistics: the interaction first, the plain difference beside it.

For each (scope, source, target, layer, head), on the cells of the design (stats.design):

- difference: the weighted mean of d = a(positive prompt) - a(negative prompt), e.g. she - he.
  Two different tokens make almost every head differ, so this is a lexical difference, not bias.
  Tested with a cluster-robust t (two-way when two clusters are declared), BH over the heads.
- interaction (when the suite declares a covariate): does d change with the covariate? The
  weighted least-squares slope of the cells' d on the covariate, stated per 10 units of it (per 10
  points of BLS percent female), tested at the declared design: cluster-robust variance by both
  declared dimensions (occupation x template), t with (fewest clusters) - 1 df, BH over the heads.
  A template-specific slope thus counts against the pooled one instead of passing as general.
  Beside it: Pearson r of the per-unit means (descriptive), I^2 and the share of templates whose
  own slope has the pooled sign; and r on two disjoint halves (units and templates split jointly)
  for held-out selection, with a random-head null (held_out_interaction).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ...schema.analysis import ITEM, TEMPLATE, Analysis
from ..design import (
    PER,
    Design,
    coded,
    decoded,
    items_table,
    paired_wide,
    power_note,
    read_twice,
    run_analysis,
    scopes,
    template_heterogeneity,
)
from ..inference import (
    ALPHA,
    bh_qvalues,
    cluster_mean_test,
    cluster_slope_test,
    pearson_columns,
    split_halves,
)
from ..placebo import placebo_counts

KEYS = ["source", "target", "layer", "head"]


def item_values(run) -> pd.DataFrame | None:
    """Per item (index item_id), columns (source, target, quantity, layer, head): the paired
    difference d (quantity "difference") where the two prompts differ, else the level both read
    ("level", e.g. at the token before the contrast); None where the suite compares no two labels."""
    analysis = run_analysis(run)
    if not analysis.paired or run.attention is None:
        return None
    frames = []
    for (source, target), both in paired_wide(run.attention, run.prompts, analysis, KEYS[:2], "weight"):
        level = read_twice(run, analysis, source, both["d"].to_numpy())
        wide = both["positive" if level else "d"]
        quantity = "level" if level else "difference"
        wide.columns = pd.MultiIndex.from_tuples(
            [(source, target, quantity, layer, head) for layer, head in wide.columns],
            names=["source", "target", "quantity", "layer", "head"],
        )
        frames.append(wide)
    return pd.concat(frames, axis=1) if frames else None


def head_stats(run) -> pd.DataFrame:
    """One row per (scope, source, target, layer, head); empty when the suite compares no two labels."""
    analysis = run_analysis(run)
    if not analysis.paired:
        return pd.DataFrame(columns=["scope", *KEYS])
    items = items_table(run.prompts, analysis)
    tables = []
    for (source, target), wide in paired_wide(run.attention, run.prompts, analysis, KEYS[:2], "weight"):
        heads = wide["d"].columns
        # read before the contrast (e.g. at the token before the pronoun): both prompts of an item
        # see the same prefix, so there is no paired difference, only a level
        level_only = read_twice(run, analysis, source, wide["d"].to_numpy())
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
            if level_only:
                level = _level(design, wide["positive"].to_numpy()[keep], analysis, scope == "all")
                table = table.assign(**level)
                tables.append(table)
                continue
            table = table.assign(
                **_difference(design, {v: m.to_numpy()[keep] for v, m in wide.items()}, analysis)
            )
            if analysis.covariate:
                cells = design.cell_means(wide["d"].to_numpy()[keep])
                layers = heads.get_level_values(0)  # the random splits' claim is read for scope all only
                table = table.assign(**_interaction(design, cells, analysis, layers, scope == "all"))
            tables.append(table)
    if not tables:
        return pd.DataFrame(columns=["scope", *KEYS])
    out = pd.concat(tables, ignore_index=True)
    level = [c for c in out.columns if c.startswith("level")]  # after the paired statistics
    return out[[c for c in out.columns if c not in level] + level]


def _level(design: Design, values: np.ndarray, analysis: Analysis, placebo: bool = False) -> dict:
    """Statistics of a measure the contrast cannot reach (read before it): the mean attention
    weight with its cluster-robust CI and, with a covariate, its slope per 10 units of the covariate
    (does the prediction position look more at the occupation when the occupation has more women?),
    two-way cluster-robust, BH over the heads."""
    cells = design.cell_means(values)
    w = design.cells["weight"].to_numpy()
    mean = cluster_mean_test(cells, w, design.clusters)
    out = {
        "n_items": design.n_items,
        "n_cells": len(design.cells),
        "clusters": design.cluster_text,
        "n_clusters": " x ".join(map(str, mean["n_clusters"])),
        "level": mean["mean"],
        "level_ci_low": mean["ci_low"],
        "level_ci_high": mean["ci_high"],
    }
    if analysis.covariate:
        x = design.cells[analysis.covariate].to_numpy(dtype=float)
        slope = cluster_slope_test(x, cells, w, design.clusters)
        out.update(
            level_per10=PER * slope["slope"],
            level_per10_ci_low=PER * slope["ci_low"],
            level_per10_ci_high=PER * slope["ci_high"],
            level_p=slope["p"],
            level_q=bh_qvalues(slope["p"]),
            level_test=f"cluster-robust slope, CR2 by {design.cluster_text}",
        )
        if placebo:
            out.update(placebo_counts(design, cells, slope["p"], analysis.unit, analysis.covariate, "level_"))
    return out


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
        "difference_df": test["df"],
        "difference_test": f"cluster-robust t, CR1 by {design.cluster_text}",
        "difference_power_note": power_note(test["n_clusters"], design.cluster_text),
    }


def _interaction(design: Design, cells: np.ndarray, analysis: Analysis, layers, splits: bool = True) -> dict:
    x = design.cells[analysis.covariate].to_numpy(dtype=float)
    test = cluster_slope_test(x, cells, design.cells["weight"].to_numpy(), design.clusters)
    units, unit_x, y = design.unit_means(cells, analysis.unit, analysis.covariate)
    i2, same_sign = template_heterogeneity(design, cells, analysis.covariate, test["slope"])
    halves = _held_out_halves(design, cells, analysis)
    placebo = (
        placebo_counts(design, cells, test["p"], analysis.unit, analysis.covariate, "interaction_")
        if splits
        else {}
    )
    splits = held_out_splits(design, cells, analysis, layers) if splits else {}
    return {
        "interaction_per10": PER * test["slope"],
        "interaction_per10_ci_low": PER * test["ci_low"],
        "interaction_per10_ci_high": PER * test["ci_high"],
        "interaction_r": pearson_columns(unit_x, y),
        "interaction_p": test["p"],
        "interaction_q": bh_qvalues(test["p"]),
        "interaction_df": test["df"],
        "interaction_df_is_clusters": test["df_is_clusters"],
        "interaction_variance_floored": test["floored"],
        "interaction_i2_templates": i2,
        "interaction_templates_same_sign": same_sign,
        **halves,
        **splits,
        **placebo,
        "interaction_test": f"cluster-robust slope, CR2 by {design.cluster_text}",
        "interaction_power_note": power_note(test["n_clusters"], design.cluster_text),
    }


def _held_out_halves(design: Design, cells: np.ndarray, analysis: Analysis) -> dict:
    """r of the per-unit means on two disjoint halves of the design for held-out selection: half A
    is one half of the units (split along the covariate) on one half of the templates, half B the
    other units on the other templates, so a head chosen on A is tested on units and templates it
    was not chosen on. One template in scope: units are split alone (held_out_splits draws such
    halves at random)."""
    units, x, _ = design.unit_means(cells, analysis.unit, analysis.covariate)
    unit_a = set(np.asarray(units)[split_halves(x)])
    templates = sorted(design.cells[TEMPLATE].unique())
    template_a = set(templates[::2]) if len(templates) > 1 else set(templates)
    out = {}
    for name, pick in (("a", True), ("b", False)):
        in_units = design.cells[analysis.unit].isin(unit_a).to_numpy() == pick
        in_templates = design.cells[TEMPLATE].isin(template_a).to_numpy() == (pick or len(templates) == 1)
        masked = np.where((in_units & in_templates)[:, None], cells, np.nan)
        _, xs, ys = design.unit_means(masked, analysis.unit, analysis.covariate)
        keep = np.isfinite(ys).any(1)
        out[f"interaction_r_half_{name}"] = pearson_columns(xs[keep], ys[keep])
    return out


HELD_OUT_DRAWS = 2000  # random head sets of the null of the held-out attention claim
HELD_OUT_SPLITS, SPLIT_DRAWS = 100, 200  # random unit x template splits, and each one's null draws


def held_out_splits(design: Design, cells: np.ndarray, analysis: Analysis, layers, seed: int = 0) -> dict:
    """The held-out claim over HELD_OUT_SPLITS random splits of the units and templates (one fixed
    split can be lucky or unlucky): each split draws half of the units and half of the templates
    (half A; the other units on the other templates: half B), takes the per-unit, template-weighted
    means of each half and their r with the covariate, chooses the top 5 heads by |r| on one half and
    tests them on the other, both ways, against random heads of the chosen heads' layers (SPLIT_DRAWS
    draws, floor 1/201): as held_out_interaction, in numpy. Returns the median p over the splits and
    the share below 0.05 (the same for every head of the scope: columns of head_stats)."""
    rng = np.random.default_rng(seed)
    unit_codes, units = pd.factorize(design.cells[analysis.unit])
    template_codes, templates = pd.factorize(design.cells[TEMPLATE])
    x = design.cells.groupby(unit_codes)[analysis.covariate].first().to_numpy(dtype=float)
    weight = np.where(np.isfinite(cells), design.cells["weight"].to_numpy()[:, None], 0.0)
    values = np.nan_to_num(cells)
    layers = np.asarray(layers)
    by_layer = {layer: np.flatnonzero(layers == layer) for layer in np.unique(layers)}

    onehot = (unit_codes[None, :] == np.arange(len(units))[:, None]).astype(float)  # units x cells

    def r_of(mask):  # (heads,) r over units of the template-weighted unit means within `mask`
        w = weight * mask[:, None]
        sums, totals = onehot @ (w * values), onehot @ w
        with np.errstate(invalid="ignore", divide="ignore"):
            means = sums / totals
        keep = np.isfinite(means).any(1)
        return pearson_columns(x[keep], means[keep])

    ps = []
    for _ in range(HELD_OUT_SPLITS):
        unit_a = rng.permutation(len(units))[: len(units) // 2]
        template_a = rng.permutation(len(templates))[: max(1, len(templates) // 2)]
        in_units, in_templates = np.isin(unit_codes, unit_a), np.isin(template_codes, template_a)
        other_templates = in_templates if len(templates) == 1 else ~in_templates  # one template: both
        halves = (r_of(in_units & in_templates), r_of(~in_units & other_templates))
        ps.append(_held_out_p(*halves, by_layer, layers, rng))
    ps = np.array(ps, dtype=float)
    return {
        "held_out_splits": int(np.isfinite(ps).sum()),
        "held_out_splits_median_p": float(np.nanmedian(ps)) if np.isfinite(ps).any() else np.nan,
        "held_out_splits_share_p05": float(np.nanmean(ps < 0.05)) if np.isfinite(ps).any() else np.nan,
    }


def _held_out_p(r_a, r_b, by_layer, layers, rng, k: int = 5) -> float:
    """held_out_interaction's p for one split, from the halves' r of every head."""
    signed, null = [], np.zeros(SPLIT_DRAWS)
    for pick, test in ((r_a, r_b), (r_b, r_a)):
        usable = np.flatnonzero(np.isfinite(pick) & np.isfinite(test))
        if not len(usable):
            continue
        kept = np.sign(pick) * test
        top = usable[np.argsort(-np.abs(pick[usable]), kind="stable")[:k]]
        signed += list(kept[top])
        pools = {layer: np.intersect1d(heads, usable) for layer, heads in by_layer.items()}
        draws = np.stack([rng.choice(pools[layers[h]], size=SPLIT_DRAWS) for h in top], axis=1)
        null += kept[draws].sum(1)
    if not signed:
        return np.nan
    observed, null_mean = np.mean(signed), null / len(signed)
    return float((1 + (null_mean >= observed - 1e-12).sum()) / (1 + SPLIT_DRAWS))


def held_out_interaction(heads: pd.DataFrame, k: int = 5, draws: int = HELD_OUT_DRAWS, seed: int = 0) -> dict:
    """Selection on one half of the design, test on the other, both ways round (halves: see
    _held_out_halves): of the k heads with the largest |r| on one half, how many keep their sign on
    the other, and their mean r there (signed by the selection). Null baseline: the same statistics
    for k heads drawn at random from the selected heads' layers (`draws` seeded draws); `held_out_p`
    is the share of draws whose mean held-out r reaches the selected heads' (most heads keep their
    sign between halves, so a count alone says little)."""
    rng = np.random.default_rng(seed)
    same, signed, null_same, null_r = 0, [], np.zeros(draws), np.zeros(draws)
    for pick, test in (
        ("interaction_r_half_a", "interaction_r_half_b"),
        ("interaction_r_half_b", "interaction_r_half_a"),
    ):
        usable = heads[heads[pick].notna() & heads[test].notna()].reset_index(drop=True)
        if usable.empty:
            continue
        top = usable.reindex(usable[pick].abs().sort_values(ascending=False).index).head(k)
        kept = np.sign(usable[pick].to_numpy()) * usable[test].to_numpy()  # every head's signed held-out r
        same += int((kept[top.index] > 0).sum())
        signed += list(kept[top.index])
        by_layer = usable.groupby("layer").indices
        # for each selected head, a random head of its layer (with replacement across draws)
        picks = np.stack([rng.choice(by_layer[layer], size=draws) for layer in top["layer"]], axis=1)
        null_same += (kept[picks] > 0).sum(1)
        null_r += kept[picks].sum(1)
    n = len(signed)
    observed = float(np.mean(signed)) if n else np.nan
    null_mean = null_r / n if n else np.full(draws, np.nan)
    return {
        "k": k,
        "n_selected": n,
        "n_same_sign": same,
        "n_same_sign_null": float(null_same.mean()) if n else np.nan,
        "mean_held_out_r": observed,
        "mean_held_out_r_null": float(null_mean.mean()) if n else np.nan,
        "held_out_p": float((1 + (null_mean >= observed - 1e-12).sum()) / (1 + draws)) if n else np.nan,
        "split": "units and templates jointly",
    }


def layer_stats(heads: pd.DataFrame) -> pd.DataFrame:
    """Per (scope, layer, source, target): mean difference over heads and heads with q < 0.05 by each
    test, empty (<NA>) where the test was not run there (a read before the contrast has a level, no
    difference: its difference count is not a zero)."""
    if heads.empty:
        return pd.DataFrame(columns=["scope", "layer", "source", "target", "n_heads"])
    grouped = heads.groupby(["scope", "layer", "source", "target"], sort=False)
    columns = {
        "mean_difference": ("difference", "mean"),
        "max_abs_d_z": ("d_z", lambda v: v.abs().max()),
        "n_heads": ("head", "size"),
        "n_difference_q05": ("difference_q", _passing),
    }
    if "difference" not in heads:  # every measure reads before the contrast: levels only
        columns = {"n_heads": columns["n_heads"]}
    if "interaction_q" in heads:
        columns.update(
            max_abs_interaction_r=("interaction_r", lambda v: v.abs().max()),
            n_interaction_q05=("interaction_q", _passing),
        )
    if "level_q" in heads:  # measures read before the contrast: heads whose level follows the covariate
        columns.update(n_level_q05=("level_q", _passing))
    out = grouped.agg(**columns).reset_index()
    counts = [c for c in out.columns if c.startswith("n_") and c.endswith("_q05")]
    return out.astype({c: "Int64" for c in counts})


def _passing(q: pd.Series):
    """Heads with q < ALPHA; <NA> where no head has a q (the test was not run)."""
    return int((q < ALPHA).sum()) if q.notna().any() else pd.NA


def condition_means(run) -> pd.DataFrame:
    """Mean attention by (layer, head, source, target, contrast label, unit), with n."""
    analysis = run_analysis(run)
    if not analysis.contrast:
        return pd.DataFrame(columns=["layer", "head", "source", "target", "label", "mean", "n"])
    unit = analysis.unit or next((c for c in analysis.clusters if c not in (TEMPLATE, ITEM)), None)
    keys = [analysis.contrast] + ([unit] if unit in run.prompts else [])
    attention, info = run.attention, run.prompts.drop_duplicates("prompt_id").set_index("prompt_id")[keys]
    row = info.index.get_indexer(attention["prompt_id"])  # -1: a prompt the prompts table lacks
    by_prompt = [pd.factorize(info[k], sort=True) for k in keys]
    factors = [pd.factorize(attention[k], sort=True) for k in KEYS[2:] + KEYS[:2]]
    code, levels = coded(factors + [(np.where(row >= 0, c[row], -1), level) for c, level in by_prompt])
    kept = code >= 0  # as a groupby drops rows with a key missing; one integer key, not six columns
    grouped = pd.Series(attention["weight"].to_numpy()[kept]).groupby(code[kept]).agg(["mean", "size"])
    out = decoded(grouped.index.to_numpy(), levels, KEYS[2:] + KEYS[:2] + ["label", *keys[1:]])
    return out.assign(mean=grouped["mean"].to_numpy(), n=grouped["size"].to_numpy())
