"""Paired statistics of two runs of the same prompts (`attnprobe compare RUN_A RUN_B`): an original
and an edited run, two checkpoints, two dtypes. Each measure kind says what it compares per item
(`Measure.paired`); the tables here are the per-item change B - A tested at the declared design.

Per scope (every item, each declared group, and for an edited run the items its edit was held out
for: chosen and fitted on other items, see edits.saved) and per compared column (a head, a cut):

- the mean over cells (stats.design: template x cluster units, every template weighing the same)
  of A, of B and of the change B - A, with a cluster-robust t for the change (CR1, two-way when
  two clusters are declared), BH q over the columns of a scope;
- with a covariate, the slope of A, of B and of the change per 10 covariate units: the change's
  slope is the change of the bias gradient (cluster-robust slope, CR2, the interaction test of the
  run's own statistics), BH q likewise;
- the share of A removed, -change / A, with a test-inverted (Fieller) interval at the same design
  (positive: B is nearer 0 than A);
- for choices (a 0/1 outcome per item): beside the paired mean change, McNemar's exact test on the
  discordant items (A right and B wrong against the reverse; binomial, two-sided), which does not
  model the clusters: the cluster-robust t is the design's test, McNemar the familiar one; for other
  values the exact sign test of the items that rose against those that fell.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..errors import RunError
from ..schema.analysis import TEMPLATE
from .design import PER, Design, items_table, run_analysis
from .inference import bh_qvalues, cluster_mean_test, cluster_slope_test, ratio_test


def check_comparable(a, b) -> None:
    """Refuse, in one line, two runs whose items cannot be paired: other suites, other prompts, models
    of other shapes (heads are paired by layer and index) or an unfinished run."""
    for run in (a, b):
        run.require("suite.name", "suite.sha256", "model.spec", "dtype")
        run.require_complete()
    sa, sb = a.manifest.suite, b.manifest.suite
    if (sa.name, sa.sha256) != (sb.name, sb.sha256):
        raise RunError(
            f"{a.directory} and {b.directory} are runs of different suites ({sa.name} {sa.sha256[:12]} "
            f"against {sb.name} {sb.sha256[:12]}); compare pairs the items of one suite: run both on it"
        )
    ma, mb = a.manifest.model, b.manifest.model
    if (ma.n_layers, ma.n_heads) != (mb.n_layers, mb.n_heads):
        raise RunError(
            f"{a.directory} ({ma.spec}: {ma.n_layers} layers x {ma.n_heads} heads) and "
            f"{b.directory} ({mb.spec}: {mb.n_layers} x {mb.n_heads}) are runs of models of "
            "different shapes; compare pairs heads by layer and index: compare runs of one architecture "
            "(an edit, a checkpoint, a dtype)"
        )
    columns = ["prompt_id", "item_id", "text"]
    pa, pb = a.prompts[columns], b.prompts[columns]
    if len(pa) != len(pb) or not (pa.to_numpy() == pb.to_numpy()).all():
        differ = _first_difference(pa, pb)
        raise RunError(
            f"{a.directory} and {b.directory} ran different prompts ({len(pa)} against {len(pb)}{differ}); "
            "compare pairs the same prompts: run both with the same --limit"
        )


def _first_difference(pa: pd.DataFrame, pb: pd.DataFrame) -> str:
    for (_, x), (_, y) in zip(pa.iterrows(), pb.iterrows()):
        if tuple(x) != tuple(y):
            return f"; prompt {x['prompt_id']} is {x['text']!r} against {y['text']!r}"
    return ""


def scopes_of(a, b, item_ids, templates) -> dict[str, list]:
    """Scope name -> item ids: every item, each declared group, and the held-out items of each edit
    either run applied (an edit saved for one quarter of a sweep records the items it was not chosen
    or fitted on)."""
    analysis = run_analysis(a)
    out = {"all": list(item_ids)}
    for name, ids in analysis.groups.items():
        out[name] = [i for i, t in zip(item_ids, templates) if t in set(ids)]
    for run in (a, b):
        for edit in run.manifest.edits:
            held = set(edit.get("source", {}).get("held_out_items") or ())
            if held:
                out[f"held out by {edit['name']}"] = [i for i in item_ids if i in held]
    return {name: ids for name, ids in out.items() if ids}


def change_table(a: pd.DataFrame, b: pd.DataFrame, run, scopes: dict[str, list]) -> pd.DataFrame:
    """Per scope and column of the per-item values `a`, `b` (index item_id, the same columns; NaN
    where an item has no value): the means of A and B and the change, with the covariate gradients;
    columns of 0/1 outcomes also get McNemar's test. Columns are the leading keys of the rows (a
    MultiIndex spreads over several key columns)."""
    analysis = run_analysis(run)
    items = items_table(run.prompts, analysis)
    a, b = a.align(b, join="inner")
    keys = a.columns.to_frame(index=False)
    k, frames = a.shape[1], []
    for scope, ids in scopes.items():
        keep = a.index.isin(ids)
        if not keep.any():
            continue
        design = Design.build(a.index[keep], items, analysis)
        va, vb = a.to_numpy(dtype=float)[keep], b.to_numpy(dtype=float)[keep]
        cells = design.cell_means(np.hstack([va, vb, vb - va]))
        w = design.cells["weight"].to_numpy()
        test = cluster_mean_test(cells, w, design.clusters)
        table = keys.assign(scope=scope, n_items=np.isfinite(vb - va).sum(0), clusters=design.cluster_text)
        for j, name in enumerate(("a", "b", "change")):
            table[f"mean_{name}"] = test["mean"][j * k : (j + 1) * k]
        table["change_ci_low"], table["change_ci_high"] = test["ci_low"][2 * k :], test["ci_high"][2 * k :]
        table["change_p"] = test["p"][2 * k :]
        table["change_q"] = bh_qvalues(table["change_p"].to_numpy())
        table["change_df"] = test["df"][2 * k :]
        share = ratio_test(cells[:, 2 * k :], cells[:, :k], w, design.clusters)  # change / A, per column
        table["share_removed"] = np.where(np.isfinite(share["ratio"]), -share["ratio"], np.nan)  # none of 0
        table["share_removed_ci_low"], table["share_removed_ci_high"] = -share["ci_high"], -share["ci_low"]
        table = table.assign(**(_mcnemar(va, vb) if _outcomes(va, vb).any() else _sign_test(va, vb)))
        if analysis.covariate:
            x = design.cells[analysis.covariate].to_numpy(dtype=float)
            slope = cluster_slope_test(x, cells, w, design.clusters)
            for j, name in enumerate(("a", "b", "change")):
                table[f"gradient_{name}"] = PER * slope["slope"][j * k : (j + 1) * k]
            table["gradient_change_ci_low"] = PER * slope["ci_low"][2 * k :]
            table["gradient_change_ci_high"] = PER * slope["ci_high"][2 * k :]
            table["gradient_change_p"] = slope["p"][2 * k :]
            table["gradient_change_q"] = bh_qvalues(table["gradient_change_p"].to_numpy())
        frames.append(table)
    if not frames:
        return pd.DataFrame()
    out = pd.concat(frames, ignore_index=True)
    first = ["scope", *keys.columns]
    return out[first + [c for c in out.columns if c not in first]]


def _outcomes(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per column: whether both runs' values are 0/1 outcomes (NaN where an item has none)."""
    zero_one = lambda v: np.isin(v, (0, 1)) | np.isnan(v)
    return (zero_one(a) & zero_one(b)).all(0)


