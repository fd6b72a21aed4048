"""CUDA against CPU, and the gender suite at the shapes researchers use: one script for a lent GPU.

(a) parity: tiny random models of six families, each run on the CPU in float32 (the reference) and on
    the device in float32 and bfloat16: `verify` on the device (attention against the from-scratch
    recomputation, whichever SDPA kernel CUDA picks), the gender suite's tables (capture, next token,
    head effects: every parquet file, column by column) and a zero-ablation edit's logits;
(b) shapes: the gender suite (--limit) on random-weight models of the shipped shapes in bfloat16: the
    prompt phase's rate, one forward pass of the plan's largest batch against its FLOP floor at the
    card's dense peak, head effects' rate, peak memory against `attnprobe check`'s estimate, and a plain
    transformers eager loop (output_attentions=True) over the same prompts;
(c) writes OUT/gpu.json and OUT/gpu.md.

    python benchmarks/gpu.py --out benchmarks/results            # on a GPU: parity, shapes up to 8B
    python benchmarks/gpu.py --tiny --out /tmp/gpu                # anywhere, in a minute (the test runs this)

On a machine without a GPU the "device" is the CPU itself, standing in for a GPU (parity is then
trivially exact; attnprobe.testing.stand_in refuses what a GPU would refuse, such as .numpy() of a
tensor left on the device: the run checks that the script and the device code paths work). The
tokenizer is the bundled model's, or --tokenizer DIR (what a GPU machine without the bundled package
is given).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from datetime import date
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import attnprobe  # noqa: E402
from attnprobe.model import from_pretrained_objects, load_tokenizer  # noqa: E402
from attnprobe.model.footprint import GB, PEAK_TFLOPS, Shape, card  # noqa: E402
from attnprobe.model.shapes import SHAPES as SHIPPED  # noqa: E402
from attnprobe.run import RunOptions, plan_run  # noqa: E402
from attnprobe.run.resources import working_bytes  # noqa: E402
from attnprobe.suite import load_suite  # noqa: E402
from attnprobe.testing.stand_in import stand_in_device  # noqa: E402

SUITE = ROOT / "probes" / "gender.yaml"
SHAPES = ["llama-3.1-8b", "llama-3.2-1b", "qwen-2.5-7b", "gemma-3-4b"]  # the 8B first: the figure to have
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
FAMILIES = {
    "llama": dict(TINY, num_key_value_heads=2),
    "qwen2": dict(TINY, num_key_value_heads=2),
    "qwen3": dict(TINY, num_key_value_heads=2, head_dim=16),
    "mistral": dict(TINY, num_key_value_heads=2, sliding_window=4),
    "gemma3_text": dict(
        TINY,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=128),
}
MEASUREMENT_TABLES = ("attention", "behavior", "logprobs", "head_effects_items", "head_effects_layers")
# The device's tables against the CPU's in the same dtype, relative to max(1, max |reference|) per
# column: the kernels sum in other orders (float32: verify's 1e-5 grown by the layers; bfloat16:
# each rounding is within eps/2 = 2^-8 and a few compound through 2 layers: 16 eps = 0.125, stated
# before measuring, not tuned).
TABLE_TOLERANCE = {
    "float32": 1e-4,
    **{d: 16 * torch.finfo(getattr(torch, d)).eps for d in ("bfloat16", "float16")},
}
DTYPES = tuple(TABLE_TOLERANCE)
TRACEBACK_LINES = 12  # of a command that fails with a traceback, kept in the results
PARITY_TEXTS = ["The doctor spoke to the nurse. She said to him that", "The engineer left early because"]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def tokenizer_of(folder: str | None):
    if folder:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
        return tokenizer
    return load_tokenizer(attnprobe.DEFAULT_MODEL)[0]


def tiny_model(family: str, vocabulary: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(FAMILIES[family], vocab_size=vocabulary)
    config = AutoConfig.for_model(family, **values)
    config.initializer_range = 0.3  # peaked attention: a wrong mask or scale shows
    config.bos_token_id = config.eos_token_id = config.pad_token_id = 0
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def table_differences(reference: Path, other: Path) -> dict[str, float]:
    """Per measurement table: the largest |difference| of a numeric column relative to max(1, max
    |reference|). The measurements only: a statistic that selects heads by rank (cross-fitted sets)
    can flip a choice between near ties, which is not a numeric difference."""
    worst = {}
    for name in MEASUREMENT_TABLES:
        path = reference / f"{name}.parquet"
        if not path.is_file():
            continue
        a, b = pd.read_parquet(path), pd.read_parquet(other / path.name)
        numeric = [c for c in a.columns if pd.api.types.is_float_dtype(a[c]) and c in b.columns]
        if len(a) != len(b) or not numeric:
            continue
        diffs = [
            float((a[c] - b[c]).abs().max()) / max(1.0, float(a[c].abs().max()))
            for c in numeric
            if a[c].notna().any()
        ]
        worst[path.stem] = max(diffs, default=0.0)
    return worst


def parity(device: str, tokenizer, limit: int, work: Path, families=tuple(FAMILIES)) -> list[dict]:
    """Each family in each dtype: the device's run against the CPU's run of the same weights in the
    same dtype (reference), and `verify` on the device (its attention against the float32
    from-scratch recomputation, at verify's tolerance for the dtype)."""
    rows, suite = [], load_suite(SUITE)
    options = dict(limit=limit, progress=False, log=lambda m: None)
    for family in families:
        base = tiny_model(family, len(tokenizer))
        for dtype in DTYPES:
            try:
                rows.append(parity_row(family, dtype, base, device, tokenizer, suite, work / family, options))
            except Exception as exc:  # recorded: the other families and dtypes still run
                rows.append({"family": family, "dtype": dtype, "passed": False, "error": failure(exc)})
            log(f"parity {family} {dtype}: {rows[-1]}")
    return rows


def failure(exc: Exception) -> str:
    frames = traceback.extract_tb(exc.__traceback__)[-4:]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames))
    return f"{type(exc).__name__}: {exc} ({where})"


