"""The definitional control of an edit sweep (stats/edits.py), before and after each edit: per set
of control prompts the accuracy, the gap kept and the offset; for each set of the control's phrases
put in the items' templates (edits.inputs.template_prompts) the joint regression's terms
(joint.py); and the row's specificity (the joint fit's on the words a keep constraint was fitted
on, held out by word)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..inference import cluster_mean_test, ratio_test
from .joint import edit_terms

TEMPLATES = "_templates"  # a control set's phrases put in the items' templates (edits.inputs.SUFFIX)


def control_columns(after: pd.Series, control0: pd.DataFrame) -> dict:
    """The control before (control0) and after the edit (`after`: each prompt's y). The prompts a keep
    constraint may be fitted on (half 0 or 1) were each edited with the constraint fitted on the other
    half's words (cross-fitted), so their gap kept is held out by word; each other set (never fitted:
    names, a new frame) gets its own columns. Clusters: the word pair where the control names one,
    else each prompt."""
    y1 = after.to_numpy()
    y0, sign = control0["y"].to_numpy(), control0["sign"].to_numpy()
    half = control0["half"].to_numpy() if "half" in control0 else np.zeros(len(y0))
    sets = control0["set"].fillna("").to_numpy() if "set" in control0 else np.full(len(y0), "")
    pairs = control0["pair"].fillna("").astype(str) if "pair" in control0 else pd.Series("", control0.index)
    units = pd.factorize(pairs if (pairs != "").all() else control0.index)[0]
    in_templates = np.char.endswith(sets.astype(str), TEMPLATES)
    out = _control_set(y0, y1, sign, units, (half != 2) & ~in_templates, "definitional")
    for name in dict.fromkeys(sets[(half == 2) | in_templates]):
        out |= _control_set(y0, y1, sign, units, sets == name, f"control_{name}")
    return out


def joint_columns(after: pd.Series, control0: pd.DataFrame, items: pd.DataFrame) -> dict:
    """The joint regression (joint.py) of the items (y0, y1) with each set of the control's phrases
    put in their templates (edits.inputs.template_prompts), before (control0) and after the edit
    (`after`); columns prefixed with the set, e.g. nouns_templates_...: the stereotype term
    removed and the factual term kept in one fit. The set of the words a keep constraint was fitted
    on (held out by word: halves 0 and 1) gives the row's specificity."""
    if "set" not in control0:
        return {}
    sets = control0["set"].fillna("").astype(str)
    items = items[["y0", "y1", "covariate", "unit", "template_id"]]
    out = {}
    for name in dict.fromkeys(sets[sets.str.endswith(TEMPLATES)]):
        on = control0[sets == name]
        phrases = pd.DataFrame(
            {
                "y0": on["y"],
                "y1": after[on.index],
                "sign": on["sign"],
                "unit": on["pair"],
                "template_id": on["template_id"],
            }
        )
        out |= edit_terms(items, phrases, name)
        if (on["half"] != 2).all():
            out |= {
                f"specificity{end}": out[f"{name}_specificity{end}"] for end in ("", "_ci_low", "_ci_high")
            }
    return out


def _control_set(y0, y1, sign, units, rows, prefix: str) -> dict:
    """One set's columns: accuracy (the share of prompts whose y has the label's sign: raw, and after
    removing the edit's mean shift, which alone moves a sign count), the mean log-odds toward the
    label, the gap kept (after / before: offset-free, as the labels are balanced; Fieller CI) and the
    offset (mean y after - before, nats toward the positive label, with CI)."""
    y0, y1, sign, units = y0[rows], y1[rows], sign[rows], [pd.factorize(units[rows])[0]]
    w = np.ones(len(y0))
    kept = ratio_test(sign * y1, sign * y0, w, units)
    offset = cluster_mean_test(y1 - y0, w, units)
    return {
        f"{prefix}_accuracy_before": float((np.sign(y0) == sign).mean()),
        f"{prefix}_accuracy_after": float((np.sign(y1) == sign).mean()),
        f"{prefix}_accuracy_after_centred": float((np.sign(y1 - (y1 - y0).mean()) == sign).mean()),
        f"{prefix}_logodds_before": float((sign * y0).mean()),
        f"{prefix}_logodds_after": float((sign * y1).mean()),
        f"{prefix}_gap_kept": float(kept["ratio"][0]),
        f"{prefix}_gap_kept_ci_low": float(kept["ci_low"][0]),
        f"{prefix}_gap_kept_ci_high": float(kept["ci_high"][0]),
        f"{prefix}_offset": float(offset["mean"][0]),
        f"{prefix}_offset_ci_low": float(offset["ci_low"][0]),
        f"{prefix}_offset_ci_high": float(offset["ci_high"][0]),
    }


def specificity_columns(row: dict) -> dict:
    """Specificity where the control has no phrases in the items' templates (with them: joint_columns'):
    the gradient share removed minus how far the definitional gap moved either way, |1 - gap kept|
    (an amplified gap is damage too), its CI half-width from the two half-widths in quadrature (the
    two are estimated on disjoint prompts: the items and the control)."""
    spec = row["gradient_removed"] - abs(1 - row["definitional_gap_kept"])
    bounds = [
        row[f"{name}_ci_{end}"]
        for name in ("gradient_removed", "definitional_gap_kept")
        for end in ("low", "high")
    ]
    half = np.hypot((bounds[1] - bounds[0]) / 2, (bounds[3] - bounds[2]) / 2)
    half = half if np.isfinite(bounds).all() else np.inf  # an unbounded part leaves it unbounded
    return {"specificity": spec, "specificity_ci_low": spec - half, "specificity_ci_high": spec + half}
