"""`attnprobe compare RUN_A RUN_B`: every measure's paired change B - A (stats.compare), written as
compare_<measure>.csv/.parquet, compare.json (the two runs, their models and edits) and
compare.html (the headline changes and the tables' strongest rows) into the output directory.
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

import pandas as pd

from ..errors import RunError
from ..measures import paired
from ..run.files.reader import RunFiles
from ..store import atomic_write, shared, write_table

SHOWN = 12  # rows of each table in compare.html (the CSV has all)


def compare_runs(a, b) -> dict[str, pd.DataFrame]:
    """{table: rows}: each registered measure's paired change between the runs in directories
    `a` and `b` (RunFiles or paths); refused in one line when their items cannot be paired."""
    a, b = (run if isinstance(run, RunFiles) else RunFiles(run) for run in (a, b))
    with shared(a.directory), shared(b.directory):  # no run --fresh or edit rewrites them meanwhile
        return paired(a, b)


def write_comparison(a, b, out: str | Path | None = None) -> tuple[Path, dict]:
    """Compare the runs and write the tables, compare.json and compare.html into `out` (default
    reports/compare/<A>--<B>/); returns compare.html's path and the tables."""
    a, b = RunFiles(a), RunFiles(b)
    tables = compare_runs(a, b)  # reads both manifests (kept for compare.json) under the runs' locks
    out = Path(out) if out else Path("reports") / "compare" / f"{a.directory.name}--{b.directory.name}"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunError(
            f"--out {out}: cannot create it ({exc.strerror or exc}); choose a writable directory"
        ) from None
    for name, table in tables.items():
        write_table(out, name, table)
    about = {name: _identity(run) for name, run in (("a", a), ("b", b))}
    atomic_write(out / "compare.json", lambda p: p.write_text(json.dumps(about, indent=2) + "\n"))
    html = _html(about, tables)
    atomic_write(out / "compare.html", lambda p: p.write_text(html))
    return out / "compare.html", tables


def _identity(run: RunFiles) -> dict:
    m = run.manifest
    return {
        "directory": str(run.directory.resolve()),
        "suite": m.suite.name,
        "model": m.model.spec,
        "dtype": m.dtype,
        "weights_content": m.model.weights_content,
        "edits": m.edits,
    }


def headline(tables: dict) -> list[str]:
    """One sentence per cut of the next-token comparison (every item): the gradient before, after and
    its change with CI, in the units of the run's statistics."""
    rows = tables.get("compare_next_token")
    if rows is None or "gradient_change" not in rows:
        return []
    out = []
    for r in rows[rows["scope"] == "all"].itertuples():
        out.append(
            f"At the cut before '{r.cut}', the log-odds gradient per 10 covariate units is "
            f"{r.gradient_a:+.3f} in A and {r.gradient_b:+.3f} in B: a change of {r.gradient_change:+.3f} "
            f"[{r.gradient_change_ci_low:+.3f}, {r.gradient_change_ci_high:+.3f}] "
            f"(p {r.gradient_change_p:.3g}, "
            f"{r.n_items} items, clusters {r.clusters}); the mean log-odds changes by {r.mean_change:+.3f} "
            f"[{r.change_ci_low:+.3f}, {r.change_ci_high:+.3f}]."
        )
    return out


def _html(about: dict, tables: dict) -> str:
    def run_line(key):
        r = about[key]
        edits = ", ".join(f"{e['name']} ({e['kind']} {e['heads']})" for e in r["edits"]) or "none"
        return (
            f"<li>{key.upper()}: {escape(r['directory'])} - {escape(r['model'])}, edits: {escape(edits)}</li>"
        )

    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>attnprobe compare</title>",
        "<style>body{font-family:sans-serif;max-width:70em;margin:2em auto}table{border-collapse:collapse;"
        "font-size:90%}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}</style></head><body>",
        "<h1>Paired comparison of two runs (B - A)</h1><ul>",
        run_line("a"),
        run_line("b"),
        "</ul>",
        *(f"<p>{escape(s)}</p>" for s in headline(tables)),
        "<p>Each change is per item B - A over the same prompts, averaged over the design's cells "
        "(every template weighing the same) and tested cluster-robustly by the declared clusters; "
        "q: Benjamini-Hochberg over the rows of one scope. The CSV files hold every row.</p>",
    ]
    for name, table in tables.items():
        order = "gradient_change_p" if "gradient_change_p" in table else "change_p"
        shown = table.sort_values(order).head(SHOWN)
        parts += [f"<h2>{escape(name)} ({len(table)} rows; the {len(shown)} smallest p)</h2>"]
        parts += [shown.to_html(index=False, float_format=lambda v: f"{v:.4g}", na_rep="")]
    return "\n".join(parts + ["</body></html>"])