def _mcnemar(a: np.ndarray, b: np.ndarray) -> dict:
    """Per column: items at 1 in A only and in B only, and McNemar's exact p (NaN for a column that
    is not a 0/1 outcome)."""
    from scipy.stats import binomtest  # scipy.stats is a slow import: only where a test needs it

    binary = _outcomes(a, b)
    only_a = ((a == 1) & (b == 0)).sum(0)
    only_b = ((a == 0) & (b == 1)).sum(0)
    p = [
        (binomtest(int(x), int(x + y)).pvalue if x + y else 1.0) if ok else np.nan
        for x, y, ok in zip(only_a, only_b, binary)
    ]
    return {"one_in_a_only": only_a, "one_in_b_only": only_b, "mcnemar_p": np.array(p)}


def _sign_test(a: np.ndarray, b: np.ndarray) -> dict:
    """Per column of a change that is not a 0/1 outcome: items that rose and fell from A to B, and the
    exact two-sided sign test of the two counts (ties left out; items as units)."""
    from scipy.stats import binomtest

    up, down = ((b - a) > 0).sum(0), ((b - a) < 0).sum(0)
    p = [binomtest(int(x), int(x + y)).pvalue if x + y else 1.0 for x, y in zip(up, down)]
    return {"n_rose": up, "n_fell": down, "sign_p": np.array(p)}


def templates_of(run, item_ids) -> list:
    first = run.prompts.drop_duplicates("item_id").set_index("item_id")[TEMPLATE]
    return first.reindex(list(item_ids)).tolist()
