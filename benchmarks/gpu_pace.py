"""The GPU at work (issue 70): how fast each phase runs on a lent GPU, against what the card can do.

For each shipped shape (random weights, bfloat16, the gender suite's first --limit prompts):

- the prompt phase (every chunk of the plan, its tables built) cold (the shape's first) and warm
  (again), beside a plain transformers eager loop over the same prompts (padded batches of the run's
  batch size, every layer's weights copied to the CPU), also cold and warm;
- single-head patches: every head's output patched in, one variant each, on --pairs item pairs, the
  way the head effects patch their held-out items (one warm-up pair first): patches a second and the
  share of the data sheet's dense peak their FLOPs reach (2 x the parameters besides the embeddings
  per computed token, each variant computing the layers from its head's up, over the positions from
  the patched one on);
- peak memory.

Then (--full) the whole gender suite at one shape as a user types it (`attnprobe run` in a process of
its own: every prompt, the head effects, statistics, report), its time beside `attnprobe check`'s
estimate for the same plan; (--edit) `attnprobe edit` with its defaults on that run; (--profile SHAPES)
torch.profiler over the prompt phase and one pair's single-head patches at each of SHAPES.

    python benchmarks/gpu_pace.py --tokenizer DIR --out DIR                 # on a GPU
    python benchmarks/gpu_pace.py --tiny --out /tmp/pace                    # anywhere (the test runs it)

Writes OUT/gpu_pace.json, OUT/gpu_pace.md and, with --profile, OUT/gpu_profile.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu import (  # noqa: E402, I001
    SHAPES,
    SUITE,
    eager_loop,
    failure,
    header,
    log,
    shape_folder,
    synchronize,
    tokenizer_of,  # noqa: E402
)

from attnprobe.defaults import DEFAULT_BATCH_SIZE  # noqa: E402
from attnprobe.forward.device import on_model_device  # noqa: E402
from attnprobe.model import load_model  # noqa: E402
from attnprobe.model.footprint import GB, PEAK_TFLOPS, Shape, card  # noqa: E402
from attnprobe.run import RunOptions, plan_run  # noqa: E402
from attnprobe.run.phases import prompts_phase  # noqa: E402
from attnprobe.suite import load_suite  # noqa: E402
from attnprobe.testing.stand_in import stand_in_device  # noqa: E402


def timed(device: str, fn) -> float:
    synchronize(device)
    started = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - started


def prompt_phase(pm, plan, options) -> None:
    phase = prompts_phase(pm, plan, options)
    for k in range(phase.n_chunks):
        phase.compute(k, lambda n: None)


def single_head_patches(pm, plan, n_pairs: int):
    """(run, patches, FLOPs): a function running every head's output patched in on the plan's first
    `n_pairs` item pairs (one variant per head and pair), the number of variants and their FLOPs."""
    from attnprobe.measures.head_effects.screen import _Builder, _recorded

    items = plan.parts["head_effects"].items
    L, H = pm.info.n_layers, pm.info.n_heads
    one_head = torch.eye(L * H, dtype=torch.bool).view(L * H, L, H)
    shape = Shape.of(pm.model.config)
    pairs, bank, _ = _recorded(pm, items[: max(1, n_pairs // 2)])
    pairs = pairs[:n_pairs]
    builder = _Builder(L, H)
    for k, pair in enumerate(pairs):
        builder.add((k, "output", "in"), pair, "in", output=one_head)
    layers = torch.arange(L).repeat_interleave(H).double()
    tokens = sum(float(((L - layers) / L).sum()) * (len(p.item.x) - p.cf.at) for p in pairs)
    flops = tokens * shape.flops_per_token()
    return (lambda: builder.run(pm, bank, True)), len(pairs) * L * H, flops


def pace_row(name: str, folder: Path, device: str, dtype: str, limit: int, n_pairs: int, work: Path) -> dict:
    quiet = dict(device=device, dtype=dtype, progress=False, log=lambda m: None)
    options = RunOptions(out=work / f"pace-{name}", limit=limit, **quiet)
    spec = f"random:{folder}"
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    pm = load_model(spec, dtype=dtype, device=device)
    plan = plan_run(load_suite(SUITE), pm, options)
    texts = [e.prompt.text for e in plan.encoded]
    row = {"shape": name, "dtype": dtype, "prompts": len(texts)}
    with on_model_device(pm):
        row["prompt_phase_cold_s"] = timed(device, lambda: prompt_phase(pm, plan, options))
        warm = [timed(device, lambda: prompt_phase(pm, plan, options)) for _ in range(2)]
        row["prompt_phase_warm_s"] = min(warm)
    row["batch_size"] = batch = plan.settings["batch_size"]  # the prompt phase's, from the device
    row["eager_cold_s"] = eager_loop(pm, texts, batch, device)
    row["eager_warm_s"] = min(eager_loop(pm, texts, batch, device) for _ in range(2))
    row["prompt_vs_eager_warm"] = row["prompt_phase_warm_s"] / row["eager_warm_s"]
    # the loop a user writes at the CPU's default batch, beside the loop at the phase's own batch
    default = [eager_loop(pm, texts, DEFAULT_BATCH_SIZE, device) for _ in range(2)]
    row["eager_default_batch_warm_s"] = min(default)
    with on_model_device(pm):
        warm_up, _, _ = single_head_patches(pm, plan, 1)
        timed(device, warm_up)
        run, patches, flops = single_head_patches(pm, plan, n_pairs)
        seconds = timed(device, run)
    peak = PEAK_TFLOPS.get(card(device)[0].split(" ")[0], {}).get(dtype)
    row |= {
        "single_head_patches": patches,
        "patches_s": seconds,
        "patches_per_s": patches / seconds,
        "patch_peak_share": peak and flops / seconds / (peak * 1e12),
        "peak_memory_gb": torch.cuda.max_memory_allocated() / GB if device.startswith("cuda") else None,
    }
    return row


def gc_collect() -> None:
    """The last shape's model gone before the next loads."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def profile(name: str, folder: Path, device: str, dtype: str, limit: int, work: Path) -> str:
    """torch.profiler over one prompt chunk and one pair's single-head patches: the top operators by
    device time and the host/device split, as markdown."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    options = RunOptions(
        out=work / "profile", limit=limit, device=device, dtype=dtype, progress=False, log=lambda m: None
    )
    pm = load_model(f"random:{folder}", dtype=dtype, device=device)
    plan = plan_run(load_suite(SUITE), pm, options)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    sections = []
    with on_model_device(pm):
        run, patches, _ = single_head_patches(pm, plan, 1)
        for what, fn in (("prompt phase", lambda: prompt_phase(pm, plan, options)), ("patches", run)):
            fn()  # warm
            with profiler(activities=activities) as prof:
                wall = timed(device, fn)
            events = prof.key_averages()
            device_us = sum(getattr(e, "self_device_time_total", 0) for e in events)
            host_us = sum(e.self_cpu_time_total for e in events)
            sort = "self_device_time_total" if device.startswith("cuda") else "self_cpu_time_total"
            sections += [
                f"## {what} ({name}, {dtype}{', ' + str(patches) + ' patches' if what == 'patches' else ''})",
                "",
                f"wall {wall * 1e3:.1f} ms; device busy {device_us / 1e3:.1f} ms "
                f"({device_us / 1e3 / wall / 1e3:.0%}); host self time in torch ops {host_us / 1e3:.1f} ms",
                "",
                "```",
                events.table(sort_by=sort, row_limit=15, max_name_column_width=50),
                "```",
                "",
            ]
    return "\n".join(sections)


def full_suite(name: str, folder: Path, device: str, dtype: str, work: Path, edit: bool, left) -> dict:
    """`attnprobe run probes/gender.yaml` (every prompt, statistics, report) as typed, timed whole,
    beside check's estimate for its plan; with `edit`, `attnprobe edit` with its defaults after it."""
    from attnprobe.run.resources import run_seconds

    out, spec = work / f"full-{name}", f"random:{folder}"
    plan = plan_run(load_suite(SUITE), spec, RunOptions(out=out, device=device, dtype=dtype))
    # check's three figures: loading and hashing (the checkpoint's first run), the device's phases, the
    # host's statistics and report
    load_s, estimate, host_s = run_seconds(plan, Shape.of(plan.config), card(device)[0])
    device_s = sum(v or 0 for v in estimate.values())
    row = {"shape": name, "estimate_s": estimate, "estimate_total_s": device_s}
    row |= {
        "estimate_load_s": load_s,
        "estimate_host_s": host_s,
        "estimate_in_all_s": load_s + device_s + host_s,
    }
    if edit:  # edit refuses random: weights (they measure nothing learned): the same weights saved
        started = time.perf_counter()
        pm = load_model(spec, dtype=dtype, device=device)
        spec = str(work / f"checkpoint-{name}")
        pm.model.save_pretrained(spec)
        pm.tokenizer.save_pretrained(spec)
        del pm
        gc_collect()
        row["checkpoint_s"] = time.perf_counter() - started
    on = ["--device", device, "--dtype", dtype]
    begun = time.time()
    row |= _typed("run", ["run", str(SUITE), "--model", spec, "--out", str(out), *on], left())
    manifest = json.loads((out / "manifest.json").read_text()) if (out / "manifest.json").is_file() else {}
    row |= _parts(manifest, begun, begun + row["run_s"])
    row["prompts"] = manifest.get("n_prompts")
    row["prompt_phase_s"] = (manifest.get("prompt_phase") or {}).get("seconds")
    row["head_effects"] = {k: (manifest.get("head_effects") or {}).get(k) for k in ("n_pairs", "seconds")}
    row["compute_s"] = manifest.get("compute_seconds_this_session")  # every phase, before statistics
    if edit and row["run_exit"] == 0:
        row |= _typed("edit", ["edit", str(out), "--device", device], left())
    return row


