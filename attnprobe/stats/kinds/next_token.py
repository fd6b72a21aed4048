"""What the model predicts: the next-token log-ratio of the two compared labels, and its interaction.

Per item and cut: y = log p(positive) - log p(negative), where log p(label) is the log of the
summed probability of the label's candidates at the cut (one candidate, unless the suite scores an
ambiguous form such as " her" against the sum of its alternatives " him" + " his"; the
`comparison` column says which words each row compares). Per scope (all templates weighted
equally, each declared group, each template): the mean y with a cluster-robust CI, and with a
covariate, the slope of y on it in log-odds per 10 units of the covariate, tested at the declared
design (cluster-robust by both declared dimensions, stats.inference.cluster_slope_test), and
Pearson and Spearman r of the per-unit mean y on it (descriptive; bootstrap CI over units).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy.special import logsumexp, stdtr

from ...schema.analysis import ITEM, TEMPLATE
from ..design import PER, Design, items_table, power_note, run_analysis, scopes
from ..inference import N_BOOT, cluster_mean_test, cluster_slope_test, rowwise_r

MIN_TEMPLATE_ITEMS = 5  # templates with fewer items share one row (a benchmark with 120 one-item templates)


def log_ratios(run, analysis) -> pd.DataFrame:
    """Rows (item_id, cut, template_id, y, comparison)."""
    lp = run.logprobs.merge(run.prompts[["prompt_id", ITEM, TEMPLATE]], on="prompt_id")
    lp = lp[lp["candidate_label"].astype(str).isin([analysis.positive, analysis.negative])]
    lp = lp.drop_duplicates([ITEM, "cut", "candidate"])  # prompts of one item share the prefix
    lp = lp.assign(candidate_label=lp["candidate_label"].astype(str))
    per_label = lp.groupby([ITEM, TEMPLATE, "cut", "candidate_label"]).agg(
        logp=("logprob", lambda v: float(logsumexp(v))),
        words=("candidate", lambda v: "+".join(w.strip() for w in v)),
    )
    wide = per_label.unstack("candidate_label")
    if (("logp", analysis.positive) not in wide) or (("logp", analysis.negative) not in wide):
        return pd.DataFrame(columns=[ITEM, "cut", TEMPLATE, "y", "comparison"])
    out = pd.DataFrame(
        {
            "y": wide[("logp", analysis.positive)] - wide[("logp", analysis.negative)],
            "comparison": wide[("words", analysis.positive)] + " vs " + wide[("words", analysis.negative)],
        }
    )
    return out.dropna(subset=["y"]).reset_index()


def item_log_ratios(run) -> pd.DataFrame | None:
    """y per item (index item_id) and cut (columns), or None where the suite compares no two labels."""
    analysis = run_analysis(run)
    if not analysis.paired or run.logprobs is None or run.logprobs.empty:
        return None
    y = log_ratios(run, analysis)
    return y.pivot(index=ITEM, columns="cut", values="y").rename_axis(columns="cut")


def behavior(run, n_boot: int = N_BOOT, seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(summary: one row per cut and scope, per unit: the unit means behind each correlation)."""
    analysis = run_analysis(run)
    if not analysis.paired or run.logprobs.empty:
        return pd.DataFrame(columns=["cut", "scope"]), pd.DataFrame(columns=["cut", "scope", "unit"])
    y = log_ratios(run, analysis)
    items = items_table(run.prompts, analysis)
    summary, per_unit = [], []
    for cut, at_cut in y.groupby("cut", sort=False):
        for scope, kind, ids in _behaviour_scopes(analysis, at_cut):
            rows = at_cut[at_cut[TEMPLATE].isin(ids)]
            design = Design.build(rows[ITEM], items, analysis)
            cells = design.cell_means(rows[["y"]].to_numpy())
            test = cluster_mean_test(cells, design.cells["weight"].to_numpy(), design.clusters)
            row = {
                "cut": cut,
                "scope": scope,
                "kind": kind,
                "comparison": " | ".join(sorted(set(rows["comparison"]))),
                "n_items": len(rows),
                "clusters": design.cluster_text,
                "n_clusters": " x ".join(map(str, test["n_clusters"])),
                "mean_log_ratio": test["mean"][0],
                "mean_ci_low": test["ci_low"][0],
                "mean_ci_high": test["ci_high"][0],
                "mean_p": test["p"][0],
                "mean_test": f"cluster-robust t, CR1 by {design.cluster_text}, df {int(test['df'][0])}",
            }
            notes = [power_note(test["n_clusters"], design.cluster_text)]
            if analysis.covariate:
                gradient, means = _gradient(analysis, design, cells, n_boot, seed)
                row.update(gradient)
                per_unit.append(pd.DataFrame({"cut": cut, "scope": scope, **means}))
            if kind == "folded":
                notes.append(
                    f"templates with fewer than {MIN_TEMPLATE_ITEMS} items are folded into this row: "
                    f"{', '.join(ids[:5])}" + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
                )
            row["power_note"] = "; ".join(dict.fromkeys(n for n in notes if n))
            summary.append(row)
    per_unit_table = (
        pd.concat(per_unit, ignore_index=True) if per_unit else pd.DataFrame(columns=["cut", "scope", "unit"])
    )
    return pd.DataFrame(summary), per_unit_table


