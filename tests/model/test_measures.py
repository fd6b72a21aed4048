"""The measure contract: every registered kind goes through parse, plan (checks before weights),
compute, schema, statistics, resume and merge on a tiny model, and a kind that lacks a part fails.

Each kind names a shipped suite that declares it (`Measure.CONTRACT`: probes/<name>.yaml and a
--limit); a kind without one, or whose suite does not declare it, fails
`test_every_kind_names_a_contract_suite_that_declares_it`. Adding a kind adds nothing here.
"""

import shutil

import pandas as pd
import pytest
from conftest import EFFECT_SUITE

from attnprobe.measures import MEASURES, Measure, analyse
from attnprobe.model import load_model
from attnprobe.run import RunOptions, plan_run, run_suite
from attnprobe.run.describe import describe
from attnprobe.run.merge import merge_shards
from attnprobe.run.reader import RunFiles
from attnprobe.suite import load_suite

CONTRACT_SUITES = sorted({kind.CONTRACT[0] for kind in MEASURES.values() if kind.CONTRACT})


def _shipped(name, directory):
    """probes/ copied (suites, their data) and the suite `name` loaded from there."""
    shutil.copytree("probes", directory / "probes")
    path = directory / "probes" / f"{name}.yaml"
    suite = load_suite(path)
    assert suite.name == name  # the suite keeps its own name (not a registered kind's)
    return path, suite


def test_every_kind_names_a_contract_suite_that_declares_it(tmp_path):
    for kind in MEASURES.values():
        assert kind.CONTRACT, f"{kind.NAME}: no CONTRACT suite"
        (tmp_path / kind.NAME).mkdir()
        _, suite = _shipped(kind.CONTRACT[0], tmp_path / kind.NAME)
        assert kind.declared(suite), f"{kind.NAME}: probes/{kind.CONTRACT[0]}.yaml does not declare it"


def test_statistics_never_overwrite_a_run_file():
    """A statistics table is written into the run directory as <name>.parquet/.csv: no kind's table
    may take the name of any kind's own file (the report would overwrite what the run measured)."""
    files = {name.split(".")[0] for kind in MEASURES.values() for name in kind.ARTEFACTS}
    files |= {"prompts", "manifest"}
    for kind in MEASURES.values():
        assert not set(kind.TABLES) & files, f"{kind.NAME}: statistics table {set(kind.TABLES) & files}"


def _table(run, attribute):
    table = getattr(run, attribute)
    return table.sort_values(list(table.columns)).reset_index(drop=True)


def check_contract(kind, path, suite, pm, tmp_path, limit) -> None:
    """One kind through the whole contract (AssertionError naming the part that fails)."""
    quiet = dict(limit=limit, chunk_size=4, progress=False, log=lambda m: None)
    # plan: the kind's own checks and description, before any weights (the tokenizer only)
    plan = plan_run(suite, pm, RunOptions(out=tmp_path / "whole", **quiet))
    lines = describe(plan)
    part = plan.parts[kind.NAME]
    assert any(line.startswith(kind.NAME) for line in lines), f"{kind.NAME}: describe says nothing"
    assert all(isinstance(e, tuple) and len(e) == 3 for e in kind.estimate(suite.measures[kind.NAME], part))
    # compute and schema: every artefact written, every chunk file listed, every table read back
    whole = run_suite(suite, pm, RunOptions(out=tmp_path / "whole", **quiet))
    for name in kind.ARTEFACTS:
        assert (whole / name).exists(), f"{kind.NAME}: {name} was not written"
    for prefix, files in kind.CHUNKS.items():
        for file in files:
            assert list((whole / "chunks").glob(f"{prefix}0*.{file}")), (
                f"{kind.NAME}: no chunk {prefix}*.{file}"
            )
    run = RunFiles(whole)
    assert run.has(kind.NAME), f"{kind.NAME}: present() does not see its results"
    for attribute in kind.READS:
        table = getattr(run, attribute)
        assert isinstance(table, pd.DataFrame) and len(table), f"{kind.NAME}: {attribute} is empty"
    # statistics: exactly the tables it declares for this run
    tables = analyse(run)
    produced = kind.statistics(run, tables)
    assert set(produced) == set(kind.tables(run)) <= set(tables), f"{kind.NAME}: tables {set(produced)}"
    # manifest: its keys are recorded
    for key in kind.manifest(suite.measures[kind.NAME], part):
        assert key in run.manifest, f"{kind.NAME}: manifest lacks {key}"
    # resume: a second run recomputes no chunk and changes no table
    markers = {p.name: p.stat().st_mtime_ns for p in (whole / "chunks").glob("*.done")}
    before = {a: _table(run, a) for a in kind.READS}
    run_suite(suite, pm, RunOptions(out=whole, **quiet))
    again = RunFiles(whole)
    assert {p.name: p.stat().st_mtime_ns for p in (whole / "chunks").glob("*.done")} == markers
    for attribute, table in before.items():
        pd.testing.assert_frame_equal(_table(again, attribute), table)
    # merge: two shards joined (and run once more, as the README says) equal the whole run
    shards = [
        run_suite(suite, pm, RunOptions(out=tmp_path / "sharded", shard=(k, 2), **quiet)) for k in (1, 2)
    ]
    merged = merge_shards(shards, tmp_path / "merged")
    run_suite(suite, pm, RunOptions(out=merged, **quiet))
    for attribute, table in before.items():
        pd.testing.assert_frame_equal(_table(RunFiles(merged), attribute), table, check_dtype=False)