def parity_row(family: str, dtype: str, base, device: str, tokenizer, suite, work: Path, options) -> dict:
    from attnprobe.edits import Zero
    from attnprobe.verify import verify

    started = time.perf_counter()
    batch = tokenizer(PARITY_TEXTS, return_tensors="pt", padding=True)
    real = batch["attention_mask"].bool()
    edit = Zero(heads=((0, 1), (1, 0)))
    runs, logits = {}, {}
    for where in dict.fromkeys(("cpu", device)):  # on a CPU-only machine the device is the CPU: one run
        model = copy.deepcopy(base).to(device=where, dtype=getattr(torch, dtype))
        pm = from_pretrained_objects(model, tokenizer, name=f"{family}-{dtype}")
        if where == device:
            checked = verify(pm, PARITY_TEXTS)
        out = work / f"{dtype}-{where.replace(':', '')}"
        runs[where] = attnprobe.run_suite(suite, pm, RunOptions(out=out, **options)).directory
        with attnprobe.edited(pm, edit), torch.no_grad():
            logits[where] = pm.model(**{k: v.to(where) for k, v in batch.items()}).logits.float().cpu()
    diffs = table_differences(runs["cpu"], runs[device])
    scale = max(1.0, float(logits["cpu"].abs().max()))
    edit_diff = float((logits[device] - logits["cpu"])[real].abs().max()) / scale
    tolerance, worst = TABLE_TOLERANCE[dtype], max(diffs.values(), default=0.0)
    return {
        "family": family,
        "dtype": dtype,
        "device": device,
        "verify_passed": bool(checked["passed"].all()),
        "verify_max_dweights_capture": float(checked["max_dweights_capture"].max()),
        "verify_tol_weights": float(checked["tol_weights_capture"].iloc[0]),
        "tables_max_rel_diff": worst,
        "worst_table": max(diffs, key=diffs.get) if diffs else None,
        "edit_logits_rel_diff": edit_diff,
        "table_tolerance": tolerance,
        "passed": bool(checked["passed"].all()) and worst <= tolerance and edit_diff <= tolerance,
        "seconds": round(time.perf_counter() - started, 2),
    }