def _behaviour_scopes(analysis, at_cut: pd.DataFrame) -> list[tuple[str, str, list]]:
    """(scope, kind, template ids): all, each declared group, each template (those with fewer than
    MIN_TEMPLATE_ITEMS items folded into one row when there are several)."""
    templates = list(dict.fromkeys(at_cut[TEMPLATE]))
    scoped = [
        (name, "pooled" if name == "all" else "group", ids)
        for name, ids in scopes(analysis, templates).items()
    ]
    sizes = at_cut.groupby(TEMPLATE)[ITEM].nunique()
    small = [t for t in templates if sizes[t] < MIN_TEMPLATE_ITEMS]
    small = small if len(small) > 1 else []  # a lone small template keeps its row
    scoped += [(t, "template", [t]) for t in templates if t not in small]
    if small:
        scoped.append((f"{len(small)} templates with < {MIN_TEMPLATE_ITEMS} items each", "folded", small))
    return scoped


def _gradient(analysis, design, cells, n_boot: int, seed: int) -> tuple[dict, dict]:
    """The log-ratio's slope on the covariate (cluster-robust) and the correlation of the unit means
    with it; the unit means themselves (columns of the per-unit table)."""
    units, x, unit_y = design.unit_means(cells, analysis.unit, analysis.covariate)
    w = design.cells["weight"].to_numpy()
    x_cells = design.cells[analysis.covariate].to_numpy(dtype=float)
    slope = cluster_slope_test(x_cells, cells, w, design.clusters)
    row = dict(n_units=len(units), **correlation_with_ci(x, unit_y[:, 0], n_boot, seed))
    row.update(
        slope_per10=PER * slope["slope"][0],
        slope_per10_ci_low=PER * slope["ci_low"][0],
        slope_per10_ci_high=PER * slope["ci_high"][0],
        slope_p=slope["p"][0],
        slope_df=float(slope["df"][0]),
        slope_test=f"cluster-robust slope, CR2 by {design.cluster_text}",
    )
    counts = pd.Series(design.cell_of_item).map(design.cells[analysis.unit]).value_counts()
    means = {"unit": units, "log_ratio": unit_y[:, 0], "n": counts.reindex(units).to_numpy(), "covariate": x}
    return row, means


def correlation_with_ci(x: np.ndarray, y: np.ndarray, n_boot: int = N_BOOT, seed: int = 0) -> dict:
    """Pearson and Spearman r of paired vectors with percentile bootstrap CIs (resampling pairs)
    and the usual t-based p-values."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    n = len(x)
    names = [f"{kind}_{part}" for kind in ("pearson", "spearman") for part in ("r", "ci_low", "ci_high", "p")]
    if n < 3 or np.std(x) == 0 or np.std(y) == 0:
        return {"n": n, **dict.fromkeys(names, np.nan)}
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n))
    out = {"n": n}
    from scipy.stats import rankdata  # scipy.stats is a slow import: only where ranks are taken

    for name, transform in (("pearson", lambda v: v), ("spearman", lambda v: rankdata(v, axis=-1))):
        r = rowwise_r(transform(x)[None], transform(y)[None])[0]
        boot = rowwise_r(transform(x[idx]), transform(y[idx]))
        t = r * math.sqrt((n - 2) / max(1e-300, 1 - r * r))
        out.update(
            {
                f"{name}_r": r,
                f"{name}_ci_low": np.nanquantile(boot, 0.025),
                f"{name}_ci_high": np.nanquantile(boot, 0.975),
                f"{name}_p": 2 * stdtr(n - 2, -abs(t)),
            }
        )
    return out
