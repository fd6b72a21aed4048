"""Statistics of a head-edit sweep (attnprobe.edits), from its raw values alone (edits_items):
per edit kind and k, on the head-effects items (clusters: unit x template, two-way CR2):

- bias: the covariate gradient of y (log-odds per 10 covariate units) before and after, the
  gradient of the paired change y_after - y_before (its CI and p test whether the edit moved the
  bias), the share of the gradient removed (1 - after / before), the mean lean before and after;
- chance: the share removed on the sampled items by the found heads against `draws` random head
  sets of the same layers: the random mean and 95th percentile, the found heads' percentile among
  the draws (share of draws removing less), and p = (1 + #random >= found) / (1 + draws);
- control: on the definitional prompts an edit may fit its keep constraint on, each edited by the
  edit fitted on the other half of the words (held out by word), the share whose y has the label's
  sign (raw, and after removing the mean shift the edit adds to every prompt, which alone can move a
  sign count), the mean y toward the label before and after, the definitional gap kept (mean y
  toward the label after / before: offset-free, as the labels are balanced; Fieller CI, word pairs as
  units) and the offset (the mean shift, nats toward the positive label); the same for each set no
  fit used (control_<set>_...: names, a new frame);
- specificity: the share of the gradient removed minus |1 - gap kept| (a gap amplified is as far
  from kept as one removed), positive when an edit removes more stereotype than it moves gender (CI
  half-width: the two half-widths in quadrature, estimated on disjoint prompts);
- cost: mean KL(original || edited) per generated text, and the change of the mean log-loss of
  the user's text (with --text).
"""

from __future__ import annotations

from collections import Counter
from math import comb

import numpy as np
import pandas as pd

from ..heads import HeadSet
from ..schema.analysis import TEMPLATE, Analysis
from .design import cell_slopes
from .inference import cluster_mean_test, cluster_slope_test, holm, slope_ratio_test
from .keeping.definitional import control_columns, joint_columns, specificity_columns

PER = 10
# a quarter's items as a run's statistics see them: unit x template clusters, the covariate the unit's
QUARTER_ANALYSIS = Analysis(clusters=("unit", TEMPLATE), covariate="covariate", unit="unit")


def slope(x: np.ndarray, y: np.ndarray) -> float:
    xc = x - x.mean()
    return float((xc * (y - y.mean())).sum() / (xc**2).sum()) if (xc**2).sum() > 0 else np.nan


def _rows(raw: pd.DataFrame, target: str, kind: str, k, draw: int) -> pd.DataFrame:
    """The raw rows of `target` (bias, control, text) under the edit (kind, k, draw), by index."""
    rows = raw[(raw["target"] == target) & (raw["kind"] == kind) & (raw["k"] == k) & (raw["draw"] == draw)]
    return rows.set_index("index")


def _bias(raw: pd.DataFrame, kind: str, k: int, draw: int) -> pd.Series:
    return _rows(raw, "bias", kind, k, draw)["y"]


def _layers(heads: str) -> list[int]:
    return sorted(layer for layer, _ in HeadSet.parse(heads))


def possible_sets(heads: str, n_heads: int) -> int:
    """How many different random sets the null can draw for the found heads `heads` ("L26H2 L25H2"):
    per layer, c of its other H - c heads (of all H where fewer than c others remain)."""
    counts = Counter(layer for layer, _ in HeadSet.parse(heads)).values()
    return int(np.prod([comb(n_heads - c, c) if n_heads - c >= c else comb(n_heads, c) for c in counts]))


DRAW_KEYS = ("kind", "k", "draw", "heads", "gradient_removed_sampled")  # then each cost measured