def _parts(manifest: dict, begun: float, ended: float) -> dict:
    """The run's wall time in three (to the second: the manifest's stamps): before its compute (start-up,
    loading and hashing the weights, tokenising) and after it (statistics and report)."""
    stamp = lambda key: datetime.strptime(manifest[key], "%Y-%m-%dT%H:%M:%S%z").timestamp()
    if not manifest.get("started") or not manifest.get("finished"):
        return {"before_compute_s": None, "after_compute_s": None}
    return {"before_compute_s": stamp("started") - begun, "after_compute_s": ended - stamp("finished")}


def _typed(what: str, args: list[str], timeout: float) -> dict:
    """`python -m attnprobe ARGS` in a process of its own: exit code, seconds, its last error lines."""
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "attnprobe", "-q", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
        )
        code = done.returncode
        error = "\n".join(done.stderr.strip().splitlines()[-12:]) if code else ""
    except subprocess.TimeoutExpired:
        code, error = "timeout", f"stopped after {timeout:.0f} s"
    return {f"{what}_exit": code, f"{what}_s": time.perf_counter() - started, f"{what}_error": error}


def markdown(result: dict) -> str:
    lines = [
        f"Measured {result['date']} on {result['device']} (torch {result['torch']}); command: "
        f"`{result['command']}`; an 8192^3 bf16 matrix product: {result['matmul_bf16_tflops']} TFLOP/s",
        "",
        "| shape | prompts | batch | prompt phase cold / warm s | eager loop cold / warm s | warm ratio | "
        f"eager warm s at batch {DEFAULT_BATCH_SIZE} | single-head patches | patches/s | share of peak | "
        "peak GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["pace"]:
        share = f"{r['patch_peak_share']:.1%}" if r.get("patch_peak_share") else "n/a"
        lines.append(
            f"| {r['shape']} | {r['prompts']} | {r['batch_size']} | {r['prompt_phase_cold_s']:.3f} / "
            f"{r['prompt_phase_warm_s']:.3f} | {r['eager_cold_s']:.3f} / {r['eager_warm_s']:.3f} | "
            f"{r['prompt_vs_eager_warm']:.2f}x | {r['eager_default_batch_warm_s']:.3f} | "
            f"{r['single_head_patches']} | {r['patches_per_s']:.0f} | {share} | "
            f"{r['peak_memory_gb'] and round(r['peak_memory_gb'], 2)} |"
        )
    for r in result["full"]:
        shown = {k: v for k, v in r.items() if k != "shape"}
        lines += ["", f"Full suite, {r['shape']}: {json.dumps(shown, default=str)}"]
    lines += [f"- {note}" for note in result["notes"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama on any machine (the test)")
    parser.add_argument("--tokenizer", help="a tokenizer directory (default: the bundled model's)")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--limit", type=int, default=600)
    parser.add_argument("--pairs", type=int, default=4, help="item pairs whose every head is patched")
    parser.add_argument("--full", default="", help="shapes to run the whole suite at (comma-separated)")
    parser.add_argument("--edit", action="store_true", help="attnprobe edit with its defaults after --full")
    parser.add_argument("--profile", default="", help="shapes whose phases to profile (comma-separated)")
    parser.add_argument("--budget-s", type=float, default=500, help="skip what is left once this has passed")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device != "cpu" else "float32"
    tokenizer = tokenizer_of(args.tokenizer)
    result = {
        **header("gpu_pace.py", device, argv),
        "pace": [],
        "full": [],
        "notes": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)

    def save():
        (args.out / "gpu_pace.json").write_text(json.dumps(result, indent=1, default=str))
        (args.out / "gpu_pace.md").write_text(markdown(result))

    def left() -> float:
        """Seconds of the budget left (at least 1)."""
        return max(1.0, args.budget_s - (time.perf_counter() - started))

    names = ["tiny-llama"] if args.tiny else [n for n in args.shapes.split(",") if n]  # "": none
    stand_in = stand_in_device() if device == "cpu" else contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as tmp, stand_in:
        work = Path(tmp)
        folders = {n: shape_folder(n, tokenizer, work, args.tiny) for n in names}
        for name in names:
            gc_collect()
            if left() <= 1:
                result["notes"].append(f"{name}: skipped, the {args.budget_s:.0f} s budget was spent")
                continue
            try:
                row = pace_row(name, folders[name], device, dtype, args.limit, args.pairs, work)
                result["pace"].append(row)
                log(f"pace {name}: {result['pace'][-1]}")
            except Exception as exc:  # recorded; the other shapes still run
                result["notes"].append(f"{name}: {failure(exc)}")
                log(f"pace {name} failed: {failure(exc)}")
            save()
        profiles = [f"{result['command']} ({result['device']}, {result['date']})", ""]
        for name in filter(None, args.profile.split(",")):
            gc_collect()
            if left() > 1:
                folder = folders.get(name) or shape_folder(name, tokenizer, work, args.tiny)
                profiles.append(profile(name, folder, device, dtype, args.limit, work))
                (args.out / "gpu_profile.md").write_text("\n".join(profiles))
        for name in filter(None, args.full.split(",")):
            if left() <= 1:
                result["notes"].append(f"full {name}: skipped, the budget was spent")
                continue
            gc_collect()
            folder = folders.get(name) or shape_folder(name, tokenizer, work, args.tiny)
            result["full"].append(full_suite(name, folder, device, dtype, work, args.edit, left))
            log(f"full {name}: {result['full'][-1]}")
            save()
    result["seconds"] = time.perf_counter() - started
    save()
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
