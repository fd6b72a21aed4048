"""Every file a run directory holds is declared once (attnprobe.run.files.inventory): what `run`, `edit`
with every option and `report` write, `--fresh` removes, and a write of anything else is refused."""

import os

import pandas as pd
import pytest
from click.testing import CliRunner
from conftest import edit_suite

import attnprobe
from attnprobe import store
from attnprobe.cli import main
from attnprobe.errors import RunError
from attnprobe.run.files.inventory import is_declared, run_writes

EVERY_OPTION = [
    *("--kinds", "zero,leace", "--k", "1", "--draws", "2", "--texts", "2", "--alone", "1"),
    *("--placebo", "1", "--stream", "--mlp", "--trace", "--paths", "--circuits", "--circuit-grain", "edges"),
    *("--also-k", "1"),
]


def _files(directory) -> dict[str, int]:
    """Every file under `directory` (relative path -> modification time in ns)."""
    found = {}
    for folder, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(folder, name)
            found[os.path.relpath(path, directory)] = os.stat(path, follow_symlinks=False).st_mtime_ns
    return found


def _invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


@pytest.mark.thorough  # a whole sweep: the fast lane keeps the declared-write refusals below
def test_run_edit_with_every_option_and_report_write_only_declared_files_and_fresh_removes_them(
    tiny_llama_dir, tmp_path
):
    suite, out = edit_suite(tmp_path), tmp_path / "run"
    (tmp_path / "cost.txt").write_text("The weather was fine, and the market was busy that morning.\n")
    _invoke("run", suite, "--model", tiny_llama_dir, "--out", out, "--no-report")
    _invoke("edit", out, *EVERY_OPTION, "--also", suite, "--cost-text", tmp_path / "cost.txt")
    _invoke("report", out)
    written = _files(out)
    assert [name for name in written if not is_declared(name)] == []
    # what round 5's hand lists missed is here, and declared (the MLP edits and their quarters too)
    for name in ("edits_mlp.csv", "edits_placebo.csv", "edits_goal.csv", "paths_parts.csv"):
        assert name in written, name
    assert "paths_circuit.csv" in written and "paths_circuit_items.parquet" in written
    assert {"circuits.csv", "circuit_edges.parquet", "circuit_agreement.csv", "circuit_runs.parquet"} <= set(
        written
    )
    assert "edits/mlp-leace.json" in written and "edits/quarters/mlp-leace-slot-q2.json" in written
    assert any(name.startswith("also/e/") and name.endswith("manifest.json") for name in written)
    assert "Circuits found by attribution" in (out / "report.html").read_text()  # the size curve
    circuits = attnprobe.Run(out).circuits
    assert (
        set(circuits["reference"]) == {"person", "another occupation"} and circuits["held_out"].notna().all()
    )
    for name in (n for n in written if n.endswith(".csv")):  # every CSV a run writes reads back
        assert isinstance(pd.read_csv(out / name), pd.DataFrame), name

    _invoke("run", suite, "--model", tiny_llama_dir, "--out", out, "--fresh", "--no-report")
    after = _files(out)
    old = [name for name, mtime in after.items() if written.get(name) == mtime and name != ".lock"]
    assert old == []  # every file there now was written by the new run
    assert not any(
        name.startswith(("edits", "paths", "also/", "readout", "tracing", "circuit")) for name in after
    )
    assert set(after) <= set(written)  # and the new run wrote nothing the old one had not


def test_a_write_into_a_run_must_be_declared_and_reached_without_a_link(tmp_path):
    (tmp_path / "outside").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "figures").symlink_to(tmp_path / "outside")
    with pytest.raises(RunError, match=r"figures is a symbolic link; attnprobe writes only inside"):
        with run_writes(tmp_path / "run"):  # planted before: refused before any work
            pass
    (tmp_path / "run" / "figures").unlink()
    with run_writes(tmp_path / "run"):
        (tmp_path / "run" / "figures").symlink_to(tmp_path / "outside")  # planted while it writes
        store.write_table(tmp_path / "run", "edits_goal", pd.DataFrame({"a": [1]}))  # declared
        with pytest.raises(RunError, match=r"attnprobe bug: notes\.csv is not a declared file"):
            store.write_table(tmp_path / "run", "notes", pd.DataFrame({"a": [1]}))
        with pytest.raises(RunError, match=r"figures is a symbolic link; attnprobe writes only inside"):
            store.atomic_write(tmp_path / "run" / "figures" / "x.png", lambda p: p.write_bytes(b"png"))
    assert sorted(os.listdir(tmp_path / "run")) == [
        ".lock",
        "edits_goal.csv",
        "edits_goal.parquet",
        "figures",
    ]
    assert os.listdir(tmp_path / "outside") == []
    store.write_table(tmp_path / "run", "notes", pd.DataFrame({"a": [1]}))  # outside a command: any file


@pytest.mark.parametrize(
    "name, declared",
    [
        ("edits_mlp.parquet", True),
        ("edits/mlp-leace-slot.safetensors", True),
        ("edits/quarters/mlp-project-slot-q3.json", True),
        ("edits/quarters/zero-k5-q0.safetensors", True),
        ("also/coref/leace-k1/chunks/00000.done", True),
        ("chunks/.00001.done.tmp", True),
        ("edits/../../etc.json", False),
        ("my-notes.txt", False),
        ("chunks/my-notes.txt", False),
        ("edits/Notes.json", False),
    ],
)
def test_declared_names(name, declared):
    assert is_declared(name) is declared