def shape_folder(name: str, tokenizer, work: Path, tiny: bool) -> Path:
    """A directory with a config.json (the shipped shape, or a tiny Llama) and the tokenizer."""
    folder = work / f"shape-{name}"
    folder.mkdir(parents=True, exist_ok=True)
    if tiny:
        config = dict(FAMILIES["llama"], model_type="llama", vocab_size=len(tokenizer))
        (folder / "config.json").write_text(json.dumps(config))
    else:
        shutil.copyfile(SHIPPED / f"{name}.json", folder / "config.json")
    tokenizer.save_pretrained(folder)
    return folder


def matmul_ceiling(device: str) -> float | None:
    """TFLOP/s of an 8192^3 bfloat16 matrix product on the card (median of 10 after 3): what the dense
    peak is in practice, beside the data sheet's figure."""
    if not device.startswith("cuda"):
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    times = []
    for i in range(13):
        synchronize(device)
        started = time.perf_counter()
        a @ a
        synchronize(device)
        if i >= 3:
            times.append(time.perf_counter() - started)
    return round(2 * 8192**3 / statistics.median(times) / 1e12, 1)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def forward_rate(pm, plan, device: str) -> dict:
    """One forward pass of the plan's largest prompt batch, capture on (median of 5 after 2 warm-ups)."""
    from attnprobe.attention.capture import encode, run_with_capture

    texts = [e.prompt.text for e in plan.encoded]
    batch_size = max(len(b.indices) for chunk in plan.chunks for b in chunk)
    enc = encode(pm.tokenizer, texts[:batch_size])
    ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    times = []
    for i in range(7):
        synchronize(device)
        started = time.perf_counter()
        run_with_capture(pm.model, ids, mask)
        synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - started)
    return {"tokens": int(ids.numel()), "seconds": statistics.median(times)}


def eager_loop(pm, texts: list[str], batch_size: int, device: str) -> float:
    """What a user without attnprobe writes: padded batches, eager attention, every layer's weights
    to the CPU."""
    model, tokenizer = pm.model, pm.tokenizer
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    synchronize(device)
    started = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(texts), batch_size):
            batch = tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=True).to(device)
            out = model(**batch, output_attentions=True, use_cache=False)
            [a.float().cpu() for a in out.attentions]
    synchronize(device)
    model.set_attn_implementation(previous)
    return time.perf_counter() - started


