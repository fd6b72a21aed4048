"""From a run's long tables to paired differences on the design's cells.

An item is the set of prompts that differ only in the contrast; its paired difference is
d = value(positive prompt) - value(negative prompt). Items are averaged into cells, one per
combination of template and cluster units (e.g. occupation x template: the participant of a
two-entity template is averaged out), so that every template weighs the same in pooled figures
however many items it expands to. Cells carry their cluster labels, the unit that owns the covariate
(e.g. the occupation) and its covariate value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..errors import AnalysisError
from ..schema.analysis import BEFORE, FEW_LEVELS, ITEM, TEMPLATE, Analysis
from .inference import cluster_slope_test, group_sums


def resolve(analysis: Analysis, prompts: pd.DataFrame) -> Analysis:
    """Fill in the labels of a run recorded without them: compared only when there are exactly two."""
    if analysis.paired or analysis.contrast not in prompts:
        return analysis
    labels = tuple(dict.fromkeys(prompts[analysis.contrast].dropna().astype(str)))
    if len(labels) != 2:
        return analysis
    return Analysis(**{**analysis.to_dict(), "positive": labels[0], "negative": labels[1], "labels": labels})


def items_table(prompts: pd.DataFrame, analysis: Analysis) -> pd.DataFrame:
    """Per item (index item_id): its template, cluster units, covariate owner and covariate."""
    wanted = [TEMPLATE, *analysis.clusters, analysis.unit, analysis.covariate]
    columns = [c for c in dict.fromkeys(wanted) if c and c != ITEM and c in prompts]
    table = prompts.drop_duplicates(ITEM).set_index(ITEM, drop=False)[columns + [ITEM]]
    table.index.name = None  # the item_id column, not the index, is what cells group by
    return table


def coded(factors: list[tuple[np.ndarray, pd.Index]]) -> tuple[np.ndarray, list[pd.Index]]:
    """One int64 code per row for the combination of several factorized columns ((codes, levels) each,
    pd.factorize's), in the order of the combinations (levels sorted: the order of their values, as a
    groupby or pivot sorts), -1 where any is missing; and the levels (decoded() reverses it)."""
    code, lowest = None, None
    for codes, levels in factors:
        if code is None:
            code, lowest = codes.astype(np.int64), codes.copy()
        else:  # in place: np.ravel_multi_index takes 8x as long on 20 million rows
            code *= max(len(levels), 1)
            code += codes
            np.minimum(lowest, codes, out=lowest)
    code[lowest < 0] = -1
    return code, [levels for _, levels in factors]


def decoded(code: np.ndarray, levels: list[pd.Index], names: list[str]) -> pd.DataFrame:
    """The columns `names` of each (non-negative) code of coded()."""
    where = np.unravel_index(code, [max(len(level), 1) for level in levels])
    return pd.DataFrame({name: level.take(w) for name, level, w in zip(names, levels, where)})


def pivoted(long: pd.DataFrame, index: str, columns: list[str], value: str, keep_empty: bool = False):
    """long.pivot_table(index=index, columns=columns, values=value, aggfunc="first", dropna=not
    keep_empty) on integer codes (6.6 s -> 1.5 s on the 9 million rows of a 1,024-head run's direct
    attribution): rows and columns sorted, each cell the first non-missing value of its rows; with
    keep_empty, rows and columns whose values are all missing are kept (NaN)."""
    row_code, row_levels = coded([pd.factorize(long[index], sort=True)])
    column_code, column_levels = coded([pd.factorize(long[c], sort=True) for c in columns])
    values = long[value].to_numpy()
    keyed = (row_code >= 0) & (column_code >= 0)
    listed = keyed if keep_empty else keyed & pd.notna(values)
    rows, at_row = np.unique(row_code[listed], return_inverse=True)
    listed_columns, at_column = np.unique(column_code[listed], return_inverse=True)
    matrix = np.full((len(rows), len(listed_columns)), np.nan, dtype=np.result_type(values.dtype, np.float32))
    filled = pd.notna(values[listed])
    cell = (at_row * len(listed_columns) + at_column)[filled]
    _, first = np.unique(cell, return_index=True)  # the first of each cell's rows, in the table's order
    matrix.flat[cell[first]] = values[listed][filled][first]
    names = decoded(listed_columns, column_levels, columns)
    header = pd.MultiIndex.from_frame(names) if len(columns) > 1 else pd.Index(names[columns[0]])
    return pd.DataFrame(matrix, index=pd.Index(row_levels[0].take(rows), name=index), columns=header)


def _pairs(long: pd.DataFrame, prompts: pd.DataFrame, analysis: Analysis, keys: list[str], value: str):
    """The pairs of paired(): (their (item, *keys) codes, in order, coded()'s levels, the positive and
    the negative values), None where one label only is there."""
    label = analysis.contrast
    info = prompts[["prompt_id", ITEM, label]].astype({label: str})
    info = info[info[label].isin([analysis.positive, analysis.negative])]
    row = pd.Index(info["prompt_id"]).get_indexer(long["prompt_id"])  # -1: a prompt of neither label
    items, names = pd.factorize(info[ITEM], sort=True)
    factors = [(np.where(row >= 0, items[row], -1), names), *(pd.factorize(long[k], sort=True) for k in keys)]
    cell, levels = coded(factors)
    kept = np.flatnonzero(cell >= 0)  # neither label, or a key missing (NaN): no pair
    row = row[kept]
    negative = (info[label] != analysis.positive).to_numpy()[row]
    both = cell[kept] * 2 + negative
    order = np.argsort(both, kind="stable")
    both = both[order]
    twice = np.flatnonzero(both[1:] == both[:-1])
    if len(twice):
        first = order[twice[0]]
        raise AnalysisError(
            f"item {names[items[row[first]]]} has two prompts labelled '{info[label].iloc[row[first]]}' "
            f"in column {label}; each item needs one prompt per contrast label"
        )
    if negative.all() or not negative.any():  # one label only: no pairs
        return None
    first_of_pair = (both[1:] >> 1 == both[:-1] >> 1) & (both[:-1] % 2 == 0)  # positive, then negative
    at = np.flatnonzero(first_of_pair)
    values = long[value].to_numpy()[kept]
    pos, neg = values[order[at]], values[order[at + 1]]
    ok = ~(pd.isna(pos) | pd.isna(neg))
    return both[at][ok] >> 1, levels, pos[ok], neg[ok]


def paired(
    long: pd.DataFrame, prompts: pd.DataFrame, analysis: Analysis, keys: list[str], value: str
) -> pd.DataFrame:
    """Rows (item_id, *keys, positive, negative, d) from a long table with prompt_id, sorted by item and
    keys, where an item has both prompts of the contrast. On integer codes, not on the table's strings
    (an attention table holds millions of rows: 19.5 million at 32 x 32 heads on the gender suite)."""
    found = _pairs(long, prompts, analysis, keys, value)
    if found is None:
        return pd.DataFrame(columns=[ITEM, *keys, "positive", "negative", "d"])
    code, levels, pos, neg = found
    out = decoded(code, levels, [ITEM, *keys])
    out["positive"], out["negative"] = pos, neg
    out["d"] = out["positive"] - out["negative"]
    return out


def paired_wide(long: pd.DataFrame, prompts: pd.DataFrame, analysis: Analysis, by: list[str], value: str):
    """[(the values of `by`, {"d", "positive", "negative": items x (layer, head)})] of paired()'s pairs
    with keys by + [layer, head]: its groups by `by` in the order they first come and each pivoted,
    index item_id and columns (layer, head) sorted, built from the codes (the long table of 9.7 million
    pairs at 32 x 32 heads, its groups and pivots took 6 s)."""
    found = _pairs(long, prompts, analysis, [*by, "layer", "head"], value)
    if found is None or not len(found[0]):  # one label only, or no pair with both values
        return []
    code, levels, pos, neg = found
    parts = np.unravel_index(code, [max(len(level), 1) for level in levels])
    group = np.ravel_multi_index(parts[1 : 1 + len(by)], [max(len(v), 1) for v in levels[1 : 1 + len(by)]])
    order = np.argsort(group, kind="stable")
    starts = np.flatnonzero(np.r_[True, group[order][1:] != group[order][:-1]])
    out = []
    for rows in sorted(np.split(order, starts[1:]), key=lambda rows: rows[0]):  # as first they come
        items, at_item = np.unique(parts[0][rows], return_inverse=True)
        heads, at_head = np.unique(parts[-2][rows] * len(levels[-1]) + parts[-1][rows], return_inverse=True)
        layer, head = np.divmod(heads, len(levels[-1]))
        header = pd.MultiIndex.from_arrays(
            [levels[-2].take(layer), levels[-1].take(head)], names=["layer", "head"]
        )
        index = pd.Index(levels[0].take(items), name=ITEM)
        wide = {}
        for name, values in (("d", pos[rows] - neg[rows]), ("positive", pos[rows]), ("negative", neg[rows])):
            matrix = np.full((len(items), len(heads)), np.nan, dtype=np.result_type(values.dtype, np.float32))
            matrix[at_item, at_head] = values
            wide[name] = pd.DataFrame(matrix, index=index, columns=header)
        key = tuple(levels[1 + j][parts[1 + j][rows[0]]] for j in range(len(by)))
        out.append((key, wide))
    return out


SAME = 1e-5  # paired values closer than this everywhere are one value read twice (float32 weights)
# In a low-precision run the two reads of one value may come from passes of other shapes (their own
# batch or pack) whose kernels round differently, each within verify's tolerance (4 eps of the format)
# of the exact weight: so within 8 eps of each other. An H200 in bfloat16 read the token before the
# pronoun unequally in the 8B shape's full suite (2026-11-30), which made it a paired difference.
SAME_LOW_PRECISION = {"bfloat16": 8 * 2.0**-7, "float16": 8 * 2.0**-10}


def read_twice(run, analysis: Analysis, source: str, d: np.ndarray) -> bool:
    """Whether a source's paired values are one value read twice (a level: both prompts of an item
    share the prefix it reads): equal within SAME, or, in a low-precision run, within the format's
    rounding and read before the contrast's first token in every prompt (the prompts table's token
    spans; a read of the contrast itself or after it is a difference however small)."""
    gap = np.nanmax(np.abs(d), initial=0.0)
    if gap <= SAME:
        return True
    if gap > SAME_LOW_PRECISION.get(str(getattr(run.manifest, "dtype", "")), SAME):
        return False
    # the rows read end (exclusive) at the span's start for `at: before`, else at the span's end
    before = source.startswith(BEFORE)
    end = f"{source.removeprefix(BEFORE)}_tok_{'start' if before else 'end'}"
    prompts = run.prompts  # the contrast column is its slot's label (pronoun_label), or the slot itself
    contrast = f"{analysis.contrast.removesuffix('_label')}_tok_start"
    return end in prompts and contrast in prompts and bool((prompts[end] <= prompts[contrast]).all())


@dataclass
class Design:
    """Cells of one scope: which items each holds and how each is labelled and weighted."""

    cell_of_item: np.ndarray  # (n_items,) cell index of each item, in the order given
    cells: pd.DataFrame  # one row per cell: template_id, clusters, unit, covariate, weight
    clusters: list[np.ndarray]  # one label array (n_cells,) per cluster dimension
    n_items: int
    cluster_text: str  # the dimensions used, e.g. "occupation x template"

    @classmethod
    def build(cls, item_ids, items: pd.DataFrame, analysis: Analysis) -> Design:
        info = items.loc[list(item_ids)]
        key = list(dict.fromkeys(c for c in (TEMPLATE, *analysis.clusters, analysis.unit) if c))
        codes = info.groupby(key, sort=False, dropna=False).ngroup().to_numpy()
        cells = info.assign(_cell=codes).drop_duplicates("_cell").sort_values("_cell").reset_index(drop=True)
        per_template = cells.groupby(TEMPLATE)[TEMPLATE].transform("size").to_numpy()
        cells["weight"] = 1.0 / per_template / cells[TEMPLATE].nunique()  # every template weighs the same
        # a dimension with one value in this scope (the template, in a one-template scope) clusters nothing
        used = [c for c in analysis.clusters if cells[c].nunique() > 1] or list(analysis.clusters[:1])
        return cls(
            codes,
            cells,
            [cells[c].astype(str).to_numpy() for c in used],
            len(info),
            " x ".join(analysis.name(c) for c in used),
        )

    def cell_means(self, values: np.ndarray) -> np.ndarray:
        """(n_cells, k) means of the items' (n_items, k) values, ignoring NaN."""
        finite = np.isfinite(values)
        sums = group_sums(np.where(finite, values, 0.0), self.cell_of_item, len(self.cells))
        with np.errstate(invalid="ignore"):
            return sums / group_sums(finite, self.cell_of_item, len(self.cells))

    def unit_means(
        self, cell_values: np.ndarray, unit: str, covariate: str
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(unit labels, covariate per unit, (n_units, k) template-weighted means of the cells)."""
        codes, labels = pd.factorize(self.cells[unit])
        W = np.where(np.isfinite(cell_values), self.cells["weight"].to_numpy()[:, None], 0.0)
        sums = group_sums(W * np.nan_to_num(cell_values), codes, len(labels))
        x = self.cells.groupby(codes)[covariate].first().to_numpy(dtype=float)
        with np.errstate(invalid="ignore"):
            return np.asarray(labels), x, sums / group_sums(W, codes, len(labels))


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


def scopes(analysis: Analysis, templates) -> dict[str, list[str]]:
    """ "all" (templates weighted equally) and each declared group, as lists of template ids."""
    out = {"all": list(templates)}
    out.update({name: [t for t in ids if t in set(templates)] for name, ids in analysis.groups.items()})
    return {name: ids for name, ids in out.items() if ids}


PER = 10  # effects are stated per 10 units of the covariate (10 points of a percentage)


def run_analysis(run) -> Analysis:
    """The run's analysis, resolved against its prompts."""
    return resolve(Analysis.from_manifest(run.manifest, run.prompts.columns), run.prompts)


def cell_slopes(items: pd.DataFrame, values: np.ndarray, analysis: Analysis) -> dict:
    """cluster_slope_test of `values` (items, k) on the covariate, on Design's cells and weights of
    `items` (every template the same, each of its cells equally): what `compare` tests per scope."""
    design = Design.build(items.index, items, analysis)
    x = design.cells[analysis.covariate].to_numpy(dtype=float)
    return cluster_slope_test(
        x, design.cell_means(values), design.cells["weight"].to_numpy(), design.clusters
    )


def power_note(n_clusters: list[int], cluster_text: str) -> str:
    """What the design lets a cluster-robust test conclude: nothing with one cluster; with fewer than
    FEW_LEVELS levels of a dimension, an interval from t with so few df that it says little (and what
    to declare instead); approximate p below 10 clusters."""
    names = cluster_text.split(" x ")
    fewest = min(n_clusters)
    if fewest < 2:
        return f"one cluster of {cluster_text}: no test"
    few = [f"{name} has {n}" for name, n in zip(names, n_clusters) if n < FEW_LEVELS]
    if few:
        return (
            f"{', '.join(few)} levels: t with {fewest - 1} df gives intervals too wide to conclude "
            "much; add levels, or drop that dimension from analysis.clusters if its levels are fixed "
            "conditions rather than a sample"
        )
    if fewest < 10:
        return f"{' x '.join(map(str, n_clusters))} clusters ({cluster_text}): p is approximate"
    return ""