@pytest.fixture(scope="module")
def tiny_pm(tiny_llama_dir):
    return load_model(str(tiny_llama_dir))


@pytest.mark.parametrize("suite_name", CONTRACT_SUITES)
def test_contract(suite_name, tiny_pm, tmp_path):
    """Every kind declared by a contract suite, on that suite (one tiny-model run per kind's part)."""
    path, suite = _shipped(suite_name, tmp_path)
    limit = min(k.CONTRACT[1] for k in MEASURES.values() if k.CONTRACT and k.CONTRACT[0] == suite_name)
    for kind in (k for k in MEASURES.values() if k.declared(suite)):
        check_contract(kind, path, suite, tiny_pm, tmp_path / kind.NAME, limit)


class _Silent(Measure):
    """A kind that parses and plans but never computes what it declares."""

    NAME = "silent"
    ARTEFACTS = ("silent.parquet",)
    READS = {"silent": "silent"}
    TABLES = ("silent_stats",)

    def parse(self, ctx, doc, scope):
        return doc.get("silent")

    def describe(self, declared, part):
        return ["silent: declared"]

    def manifest(self, declared, part):
        return {}

    def compute(self, declared, part, engine):
        return None  # the broken part: silent.parquet is never written

    def merge(self, shards, out, merged):
        return None

    def statistics(self, run, tables):
        return {}


def test_a_kind_that_lacks_a_part_fails_the_contract(tiny_pm, tmp_path, monkeypatch):
    class NoStatistics(Measure):  # an abstract part missing: it cannot even be registered
        NAME = "nostats"

        def parse(self, ctx, doc, scope): ...
        def describe(self, declared, part): ...
        def manifest(self, declared, part): ...
        def compute(self, declared, part, engine): ...
        def merge(self, shards, out, merged): ...

    with pytest.raises(TypeError, match="statistics"):
        NoStatistics()
    import attnprobe.suite

    silent = _Silent()
    monkeypatch.setitem(MEASURES, "silent", silent)
    monkeypatch.setattr(attnprobe.suite, "_TOP_KEYS", attnprobe.suite._TOP_KEYS | {"silent"})
    (tmp_path / "fx.yaml").write_text(EFFECT_SUITE + "silent: {on: true}\n")
    suite = load_suite(tmp_path / "fx.yaml")
    assert silent.declared(suite)
    with pytest.raises(AssertionError, match="silent.parquet was not written"):
        check_contract(silent, tmp_path / "fx.yaml", suite, tiny_pm, tmp_path / "silent", None)
