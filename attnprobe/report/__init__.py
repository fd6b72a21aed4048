"""The report of one or more runs: CSV tables, figures (PNG and SVG) and one self-contained HTML file.

`write_report(run_dir)` writes head_stats.csv, layer_stats.csv, behavior.csv,
behavior_by_occupation.csv, condition_means.csv and figures/ into the run directory, and report.html beside them.
With several run directories the HTML puts the models side by side (written to `out`).
Numbers come from `attnprobe.stats`; this package only lays them out.
"""

from __future__ import annotations

import base64
import io
from importlib.resources import files
from pathlib import Path

import jinja2
import matplotlib.pyplot as plt
import pandas as pd

from .. import stats
from ..run.reader import RunFiles
from ..run.storage import HEAD_EFFECT_TABLES, STATS_TABLES, atomic_write
from ..tables import write_csv
from ..version import __version__
from . import plots


def load_tables(run: RunFiles, refresh: bool = False, write: bool = True) -> dict[str, pd.DataFrame]:
    """The statistics tables of a run, computed once and cached as CSV in the run directory (with
    `write=False`, computed in memory when the cache is missing or stale, and nothing written)."""
    names = STATS_TABLES + (HEAD_EFFECT_TABLES if run.has_head_effects else ())
    paths = {name: run.directory / f"{name}.csv" for name in names}
    fresh = all(p.is_file() and p.stat().st_mtime >= (run.directory / "attention.parquet").stat().st_mtime for p in paths.values())
    if fresh and not refresh:
        return {name: pd.read_csv(path, keep_default_na=False, na_values=[""]) for name, path in paths.items()}
    tables = stats.analyse(run)
    if write:
        for name, table in tables.items():
            atomic_write(paths[name], lambda path, table=table: write_csv(table, path))
    return tables


def _figure(fig, directory: Path, name: str, alt: str) -> dict:
    """Save as PNG and SVG under figures/, return the PNG inline for the HTML."""
    directory.mkdir(exist_ok=True)
    fig.savefig(directory / f"{name}.svg")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    (directory / f"{name}.png").write_bytes(buffer.getvalue())
    plt.close(fig)
    return {"png": base64.b64encode(buffer.getvalue()).decode(), "alt": alt}


def headline(run: RunFiles, tables: dict) -> str:
    """One sentence with the run's main numbers."""
    manifest = run.manifest
    parts = []
    behavior = tables["behavior"]
    if len(behavior):
        b = behavior[behavior["scope"] == "all"].iloc[0]
        parts.append(f"Across {int(b['n'])} occupations, {manifest['model']['spec']}'s log p(she) - log p(he) before the pronoun "
                     f"{'rises' if b['pearson_r'] > 0 else 'falls'} with the BLS share of women (Pearson r = {b['pearson_r']:.2f}, "
                     f"95% CI [{b['pearson_ci_low']:.2f}, {b['pearson_ci_high']:.2f}])")
    heads = tables["head_stats"]
    for target, group in heads.groupby("target", sort=False):
        significant = group[group["q"] < 0.05]
        if len(significant):
            top = significant.loc[significant["d_z"].abs().idxmax()]
            parts.append(f"{len(significant)} of {len(group)} heads attend differently from she and he to the {target} "
                         f"(q < 0.05), most strongly L{int(top['layer'])}H{int(top['head'])} (d_z = {top['d_z']:.2f}, "
                         f"q = {top['q']:.4f}, r with BLS = {top['bls_pearson_r']:.2f})")
        else:
            parts.append(f"no head attends differently from she and he to the {target} at q < 0.05")
    return "; ".join(parts) + "." if parts else "No paired items in this run."


