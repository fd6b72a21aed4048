"""How fast, and in how much memory, each size bound refuses what a user typed or handed in: every
case is the real `attnprobe` command in a new process, timed from start to exit (Python and the
imports included) with the peak resident memory of that process (goal: under 2 s and under 1 GB).
Inputs are written to a temporary directory; a 200 MB data file is made for the line-count cases.
Writes benchmarks/results/hostile_bounds.{json,md}.

    .venv/bin/python benchmarks/hostile_bounds.py
"""

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

RUNS = 3
BIG = 200 * 2**20  # bytes of the line-count cases (issue 55: 200 MB, CR-only ran 250 s and 12.3 GB)


def suite(folder: Path, entry: str, name: str = "s.yaml") -> Path:
    """A sentence suite reading one data file, as a user writes it."""
    path = folder / name
    path.write_text(f"name: s\nsentences:\n  - {entry}\n")
    return path


def inputs(folder: Path) -> list[tuple[str, list[str]]]:
    """(what, attnprobe arguments) per case; each must exit 2 with one line."""
    big_cr = folder / "cr.csv"
    with big_cr.open("w", newline="") as f:  # old-Mac line ends: 200 MB of short rows
        row = "text\r" + "The nurse said that [she] left.\r" * 4096
        for _ in range(BIG // len(row)):
            f.write(row)
    (folder / "lf.csv").write_text(big_cr.read_text().replace("\r", "\n"), newline="")
    (folder / "wide.csv").write_text(",".join(f"c{i}" for i in range(10**6)) + "\ntext\n")
    (folder / "cell.csv").write_text("text\n" + "a" * 200_000 + "\n")
    (folder / "line.jsonl").write_text('{"text": "' + "a" * 50 * 2**20 + '"}\n')
    (folder / "deep.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with (folder / "sparse.csv").open("wb") as f:  # 600 MB without writing it: refused by its size
        f.truncate(600 * 2**20)
    (folder / "doc.txt").write_text("The nurse said that [she] left. " * (30 * 2**20 // 32))
    os.mkfifo(folder / "fifo.txt")
    table = "{id: t, file: %s}"
    return [
        (
            "200 MB CSV, CR line ends (max_prompts)",
            ["check", str(suite(folder, table % "cr.csv", "cr.yaml"))],
        ),
        (
            "200 MB CSV, LF line ends (max_prompts)",
            ["check", str(suite(folder, table % "lf.csv", "lf.yaml"))],
        ),
        ("600 MB data file (512 MB bound)", ["check", str(suite(folder, table % "sparse.csv", "sp.yaml"))]),
        ("CSV header of 10^6 columns", ["check", str(suite(folder, table % "wide.csv", "wide.yaml"))]),
        ("CSV cell of 200,000 characters", ["check", str(suite(folder, table % "cell.csv", "cell.yaml"))]),
        ("JSONL line of 50 MiB", ["check", str(suite(folder, table % "line.jsonl", "line.yaml"))]),
        ("JSON nested 100,000 deep", ["check", str(suite(folder, table % "deep.jsonl", "deep.yaml"))]),
        ("probe of a 30 MB text", ["probe", str(folder / "doc.txt"), "--model", "smollm2-135m"]),
        ("probe of /dev/zero", ["probe", "/dev/zero", "--model", "smollm2-135m"]),
        ("probe of a FIFO", ["probe", str(folder / "fifo.txt"), "--model", "smollm2-135m"]),
        ("edit --draws 10^9", ["edit", str(folder), "--draws", str(10**9)]),
        ("edit --alone 10^9", ["edit", str(folder), "--alone", str(10**9)]),
        ("verify --long 10^12", ["verify", "--model", "smollm2-135m", "--long", str(10**12)]),
    ]


def one(args: list[str]) -> None:
    """Run `attnprobe ARGS` as this process's only child; print its seconds, peak MB and output."""
    exe = str(Path(sys.executable).parent / "attnprobe")
    started = time.perf_counter()
    done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - started
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # kB on Linux
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    print(json.dumps({"seconds": seconds, "peak_mb": peak_mb, "rc": done.returncode, "stderr": lines}))


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for what, args in inputs(Path(tmp)):
            runs = []
            for _ in range(RUNS):  # a new measuring process per run: its children's peak is this case's
                out = subprocess.run(
                    [sys.executable, __file__, "--one", json.dumps(args)], capture_output=True, text=True
                )
                runs.append(json.loads(out.stdout))
            last = runs[-1]
            rows.append(
                {
                    "case": what,
                    "command": "attnprobe " + " ".join(args).replace(tmp, "TMP"),
                    "median_s": statistics.median(r["seconds"] for r in runs),
                    "peak_mb": max(r["peak_mb"] for r in runs),
                    "exit": last["rc"],
                    "lines": len(last["stderr"]),
                    "message": last["stderr"][-1][:160].replace(tmp, "TMP") if last["stderr"] else "",
                }
            )
            print(f"{what}: {rows[-1]['median_s']:.2f} s, {rows[-1]['peak_mb']:.0f} MB, exit {last['rc']}")
    write(rows)


def write(rows: list[dict]) -> None:
    out = Path(__file__).parent / "results"
    about = {
        "date": str(date.today()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "runs": RUNS,
    }
    (out / "hostile_bounds.json").write_text(json.dumps({**about, "rows": rows}, indent=1) + "\n")
    lines = [
        f"Measured {about['date']} on {about['machine']} (median of {RUNS} runs, a new process each; "
        "seconds from start to exit, imports included; peak resident memory of the process)",
        "",
        "| case | exit | stderr lines | median s | peak MB | message |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['case']} | {r['exit']} | {r['lines']} | {r['median_s']:.2f} | {r['peak_mb']:.0f} | "
        f"{r['message'].replace('|', '/')} |"
        for r in rows
    ]
    (out / "hostile_bounds.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        one(json.loads(sys.argv[2]))
    else:
        main()