def shape_row(name: str, folder: Path, device: str, dtype: str, limit: int, work: Path) -> dict:
    from attnprobe.model import load_model
    from attnprobe.verify import verify

    spec = f"random:{folder}"
    options = RunOptions(
        out=work / f"run-{name}", limit=limit, device=device, dtype=dtype, progress=False, log=lambda m: None
    )
    plan = plan_run(load_suite(SUITE), spec, options)
    shape = Shape.of(plan.config)
    estimate = shape.weights(dtype) + working_bytes(plan)  # as `attnprobe check` and `run` count it
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    pm = load_model(spec, dtype=dtype, device=device)
    synchronize(device)
    loaded = time.perf_counter() - started
    started = time.perf_counter()
    directory = attnprobe.run_suite(SUITE, pm, options).directory
    total = time.perf_counter() - started
    manifest = json.loads((directory / "manifest.json").read_text())
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None
    checked = verify(pm, ["The doctor spoke to the nurse. She said to him that", "The engineer left early."])
    forward = forward_rate(pm, plan, device)
    texts = [e.prompt.text for e in plan.encoded]
    eager = eager_loop(pm, texts, plan.settings["batch_size"], device)
    prompts = manifest["prompt_phase"]["seconds"]
    effects = manifest.get("head_effects") or {}
    card_name = card(device)[0]
    peak_flops = PEAK_TFLOPS.get(card_name.split(" ")[0], {}).get(dtype)
    forward_flops = forward["tokens"] * shape.flops_per_token()
    prompt_flops = plan.sharing["tokens_forwarded"] * shape.flops_per_token()
    del pm
    gc.collect()
    return {
        "shape": name,
        "parameters_b": round(shape.parameters / 1e9, 3),
        "dtype": dtype,
        "device": card_name,
        "n_prompts": manifest["n_prompts"],
        "load_s": round(loaded, 2),
        "run_seconds": round(total, 2),
        "prompt_phase_s": prompts,
        "prompts_per_s": round(manifest["n_prompts"] / prompts, 1),
        "prompt_phase_peak_fraction": peak_flops and prompt_flops / prompts / (peak_flops * 1e12),
        "forward_tokens": forward["tokens"],
        "forward_s": round(forward["seconds"], 5),
        "forward_peak_fraction": peak_flops and forward_flops / forward["seconds"] / (peak_flops * 1e12),
        "head_effect_pairs": effects.get("n_pairs"),
        "head_effects_s": effects.get("seconds"),
        "head_effect_pairs_per_s": effects.get("n_pairs")
        and round(effects["n_pairs"] / effects["seconds"], 2),
        "eager_loop_s": round(eager, 3),
        "prompt_phase_vs_eager": round(eager / prompts, 3),
        "peak_memory_gb": peak and round(peak / GB, 2),
        "estimated_memory_gb": round(estimate / GB, 2),
        "memory_estimate_error": peak and round(estimate / peak - 1, 3),
        "verify_passed": bool(checked["passed"].all()),
        "verify_max_dweights_capture": float(checked["max_dweights_capture"].max()),
        "verify_max_doutput_capture": float(checked["max_doutput_capture"].max()),
        "verify_tol_weights": float(checked["tol_weights_capture"].iloc[0]),
    }


def commands(device: str, tokenizer, work: Path, tiny: bool = False) -> list[dict]:
    """(d) Each command on the device, as a user types it, on a tiny checkpoint saved with the tokenizer:
    exit code and seconds (the tables' values are (a)'s business). `tiny` (a check on any machine):
    24 prompts and 8 cost texts in place of 240 and the default 64, an edit of two kinds without the
    placebo, paths, stream and tracing, each command in this process, the edited run without its
    report."""

    model = work / "tiny-checkpoint"
    tiny_model("llama", len(tokenizer)).save_pretrained(model)
    tokenizer.save_pretrained(model)
    (work / "doc.txt").write_text("The doctor spoke to the nurse because [she] was late.\n")
    run_a, run_b = work / "cli-run", work / "cli-edited"
    on, limit = ["--device", device], "24" if tiny else "240"
    texts = ["--texts", "8"] if tiny else []
    steps = [
        ["run", str(SUITE), "--model", str(model), "--limit", limit, "--out", str(run_a), *on],
        [
            "edit",
            str(run_a),
            "--kinds",
            "zero,leace" if tiny else "zero,mean,resample,scale,project,orthogonal,leace",
            "--k",
            "1",
            "--draws",
            "2",
            "--alone",
            "1",
            *texts,
            # the sweep's other parts on the device (on any machine the CPU tests run each of them)
            *([] if tiny else ["--placebo", "2", "--paths", "--stream", "--trace"]),
            *on,
        ],
        [
            "run",
            str(SUITE),
            "--model",
            str(model),
            "--limit",
            limit,
            "--out",
            str(run_b),
            "--edit",
            str(run_a / "edits" / "zero-k1.json"),
            *on,
            *(["--no-report"] if tiny else []),  # the first run's report is the one checked
        ],
        ["compare", str(run_a), str(run_b), "--out", str(work / "cli-compare")],
        ["verify", "--model", str(model), "--dtype", "bfloat16", *on],
        ["probe", str(work / "doc.txt"), "--model", str(model), *on],
    ]
    rows = []
    for args in steps:
        started = time.perf_counter()
        code, error = (_in_process if tiny else _as_typed)(["-q", *args])
        rows.append(
            {
                "command": "attnprobe " + " ".join(_shown(a, work) for a in args),
                "exit": code,
                "seconds": round(time.perf_counter() - started, 1),
                "error": error,
            }
        )
        log(f"command: {rows[-1]}")
    return rows


