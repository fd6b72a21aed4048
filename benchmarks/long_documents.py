"""Long documents on Gemma 3 270M: attnprobe's chunked read of chosen query rows against
transformers' eager path with `output_attentions=True`, each job in a fresh process.

    python benchmarks/long_documents.py [--lengths 1024,4096,8192,16384,32768] [--rows 8]
                                        [--eager-cap-gib 16] [--out benchmarks/results]

Per length: wall time of the forward (model load excluded) and the process's peak resident memory
(VmHWM, model load included; a separate process measures the load alone). attnprobe records the
last `--rows` query rows of every layer and head over all keys (longdoc.read_rows). The eager path
runs one forward with every layer's weights returned; a watchdog kills it past `--eager-cap-gib`
resident, and it is not tried at longer lengths after that. Writes long_documents.json/.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

MODEL = "gemma3-270m"

JOB = """
import json, sys, time, torch, attnprobe
from attnprobe.verify.long import long_ids
from attnprobe.forward.longdoc import read_rows
kind, n, rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pm = attnprobe.load_model({model!r})
ids = long_ids(pm.tokenizer, n)
start = time.perf_counter()
if kind == "attnprobe":
    got = read_rows(pm, ids, range(n - rows, n))
    total = sum(float(w.sum()) for w in got.values())  # every recorded row sums to 1
elif kind == "eager":
    pm.model.set_attn_implementation("eager")
    with torch.inference_mode():
        out = pm.model(input_ids=ids[None], output_attentions=True, use_cache=False, logits_to_keep=1)
    total = sum(float(w[0, :, -rows:].sum()) for w in out.attentions)
seconds = time.perf_counter() - start
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
print(json.dumps({{"seconds": seconds, "peak_gib": int(hwm.split()[1]) / 2**20, "row_sum": total}}))
"""


def run_job(kind: str, n: int, rows: int, cap_gib: float) -> dict:
    """One job in a fresh process; killed (and reported so) past `cap_gib` resident."""
    process = subprocess.Popen(
        [sys.executable, "-c", JOB.format(model=MODEL), kind, str(n), str(rows)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    peak, killed = [0.0], [False]

    def watch():
        while process.poll() is None:
            try:
                status = Path(f"/proc/{process.pid}/status").read_text()
                rss = int(next(l for l in status.splitlines() if l.startswith("VmRSS")).split()[1]) / 2**20
            except (OSError, StopIteration):
                break
            peak[0] = max(peak[0], rss)
            if rss > cap_gib:
                killed[0] = True
                process.kill()
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    out, _ = process.communicate()
    watcher.join()
    if killed[0] or process.returncode:
        return {
            "kind": kind,
            "tokens": n,
            "failed": f"killed past {cap_gib} GiB" if killed[0] else f"exit {process.returncode}",
            "peak_gib": peak[0],
        }
    return {"kind": kind, "tokens": n, **json.loads(out.strip().splitlines()[-1])}


def load_only() -> float:
    code = f"import attnprobe\nattnprobe.load_model({MODEL!r})\n" + (
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
        "print(int(hwm.split()[1]) / 2**20)\n"
    )
    return float(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.split()[-1]
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096,8192,16384,32768")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--eager-cap-gib", type=float, default=16.0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    results = {"load_peak_gib": load_only(), "jobs": []}
    eager_alive = True
    for n in [int(x) for x in args.lengths.split(",")]:
        for kind in ("attnprobe", "eager"):
            if kind == "eager" and not eager_alive:
                results["jobs"].append(
                    {"kind": kind, "tokens": n, "failed": "not tried (failed at a shorter length)"}
                )
                continue
            job = run_job(kind, n, args.rows, args.eager_cap_gib)
            eager_alive &= not (kind == "eager" and "failed" in job)
            results["jobs"].append(job)
            print(json.dumps(job), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "long_documents.json").write_text(json.dumps(results, indent=2))
    lines = [
        f"Model load alone: peak {results['load_peak_gib']:.2f} GiB resident.",
        "",
        "| tokens | path | seconds | peak resident GiB |",
        "|---|---|---|---|",
    ]
    for job in results["jobs"]:
        seconds = f"{job['seconds']:.1f}" if "seconds" in job else job["failed"]
        peak = f"{job['peak_gib']:.2f}" if job.get("peak_gib") else "-"
        lines.append(f"| {job['tokens']:,} | {job['kind']} | {seconds} | {peak} |")
    (args.out / "long_documents.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
