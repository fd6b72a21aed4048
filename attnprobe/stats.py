"""Head-level statistics of a run: pandas in, pandas out.

The unit of analysis is the paired item: prompts that differ only in the contrast slot (the
pronoun). For each (layer, head, source, target):

  d_i = a(female prompt of item i) - a(male prompt of item i)

where a is the aggregated attention weight. Reported: mean d, Cohen's d_z = mean / sd, the share of
items with d > 0, a 95% percentile bootstrap CI, a sign-flip permutation p-value, and
Benjamini-Hochberg q-values across all heads of one measure.

Dependence: items that share an occupation share its tokens, so they are not independent. Both
the bootstrap and the sign-flip test therefore resample / flip whole clusters (default: the
occupation; `cluster=None` treats items as independent). With 60 occupations this is the
conservative choice; it is stated in every output.

Behaviour: y_i = log p(she) - log p(he) at the cut before the pronoun; per occupation means are
correlated with BLS percent female (Pearson and Spearman, bootstrap CI over occupations).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
from scipy import stats as sps

N_BOOT = 2000
N_PERM = 2000
MIN_ITEMS = 30  # below this a cell gets a power note
FEMALE, MALE = "female", "male"


# ------------------------------------------------------------------------------ primitives


def bh_qvalues(p: np.ndarray) -> np.ndarray:
    """Benjamini-Hochberg adjusted p-values (q-values), in the input order."""
    p = np.asarray(p, dtype=float)
    n = len(p)
    order = np.argsort(p)
    ranked = p[order] * n / np.arange(1, n + 1)
    q = np.minimum.accumulate(ranked[::-1])[::-1]  # enforce monotonicity from the top
    out = np.empty(n)
    out[order] = np.minimum(q, 1.0)
    return out


def _cluster_sums(d: np.ndarray, clusters: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-cluster sums of d (n_clusters, k) and item counts (n_clusters,)."""
    labels, index = np.unique(clusters, return_inverse=True)
    sums = np.zeros((len(labels), d.shape[1]))
    np.add.at(sums, index, d)
    return sums, np.bincount(index).astype(float)


def sign_flip_pvalues(d: np.ndarray, clusters: np.ndarray | None = None, n_perm: int = N_PERM,
                      seed: int = 0) -> np.ndarray:
    """Two-sided p-values of mean(d) = 0 for each column of d (n_items, k), flipping the sign of
    whole clusters. With at most 16 clusters every sign pattern is enumerated (exact test);
    otherwise p = (1 + #{|perm| >= |obs|}) / (1 + n_perm)."""
    d = np.atleast_2d(np.asarray(d, dtype=float).T).T
    units = d if clusters is None else _cluster_sums(d, np.asarray(clusters))[0]  # (n_units, k)
    observed = np.abs(units.sum(0))
    n = units.shape[0]
    if n <= 16:
        signs = np.array(list(itertools.product([1.0, -1.0], repeat=n)))  # (2^n, n), includes identity
        null = np.abs(signs @ units)
        return (null >= observed - 1e-12).mean(0)
    rng = np.random.default_rng(seed)
    exceed = np.zeros(units.shape[1])
    for start in range(0, n_perm, 500):  # in blocks, to bound memory
        signs = rng.choice([-1.0, 1.0], size=(min(500, n_perm - start), n))
        exceed += (np.abs(signs @ units) >= observed - 1e-12).sum(0)
    return (1 + exceed) / (1 + n_perm)


