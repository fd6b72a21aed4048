"""The report of one or more runs: CSV tables, figures (PNG and SVG) and one self-contained HTML file.

`write_report(run_dir)` writes head_stats.csv, layer_stats.csv, behavior.csv, behavior_by_unit.csv,
condition_means.csv (and head_effects*.csv) and figures/ into the run directory, and report.html
beside them. With several run directories the HTML puts the models side by side (written to `out`).
Numbers come from `attnprobe.stats`; context.py chooses the words, plots.py draws, figures.py saves.
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

import jinja2
import pandas as pd

from .. import stats
from ..run.reader import RunFiles
from ..run.storage import HEAD_EFFECT_TABLES, STATS_TABLES, TABLES_KEY, atomic_write, write_table
from ..tables import read_table
from ..version import __version__
from . import plots
from .context import headline, run_context

__all__ = ["headline", "load_tables", "write_report"]


def load_tables(run: RunFiles, refresh: bool = False, write: bool = True) -> dict[str, pd.DataFrame]:
    """The statistics tables of a run, computed once and cached as CSV in the run directory (with
    `write=False`, computed in memory when the cache is missing or stale, and nothing written)."""
    names = STATS_TABLES + (HEAD_EFFECT_TABLES if run.has_head_effects else ())
    paths = {name: run.directory / f"{name}.parquet" for name in names}
    stamp = {"stats": stats.TABLES_VERSION, "analysis": run.manifest.get("analysis")}
    key = run.directory / TABLES_KEY
    cached = json.loads(key.read_text()) if key.is_file() else {}
    fresh = cached.get("stamp") == json.loads(json.dumps(stamp)) and all(
        p.is_file() and p.stat().st_mtime >= (run.directory / "attention.parquet").stat().st_mtime for p in paths.values())
    if fresh and not refresh:
        return {name: read_table(run.directory, name) for name in names}
    tables = stats.analyse(run)
    if write:
        for name, table in tables.items():
            write_table(run.directory, name, table)
        payload = json.dumps({"stamp": stamp}, indent=1)
        atomic_write(key, lambda path: path.write_text(payload))  # last: the tables above are complete
    return tables


def write_report(run_dirs, out: str | Path | None = None) -> Path:
    """Write report.html for one run (into its directory) or a side-by-side report of several."""
    run_dirs = [run_dirs] if isinstance(run_dirs, (str, Path)) else list(run_dirs)
    runs = [RunFiles(d) for d in run_dirs]
    tables = [load_tables(run) for run in runs]
    heads = [t["head_stats"][t["head_stats"]["scope"] == "all"] for t in tables if len(t["head_stats"])]
    limits = {"d_z": plots.largest_abs(pd.concat([h["d_z"] for h in heads]))} if heads else {}  # one scale for all runs
    contexts = [run_context(run, t, limits) for run, t in zip(runs, tables)]
    environment = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    template = environment.from_string(files(__package__).joinpath("report.html.j2").read_text())
    targets = list(dict.fromkeys(t for table in tables for t in table["head_stats"].get("target", pd.Series(dtype=str))))
    html = template.render(
        title=" vs ".join(c["model"] for c in contexts) + f" / {contexts[0]['suite']}",
        runs=contexts, targets=targets, version=__version__, n_boot=stats.N_BOOT, alpha=stats.ALPHA,
        view_js=files(__package__).joinpath("view.js").read_text(),
    )
    path = Path(out) if out else (runs[0].directory / "report.html" if len(runs) == 1 else Path("reports") / "compare.html")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html, encoding="utf-8")
    return path
