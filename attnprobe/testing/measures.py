"""check_measure: one measure kind through the whole contract on a tiny model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd


def check_measure(kind, suite, model, directory, limit: int | None = None) -> None:
    """Run `kind` (a registered Measure) on `suite` (a Suite declaring it) with `model` (a loaded
    tiny ProbeModel) in `directory`, checking every part the command line calls; AssertionError
    naming the part that fails."""
    check_measures([kind], suite, model, directory, limit)


def check_measures(kinds, suite, model, directory, limit: int | None = None) -> None:
    """check_measure for several kinds the suite declares, sharing its runs (contract_runs): every
    check of CHECKS for every kind."""
    runs = contract_runs(suite, model, directory, limit)
    for kind in kinds:
        for check in CHECKS.values():
            check(kind, runs)


@dataclass
class ContractRuns:
    """The runs a contract checks, made once for every kind a suite declares: its plan and description,
    the whole run with its statistics, what its tables were before a second run over it, and the
    run of two shards merged."""

    suite: object
    plan: object
    described: list[str]
    run: object  # RunFiles of the whole run
    tables: dict  # analyse(run)
    before: dict  # (kind name, READS attribute) -> the table, sorted
    recomputed: bool  # the second run recomputed a chunk
    resumed: Path  # the whole run after the second run over it
    merged: Path
    figures: object  # plotting.Figures under the whole run


def contract_runs(suite, model, directory, limit: int | None = None) -> ContractRuns:
    """Plan (each kind's checks before weights), run, second run over the same directory, two shards
    merged and run once more: the runs every check of CHECKS reads."""
    from ..measures import MEASURES, analyse
    from ..plotting import Figures
    from ..run import RunOptions, plan_run, run_suite
    from ..run.describe import describe
    from ..run.files.merge import merge_shards
    from ..run.files.reader import RunFiles

    directory = Path(directory)
    quiet = dict(limit=limit, chunk_size=4, progress=False, log=lambda m: None)
    plan = plan_run(suite, model, RunOptions(out=directory / "whole", **quiet))
    whole = run_suite(suite, model, RunOptions(out=directory / "whole", **quiet))
    run = RunFiles(whole)
    tables = analyse(run)
    declared = [kind for kind in MEASURES.values() if kind.declared(suite)]
    before = {(k.NAME, a): _table(run, a) for k in declared if run.has(k.NAME) for a in k.READS}
    markers = {p.name: p.stat().st_mtime_ns for p in (whole / "chunks").glob("*.done")}
    run_suite(suite, model, RunOptions(out=whole, **quiet))
    recomputed = {p.name: p.stat().st_mtime_ns for p in (whole / "chunks").glob("*.done")} != markers
    shards = [
        run_suite(suite, model, RunOptions(out=directory / "sharded", shard=(k, 2), **quiet)) for k in (1, 2)
    ]
    merged = merge_shards(shards, directory / "merged")
    run_suite(suite, model, RunOptions(out=merged, **quiet))
    return ContractRuns(
        suite,
        plan,
        describe(plan),
        run,
        tables,
        before,
        recomputed,
        whole,
        merged,
        Figures(directory / "figures"),
    )


def _described(kind, runs: ContractRuns) -> None:
    """Its checks before weights (plan) gave a part, a line of `describe` and well-formed estimates."""
    part = runs.plan.parts[kind.NAME]
    assert any(line.startswith(kind.NAME) for line in runs.described), f"{kind.NAME}: describe says nothing"
    estimates = kind.estimate(runs.suite.measures[kind.NAME], part)
    assert all(isinstance(e, tuple) and len(e) == 3 for e in estimates), f"{kind.NAME}: estimate()"


def _statistics(kind, runs: ContractRuns) -> None:
    """Exactly the tables it declares for this run, and its manifest keys recorded."""
    produced = _called(kind, "statistics", runs.run, runs.tables)
    assert set(produced) == set(kind.tables(runs.run)) <= set(runs.tables), (
        f"{kind.NAME}: tables {set(produced)}"
    )
    for key in kind.manifest(runs.suite.measures[kind.NAME], runs.plan.parts[kind.NAME]):
        assert key in runs.run.manifest.entries, f"{kind.NAME}: manifest lacks {key}"


def _called(kind, method: str, *args):
    """kind.method(*args), a raise named as the contract's failure."""
    try:
        return getattr(kind, method)(*args)
    except Exception as exc:
        raise AssertionError(f"{kind.NAME}: {method}() raised {type(exc).__name__}: {exc}") from exc


def _written(kind, runs: ContractRuns) -> None:
    """Every artefact and chunk file written, every table it reads back non-empty and of the run's
    prompts (prompt ids among prompts.parquet's)."""
    run = runs.run
    whole = run.directory
    for name in kind.ARTEFACTS:
        assert (whole / name).exists(), f"{kind.NAME}: {name} was not written"
    for prefix, files in kind.CHUNKS.items():
        for file in files:
            assert list((whole / "chunks").glob(f"{prefix}0*.{file}")), (
                f"{kind.NAME}: no chunk {prefix}*.{file}"
            )
    assert run.has(kind.NAME), f"{kind.NAME}: present() does not see its results"
    ids = set(run.prompts["prompt_id"])
    for attribute in kind.READS:
        table = getattr(run, attribute)
        assert isinstance(table, pd.DataFrame) and len(table), f"{kind.NAME}: {attribute} is empty"
        if "prompt_id" in table:
            stray = set(table["prompt_id"]) - ids
            assert not stray, (
                f"{kind.NAME}: {attribute} has prompt ids the run does not have: {sorted(stray)[:5]}"
            )


def _section(kind, runs: ContractRuns) -> None:
    """`attnprobe report`: its section, a dict or None."""
    section = _called(kind, "section", runs.run, runs.tables, runs.figures)
    assert section is None or isinstance(section, dict), f"{kind.NAME}: section() gave {type(section)}"


def _paired(kind, runs: ContractRuns) -> None:
    """`attnprobe compare`: its pairing of the run with itself, {table: DataFrame}."""
    from ..measures import comparison_scopes

    paired = _called(kind, "paired", runs.run, runs.run, comparison_scopes(runs.run, runs.run))
    assert isinstance(paired, dict) and all(isinstance(t, pd.DataFrame) for t in paired.values()), (
        f"{kind.NAME}: paired() must give {{table: DataFrame}}"
    )


def _table(run, attribute):
    table = getattr(run, attribute)
    return table.sort_values(list(table.columns)).reset_index(drop=True)


def _resumed(kind, runs: ContractRuns) -> None:
    """A second run over the finished run recomputes no chunk and changes none of its tables."""
    from ..run.files.reader import RunFiles

    assert not runs.recomputed, f"{kind.NAME}: a resumed run recomputed chunks"
    for attribute in kind.READS:
        table = _before(kind, runs, attribute)
        pd.testing.assert_frame_equal(
            _table(RunFiles(runs.resumed), attribute), table, obj=f"{kind.NAME} resumed"
        )


def _before(kind, runs: ContractRuns, attribute: str) -> pd.DataFrame:
    assert (kind.NAME, attribute) in runs.before, f"{kind.NAME}: the whole run has no {attribute}"
    return runs.before[(kind.NAME, attribute)]


def _merged(kind, runs: ContractRuns) -> None:
    """Two shards joined (and run once more) equal the whole run."""
    from ..run.files.reader import RunFiles

    for attribute in kind.READS:
        table = _before(kind, runs, attribute)
        pd.testing.assert_frame_equal(
            _table(RunFiles(runs.merged), attribute), table, check_dtype=False, obj=f"{kind.NAME} merged"
        )


# The contract, one named check each (tests/model/test_measures.py makes one test per kind and check)
CHECKS = {
    "described": _described,
    "written": _written,
    "statistics": _statistics,
    "section": _section,
    "paired": _paired,
    "resumed": _resumed,
    "merged": _merged,
}
