"""The neutral registry (attnprobe.registry): built-ins registered in order, plug-ins from installed
distributions checked as they register: a clash of names or files refused in one line naming both,
a name that cannot name a file refused, a plug-in that fails (or exits) while importing skipped; a
plug-in's outputs checked before anything is written."""

import sys
import textwrap

import pandas as pd
import pytest
import torch

from attnprobe.edits.editor import replaced
from attnprobe.edits.kinds import KINDS, HeadEdit, Zero
from attnprobe.errors import AnalysisError, AttnprobeError, RegistryError
from attnprobe.measures import MEASURES, Measure, _statistics
from attnprobe.registry import Registry
from attnprobe.run.files import inventory

PLUGINS = """
from dataclasses import dataclass
from typing import ClassVar

from attnprobe.edits.kinds import HeadEdit
from attnprobe.measures import PromptsMeasure


class Named(PromptsMeasure):
    NAME = "prompt_words"
    TABLES = ("prompt_words_stats",)

    def parse(self, ctx, doc, scope):
        return None

    def describe(self, declared, part):
        return []

    def manifest(self, declared, part):
        return {}

    def count(self, declared, suite, encoded):
        return 0

    def score(self, pm, declared, suite, prompts, batch_size, advance):
        return None

    def statistics(self, run, tables):
        return None  # a plug-in's bug: statistics must be {table: DataFrame}


class LikeAttention(Named):
    NAME = "attention"


class LikeBehavior(Named):
    NAME = "behavior"  # its own file behavior.parquet beside next_token's statistics table behavior.csv


class LikeHeadStats(Named):
    NAME = "mine"
    TABLES = ("head_stats",)


class LikeEdits(Named):
    NAME = "mine_too"
    TABLES = ("edits_goal",)


class OutOfTree(Named):
    NAME = "../x"


@dataclass(frozen=True)
class Broadcast(HeadEdit):
    kind: ClassVar[str] = "broadcast"

    def replacement(self, layer, z):
        return z[:1]  # one row's output for every row of the batch


@dataclass(frozen=True)
class LikeStream(HeadEdit):
    kind: ClassVar[str] = "stream"

    def replacement(self, layer, z):
        return z
"""


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """install(entry points text) puts a distribution `outside_plugins` holding PLUGINS (and a module
    that calls exit() on import) on the path, as pip would."""
    site = tmp_path / "site"
    (site / "outside_plugins-0.1.dist-info").mkdir(parents=True)
    (site / "outside_plugins.py").write_text(PLUGINS)
    (site / "exits_on_import.py").write_text("exit()\n")
    (site / "outside_plugins-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: outside-plugins\nVersion: 0.1\n"
    )
    monkeypatch.syspath_prepend(str(site))

    def install(entry_points: str):
        (site / "outside_plugins-0.1.dist-info" / "entry_points.txt").write_text(
            textwrap.dedent(entry_points)
        )

    yield install
    sys.modules.pop("outside_plugins", None)


def _measures() -> Registry:
    """A registry like MEASURES: the built-ins, in order, and the plug-ins of the group `test.measures`."""
    from attnprobe.measures import _clash

    fresh = Registry("test.measures", Measure, "NAME", lambda kind: kind(), _clash)
    for kind in dict.values(MEASURES):
        fresh.register(kind)
    return fresh


@pytest.mark.parametrize(
    "plugin, phrases",
    [
        ("LikeAttention", ["is named 'attention' like attnprobe.measures.attention.Attention", "rename one"]),
        ("LikeBehavior", ["writes behavior.csv, as the measure next_token (attnprobe.measures.next_token)"]),
        ("LikeHeadStats", ["writes head_stats.csv, as the measure attention"]),
        ("OutOfTree", ["is named '../x'", "lower-case letters, digits and _"]),
    ],
)
def test_a_plugin_measure_that_clashes_is_refused_in_one_line_naming_both(installed, plugin, phrases):
    installed(f"[test.measures]\nfine = outside_plugins:Named\nbad = outside_plugins:{plugin}\n")
    with pytest.raises(RegistryError) as refused:
        list(_measures())
    message = str(refused.value)
    assert "\n" not in message and f"the plug-in bad (outside_plugins:{plugin})" in message
    assert all(p in message for p in phrases), message


def test_a_plugin_measure_writing_a_file_of_the_run_or_an_edit_is_refused(installed, monkeypatch):
    installed("[test.measures]\nbad = outside_plugins:LikeEdits\n")
    monkeypatch.setattr(inventory, "MEASURES", _measures())
    with pytest.raises(
        RegistryError, match=r"measure mine_too \(outside_plugins\) writes edits_goal\.csv, which "
    ):
        inventory.declared()


def test_a_plugin_that_exits_or_fails_on_import_is_skipped_and_the_rest_load(installed, capsys):
    installed(
        "[test.measures]\nexits = exits_on_import:X\nmissing = outside_plugins:NoSuchThing\n"
        "fine = outside_plugins:Named\n"
    )
    loaded = _measures()
    assert list(loaded)[-1] == "prompt_words" and list(loaded)[:-1] == list(MEASURES)
    skipped = capsys.readouterr().err.splitlines()
    assert [line.split(" is skipped: ")[1].split(":")[0] for line in skipped] == [
        "SystemExit",
        "AttributeError",
    ]


def test_a_builtin_registered_twice_is_refused():
    kinds = Registry("test.kinds", HeadEdit, "kind")
    kinds.register(Zero)
    with pytest.raises(RegistryError, match="is named 'zero' like attnprobe.edits.kinds.Zero"):
        kinds.register(Zero)


def test_an_edit_kind_named_as_the_sweeps_own_rows_is_refused(installed):
    from attnprobe.edits.kinds import SWEEP_NAMES

    kinds = Registry("test.kinds", HeadEdit, "kind", clash=KINDS.clash)
    installed("[test.kinds]\nbad = outside_plugins:LikeStream\n")
    with pytest.raises(RegistryError, match="is named 'stream', a name the edit sweep's own rows carry"):
        list(kinds)
    assert "stream" in SWEEP_NAMES


def test_a_plugin_measure_returning_none_is_one_line_before_anything_is_written(installed):
    installed("[test.measures]\nfine = outside_plugins:Named\n")
    kind = _measures()["prompt_words"]
    with pytest.raises(
        AnalysisError, match=r"measure prompt_words \(outside_plugins\) statistics gave NoneType"
    ):
        _statistics(kind, run=None, tables={})
    kind.statistics = lambda run, tables: {"head_stats": pd.DataFrame()}
    with pytest.raises(AnalysisError, match="gave 'head_stats', not in its TABLES"):
        _statistics(kind, run=None, tables={})


def test_an_edit_kind_whose_output_broadcasts_is_refused(installed):
    installed("[test.kinds]\nb = outside_plugins:Broadcast\n")
    kinds = Registry("test.kinds", HeadEdit, "kind")
    z = torch.randn(3, 2, 4, 8)  # (B, H, T, D)
    with pytest.raises(
        AttnprobeError, match=r"'broadcast' .* with \(1, 2, 4, 8\), not their shape \(3, 2, 4, 8\)"
    ):
        replaced(kinds["broadcast"](), 0, z)
    assert torch.equal(replaced(Zero(), 0, z), torch.zeros_like(z))
