"""A short run as a user types it, whole process, against lm-eval on the same model and file (issue 70).

300 CrowS-Pairs-shaped pairs (the shipped pairs in ten openings, written in crows_pairs_anonymized.csv's
columns; no dataset hub here) scored by

    attnprobe run crows.yaml --model DIR --out OUT --fresh        (report included, as typed)
    lm_eval --model hf --model_args pretrained=DIR,dtype=float32 --tasks crows_local
            --include_path FOLDER --device cpu --batch_size B --output_path OUT

on the bundled SmolLM2-135M's safetensors folder (both read the same files), in turns, --rounds
each, medians. Where attnprobe's time goes: its imports (timed inside a process that imports what `run`
needs), its phases (the manifest's compute seconds), the rest (the interpreter's start and end,
loading, hashing, planning, statistics, report, writes: the remainder). Needs lm-eval 0.4.13
importable by --lm-eval-python.

    python benchmarks/startup.py --lm-eval-python /tmp/lmenv/bin/python --out benchmarks/results
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness_parity  # noqa: E402

OPENINGS = [*harness_parity.OPENINGS, "Some said that ", "Back then, "]  # 10 x 32 pairs, the first 300
PAIRS = 300


# what `run` imports, timed inside a process that starts as the program does (cli/program.py's collector
# threshold): the process's start and end are the rest's
IMPORTS = (
    "import gc, time\nfrom attnprobe.cli.program import YOUNG_OBJECTS\ngc.set_threshold(YOUNG_OBJECTS)\n"
    "started = time.perf_counter()\nimport attnprobe.cli.run, attnprobe.run, attnprobe.report\n"
    "print(time.perf_counter() - started)"
)


def write_inputs(folder: Path, lm_eval_python: str) -> None:
    """crows.csv (the first PAIRS pairs), attnprobe's crows.yaml and lm-eval's crows_local task (its
    own crows_pairs_english definition, included from the installed package, reading crows.csv)."""
    harness_parity.OPENINGS[:] = OPENINGS
    path = harness_parity.write_crows(folder, len(OPENINGS))
    rows = list(csv.reader(open(path, newline="")))
    with open(path, "w", newline="") as handle:
        csv.writer(handle).writerows(rows[: PAIRS + 1])
    harness_parity.write_suites(folder)
    where = "import lm_eval, pathlib; print(pathlib.Path(lm_eval.__file__).parent / 'tasks')"
    tasks = subprocess.run([lm_eval_python, "-c", where], capture_output=True, text=True, check=True)
    base = Path(tasks.stdout.strip()) / "crows_pairs" / "crows_pairs_english.yaml"
    (folder / "crows_local.yaml").write_text(
        f"include: {base}\ntask: crows_local\ntag: []\ndataset_path: csv\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files: {path}\ntest_split: train\n"
    )


def timed(command: list[str], cwd: Path, env: dict | None = None) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return time.perf_counter() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--lm-eval-python", required=True, help="a Python that imports lm_eval 0.4.13")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", default="16", help="lm-eval's --batch_size")
    args = parser.parse_args(argv)
    from attnprobe.model import _resolve

    model = _resolve("smollm2-135m", allow_pickle=False)[0]  # the bundled model's safetensors folder
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_inputs(folder, args.lm_eval_python)
        ours = [sys.executable, "-m", "attnprobe", "-q", "run", "crows.yaml", "--model", model]
        ours += ["--out", str(folder / "run"), "--fresh"]
        theirs = [args.lm_eval_python, "-m", "lm_eval", "--model", "hf"]
        theirs += ["--model_args", f"pretrained={model},dtype=float32", "--tasks", "crows_local"]
        theirs += ["--include_path", str(folder), "--device", "cpu", "--batch_size", args.batch_size]
        theirs += ["--output_path", str(folder / "lm_eval")]
        imports, ours_env = [sys.executable, "-c", IMPORTS], dict(env, PYTHONPATH=str(ROOT))
        times = {"attnprobe": [], "lm_eval": [], "imports": [], "compute": []}
        for _ in range(args.rounds):
            times["attnprobe"].append(timed(ours, folder, ours_env))
            manifest = json.loads((folder / "run" / "manifest.json").read_text())
            times["compute"].append(manifest["compute_seconds_this_session"])
            times["lm_eval"].append(timed(theirs, folder, env))
            done = subprocess.run(
                imports, cwd=folder, capture_output=True, text=True, check=True, env=ours_env
            )
            times["imports"].append(float(done.stdout))
    median = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "date": str(date.today()),
        "command": "python benchmarks/startup.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "pairs": PAIRS,
        "lm_eval_batch_size": args.batch_size,
        "omp_threads": env["OMP_NUM_THREADS"],
        "rounds": times,
        "median": median,
        "speedup": median["lm_eval"] / median["attnprobe"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "startup.json").write_text(json.dumps(result, indent=1))
    rest = median["attnprobe"] - median["imports"] - median["compute"]
    lines = [
        f"Measured {result['date']} on 2 CPU cores; command: `{result['command']}`; {PAIRS} CrowS-Pairs-"
        f"shaped pairs, SmolLM2-135M float32, whole process each, {args.rounds} rounds in turn, medians.",
        "",
        "| | seconds |",
        "|---|---|",
        f"| attnprobe run (report included) | {median['attnprobe']:.1f} |",
        f"| of which imports | {median['imports']:.1f} |",
        f"| of which the phases (compute) | {median['compute']:.1f} |",
        f"| of which the rest (start, load, hash, plan, statistics, report, writes, exit) | {rest:.1f} |",
        f"| lm-eval 0.4.13, batch size {args.batch_size} | {median['lm_eval']:.1f} |",
        f"| lm-eval / attnprobe | {result['speedup']:.2f}x |",
    ]
    (args.out / "startup.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
