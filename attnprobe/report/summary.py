"""The key findings of a run as data: `summary.json`, the table `attnprobe run` ends with, the
report's first table and `Run`'s notebook view all read this one dict.

The strongest head, everywhere it is named, is chosen by one rule: attnprobe.measures.sections.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ..heads import HeadSet
from ..measures.sections import head_test, pooled_row, split_levels, strongest_head
from ..stats import ALPHA, held_out_interaction, run_analysis

SUMMARY_VERSION = 1  # bump when a key of summary.json changes meaning or goes away
WIDTH = 100  # the run's closing table: at most this many columns per line


def _number(value) -> float | None:
    """A JSON-safe float: NaN and infinities become None."""
    return float(value) if value is not None and np.isfinite(value) else None


def _span(values: pd.Series) -> tuple[float, float]:
    """The units' 10th and 90th percentiles of the covariate, rounded to a multiple of 10 where the
    covariate spans more than 20 (a percentage: 10% and 90% for the BLS shares)."""
    low, high = np.nanpercentile(values.to_numpy(float), [10, 90])
    if high - low > 20:
        low, high = 10 * round(low / 10), 10 * round(high / 10)
    return float(low), float(high)


def _behaviour(run, tables: dict, analysis) -> dict | None:
    b = pooled_row(tables["behavior"]) if "behavior" in tables else None
    if b is None:
        return None
    out = {"cut": str(b["cut"]), "clusters": str(b["clusters"])}
    if analysis.covariate and "slope_per10" in b:
        low, high = _span(run.prompts.groupby(analysis.unit)[analysis.covariate].first())
        steps = (high - low) / 10  # the slope is per 10 covariate units
        out.update(
            covariate=analysis.name(analysis.covariate),
            unit=analysis.name(analysis.unit),
            n_units=int(b["n_units"]),
            slope_per10=_number(b["slope_per10"]),
            slope_per10_ci=[_number(b["slope_per10_ci_low"]), _number(b["slope_per10_ci_high"])],
            slope_p=_number(b["slope_p"]),
            # log-odds move linearly with the covariate: over `steps` tens the odds multiply by e^(steps b)
            odds_from=low,
            odds_to=high,
            odds_ratio=_number(math.exp(steps * b["slope_per10"])),
            odds_ratio_ci=[_number(math.exp(steps * b[f"slope_per10_ci_{e}"])) for e in ("low", "high")],
        )
    else:
        out.update(
            mean_log_ratio=_number(b["mean_log_ratio"]),
            mean_log_ratio_ci=[_number(b["mean_ci_low"]), _number(b["mean_ci_high"])],
        )
    return out


def _heads(tables: dict, analysis) -> list[dict]:
    heads, levels = split_levels(tables["head_stats"])
    entries = [(group, False) for _, group in heads.groupby("target", sort=False)]
    if analysis.covariate and "level_q" in levels:
        entries += [(group, True) for _, group in levels.groupby(["source", "target"], sort=False)]
    out = []
    for group, level in entries:
        q, size = head_test(bool(analysis.covariate), level)
        top = strongest_head(group, bool(analysis.covariate), level)
        row = {
            "source": str(group["source"].iloc[0]),
            "target": str(group["target"].iloc[0]),
            "test": "level on the covariate"
            if level
            else "interaction with the covariate"
            if analysis.covariate
            else "paired difference",
            "n_heads": len(group),
            "n_passing": int((group[q] < ALPHA).sum()),
            "strongest": None,
        }
        if top is not None:
            row["strongest"] = {
                "head": HeadSet.name(top["layer"], top["head"]),
                "layer": int(top["layer"]),
                "index": int(top["head"]),
                "statistic": size,
                "value": _number(top[size]),
                "q": _number(top[q]),
            }
        if analysis.covariate and not level:
            held = held_out_interaction(group)
            row["held_out"] = {
                "k": int(held["k"]),
                "same_sign": int(held["n_same_sign"]),
                "of": int(held["n_selected"]),
                "same_sign_random": _number(held["n_same_sign_null"]),
                "r": _number(held["mean_held_out_r"]),
                "r_random": _number(held["mean_held_out_r_null"]),
                "p": _number(held["held_out_p"]),
            }
        out.append(row)
    return out


def summary(run, tables: dict, report: str | None = None) -> dict:
    """The run's key findings (`summary.json`, versioned by `summary_version`)."""
    analysis = run_analysis(run)
    manifest = run.manifest
    out = {
        "summary_version": SUMMARY_VERSION,
        "suite": manifest.suite.name,
        "model": manifest.model.spec,
        "n_prompts": int(manifest.n_prompts),
        "contrast": [analysis.positive, analysis.negative] if analysis.paired else None,
        "alpha": ALPHA,
        "strongest_head_rule": "largest |slope per 10 covariate points| among heads at q < 0.05"
        if analysis.covariate
        else "largest |d_z| among heads at q < 0.05",
        "behaviour": None,
        "heads": [],
        "report": report,
    }
    if analysis.paired:
        out["behaviour"] = _behaviour(run, tables, analysis)
        out["heads"] = _heads(tables, analysis)
    return out


