"""The notebook face: `run_suite` and `Run`, a run directory with its statistics, figures and report.

`Run` reads the run's files (attnprobe.run.files.reader) and computes statistics on first use
(attnprobe.stats), reusing the report's cached tables when they are current; reading never writes
a file. `run.report()` writes the tables, figures and report.html.
"""

from __future__ import annotations

import numbers
from html import escape
from pathlib import Path

import pandas as pd

from .. import run as run_package
from ..edits import EditOptions, run_edits
from ..errors import AnalysisError
from ..heads import HeadSet
from ..measures import table_names
from ..measures.sections import split_levels, strongest_head
from ..model import load_model
from ..report import load_tables, write_report
from ..report.comparison import compare_runs
from ..report.summary import summary, summary_html
from ..run.files.layout import same_weights
from ..run.files.merge import merge_shards as _merge_into
from ..run.files.reader import RunFiles
from ..run.options import RunOptions
from ..stats import run_analysis
from ..store import write_csv, write_parquet


class Run(RunFiles):
    """A run directory: its tables as DataFrames, statistics, figures and report."""

    @property
    def head_stats(self) -> pd.DataFrame:
        return self._tables()["head_stats"]

    @property
    def layer_stats(self) -> pd.DataFrame:
        return self._tables()["layer_stats"]

    @property
    def behavior(self) -> pd.DataFrame:
        return self._tables()["behavior"]

    @property
    def behavior_by_unit(self) -> pd.DataFrame:
        """The per-unit (e.g. per-occupation) means behind each behaviour correlation."""
        return self._tables()["behavior_by_unit"]

    @property
    def condition_means(self) -> pd.DataFrame:
        return self._tables()["condition_means"]

    @property
    def head_effects(self) -> pd.DataFrame | None:
        """Per counterfactual word and head: patching statistics (None when the run has no head effects)."""
        return self._tables().get("head_effects")

    @property
    def head_effects_layer_shares(self) -> pd.DataFrame | None:
        """Per word, layer, component (attention, mlp) and direction (in, out): share of the total effect."""
        return self._tables().get("head_effects_layer_shares")

    @property
    def head_effects_summary(self) -> pd.DataFrame | None:
        """Per word: the total effect, shares carried by all heads, their patterns, the cross-fitted set."""
        return self._tables().get("head_effects_summary")

    @property
    def referent_accuracy(self) -> pd.DataFrame:
        """Per source and head: how often the source attends more to the correct referent (empty without
        referents)."""
        return self._tables()["referent_accuracy"]

    @property
    def referent_choice_accuracy(self) -> pd.DataFrame:
        """The model's own choice in the scored continuation: accuracy, per label, pro - anti gap, margin."""
        return self._tables()["referent_choice_accuracy"]

    @property
    def edits(self) -> pd.DataFrame | None:
        """Per edit kind and k (`attnprobe edit` / `Run.edit`): the stereotype gradient before and
        after, against random heads of the same layers, definitional control and KL cost (None
        before any edit sweep)."""
        return self._edit_table("edits", "attnprobe edit")

    @property
    def circuits(self) -> pd.DataFrame | None:
        """Per comparison and circuit size (`attnprobe edit --circuits`): faithfulness held out and
        in-sample with intervals, what is left after knocking the circuit out, random circuits (None
        before a circuit search; `grain`: parts, or edges with `run.edit(circuits=True,
        circuit_grain="edges")`). The ranking is circuit_parts.csv or circuit_edges.parquet beside it."""
        return self._edit_table("circuits", "attnprobe edit --circuits")

    def _edit_table(self, name: str, command: str) -> pd.DataFrame | None:
        """The table NAME.parquet `command` writes into the run (None before it has)."""
        path = self.directory / f"{name}.parquet"
        if not path.is_file():
            return None
        return self._read(f"{name}.parquet", lambda: pd.read_parquet(path), command)

    def edit(self, options=None, model=None, also=(), **settings) -> pd.DataFrame:
        """Run the head-edit sweep on this run (`attnprobe edit`): EditOptions or its fields by name;
        `also`: other suites each chosen edit is applied to (edits_transfer)."""
        options = options or EditOptions(**settings)
        return run_edits(self.directory, options, model=model, log=lambda m: None, also=also)

    def compare(self, other) -> dict[str, pd.DataFrame]:
        """Paired statistics other - self over the same prompts (`attnprobe compare SELF OTHER`):
        {table: rows} per measure (e.g. compare_next_token: the gradient's change with its CI)."""
        return compare_runs(self, other)

    def __getattr__(self, name: str):
        """Beyond the measures' own tables (RunFiles), every statistics table of the run by its name
        (held_out, direct_attribution_shares, ...), as the report reads it. Statistics look up
        optional attributes of the run themselves: while they are computed, a missing one is missing."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_") or self.__dict__.get("_busy"):
                raise
        self.__dict__["_busy"] = True
        try:
            found = name in table_names(self) and self._tables()
        finally:
            del self.__dict__["_busy"]
        if not found:
            raise AttributeError(f"'Run' object has no attribute '{name}'")
        return found[name]

    def __dir__(self):  # the tables' names, without computing them (tab completion stays instant)
        return sorted({*super().__dir__(), *table_names(self)})

    def export(self, name: str, path) -> Path:
        """Write one of the run's statistics tables (by name, e.g. "head_stats") to `path`: Parquet
        (typed, as computed) for a .parquet name, else CSV (text a spreadsheet would run as a formula
        gets a leading ')."""
        if not isinstance(name, str) or name not in self._tables():
            raise AnalysisError(f"no table {name!r} in this run; tables: {', '.join(sorted(self._tables()))}")
        path = _export_path(path)
        (write_parquet if path.suffix == ".parquet" else write_csv)(self._tables()[name], path)
        return path

    def attention_matrix(self, prompt_id: int, layer: int, head: int, model=None) -> pd.DataFrame:
        """One head's whole attention matrix for one of the run's prompts: a row per query token and a
        column per key token ("position:token"), weights after softmax. The run stored only the rows
        its measures read, so the matrix is recomputed with the run's model (`model`, else loaded from
        the manifest's spec and dtype); the rows the run recorded are the same weights."""
        from .adhoc import model_of, recompute_attention

        for name, value in (("prompt_id", prompt_id), ("layer", layer), ("head", head)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # numpy's ints too
                raise AnalysisError(
                    f"{name} {value!r}: give a whole number (run.prompts lists the prompt ids)"
                )
        prompt_id, layer, head = int(prompt_id), int(layer), int(head)
        if self.manifest.edits:
            raise AnalysisError(
                "this run was made with saved edits applied; recompute its attention inside "
                "`with ap.edited(model, *edits):` with model.capture([text])"
            )
        prompts = self.prompts.set_index("prompt_id")
        if prompt_id not in prompts.index:
            some = ", ".join(map(str, prompts.index[:5]))
            raise AnalysisError(
                f"no prompt {prompt_id!r} in this run; its prompt ids: {some}, ... (run.prompts)"
            )
        m = self.manifest.model
        if not (0 <= layer < m.n_layers and 0 <= head < m.n_heads):
            raise AnalysisError(
                f"{HeadSet.name(layer, head)} is outside the model's {m.n_layers} layers x {m.n_heads} heads"
            )
        prompt = prompts.loc[prompt_id]
        model = load_model(m.spec, dtype=self.manifest.dtype) if model is None else model_of(model)
        same_weights(self.manifest, model, f"attention_matrix of {self.directory}", AnalysisError)
        return recompute_attention(model, prompt["text"], int(prompt["n_tokens"]), layer, head)

    def _tables(self) -> dict:
        if "_stats" not in self.__dict__:
            self.__dict__["_stats"] = load_tables(self, write=False)
        return self.__dict__["_stats"]

    def plot_heads(self, target: str | None = None, statistic: str | None = None, source: str | None = None):
        """Layer x head heatmap (all templates; a dot marks q < 0.05); a matplotlib Figure.
        `statistic`: "interaction" (r with the covariate; the default when the suite has one),
        "difference" (d_z of the paired difference) or "level" (slope per 10 covariate units of a
        measure read before the contrast, e.g. `at: before`). `source`: the query span (default
        the first one the statistic exists for)."""
        for name, value in (("target", target), ("statistic", statistic), ("source", source)):
            if value is not None and not isinstance(value, str):
                raise AnalysisError(f"{name} {value!r}: give a name (a string) or leave it out")
        heads = self.head_stats[self.head_stats["scope"] == "all"]
        statistic = statistic or ("interaction" if "interaction_r" in heads else "difference")
        choices = {
            "interaction": ("interaction_r", "interaction_q"),
            "difference": ("d_z", "difference_q"),
            "level": ("level_per10", "level_q"),
        }
        column = choices.get(statistic, ("",))[0]
        if column not in heads or heads[column].isna().all():
            have = [name for name, (c, _) in choices.items() if c in heads and heads[c].notna().any()]
            raise AnalysisError(
                f"statistic {statistic!r} is not in this run's head_stats; use {' or '.join(have)}"
            )
        value, q = choices[statistic]
        heads = heads[heads[value].notna()]
        sources = list(dict.fromkeys(heads["source"]))
        source = source or sources[0]
        if source not in sources:
            raise AnalysisError(
                f"no {statistic} for source {source!r} in this run; sources: {', '.join(sources)}"
            )
        heads = heads[heads["source"] == source]
        targets = list(dict.fromkeys(heads["target"]))
        target = target or (targets[0] if targets else None)
        if target not in targets:
            raise AnalysisError(f"no attention target {target!r} in this run; targets: {', '.join(targets)}")
        import matplotlib.pyplot as plt  # loaded where a figure is drawn, not by `attnprobe run`

        from ..plotting.plots import head_heatmap

        title = f"{source} -> {target}: {statistic}"
        figure = head_heatmap(heads, target, value, q, title=title, label=value)
        plt.close(figure)  # returned, so Jupyter shows it once (pyplot would show it again at the cell's end)
        return figure

    def attention_view(self, start: tuple[int, int] | None = None, html_action: str = "view"):
        """The report's attention view of this run's example prompts, in the notebook (offline)."""
        from .views import attention_view

        if start is None:  # the strongest head, as the report names it (report.summary)
            heads, _ = split_levels(self.head_stats)
            best = strongest_head(heads, bool(run_analysis(self).covariate))
            start = (int(best["layer"]), int(best["head"])) if best is not None else None
        return attention_view(self, start=start or (0, 0), html_action=html_action)

    def report(self) -> Path:
        """Write report.html (and the CSV tables and figures) into the run directory."""
        return write_report(self.directory)

    def _repr_html_(self) -> str:
        m = self.manifest
        return (
            f"<div><b>attnprobe run</b> {escape(m.suite.name)} on {escape(m.model.spec)}: "
            f"{m.n_prompts} prompts, {escape(m.dtype)}, <code>{escape(str(self.directory))}</code>"
            f"{summary_html(self.summary)}</div>"
        )

    @property
    def summary(self) -> dict:
        """The key findings (as summary.json holds them; `attnprobe run`'s closing table)."""
        return summary(self, self._tables())


def run_suite(suite, model=None, options: RunOptions | None = None, **settings) -> Run:
    """Run a suite (a path or a loaded Suite) on a model (a spec or a loaded ProbeModel) and return
    the Run. `options`: a RunOptions; or give its fields as keywords (out, batch_size, limit, dtype,
    resume, chunk_size, skip, ...), e.g.
    `run_suite("probes/gender.yaml", limit=200, skip=("head_effects",))`."""
    if options is not None and settings:
        raise TypeError("give either options or keyword settings, not both")
    return Run(run_package.run_suite(suite, model, options or RunOptions(**settings)))


def merge_shards(shard_dirs, out) -> Run:
    """Join the directories of a sharded run (`--shard K/N`, all N of them) into one run directory
    identical to an unsharded run with the same settings."""
    return Run(_merge_into(shard_dirs, out))


def _export_path(path) -> Path:
    """Where `Run.export` may write: a file name in an existing folder that is no run directory (the
    notebook never writes into a run: a file there could replace one of its own)."""
    if not isinstance(path, (str, Path)) or not str(path):
        raise AnalysisError(f"export to {path!r}: give a file name, e.g. 'head_stats.csv'")
    path = Path(path).expanduser()
    if path.is_dir():
        raise AnalysisError(
            f"export to {path}: it is a directory; give a file name in it, e.g. {path / 'x.csv'}"
        )
    if not path.parent.is_dir():
        raise AnalysisError(f"export to {path}: the folder {path.parent} does not exist; make it first")
    where = path.resolve().parent  # where the bytes would land, through any link on the way
    run = next((p for p in (path.parent, where, *where.parents) if (p / "manifest.json").is_file()), None)
    if run is not None:
        raise AnalysisError(
            f"export to {path}: {run} is a run directory, and the notebook never writes into one; "
            "export somewhere else"
        )
    return path