def _as_typed(args: list[str]) -> tuple[int, str]:
    """(exit code, last line of its errors) of `python -m attnprobe ARGS`, a process of its own."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "attnprobe", *args], capture_output=True, text=True, cwd=ROOT
    )
    return done.returncode, "\n".join(
        done.stderr.strip().splitlines()[-TRACEBACK_LINES:]
    ) if done.returncode else ""


def _in_process(args: list[str]) -> tuple[int, str]:
    """The same through the CLI's entry in this process (--tiny: without 6 s of imports per command)."""
    from click.testing import CliRunner

    from attnprobe.cli import main as cli

    done = CliRunner().invoke(cli, args)
    if not done.exit_code:
        return 0, ""
    if done.exit_code == 1 and done.exc_info:  # not a user error: where it broke
        shown = traceback.format_exception(*done.exc_info)
        return 1, "\n".join("".join(shown).strip().splitlines()[-TRACEBACK_LINES:])
    return done.exit_code, done.output.strip().splitlines()[-1] if done.output.strip() else ""


PARITY_HEADER = (
    "| family | dtype | verify | max dweights (tol) | tables max rel diff (tol) | edit logits rel diff | ok |"
)
SHAPE_HEADER = (
    "| shape | params (B) | load s | prompts | prompts/s | prompt phase s | forward: tokens, ms, share of "
    "peak | head-effect pairs/s | eager loop s (ratio) | peak GB | estimate GB (error) | verify: max "
    "dweights (tol) |"
)


def _parity_line(r: dict) -> str:
    if "error" in r:
        return f"| {r['family']} | {r['dtype']} | error: {r['error']} | | | | NO |"
    cells = [
        r["family"],
        r["dtype"],
        "pass" if r["verify_passed"] else "FAIL",
        f"{r['verify_max_dweights_capture']:.1e} ({r['verify_tol_weights']:.0e})",
        f"{r['tables_max_rel_diff']:.1e} ({r['table_tolerance']:.0e})",
        f"{r['edit_logits_rel_diff']:.1e}",
        "yes" if r["passed"] else "NO",
    ]
    return "| " + " | ".join(cells) + " |"


def _shape_line(r: dict) -> str:
    share = f"{r['forward_peak_fraction']:.0%}" if r["forward_peak_fraction"] else "n/a"
    error = f"{r['memory_estimate_error']:+.0%}" if r["memory_estimate_error"] is not None else "n/a"
    cells = [
        r["shape"],
        r["parameters_b"],
        r["load_s"],
        r["n_prompts"],
        r["prompts_per_s"],
        f"{r['prompt_phase_s']:.2f}",
        f"{r['forward_tokens']}, {r['forward_s'] * 1e3:.1f}, {share}",
        r["head_effect_pairs_per_s"],
        f"{r['eager_loop_s']} ({r['prompt_phase_vs_eager']}x)",
        r["peak_memory_gb"] or "n/a",
        f"{r['estimated_memory_gb']} ({error})",
        f"{'pass' if r['verify_passed'] else 'FAIL'} {r['verify_max_dweights_capture']:.1e} "
        f"({r['verify_tol_weights']:.0e})",
    ]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _shown(arg: str, work: Path) -> str:
    """An argument as the results table shows it: paths short."""
    if arg.startswith(str(work)):
        return Path(arg).name
    return arg.replace(f"{ROOT}/", "")


