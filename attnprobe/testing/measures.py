"""check_measure: one measure kind through the whole contract on a tiny model."""

from __future__ import annotations

from pathlib import Path

import pandas as pd


def check_measure(kind, suite, model, directory, limit: int | None = None) -> None:
    """Run `kind` (a registered Measure) on `suite` (a Suite declaring it) with `model` (a loaded
    tiny ProbeModel) in `directory`, checking every part the command line calls; AssertionError
    naming the part that fails."""
    check_measures([kind], suite, model, directory, limit)


def check_measures(kinds, suite, model, directory, limit: int | None = None) -> None:
    """check_measure for several kinds the suite declares, sharing its runs: a run measures every
    kind the suite declares, so each run (whole, resumed, two shards, merged) is made once and every
    kind's part of it checked."""
    from ..measures import analyse
    from ..run import RunOptions, plan_run, run_suite
    from ..run.describe import describe
    from ..run.files.reader import RunFiles

    directory = Path(directory)
    quiet = dict(limit=limit, chunk_size=4, progress=False, log=lambda m: None)
    # plan: each kind's own checks and description, before any weights (the tokenizer only)
    plan = plan_run(suite, model, RunOptions(out=directory / "whole", **quiet))
    lines = describe(plan)
    for kind in kinds:
        part = plan.parts[kind.NAME]
        assert any(line.startswith(kind.NAME) for line in lines), f"{kind.NAME}: describe says nothing"
        estimates = kind.estimate(suite.measures[kind.NAME], part)
        assert all(isinstance(e, tuple) and len(e) == 3 for e in estimates), f"{kind.NAME}: estimate()"
    whole = run_suite(suite, model, RunOptions(out=directory / "whole", **quiet))
    run = RunFiles(whole)
    for kind in kinds:
        _written(kind, run)
    # statistics: exactly the tables each kind declares for this run; its manifest keys recorded
    tables = analyse(run)
    for kind in kinds:
        produced = _called(kind, "statistics", run, tables)
        assert set(produced) == set(kind.tables(run)) <= set(tables), f"{kind.NAME}: tables {set(produced)}"
        for key in kind.manifest(suite.measures[kind.NAME], plan.parts[kind.NAME]):
            assert key in run.manifest.entries, f"{kind.NAME}: manifest lacks {key}"
        _report_and_compare(kind, run, tables, directory)
    _resume_and_merge(kinds, suite, model, whole, directory, quiet)


def _called(kind, method: str, *args):
    """kind.method(*args), a raise named as the contract's failure."""
    try:
        return getattr(kind, method)(*args)
    except Exception as exc:
        raise AssertionError(f"{kind.NAME}: {method}() raised {type(exc).__name__}: {exc}") from exc


def _written(kind, run) -> None:
    """Every artefact and chunk file written, every table it reads back non-empty and of the run's
    prompts (prompt ids among prompts.parquet's); `run`: the RunFiles of the whole run."""
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


def _report_and_compare(kind, run, tables: dict, directory: Path) -> None:
    """`attnprobe report` (its section) and `attnprobe compare` (its pairing of a run with itself)."""
    from ..measures import comparison_scopes

    section = _called(kind, "section", run, tables, directory / "figures")
    assert section is None or isinstance(section, dict), f"{kind.NAME}: section() gave {type(section)}"
    paired = _called(kind, "paired", run, run, comparison_scopes(run, run))
    assert isinstance(paired, dict) and all(isinstance(t, pd.DataFrame) for t in paired.values()), (
        f"{kind.NAME}: paired() must give {{table: DataFrame}}"
    )


def _table(run, attribute):
    table = getattr(run, attribute)
    return table.sort_values(list(table.columns)).reset_index(drop=True)


def _resume_and_merge(kinds, suite, model, whole: Path, directory: Path, quiet: dict) -> None:
    """A second run recomputes no chunk and changes no table; two shards joined (and run once more)
    equal the whole run."""
    from ..run import RunOptions, run_suite
    from ..run.files.merge import merge_shards
    from ..run.files.reader import RunFiles

    run = RunFiles(whole)
    markers = {p.name: p.stat().st_mtime_ns for p in (whole / "chunks").glob("*.done")}
    before = {(kind.NAME, a): _table(run, a) for kind in kinds for a in kind.READS}
    run_suite(suite, model, RunOptions(out=whole, **quiet))
    recomputed = {p.name: p.stat().st_mtime_ns for p in (whole / "chunks").glob("*.done")} != markers
    assert not recomputed, f"{'/'.join(k.NAME for k in kinds)}: a resumed run recomputed chunks"
    for (name, attribute), table in before.items():
        pd.testing.assert_frame_equal(_table(RunFiles(whole), attribute), table, obj=f"{name} resumed")
    shards = [
        run_suite(suite, model, RunOptions(out=directory / "sharded", shard=(k, 2), **quiet)) for k in (1, 2)
    ]
    merged = merge_shards(shards, directory / "merged")
    run_suite(suite, model, RunOptions(out=merged, **quiet))
    for (name, attribute), table in before.items():
        pd.testing.assert_frame_equal(
            _table(RunFiles(merged), attribute), table, check_dtype=False, obj=f"{name} merged"
        )
