"""The report of one or more runs: CSV tables, figures (PNG and SVG) and one self-contained HTML file.

`write_report(run_dir)` writes head_stats.csv, layer_stats.csv, behavior.csv, behavior_by_unit.csv,
condition_means.csv (and head_effects*.csv) and figures/ into the run directory, and report.html
beside them. With several run directories the HTML puts the models side by side (written to `out`).
Numbers come from `attnprobe.stats`; context.py chooses the words, each measure lays out its own
section (Measure.section; section.html.j2 is the generic layout), attnprobe.plotting draws.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from contextlib import ExitStack
from importlib.resources import files
from pathlib import Path

import jinja2
import markupsafe
import pandas as pd

from .. import stats
from ..errors import RunError
from ..measures import MEASURES, analyse, table_names
from ..plotting import largest_abs
from ..progress import Progress
from ..run.files.inventory import run_writes
from ..run.files.layout import TABLES_KEY, artefacts
from ..run.files.reader import RunFiles
from ..store import atomic_write, digest, read_table, write_table
from ..version import __version__
from .context import difference_context, run_context, run_labels
from .headline import headline
from .summary import summary_html

__all__ = ["headline", "load_tables", "write_report"]

SHARE_SHOWN = 10.0  # shares beyond 1,000% are ratios to a mean near 0: the report shows n/a


def load_tables(
    run: RunFiles, refresh: bool = False, write: bool = True, progress: bool | None = False
) -> dict[str, pd.DataFrame]:
    """The statistics tables of a run, computed once and cached as CSV in the run directory (with
    `write=False`, computed in memory when the cache is missing or stale, and nothing written).
    `progress`: None shows the statistics phase (a bar, or log lines off a terminal)."""
    run.require_complete()
    names = table_names(run)
    stamp = {
        "stats": stats.TABLES_VERSION,
        "analysis": run.manifest.analysis,
        **{
            file: _signature(run.directory / file)  # a rerun measure makes its tables stale
            for kind in MEASURES.values()
            for file in kind.READS.values()
            if file.endswith(".parquet")
        },
    }
    if not refresh and _cache_is_valid(run.directory, names, json.loads(json.dumps(stamp))):
        return {name: read_table(run.directory, name) for name in names}
    with Progress(len(MEASURES) + 1, enabled=progress, unit="step", desc="statistics") as bar:
        with warnings.catch_warnings():  # a scope without data is NaN in its row, said there: no numpy noise
            warnings.filterwarnings(
                "ignore", r"Mean of empty slice|All-NaN slice|invalid value", RuntimeWarning
            )
            tables = analyse(run, step=bar.step)
    if write:
        with run_writes(run.directory, lock=False):
            _write_tables(run.directory, tables, stamp)
    return tables


def _write_tables(directory: Path, tables: dict, stamp: dict) -> None:
    """The statistics tables, each measure's stale ones removed, then the cache key (last: the tables
    above are complete)."""
    for name, table in tables.items():
        write_table(directory, name, table)
    stale = {name for kind in MEASURES.values() for name in kind.TABLES} - set(tables)
    for name in stale:  # left by an earlier run: stale now
        for ext in ("csv", "parquet"):
            (directory / f"{name}.{ext}").unlink(missing_ok=True)
    sums = {name: digest(directory / f"{name}.parquet") for name in tables}
    payload = json.dumps({"stamp": stamp, "sha256": sums}, indent=1)
    atomic_write(directory / TABLES_KEY, lambda path: path.write_text(payload))


def _signature(path: Path) -> list:
    """Size and modification time of a run's table: a rerun that rebuilt it changes them."""
    info = path.stat() if path.is_file() else None
    return [info.st_size, info.st_mtime_ns] if info else []