def markdown(result: dict) -> str:
    lines = [
        f"Measured {result['date']} on {result['device']} (torch {result['torch']}, transformers "
        f"{result['transformers']}); command: `{result['command']}`; an 8192^3 bfloat16 matrix product "
        f"ran at {result['matmul_bf16_tflops']} TFLOP/s (shares below are of the data sheet's dense peak)",
        "",
        "## Parity: the device against the CPU, the same weights in the same dtype",
        "",
        PARITY_HEADER,
        "|---|---|---|---|---|---|---|",
        *map(_parity_line, result["parity"]),
        "",
        "## The gender suite at real shapes (random weights)",
        "",
        SHAPE_HEADER,
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *map(_shape_line, result["shapes"]),
        "",
        "## The commands on the device",
        "",
        "| command | exit | s |",
        "|---|---|---|",
        *[f"| `{r['command']}` | {r['exit']} | {r['seconds']} |" for r in result["commands"]],
        *[
            f"- `{r['command']}` failed: {r['error'].splitlines()[-1]}"
            for r in result["commands"]
            if r["exit"]
        ],
        *[f"- {note}" for note in result["notes"]],
    ]
    return "\n".join(lines) + "\n"


def header(script: str, device: str, argv) -> dict:
    """What every GPU result records first: date, card, versions, the command, the card's bf16 ceiling."""
    import transformers

    return {
        "date": str(date.today()),
        "device": card(device)[0] if device != "cpu" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": f"python benchmarks/{script} " + " ".join(argv if argv is not None else sys.argv[1:]),
        "matmul_bf16_tflops": matmul_ceiling(device),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes only (any machine, about a minute)")
    parser.add_argument("--tokenizer", help="a tokenizer directory (default: the bundled model's)")
    parser.add_argument("--limit", type=int, default=600, help="prompts per shape run")
    parser.add_argument("--parity-limit", type=int, default=40, help="prompts per parity run")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--no-parity", action="store_true", help="skip (a): a rerun of the commands")
    parser.add_argument("--families", default=",".join(FAMILIES), help="(a)'s families")
    parser.add_argument(
        "--budget-s", type=float, default=420, help="skip the shapes left once this has passed"
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    tokenizer = tokenizer_of(args.tokenizer)
    result = {
        **header("gpu.py", device, argv),
        "parity": [],
        "shapes": [],
        "commands": [],
        "notes": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)

    def save():
        (args.out / "gpu.json").write_text(json.dumps(result, indent=1))
        (args.out / "gpu.md").write_text(markdown(result))

    # without a GPU the device is the CPU standing in for one: what a GPU refuses is refused
    # (attnprobe.testing.stand_in), so a device defect shows on any machine
    stand_in = stand_in_device() if device == "cpu" else contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as tmp, stand_in:
        work = Path(tmp)
        families = [] if args.no_parity else args.families.split(",")
        result["parity"] = parity(device, tokenizer, args.parity_limit, work, families)
        save()
        names = ["tiny-llama"] if args.tiny else [n for n in args.shapes.split(",") if n]
        if device.startswith("cuda"):  # CUDA's first use in a process (2 s at 1B on an H100): not timed
            shape_row(
                "warm-up", shape_folder("tiny-llama", tokenizer, work, True), device, "bfloat16", 24, work
            )
        for i, name in enumerate(names):
            if i == 1 or len(names) == 1:  # the commands after the first shape: both are needed figures
                result["commands"] = commands(device, tokenizer, work, args.tiny)
                save()
            if time.perf_counter() - started > args.budget_s:
                result["notes"].append(f"{name}: skipped, the {args.budget_s:.0f} s budget was spent")
                continue
            folder = shape_folder(name, tokenizer, work, args.tiny)
            dtype = "float32" if device == "cpu" else "bfloat16"
            try:
                result["shapes"].append(shape_row(name, folder, device, dtype, args.limit, work))
                log(f"shape {name}: {result['shapes'][-1]}")
            except Exception as exc:  # one shape's failure is recorded, the others still run
                result["notes"].append(f"{name}: {failure(exc)}")
                log(f"shape {name} failed: {exc}")
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            save()
    result["seconds"] = round(time.perf_counter() - started, 1)
    save()
    print(markdown(result))
    passed = (
        all(r["passed"] for r in result["parity"])
        and all(r["verify_passed"] for r in result["shapes"])
        and all(r["exit"] == 0 for r in result["commands"])
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