def bootstrap_mean_ci(d: np.ndarray, clusters: np.ndarray | None = None, n_boot: int = N_BOOT, seed: int = 0,
                      level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Percentile CI of mean(d) per column, resampling clusters (or items) with replacement."""
    d = np.atleast_2d(np.asarray(d, dtype=float).T).T
    sums, counts = (d, np.ones(len(d))) if clusters is None else _cluster_sums(d, np.asarray(clusters))
    rng = np.random.default_rng(seed)
    draws = rng.multinomial(len(counts), np.full(len(counts), 1 / len(counts)), size=n_boot).astype(float)  # (B, n)
    means = (draws @ sums) / (draws @ counts)[:, None]  # (B, k): each resample's item mean
    alpha = (1 - level) / 2
    return np.quantile(means, alpha, axis=0), np.quantile(means, 1 - alpha, axis=0)


def correlation_with_ci(x: np.ndarray, y: np.ndarray, n_boot: int = N_BOOT, seed: int = 0) -> dict:
    """Pearson and Spearman r of paired vectors, with percentile bootstrap CIs (resampling pairs)
    and the usual t-based p-values."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    n = len(x)
    if n < 3 or np.std(x) == 0 or np.std(y) == 0:
        return {"n": n, "pearson_r": np.nan, "pearson_ci_low": np.nan, "pearson_ci_high": np.nan, "pearson_p": np.nan,
                "spearman_r": np.nan, "spearman_ci_low": np.nan, "spearman_ci_high": np.nan, "spearman_p": np.nan}
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n))
    out = {"n": n}
    for name, transform in (("pearson", lambda v: v), ("spearman", lambda v: sps.rankdata(v, axis=-1))):
        r = _rowwise_r(transform(x)[None], transform(y)[None])[0]
        boot = _rowwise_r(transform(x[idx]), transform(y[idx]))
        t = r * math.sqrt((n - 2) / max(1e-300, 1 - r * r))
        out.update({f"{name}_r": r, f"{name}_ci_low": np.nanquantile(boot, 0.025),
                    f"{name}_ci_high": np.nanquantile(boot, 0.975), f"{name}_p": 2 * sps.t.sf(abs(t), n - 2)})
    return out