def _f(value, digits: int = 2, sign: bool = False) -> str:
    return "n/a" if value is None else f"{value:{'+' if sign else ''}.{digits}f}"


def _g(value) -> str:
    """A p-value or a covariate value in two significant digits, "n/a" where there is none."""
    return "n/a" if value is None else f"{value:.2g}"


def summary_rows(s: dict) -> list[tuple[str, str]]:
    """(label, text) rows of the key-findings table, shared by the terminal and the HTML views."""
    rows = [("run", f"{s['suite']} on {s['model']}, {s['n_prompts']:,} prompts")]
    if s["contrast"] is None:
        return rows + [("result", "no two labels compared: descriptive tables only")]
    pos, neg = s["contrast"]
    b = s["behaviour"]
    if b and "slope_per10" in b:
        low, high = b["slope_per10_ci"]
        (ratio_low, ratio_high), span = b["odds_ratio_ci"], f"from {_g(b['odds_from'])} to {_g(b['odds_to'])}"
        ratio = "n/a (no slope)" if b["odds_ratio"] is None else f"x{_f(b['odds_ratio'], 1)}"
        ratio += "" if b["odds_ratio"] is None else f" [{_f(ratio_low, 1)}, {_f(ratio_high, 1)}]"
        rows += [
            ("behaviour", f"log p({pos}) - log p({neg}) per 10 points of {b['covariate']}:"),
            (
                "",
                f"{_f(b['slope_per10'], 3, True)} [{_f(low, 3, True)}, {_f(high, 3, True)}], "
                f"p {_g(b['slope_p'])}, {b['n_units']} {b['unit']}s (clusters: {b['clusters']})",
            ),
            (
                "in words",
                f"{span} points, the odds of {pos} over {neg} {ratio}",
            ),
        ]
    elif b:
        low, high = b["mean_log_ratio_ci"]
        rows.append(
            (
                "behaviour",
                f"mean log p({pos}) - log p({neg}): {_f(b['mean_log_ratio'], 3, True)} "
                f"[{_f(low, 3, True)}, {_f(high, 3, True)}]",
            )
        )
    covariate = (b or {}).get("covariate", "the covariate")
    tested = {  # what a head passes, said once above the heads it is said of (the figures' dots differ)
        "interaction with the covariate": f"whose {pos} - {neg} attention follows {covariate}",
        "level on the covariate": f"whose attention follows {covariate}",
        "paired difference": f"whose attention differs between {pos} and {neg}",
    }
    test = None
    for h in s["heads"]:
        if h.get("test") != test:
            test = h.get("test")
            rows.append(("", f"heads {tested.get(test, 'passing')}, q < {s['alpha']} (BH):"))
        top = h["strongest"]
        best = f"; strongest {top['head']} ({_f(top['value'], 4, True)})" if top else ""
        rows.append(("heads", f"{h['source']} -> {h['target']}: {h['n_passing']} of {h['n_heads']}{best}"))
        held = h.get("held_out")
        if held and held["of"]:
            rows.append(
                (
                    "held out",
                    f"{h['target']}: top {held['k']} heads keep sign {held['same_sign']}/{held['of']} "
                    f"(random {_f(held['same_sign_random'], 1)}), r {_f(held['r'])} "
                    f"(random {_f(held['r_random'])}), p {_g(held['p'])}",
                )
            )
    if s["report"]:
        rows.append(("report", s["report"]))
    return rows


def summary_lines(s: dict, limit: int = 12) -> list[str]:
    """The terminal table: at most `limit` lines of at most WIDTH columns."""
    rows = summary_rows(s)
    if len(rows) > limit:  # many attention entries: keep the first rows and the report's place
        rows = rows[: limit - 2] + [("...", "more rows in summary.json")] + rows[-1:]
    lines = [f"{label:<9} {text}" for label, text in rows]
    return [line if len(line) <= WIDTH else line[: WIDTH - 3] + "..." for line in lines]


def summary_html(s: dict) -> str:
    """The key-findings table as HTML (the report's first table, `Run._repr_html_`)."""
    from html import escape

    cells = "".join(
        f"<tr><th scope='row'>{escape(label)}</th><td>{escape(text)}</td></tr>"
        for label, text in summary_rows(s)
    )
    return f"<table class='findings'><caption>Key findings</caption>{cells}</table>"