def _run_context(run: RunFiles, tables: dict) -> dict:
    import json

    manifest = run.manifest
    heads = tables["head_stats"]
    figures_dir = run.directory / "figures"
    heatmaps = [_figure(plots.head_heatmap(heads, target), figures_dir, f"heads_{target}", f"layer x head d_z, pronoun -> {target}")
                for target in heads["target"].unique()]
    behavior_figures = []
    by_occupation = tables["behavior_by_occupation"]
    if len(by_occupation) and "occupation" in by_occupation and by_occupation["bls_pct_female"].notna().any():
        behavior_figures = [
            _figure(plots.behavior_scatter(tables["behavior_by_occupation"], tables["behavior"]), figures_dir, "behavior_vs_bls",
                    "per-occupation log p(she)/p(he) against BLS percent female"),
            _figure(plots.template_breakdown(tables["behavior"]), figures_dir, "behavior_by_template", "behaviour r by template"),
        ]
    significant = heads[heads["q"] < 0.05]
    ranked = significant.reindex(significant["d_z"].abs().sort_values(ascending=False).index)
    top = ranked.head(12)
    strongest = top.iloc[0] if len(top) else None
    b = tables["behavior"]
    overall = b[b["scope"] == "all"].iloc[0] if len(b) else None
    examples = json.loads((run.directory / "examples.json").read_text()) if (run.directory / "examples.json").is_file() else []
    templates = run.prompts.drop_duplicates("template_id")[["template_id"]].rename(columns={"template_id": "id"})
    texts = manifest["suite"].get("templates", {})  # recorded by the run: the suite file is not re-read
    effects = _effects_context(tables, heads, figures_dir, manifest)
    return {
        "effects": effects,
        "model": manifest["model"]["spec"], "suite": manifest["suite"]["name"], "family": manifest["model"]["family"],
        "description": manifest["suite"].get("description", ""), "n_prompts": manifest["n_prompts"],
        "n_items": int(run.prompts["item_id"].nunique()), "n_layers": manifest["model"]["n_layers"],
        "n_heads_per_layer": manifest["model"]["n_heads"], "n_heads": manifest["model"]["n_layers"] * manifest["model"]["n_heads"],
        "dtype": manifest["dtype"], "suite_sha": manifest["suite"]["sha256"], "finished": manifest.get("finished", ""),
        "headline": headline(run, tables), "heatmaps": heatmaps, "behavior_figures": behavior_figures,
        "top_heads": top.to_dict("records"), "behavior": b.to_dict("records"),
        "behavior_r": overall["pearson_r"] if overall is not None else float("nan"),
        "behavior_ci": (overall["pearson_ci_low"], overall["pearson_ci_high"]) if overall is not None else (float("nan"),) * 2,
        "n_significant": significant.groupby("target").size().to_dict(),
        "strongest": f"L{int(strongest['layer'])}H{int(strongest['head'])} -> {strongest['target']}, d_z = {strongest['d_z']:.2f}" if strongest is not None else "-",
        "view_start": f"{int(strongest['layer'])},{int(strongest['head'])}" if strongest is not None else "0,0",
        "examples": examples, "skipped": manifest.get("skipped", []),
        "templates": [{"id": t, "text": texts.get(t, "")} for t in templates["id"]],
    }


def _effects_context(tables: dict, heads: pd.DataFrame, figures_dir: Path, manifest: dict) -> dict | None:
    """The "heads that carry the bias" section, when the run has head interventions."""
    if "head_effects" not in tables:
        return None
    effects, summary = tables["head_effects"], tables["head_effects_summary"].iloc[0]
    figures = [_figure(plots.head_heatmap(effects.assign(target="effect"), "effect", value="mean_ie",
                                          title="indirect effect (pattern swap), heads with q < 0.05",
                                          label="change of log p(she) - log p(he)"),
                       figures_dir, "head_effects", "layer x head mean indirect effect")]
    if "occupation" in set(heads["target"]):
        figures.append(_figure(plots.head_heatmap(heads, "occupation"), figures_dir, "heads_occupation_beside_effects",
                               "attention bias, pronoun -> occupation"))
    top = effects.reindex(effects["mean_ie"].abs().sort_values(ascending=False).index).head(int(summary["top_k"]))
    info = manifest.get("head_effects", {})
    return {"summary": summary.to_dict(), "figures": figures, "top": top.to_dict("records"),
            "counterfactual": info.get("counterfactual", {}), "seconds": info.get("seconds"), "dropped": info.get("dropped", [])}


def write_report(run_dirs, out: str | Path | None = None) -> Path:
    """Write report.html for one run (into its directory) or a side-by-side report of several."""
    run_dirs = [run_dirs] if isinstance(run_dirs, (str, Path)) else list(run_dirs)
    runs = [RunFiles(d) for d in run_dirs]
    contexts = [_run_context(run, load_tables(run)) for run in runs]
    environment = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    template = environment.from_string(files(__package__).joinpath("report.html.j2").read_text())
    targets = sorted({t for c in contexts for t in c["n_significant"]} | {t for run in runs for t in load_tables(run)["head_stats"]["target"].unique()})
    html = template.render(
        title=" vs ".join(c["model"] for c in contexts) + f" / {contexts[0]['suite']}",
        runs=contexts, targets=targets, version=__version__, n_boot=stats.N_BOOT, n_perm=stats.N_PERM,
        cluster="occupation", view_js=files(__package__).joinpath("view.js").read_text(),
    )
    path = Path(out) if out else (runs[0].directory / "report.html" if len(runs) == 1 else Path("reports") / "compare.html")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html, encoding="utf-8")
    return path