def _rowwise_r(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a - a.mean(-1, keepdims=True)
    b = b - b.mean(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (a * b).sum(-1) / np.sqrt((a * a).sum(-1) * (b * b).sum(-1))


# ------------------------------------------------------------------------------ run tables


def paired_attention(run, contrast_labels=(FEMALE, MALE)) -> pd.DataFrame:
    """One row per (item, source, target, layer, head): a_female, a_male, d = a_female - a_male."""
    prompts = run.prompts
    label_column = _label_column(run)
    attention = run.attention.merge(prompts[["prompt_id", "item_id", label_column]], on="prompt_id")
    attention = attention[attention[label_column].isin(contrast_labels)]
    wide = attention.pivot_table(index=["item_id", "source", "target", "layer", "head"], columns=label_column,
                                 values="weight", aggfunc="first").dropna().reset_index()
    first, second = contrast_labels
    wide["d"] = wide[first] - wide[second]
    return wide.rename(columns={first: f"a_{first}", second: f"a_{second}"})


def _label_column(run) -> str:
    contrast = run.manifest["suite"].get("contrast") or "pronoun"
    for candidate in (f"{contrast}_label", contrast):
        if candidate in run.prompts.columns:
            return candidate
    raise KeyError(f"prompts.csv has no column for the contrast slot '{contrast}'")


def _items(run) -> pd.DataFrame:
    """Per item: template, occupation and its BLS share (first prompt of the item)."""
    columns = [c for c in ("item_id", "template_id", "occupation", "occupation_bls_pct_female") if c in run.prompts]
    return run.prompts[columns].drop_duplicates("item_id").set_index("item_id")


def head_stats(run, cluster: str | None = "occupation", n_boot: int = N_BOOT, n_perm: int = N_PERM,
               seed: int = 0) -> pd.DataFrame:
    """One row per (layer, head, source, target): the paired bias effect and its tests."""
    pairs = paired_attention(run)
    items = _items(run)
    rows = []
    for (source, target), group in pairs.groupby(["source", "target"], sort=False):
        d = group.pivot_table(index="item_id", columns=["layer", "head"], values="d")  # (items, heads)
        heads = d.columns
        values = d.to_numpy()
        item_info = items.loc[d.index]
        clusters = item_info[cluster].to_numpy() if cluster and cluster in item_info else None
        mean = values.mean(0)
        sd = values.std(0, ddof=1) if len(values) > 1 else np.full(len(heads), np.nan)
        low, high = bootstrap_mean_ci(values, clusters, n_boot, seed)
        p = sign_flip_pvalues(values, clusters, n_perm, seed)
        q = bh_qvalues(p)
        by_label = group.groupby(["layer", "head"])[[f"a_{FEMALE}", f"a_{MALE}"]].mean()
        table = pd.DataFrame({
            "layer": heads.get_level_values(0), "head": heads.get_level_values(1), "source": source, "target": target,
            "n_items": len(values), "n_clusters": len(np.unique(clusters)) if clusters is not None else len(values),
            "mean_female": by_label[f"a_{FEMALE}"].reindex(heads).to_numpy(),
            "mean_male": by_label[f"a_{MALE}"].reindex(heads).to_numpy(),
            "effect": mean, "ci_low": low, "ci_high": high,
            "d_z": np.divide(mean, sd, out=np.full_like(mean, np.nan), where=sd > 0),
            "share_positive": (values > 0).mean(0), "p": p, "q": q,
        })
        table = table.join(_bls_correlations(d, item_info, n_boot, seed))
        rows.append(table)
    out = pd.concat(rows, ignore_index=True)
    out["cluster"] = cluster or "item"
    out["power_note"] = np.where(out["n_items"] < MIN_ITEMS, f"fewer than {MIN_ITEMS} items: low power", "")
    return out


def _bls_correlations(d: pd.DataFrame, item_info: pd.DataFrame, n_boot: int, seed: int) -> pd.DataFrame:
    """Per head: r between the per-occupation mean effect and BLS percent female."""
    if "occupation_bls_pct_female" not in item_info:  # no labour statistics in this suite: NaN columns
        names = [f"bls_{kind}_{part}" for kind in ("pearson", "spearman") for part in ("r", "ci_low", "ci_high")]
        return pd.DataFrame(np.nan, index=range(d.shape[1]), columns=names)
    per_occupation = d.groupby(item_info["occupation"].to_numpy()).mean()  # (occupations, heads)
    bls = item_info.groupby("occupation")["occupation_bls_pct_female"].first().reindex(per_occupation.index).to_numpy()
    x, y = bls, per_occupation.to_numpy()  # (O,), (O, heads)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(n_boot, len(x)))
    result = {}
    for name, transform in (("bls_pearson", lambda v, axis: v), ("bls_spearman", lambda v, axis: sps.rankdata(v, axis=axis))):
        r = _rowwise_r(transform(x, 0)[None, :], transform(y, 0).T)  # (heads,)
        boot = _rowwise_r(transform(x[idx], 1)[:, None, :], np.moveaxis(transform(y[idx], 1), 2, 1))  # (B, heads)
        result[f"{name}_r"] = r
        result[f"{name}_ci_low"] = np.nanquantile(boot, 0.025, axis=0)
        result[f"{name}_ci_high"] = np.nanquantile(boot, 0.975, axis=0)
    return pd.DataFrame(result)


def condition_means(run) -> pd.DataFrame:
    """Mean attention by (layer, head, source, target, pronoun label, occupation), with n."""
    label_column = _label_column(run)
    keys = ["prompt_id", label_column] + (["occupation"] if "occupation" in run.prompts else [])
    merged = run.attention.merge(run.prompts[keys], on="prompt_id")
    group = ["layer", "head", "source", "target", label_column] + keys[2:]
    return merged.groupby(group)["weight"].agg(mean="mean", n="size").reset_index().rename(columns={label_column: "label"})


def layer_stats(heads: pd.DataFrame) -> pd.DataFrame:
    """Per (layer, source, target): average effect over heads, strongest head, heads with q < 0.05."""
    grouped = heads.groupby(["layer", "source", "target"])
    out = grouped.agg(mean_effect=("effect", "mean"), max_abs_d_z=("d_z", lambda v: v.abs().max()),
                      n_heads=("head", "size"), n_significant=("q", lambda v: int((v < 0.05).sum())))
    return out.reset_index()


def behavior(run, n_boot: int = N_BOOT, seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(summary, per occupation): log p(female candidate) - log p(male candidate) vs BLS percent female,
    over all templates and per template."""
    lp = run.logprobs.merge(run.prompts[["prompt_id", "item_id"]], on="prompt_id")
    wide = lp.pivot_table(index=["item_id", "cut"], columns="candidate_label", values="logprob", aggfunc="first")
    if FEMALE not in wide or MALE not in wide:
        return pd.DataFrame(), pd.DataFrame()
    y = (wide[FEMALE] - wide[MALE]).rename("log_ratio").reset_index()
    y = y.join(_items(run), on="item_id")
    unit = "occupation" if "occupation" in y else "item_id"  # suites without occupations: one row per item
    if "occupation_bls_pct_female" not in y:
        y["occupation_bls_pct_female"] = np.nan

    def per_unit(frame):
        return frame.groupby(unit).agg(log_ratio=("log_ratio", "mean"), n=("log_ratio", "size"),
                                       bls_pct_female=("occupation_bls_pct_female", "first")).reset_index()

    parts = [per_unit(y).assign(template_id="all")]
    parts += [per_unit(group).assign(template_id=template) for template, group in y.groupby("template_id", sort=True)]
    per_occupation = pd.concat(parts, ignore_index=True)[["template_id", unit, "log_ratio", "n", "bls_pct_female"]]
    summary = []
    for scope, group in per_occupation.groupby("template_id", sort=False):
        row = {"scope": scope, "n_items": int(group["n"].sum()), "n_occupations": len(group),
               "mean_log_ratio": float((group["log_ratio"] * group["n"]).sum() / group["n"].sum())}
        row.update(correlation_with_ci(group["bls_pct_female"], group["log_ratio"], n_boot, seed))
        row["power_note"] = f"fewer than {MIN_ITEMS} occupations" if row["n"] < MIN_ITEMS else ""
        summary.append(row)
    return pd.DataFrame(summary), per_occupation


def head_effects(run, heads: pd.DataFrame | None = None, cluster: str | None = "occupation", n_boot: int = N_BOOT,
                 n_perm: int = N_PERM, seed: int = 0, top_k: int = 5) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per head, summary) of the head interventions of a run (interventions.py).

    Per head: mean indirect effect of the pattern swap with cluster-bootstrap CI, sign-flip p and
    BH q; mean zero- and mean-ablation effects; mean attribution estimate. Summary: the total
    effect, the share of it carried by the top-k heads (ranked by mean IE in the direction of the
    total effect), and rank agreement of attribution with exact patching and of |IE| with the
    attention-bias |d_z| of the same head (pronoun -> occupation)."""
    items = run.head_effect_items
    totals = run.head_effect_totals.set_index("item_id")
    clusters = totals[cluster].to_numpy() if cluster in totals else None
    te = totals["te"].to_numpy()
    te_low, te_high = bootstrap_mean_ci(te, clusters, n_boot, seed)
    ie = items.pivot_table(index="item_id", columns=["layer", "head"], values="pattern", dropna=False).reindex(totals.index)
    computed = ie.notna().all(0).to_numpy()  # with exact: k, only some heads were patched
    values = ie.to_numpy()
    table = ie.columns.to_frame(index=False)
    table["n_items"] = len(values)
    table["mean_ie"] = values.mean(0)
    low, high = bootstrap_mean_ci(np.nan_to_num(values), clusters, n_boot, seed)
    p = sign_flip_pvalues(np.nan_to_num(values), clusters, n_perm, seed)
    table["ie_ci_low"], table["ie_ci_high"] = np.where(computed, low, np.nan), np.where(computed, high, np.nan)
    table["p"] = np.where(computed, p, np.nan)
    table["q"] = np.nan
    table.loc[computed, "q"] = bh_qvalues(p[computed])
    for mode in ("zero", "mean", "attribution"):
        table[f"mean_{mode}"] = items.groupby(["layer", "head"])[mode].mean().reindex(ie.columns).to_numpy()
    direction = np.sign(te.mean()) or 1.0
    ranked = table[computed].assign(score=lambda t: direction * t["mean_ie"]).sort_values("score", ascending=False)
    summary = {
        "n_items": len(te), "te_mean": te.mean(), "te_ci_low": float(te_low[0]), "te_ci_high": float(te_high[0]),
        "top_k": top_k, "top_heads": " ".join(f"L{int(r.layer)}H{int(r.head)}" for r in ranked.head(top_k).itertuples()),
        "share_top_k": ranked["mean_ie"].head(top_k).sum() / te.mean() if te.mean() else np.nan,
        "n_heads_q05": int((table["q"] < 0.05).sum()),
        "spearman_attribution_exact": sps.spearmanr(table.loc[computed, "mean_attribution"], table.loc[computed, "mean_ie"]).statistic,
    }
    if heads is not None and "occupation" in set(heads["target"]):
        bias = heads[heads["target"] == "occupation"].set_index(["layer", "head"])["d_z"].reindex(ie.columns).to_numpy()
        summary["spearman_ie_attention_bias"] = sps.spearmanr(np.abs(table["mean_ie"]), np.abs(bias), nan_policy="omit").statistic
    table["cluster"] = cluster or "item"
    return table, pd.DataFrame([summary])


def analyse(run, **kwargs) -> dict[str, pd.DataFrame]:
    """Every table the report needs, keyed by the CSV name it is written as."""
    heads = head_stats(run, **kwargs)
    summary, per_occupation = behavior(run, n_boot=kwargs.get("n_boot", N_BOOT), seed=kwargs.get("seed", 0))
    tables = {"head_stats": heads, "layer_stats": layer_stats(heads), "behavior": summary,
              "behavior_by_occupation": per_occupation, "condition_means": condition_means(run)}
    if run.has_head_effects:
        tables["head_effects"], tables["head_effects_summary"] = head_effects(run, heads, **kwargs)
    return tables
