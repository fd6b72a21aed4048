"""A built wheel, installed (not editable) into a fresh virtual environment, runs `attnprobe run`
and `attnprobe edit` (on a tiny model: the package is what is tested) and `attnprobe verify` on the
bundled model: the package data they need (report templates, edit openings, verify texts) ships in
the wheel, and nothing reads files beside the package."""

import importlib.util
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _fresh_venv(tmp_path: Path) -> Path:
    """A venv of its own whose site-packages sees this environment's third-party libraries (torch,
    transformers, the bundled model: a .pth line, whose own .pth files, the editable attnprobe
    among them, are not run) but no attnprobe."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "third_party.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


@pytest.mark.slow
def test_a_built_wheel_runs_and_edits_in_a_fresh_venv(tmp_path, tiny_llama_dir):
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    source = tmp_path / "source"  # built from a copy: setuptools writes build/ beside what it builds
    shutil.copytree(REPO / "attnprobe", source / "attnprobe", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            *isolation,
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        check=True,
        cwd=tmp_path,
    )
    wheel = next((tmp_path / "dist").glob("attnprobe-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for data in (
        "attnprobe/report/report.html.j2",
        "attnprobe/report/section.html.j2",
        "attnprobe/measures/templates/attention.html.j2",
        "attnprobe/edits/data/openings.txt",
        "attnprobe/verify/data/texts.txt",
    ):
        assert data in names, f"{data} is not in the wheel"
    venv = _fresh_venv(tmp_path)
    site = next((venv / "lib").glob("python3*/site-packages"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
    )
    python = venv / "bin" / "python"
    work = tmp_path / "work"  # no checkout here: the suite is copied, the package comes from the wheel
    work.mkdir()
    shutil.copy(REPO / "probes" / "gender.yaml", work)
    shutil.copy(REPO / "probes" / "occupations-bls.tsv", work)
    shutil.copytree(REPO / "probes" / "edits", work / "edits")
    # both commands in one interpreter (torch is imported once), as the console script calls them
    script = f"""
import importlib.util, sys
assert importlib.util.find_spec("attnprobe").origin.startswith({str(site)!r}), "not the wheel's attnprobe"
from attnprobe.cli import main
for args in (["run", "gender.yaml", "--model", {str(tiny_llama_dir)!r}, "--limit", "24", "--out", "out",
              "--no-progress"],
             ["edit", "out", "--kinds", "zero", "--k", "1", "--draws", "2", "--texts", "8", "--alone", "0"],
             ["verify", "--model", "smollm2-135m"]):
    try:
        main(args, standalone_mode=False)
    except SystemExit as stop:
        if stop.code:
            raise
"""
    done = subprocess.run([str(python), "-c", script], capture_output=True, text=True, cwd=work)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    for name in ("report.html", "head_effects_items.parquet", "edits.csv"):
        assert (work / "out" / name).is_file(), name
