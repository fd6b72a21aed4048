"""How long `attnprobe --help` and each command's --help take as a user meets them: a new process
each time, median of 5 runs per command (goal: under 1 s). Writes benchmarks/results/cli_help.{json,md}.

    .venv/bin/python benchmarks/cli_help.py
"""

import json
import shutil
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

COMMANDS = ["", "models", "check", "run", "report", "merge", "compare", "verify", "probe", "edit"]
RUNS = 5


def main() -> None:
    exe = shutil.which("attnprobe", path=str(Path(sys.executable).parent)) or "attnprobe"
    rows = []
    for command in COMMANDS:
        args = [exe, *([command] if command else []), "--help"]
        times = []
        for _ in range(RUNS):
            started = time.perf_counter()
            subprocess.run(args, check=True, capture_output=True)
            times.append(time.perf_counter() - started)
        rows.append(
            {
                "command": f"attnprobe {command} --help".replace("  ", " "),
                "median_s": statistics.median(times),
                "max_s": max(times),
            }
        )
    out = Path(__file__).parent / "results"
    (out / "cli_help.json").write_text(
        json.dumps({"date": str(date.today()), "runs": RUNS, "rows": rows}, indent=1)
    )
    lines = [
        f"Measured {date.today()} ({RUNS} runs each, a new process per run)",
        "",
        "| command | median s | max s |",
        "|---|---|---|",
    ]
    lines += [f"| `{r['command']}` | {r['median_s']:.3f} | {r['max_s']:.3f} |" for r in rows]
    (out / "cli_help.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
