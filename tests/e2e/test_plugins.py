"""Other packages register a measure, an edit kind and a site mode through entry points
(attnprobe.measures, attnprobe.edit_kinds, attnprobe.site_modes): a tiny outside package, installed
as a distribution on the path, is used from a suite, from `attnprobe edit --kinds` and `--mlp-modes`,
end to end through the real command line."""

import textwrap
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from conftest import edit_suite, forked_cli

ROOT = Path(__file__).resolve().parents[2]
# the example docs/extending.md shows, and a kind that fails when it runs
PLUGIN = (
    (ROOT / "docs" / "examples" / "outside_probe.py").read_text()
    + """

@dataclass(frozen=True)
class Explode(HeadEdit):
    kind: ClassVar[str] = "explode"

    def replacement(self, layer, z):
        raise RuntimeError("boom")
"""
)
ENTRY_POINTS = """
[attnprobe.measures]
prompt_length = outside_probe:PromptLength
broken = outside_probe:NoSuchThing

[attnprobe.edit_kinds]
negate = outside_probe:Negate
explode = outside_probe:Explode

[attnprobe.site_modes]
mean_gap = outside_probe:MeanGap
"""


@pytest.mark.slow  # three attnprobe commands, each in a process of its own
def test_an_outside_package_registers_a_measure_an_edit_kind_and_a_site_mode(tiny_llama_dir, tmp_path):
    site = tmp_path / "site"
    (site / "outside_probe-0.1.dist-info").mkdir(parents=True)
    (site / "outside_probe.py").write_text(PLUGIN)
    (site / "outside_probe-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: outside-probe\nVersion: 0.1\n"
    )
    (site / "outside_probe-0.1.dist-info" / "entry_points.txt").write_text(textwrap.dedent(ENTRY_POINTS))
    suite = edit_suite(tmp_path)
    suite.write_text(suite.read_text() + "prompt_length: {}\n")
    run = tmp_path / "run"

    def attnprobe(*args):  # the CLI in a process of its own (forked), the plug-in first on its path
        log = tmp_path / f"{args[0]}-{len(list(tmp_path.glob('*.log')))}.log"
        process = forked_cli(args, log, path=[site])
        process.join()
        return SimpleNamespace(returncode=process.exitcode, stderr=log.read_text())

    sweep = ["--k", "1", "--draws", "2", "--texts", "8", "--alone", "0"]
    made = attnprobe("run", str(suite), "--model", str(tiny_llama_dir), "--out", str(run))
    assert made.returncode == 0, made.stderr[-3000:]
    skipped = [line for line in made.stderr.splitlines() if "plug-in broken" in line]
    assert len(skipped) == 1 and "is skipped: AttributeError" in skipped[0]
    lengths = pd.read_parquet(run / "prompt_length.parquet")
    assert sorted(lengths["prompt_id"]) == sorted(pd.read_parquet(run / "prompts.parquet")["prompt_id"])
    assert (run / "prompt_length_stats.csv").is_file()
    several = ["--mlp-layer-modes", "mean_gap"]  # over several layers (each on the model edited below it)
    edited = attnprobe(
        "edit", str(run), "--kinds", "negate,zero", "--mlp-modes", "mean_gap,leace", *several, *sweep
    )
    assert edited.returncode == 0, edited.stderr[-3000:]
    table = pd.read_csv(run / "edits.csv")
    assert set(table["kind"]) == {"negate", "zero"} and table["gradient_after"].notna().all()
    assert (run / "edits" / "negate-k1.json").is_file()  # saved, as a built-in kind's edit
    layers = pd.read_csv(run / "edits_mlp.csv")
    windows = layers["kind"].str.startswith("mlp-layers-mean_gap")
    # the windows of 1 and 2 layers, and the chosen one
    assert windows.sum() == 2 + 1 and layers.loc[windows, "gradient_after"].notna().all()
    assert list((run / "edits").glob("mlp-layers-mean_gap*.json"))
    layers = layers[~windows]
    modes = set(layers["kind"].str.replace("-chosen", "").str.replace("-slot", ""))  # a row per layer, chosen
    gap = layers[layers["kind"].str.startswith("mlp-mean_gap")]
    assert (
        modes == {"mlp-mean_gap", "mlp-leace"} and len(gap) == 2 * 3 and gap["gradient_after"].notna().all()
    )
    assert (run / "edits" / "mlp-mean_gap.json").is_file()  # saved, as a built-in mode's edit
    # a plug-in's kind that fails at run time: one line naming it, no traceback
    failed = attnprobe("edit", str(run), "--kinds", "explode", *sweep)
    lines = [line for line in failed.stderr.splitlines() if line.startswith("attnprobe: error:")]
    assert failed.returncode == 2 and "Traceback" not in failed.stderr
    assert lines == [failed.stderr.strip().splitlines()[-1]]
    assert "edit kind 'explode' (outside_probe) failed: RuntimeError: boom" in lines[0]


def test_a_plugin_named_like_a_builtin_is_refused_in_one_line_at_the_command_line(tmp_path):
    """Round 5 skipped it with a line on stderr and went on; now the command stops before any work."""
    site = tmp_path / "site"
    (site / "clash-0.1.dist-info").mkdir(parents=True)
    (site / "clashing.py").write_text(PLUGIN + "\n\nclass Clash(PromptLength):\n    NAME = 'next_token'\n")
    (site / "clash-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: clash\nVersion: 0.1\n"
    )
    (site / "clash-0.1.dist-info" / "entry_points.txt").write_text(
        "[attnprobe.measures]\nmine = clashing:Clash\n"
    )
    process = forked_cli(["check", ROOT / "probes" / "minimal.yaml"], tmp_path / "check.log", path=[site])
    process.join()
    checked = SimpleNamespace(returncode=process.exitcode, stderr=(tmp_path / "check.log").read_text())
    assert checked.returncode == 2 and "Traceback" not in checked.stderr, checked.stderr[-2000:]
    assert checked.stderr.strip().splitlines() == [
        "attnprobe: error: attnprobe.measures: the plug-in mine (clashing:Clash) is named 'next_token' like "
        "attnprobe.measures.next_token.NextToken; rename one of them (its NAME)"
    ]