def _cache_is_valid(directory: Path, names, stamp: dict) -> bool:
    """Cached tables count when made by this statistics version for this analysis and attention
    table, and every file is byte for byte what was written (a report cut short by a full disk or a
    kill leaves a mismatch, and the tables are recomputed)."""
    try:
        cached = json.loads((directory / TABLES_KEY).read_text())
        return cached.get("stamp") == stamp and all(
            digest(directory / f"{name}.parquet") == cached["sha256"][name] for name in names
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _table_links(directory: Path, names: list[str], page_dir: Path) -> list[dict]:
    """The run's own tables (its artefacts()) and each non-empty statistics table, as links relative
    to the page."""
    own = [name for name in artefacts() if name.endswith((".csv", ".parquet"))]
    found = [
        name
        for name in [*own, *(f"{n}.{ext}" for n in names for ext in ("csv", "parquet"))]
        if (directory / name).is_file()
    ]
    return [{"name": name, "href": os.path.relpath(directory / name, page_dir)} for name in found]


def _check_out(path: Path) -> None:
    """--out must name a file whose folder is (or can become) a directory."""
    if path.is_dir():
        raise RunError(f"--out {path} is a directory; give a file name, e.g. {path / 'report.html'}")
    above = next((p for p in path.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise RunError(
            f"--out {path}: {above} is a file, not a directory; choose another place for the report"
        )


def share_text(value, digits: int = 0, percent: bool = True) -> str:
    """A share as a percentage, or "n/a" where it is not finite or beyond +-1,000%: a ratio to a
    mean near zero, which says nothing (the tables keep the number)."""
    try:
        ok = math.isfinite(value) and abs(value) <= SHARE_SHOWN
    except TypeError:
        ok = False
    return f"{100 * value:.{digits}f}" + ("%" if percent else "") if ok else "n/a"


def with_contents(html: str) -> str:
    """The page with an id on every section heading (h2, h3) and a table of contents linking them
    where the template marks it."""
    entries = []

    def anchor(match):
        level, text = match[1], match[2]
        entries.append((level, f"s{len(entries) + 1}", re.sub(r"<[^>]+>", "", text)))
        return f'<h{level} id="{entries[-1][1]}">{text}</h{level}>'

    html = re.sub(r"<h([23])>(.*?)</h\1>", anchor, html)
    bold = {"2": ' class="run"', "3": ""}  # a run's own heading stands out from its sections
    links = " ".join(f'<a href="#{key}"{bold[level]}>{text}</a>' for level, key, text in entries)
    return html.replace("<!-- toc -->", f'<nav class="toc" aria-label="contents">Contents: {links}</nav>', 1)


def write_report(run_dirs, out: str | Path | None = None, progress: bool | None = False) -> Path:
    """Write report.html for one run (into its directory) or a side-by-side report of several.
    `progress`: None shows the statistics and report phases (bars, or log lines off a terminal).
    Into a run directory only its declared files are written (run.files.inventory)."""
    run_dirs = [run_dirs] if isinstance(run_dirs, (str, Path)) else list(run_dirs)
    runs = [RunFiles(d) for d in run_dirs]
    if out:
        _check_out(Path(out))  # before any statistics are computed
    with ExitStack() as guards:
        for run in runs:
            guards.enter_context(run_writes(run.directory, lock=False, page=out))
        return _write_report(runs, out, progress)


def _write_report(runs: list[RunFiles], out, progress) -> Path:
    tables = [load_tables(run, progress=progress) for run in runs]
    bar = Progress(len(runs) + 1, enabled=progress, unit="part", desc="report")
    heads = [t["head_stats"][t["head_stats"]["scope"] == "all"] for t in tables if len(t["head_stats"])]
    limits = (
        {"d_z": largest_abs(pd.concat([h["d_z"] for h in heads]))} if heads else {}
    )  # one scale for all runs
    contexts = []
    for run, table in zip(runs, tables):
        contexts.append(run_context(run, table, limits))
        bar.step(f"figures of {run.directory}")
    path = (
        Path(out)
        if out
        else (runs[0].directory / "report.html" if len(runs) == 1 else Path("reports") / "compare.html")
    )
    environment = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    environment.filters["share"] = share_text
    template = environment.from_string(files(__package__).joinpath("report.html.j2").read_text())
    for context, run, table, label in zip(contexts, runs, tables, run_labels(contexts)):
        context["sections"] = [_section_html(environment, s, context) for s in context["measure_sections"]]
        context["findings"] = markupsafe.Markup(summary_html({**context["summary"], "report": None}))
        context["files"] = _table_links(
            run.directory, [name for name, t in table.items() if len(t)], path.parent
        )
        context["label"] = label
    compared = (
        difference_context(contexts, tables, path.parent / f"{path.stem}_figures") if len(runs) > 1 else None
    )
    targets = list(
        dict.fromkeys(t for table in tables for t in table["head_stats"].get("target", pd.Series(dtype=str)))
    )
    html = template.render(
        title=" vs ".join(c["label"] for c in contexts) + f" / {contexts[0]['suite']}",
        runs=contexts,
        compared=compared,
        targets=targets,
        version=__version__,
        n_boot=stats.N_BOOT,
        alpha=stats.ALPHA,
        view_js=files(__package__).joinpath("view.js").read_text(),
        tables_js=files(__package__).joinpath("tables.js").read_text(),
    )
    html = with_contents(html)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda p: p.write_text(html, encoding="utf-8"))
    for context, run in zip(contexts, runs):  # each run's key findings, pointing at this report
        payload = json.dumps({**context["summary"], "report": str(path)}, indent=1)
        atomic_write(run.directory / "summary.json", lambda p, text=payload: p.write_text(text))
    bar.step(f"written {path}")
    bar.close()
    return path


def _section_html(environment, section: dict, run: dict) -> markupsafe.Markup:
    """One measure's section, laid out by its own template (Measure.section's "template") or the
    generic one (section.html.j2)."""
    layout = section.get("template") or files(__package__).joinpath("section.html.j2")
    html = environment.from_string(layout.read_text()).render(sec=section, run=run, alpha=stats.ALPHA)
    return markupsafe.Markup(html)
