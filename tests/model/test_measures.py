"""The measure contract: every registered kind goes through parse, plan (checks before weights),
compute, schema, statistics, resume and merge on a tiny model, and a kind that lacks a part fails.

Each kind names a shipped suite that declares it (`Measure.CONTRACT`: probes/<name>.yaml and a
--limit); a kind without one, or whose suite does not declare it, fails
`test_every_kind_names_a_contract_suite_that_declares_it`. Adding a kind adds nothing here.
"""

import shutil

import pytest
from conftest import EFFECT_SUITE

from attnprobe.measures import MEASURES, Measure, NextToken
from attnprobe.model import load_model
from attnprobe.suite import load_suite
from attnprobe.testing import check_measure
from attnprobe.testing.measures import CHECKS, contract_runs

CASES = [(kind.NAME, check) for kind in MEASURES.values() for check in CHECKS]  # one test each


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


@pytest.fixture(scope="module")
def tiny_pm(tiny_llama_dir):
    return load_model(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def contract(tiny_pm, tmp_path_factory):
    """The contract runs of a suite (contract_runs), made once per suite in this process."""
    made = {}

    def runs(suite_name):
        if suite_name not in made:
            directory = tmp_path_factory.mktemp(f"contract-{suite_name}")
            _, suite = _shipped(suite_name, directory)
            limit = min(
                k.CONTRACT[1] for k in MEASURES.values() if k.CONTRACT and k.CONTRACT[0] == suite_name
            )
            made[suite_name] = contract_runs(suite, tiny_pm, directory, limit)
        return made[suite_name]

    return runs


@pytest.mark.parametrize("name, check", CASES, ids=[f"{name}-{check}" for name, check in CASES])
def test_contract(name, check, contract):
    """Every registered kind through every check of the contract, on its CONTRACT suite (the runs
    shared by the kinds of a suite): one test per kind and check."""
    kind = MEASURES[name]
    runs = contract(kind.CONTRACT[0])
    assert kind.declared(runs.suite)
    CHECKS[check](kind, runs)


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

    silent = _Silent()
    monkeypatch.setitem(MEASURES, "silent", silent)
    (tmp_path / "fx.yaml").write_text(EFFECT_SUITE + "silent: {on: true}\n")
    suite = load_suite(tmp_path / "fx.yaml")
    assert silent.declared(suite)
    with pytest.raises(AssertionError, match="silent.parquet was not written"):
        check_measure(silent, suite, tiny_pm, tmp_path / "silent")


class _SectionRaises(NextToken):
    def section(self, run, tables, figures_dir):
        raise KeyError("figure")  # breaks `attnprobe report`


class _PairedRaises(NextToken):
    def paired(self, a, b, scopes):
        raise ValueError("no pairs")  # breaks `attnprobe compare`


class _WrongPromptIds(NextToken):
    def read(self, pm, declared, part, batch, captured, positions):
        table = super().read(pm, declared, part, batch, captured, positions)
        return table.assign(prompt_id=table["prompt_id"] + 10**6)


@pytest.mark.parametrize(
    "planted, message",
    [
        (_SectionRaises, r"next_token: section\(\) raised KeyError"),
        (_PairedRaises, r"next_token: paired\(\) raised ValueError: no pairs"),
        (_WrongPromptIds, r"next_token: logprobs has prompt ids the run does not have: \[100\d{4}"),
    ],
)
def test_the_public_contract_catches_a_planted_fault(planted, message, tiny_pm, tmp_path, monkeypatch):
    """attnprobe.testing.check_measure catches what the round-4 contract let pass: a section() or
    paired() that raises (report and compare fail) and rows of prompts the run does not have."""
    monkeypatch.setitem(MEASURES, "next_token", planted())
    name, limit = NextToken.CONTRACT
    _, suite = _shipped(name, tmp_path)
    with pytest.raises(AssertionError, match=message):
        check_measure(MEASURES["next_token"], suite, tiny_pm, tmp_path / "planted", limit)
