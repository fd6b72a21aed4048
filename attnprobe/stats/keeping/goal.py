"""The debiasing goal (issue 52), judged per edit on the sweep's tables: which of its conditions an
edit meets, and for those it misses, which fail. An edit meets the goal when

- the stereotype term of the joint regression (on the held-out nouns in the items' templates) is
  reduced by at least half, its CI inside [25%, 150%]: an edit that reverses the stereotype (removing
  more than there was) is not credited for it;
- the factual term is kept within [0.9, 1.1], its CI inside [0.8, 1.2], on held-out nouns and on
  names (each in the items' templates);
- the uncentred accuracy on the definitional prompts (the control file's nouns, each judged by the
  edit fitted on the other half of the pairs) is at least 99%, and the offset (the mean shift toward
  one label) at most 0.1 nats either way;
- the placebo's p (refits on permuted covariates) is at most 0.01: needs `--placebo 199` or more;
- the upper bound of the KL's CI is at most 0.001.

A condition whose column is missing fails (a placebo not run says so; a set without names shows
its numbers as nan).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..edits import MLP_LAYERS, STREAM_LAYERS
from .edit_search import search_table
from .layers import KL_MAX as KL
from .layers import OFFSET_MAX as OFFSET

REMOVED, REMOVED_CI = 0.5, (0.25, 1.5)
KEPT, KEPT_CI = (0.9, 1.1), (0.8, 1.2)
ACCURACY, PLACEBO_P = 0.99, 0.01  # OFFSET and KL: the bounds the layer gate and the search use too
HELD_OUT = ("nouns_templates", "names_templates")  # the phrase sets the factual term is judged on


def _within(value, bounds) -> bool:
    return bool(np.isfinite(value) and bounds[0] <= value <= bounds[1])


def failures(row: pd.Series) -> list[str]:
    """The goal's conditions `row` (a row of edits.csv or edits_stream.csv) fails, in words."""
    get = lambda name: float(row[name]) if name in row and pd.notna(row[name]) else np.nan
    out = []
    removed = get("nouns_templates_stereotype_removed")
    low, high = (get(f"nouns_templates_stereotype_removed_ci_{end}") for end in ("low", "high"))
    if not (removed >= REMOVED and _within(low, REMOVED_CI) and _within(high, REMOVED_CI)):
        out.append(f"stereotype removed {removed:.0%} [{low:.0%}, {high:.0%}]")
    for name in HELD_OUT:
        kept = get(f"{name}_factual_kept")
        ci = get(f"{name}_factual_kept_ci_low"), get(f"{name}_factual_kept_ci_high")
        if not (_within(kept, KEPT) and _within(ci[0], KEPT_CI) and _within(ci[1], KEPT_CI)):
            out.append(f"{name.split('_')[0]} kept {kept:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]")
    accuracy, offset = get("definitional_accuracy_after"), get("definitional_offset")
    if not accuracy >= ACCURACY:
        out.append(f"accuracy {accuracy:.1%}")
    if not abs(offset) <= OFFSET:
        out.append(f"offset {offset:+.2f} nats")
    placebo = get("placebo_p")
    if not placebo <= PLACEBO_P:
        out.append("placebo not run" if np.isnan(placebo) else f"placebo p {placebo:.3f}")
    kl = get("kl_ci_high")
    if not kl <= KL:
        out.append(f"KL upper {kl:.4f}")
    return out


COLUMNS = {
    "nouns_templates_stereotype_removed": "stereotype_removed",
    "nouns_templates_factual_kept": "nouns_kept",
    "names_templates_factual_kept": "names_kept",
    "specificity": "specificity",
}


def goal_table(edits: pd.DataFrame, stream: pd.DataFrame, mlp=None, raw=None) -> pd.DataFrame:
    """One row per edit (head kinds per k; the stream and the MLP outputs per layer and chosen; given the
    sweep's `raw` rows with the per-layer chosen rows, the held-out search's choice, site "search"):
    the goal's columns with their CIs, the offset, the uncentred accuracy, the placebo's p and floor, the
    readout R2 after, KL's upper bound, and `fails` (the conditions missed; empty: goal met). The
    closest first: those removing REMOVED to 150% of the stereotype term, then by how few
    conditions fail, then by specificity (an edit removing nothing misses few conditions, but not
    the one the goal is for)."""
    frames = [edits.copy().assign(site="heads", size=edits.get("k"))]
    for site, table in (("stream", stream), ("mlp", mlp)):
        if table is not None and len(table):
            chosen = table["chosen"] if "chosen" in table else pd.Series(False, index=table.index)
            label = table["layer"].astype(str).where(~chosen.astype(bool), "chosen")
            frames.append(table.copy().assign(site=site, size=label))  # copy: a CSV's frame is fragmented
    search = search_table(raw)[0] if raw is not None else pd.DataFrame()
    if len(search):
        frames.append(search.assign(site="search", size="held out"))
    rows = pd.concat(frames, ignore_index=True)
    several = {MLP_LAYERS: "mlp layers", STREAM_LAYERS: "stream layers"}  # their size: how many layers
    for prefix, site in several.items():
        rows.loc[rows["kind"].astype(str).str.startswith(prefix), "site"] = site
    out = rows[["site", "kind", "size"]].copy()
    for column, name in COLUMNS.items():
        for end in ("", "_ci_low", "_ci_high"):
            out[name + end] = rows.get(column + end, np.nan)
    keep = ["definitional_offset", "definitional_accuracy_after", "placebo_p", "placebo_p_floor"]
    for column in [*keep, "readout_r2_after", "kl", "kl_ci_high"]:
        out[column] = rows.get(column, np.nan)
    out["choices"] = rows.get("choices", pd.Series("", index=rows.index)).fillna("")
    fails = [failures(row) for _, row in rows.iterrows()]
    out["n_fails"] = [len(f) for f in fails]
    out["fails"] = ["; ".join(f) for f in fails]
    out["goal_met"] = out["n_fails"] == 0
    out["removes"] = out["stereotype_removed"].between(REMOVED, REMOVED_CI[1])  # not over-removal
    order = ["removes", "n_fails", "specificity"]
    return out.sort_values(order, ascending=[False, True, False], kind="stable").reset_index(drop=True)