def edit_tables(raw: pd.DataFrame, n_heads: int | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(edits: one row per kind and k, draws: one row per random head set). With `n_heads`, each row
    also gets the smallest p its null can give (random_p_floor: 1 / (1 + the different random sets
    drawn; the sweep draws distinct sets, of the same layers first and from every head when those are
    too few: random_sets_same_layers says how many are of the same layers), and Holm's adjustment over
    the table's rows of p taken at least at its floor (random_p_holm)."""
    base = _Unedited(raw)
    summary, draws = [], []
    for (kind, k), group in raw[raw["kind"] != "none"].groupby(["kind", "k"], sort=False):
        after = _bias(raw, kind, k, -1).reindex(base.items.index).to_numpy()
        row = {"kind": kind, "k": k, "heads": group["heads"].iloc[0], "heads_all": group["heads_all"].iloc[0]}
        row["n_items"] = len(base.items)
        row.update(_gradients(base, after))
        control = _rows(raw, "control", kind, k, -1)["y"].reindex(base.control0.index)
        row.update(control_columns(control, base.control0))
        row.update(joint_columns(control, base.control0, base.items.assign(y0=base.before, y1=after)))
        row.update({} if "specificity" in row else specificity_columns(row))
        row.update(_costs(raw, kind, k, -1, base.loss0, base.user))
        row.update(_readout(raw, kind, k, base))
        against, drawn = _against_random(raw, base, kind, k, group, after)
        row.update(against)
        draws += drawn
        if n_heads is not None and row["heads_all"]:
            row["random_sets_possible"] = possible_sets(row["heads_all"], n_heads)  # of the same layers
            distinct = group.loc[group["draw"] >= 0, "heads"].nunique()
            row["random_sets_same_layers"] = sum(
                _layers(h) == _layers(row["heads_all"]) for h in set(group.loc[group["draw"] >= 0, "heads"])
            )
            row["random_p_floor"] = 1 / (1 + distinct)
        summary.append(row)
    summary = pd.DataFrame(summary)
    if "random_p_floor" in summary:
        tested = summary["random_p"].notna()
        floored = np.maximum(summary.loc[tested, "random_p"], summary.loc[tested, "random_p_floor"])
        summary.loc[tested, "random_p_holm"] = holm(floored.to_numpy())
    # with --draws 0 no row, but the columns all the same (a CSV with a header, not an empty file)
    return summary, pd.DataFrame(draws, columns=None if draws else list(DRAW_KEYS))


class _Unedited:
    """The sweep's unedited values: the bias items (covariate, clusters, y before), the control prompts'
    rows, the texts' losses."""

    def __init__(self, raw: pd.DataFrame):
        none = lambda target: raw[(raw["target"] == target) & (raw["kind"] == "none")].set_index("index")
        self.items = none("bias").sort_index()
        self.x = self.items["covariate"].to_numpy(dtype=float)
        self.clusters = [pd.factorize(self.items["unit"])[0], pd.factorize(self.items["template_id"])[0]]
        self.w = np.ones(len(self.items))
        self.before = self.items["y"].to_numpy()
        self.control0 = none("control").sort_index()
        texts0 = none("text").sort_index()
        self.loss0, self.user = texts0["loss"], texts0["user_text"].astype(bool)


def _gradients(base: _Unedited, after: np.ndarray) -> dict:
    """The covariate gradient before, after and of the change (per PER units, CIs), the share
    removed (a test-inverted interval of slope after / slope before) and the mean lean before and after."""
    x, before, w, clusters = base.x, base.before, base.w, base.clusters
    slopes = cluster_slope_test(x, np.column_stack([before, after, after - before]), w, clusters)
    leans = cluster_mean_test(np.column_stack([before, after]), w, clusters)
    row = {}
    for j, name in enumerate(("gradient_before", "gradient_after", "gradient_change")):
        row[name] = PER * slopes["slope"][j]
        row[f"{name}_ci_low"], row[f"{name}_ci_high"] = PER * slopes["ci_low"][j], PER * slopes["ci_high"][j]
    row["gradient_change_p"] = slopes["p"][2]
    kept = slope_ratio_test(x, after, before, w, clusters)  # slope after / slope before
    row["gradient_removed"] = 1 - slopes["slope"][1] / slopes["slope"][0]
    row["gradient_removed_ci_low"], row["gradient_removed_ci_high"] = (
        1 - kept["ci_high"][0],
        1 - kept["ci_low"][0],
    )
    for j, name in enumerate(("lean_before", "lean_after")):
        row[name], row[f"{name}_ci_low"], row[f"{name}_ci_high"] = (
            leans["mean"][j],
            leans["ci_low"][j],
            leans["ci_high"][j],
        )
    return row


def _against_random(raw, base: _Unedited, kind, k, group, after) -> tuple[dict, list[dict]]:
    """Chance: the same edit on random heads of the same layers, on the sampled items (the row's
    columns, and one row per draw)."""
    x, before, index = base.x, base.before, base.items.index
    random = sorted(d for d in group["draw"].unique() if d >= 0)
    sampled = _bias(raw, kind, k, random[0]).index if random else index[:0]
    found = share_removed(x, before, after, index, sampled) if random else np.nan
    removed, draws = [], []
    for d in random:
        r = _bias(raw, kind, k, d)
        removed.append(share_removed(x, before, r.reindex(index).to_numpy(), index, sampled))
        draws.append(
            {
                "kind": kind,
                "k": k,
                "draw": d,
                "heads": group.loc[group["draw"] == d, "heads"].iloc[0],
                "gradient_removed_sampled": removed[-1],
                **_costs(raw, kind, k, d, base.loss0, base.user),
            }
        )
    removed = np.array(removed)
    # too few sampled items (or one covariate value among them) leave no slope to compare: no p
    # rather than the smallest p the draws allow
    compared = len(removed) > 0 and np.isfinite(found)
    n_values = len(np.unique(x[np.isin(index, sampled)]))
    row = dict(
        n_sampled=len(sampled),
        gradient_removed_sampled=found,
        n_random=len(removed),
        random_removed_mean=removed.mean() if len(removed) else np.nan,
        random_removed_q95=np.quantile(removed, 0.95) if len(removed) else np.nan,
        random_percentile=100 * (removed < found).mean() if compared else np.nan,
        random_p=(1 + (removed >= found).sum()) / (1 + len(removed)) if compared else np.nan,
        note=""
        if compared or not len(removed)
        else f"the random-set comparison rests on {len(sampled)} sampled items with {n_values} covariate "
        "value(s): no gradient there, so no p against random heads; use more items",
        clusters="unit x template",
        n_clusters=" x ".join(str(len(np.unique(c))) for c in base.clusters),
        test="cluster-robust slope, CR2 by unit x template (two-way)",
    )
    return row, draws


def head_table(raw: pd.DataFrame, n_heads: int) -> pd.DataFrame:
    """Per head zeroed alone (edits.sweep.single: kind "single", k = its rank): the sweep's statistics but
    the random-set comparison (none is drawn)."""
    summary, _ = edit_tables(raw, n_heads)
    summary = summary.rename(columns={"k": "rank", "heads_all": "head"}).drop(columns=["kind", "heads"])
    return summary[
        [
            c
            for c in summary.columns
            if not c.startswith(("random", "n_random", "n_sampled", "gradient_removed_sampled", "note"))
        ]
    ]


def quarter_table(raw: pd.DataFrame) -> pd.DataFrame:
    """Per kind, k and quarter: the gradient before, after and its change on the quarter's items alone,
    each edited with its own quarter's edit (the one saved as edits/quarters/KIND-kK-qF). Weighted as
    the run's statistics are (stats.design): the mean of each template x unit cell, every template
    weighing the same, each of its cells equally; clusters unit x template, a dimension with one
    value in the quarter left out (a one-template quarter). `attnprobe compare` of the run and a run
    with that edit gives the same rows (its scope "held out by KIND-kK-qF")."""
    if "quarter" not in raw:
        return pd.DataFrame()
    items = raw[(raw["target"] == "bias") & (raw["kind"] == "none")].set_index("index").sort_index()
    rows = []
    for (kind, k), group in raw[(raw["kind"] != "none") & (raw["draw"] == -1)].groupby(
        ["kind", "k"], sort=False
    ):
        after = group[group["target"] == "bias"].set_index("index")["y"]
        for quarter, on in items.groupby("quarter"):
            before, y1 = on["y"].to_numpy(), after.reindex(on.index).to_numpy()
            test = cell_slopes(on, np.column_stack([before, y1, y1 - before]), QUARTER_ANALYSIS)
            row = {"kind": kind, "k": k, "quarter": int(quarter), "n_items": len(on)}
            for j, name in enumerate(("gradient_before", "gradient_after", "gradient_change")):
                row[name] = PER * test["slope"][j]
            row["gradient_change_ci_low"] = PER * test["ci_low"][2]
            row["gradient_change_ci_high"] = PER * test["ci_high"][2]
            row["gradient_change_p"] = test["p"][2]
            rows.append(row)
    return pd.DataFrame(rows)


def share_removed(x, before, after, index, sampled) -> float:
    """1 - slope after / slope before on the sampled items."""
    on = np.isin(index, sampled)
    return 1 - slope(x[on], after[on]) / slope(x[on], before[on])


def _readout(raw, kind, k, base: _Unedited, n_boot: int = 1000) -> dict:
    """R2 of the covariate read on held-out items from the found heads' outputs before and after the
    edit (edits.sweep.erased: cross-fitted ridge readouts), against the held-out items' mean, with
    95% intervals resampling units (the readings fixed: the readout is not refitted)."""
    out, rng = {}, np.random.default_rng(0)
    for when in ("before", "after"):
        rows = raw[(raw["target"] == f"readout_{when}") & (raw["kind"] == kind) & (raw["k"] == k)]
        if len(rows):
            read = rows.set_index("index")["y"].to_numpy()
            x, units = (base.items[c].reindex(rows["index"]).to_numpy() for c in ("covariate", "unit"))
            x = x.astype(float)
            unit = np.unique(units, return_inverse=True)[1]
            # per unit: items, sums of x and x^2, squared reading errors; a resample is counts of units
            per_unit = np.stack(
                [np.bincount(unit, v) for v in (np.ones(len(x)), x, x**2, (x - read) ** 2)], 1
            )
            U = per_unit.shape[0]
            picked = rng.integers(U, size=(n_boot, U)) + U * np.arange(n_boot)[:, None]
            counts = np.bincount(picked.ravel(), minlength=n_boot * U).reshape(n_boot, U)
            n, sx, sxx, residual = (counts @ per_unit).T
            draws = 1 - residual / (sxx - sx**2 / n)
            out[f"readout_r2_{when}"] = _r2(x, read)
            out[f"readout_r2_{when}_ci_low"], out[f"readout_r2_{when}_ci_high"] = np.quantile(
                draws, [0.025, 0.975]
            )
    return out


def _r2(x: np.ndarray, read: np.ndarray) -> float:
    return float(1 - ((x - read) ** 2).sum() / ((x - x.mean()) ** 2).sum())


def _costs(raw, kind, k, draw, loss0: pd.Series, user: pd.Series) -> dict:
    """The cost on the texts the edit was measured on (index-aligned with the clean ones): the mean
    KL(original || edited) over the generated texts with a t interval (texts as units: the goal is
    judged on its upper bound), the perplexity change on them, and the user's text's loss change."""
    rows = _rows(raw, "text", kind, k, draw).sort_index()
    mine, generated = loss0.reindex(rows.index), ~user.reindex(rows.index).to_numpy(bool)
    kl = rows["kl"].to_numpy()[generated]
    test = cluster_mean_test(kl, np.ones(len(kl)), [np.arange(len(kl))]) if len(kl) > 1 else None
    change = rows["loss"].to_numpy()[generated].mean() - mine.to_numpy()[generated].mean()
    out = {
        "kl": float(kl.mean()) if len(kl) else np.nan,
        "kl_ci_low": float(test["ci_low"][0]) if test else np.nan,
        "kl_ci_high": float(test["ci_high"][0]) if test else np.nan,
        "n_texts": int(len(kl)),
        "perplexity_change": float(np.expm1(change)) if len(kl) else np.nan,
    }
    if (~generated).any():
        loss1 = rows["loss"].to_numpy()
        out["text_loss_before"], out["text_loss_after"] = (
            float(mine[~generated].mean()),
            float(loss1[~generated].mean()),
        )
        out["text_loss_change"] = out["text_loss_after"] - out["text_loss_before"]
    return out


SINGLE = "single"  # the top heads each zeroed alone (edits.sweep.measure; k = the head's rank)
STREAM, STREAM_CHOSEN = "stream", "stream-chosen"  # edits.layers.stream's raw kind and its chosen rows
MLP = "mlp-"  # edits.layers.mlp's raw kinds: mlp-MODE
MLP_LAYERS = MLP + "layers-"  # its edits of several layers: mlp-layers-MODE (k = how many layers)
STREAM_LAYERS = STREAM + "-layers"  # the stream erased entering several layers (k = how many)
