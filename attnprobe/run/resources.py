"""A planned run's memory and time on a device, from the model's config and the plan (no weights): the
lines `attnprobe check --device` prints and the working set `run` checks before loading
(model/footprint.py holds the formulas)."""

from __future__ import annotations

from ..defaults import ROW_TOKENS
from ..forward.estimates import CPU_FLOPS, REFERENCE_PARAMETERS, load_seconds
from ..model.footprint import GB, HOST_SECONDS_PER_PROMPT, Shape, card, patch_budget, peak_seconds
from .plan import RunPlan


def phase_memory(plan: RunPlan, shape: Shape) -> dict[str, float]:
    """Working bytes of each phase of the plan (the weights besides): the prompt passes, and each
    measure's phases that record every layer (Measure.held)."""
    longest = _longest(plan)
    batch = max((len(b.indices) for chunk in plan.chunks for b in chunk), default=1)
    memory = {"prompts": shape.forward_working(plan.dtype, batch * longest, batch)}
    for kind, declared, part in plan.kinds():
        for phase, tokens, sequences in kind.held(declared, part):
            memory[phase] = shape.recorded_working(plan.dtype, tokens, sequences, longest)
    return memory


def _longest(plan: RunPlan) -> int:
    """Tokens of the plan's longest forwarded prompt."""
    return max((e.n_forward for e in plan.encoded), default=1)


def _budget_line(plan: RunPlan, shape: Shape, device: str, left: float) -> str:
    """The patched passes' budget (model.footprint.patch_budget) from the memory free at the peak
    (`left`) plus what the peak's own patched pass of ROW_TOKENS holds."""
    on_gpu = str(device).startswith("cuda")
    room = left + shape.forward_working(plan.dtype, ROW_TOKENS, 0)
    budget = patch_budget(shape, plan.dtype, room, _longest(plan), on_gpu)
    where = (
        f"half of the {max(room, 0) / GB:.1f} GB a patched pass may use at the peak; the run sizes them "
        "from the memory free when it patches"
        if on_gpu
        else "the CPU's budget"
    )
    return (
        f"prompt passes: up to {plan.settings['batch_size']} prompts each; "
        f"patched passes (patching, edits): up to {budget:,} rows x tokens each ({where})"
    )


def size_scale(shape: Shape) -> float:
    """The model's work per token against the reference model's: parameters besides the embeddings (how
    the reference's measured CPU seconds are scaled, on a CPU and into work for a GPU)."""
    return (shape.parameters - shape.embeddings) / REFERENCE_PARAMETERS


def phase_seconds(plan: RunPlan, shape: Shape, device_card: str) -> dict[str, float | None]:
    """Seconds of each phase on a known GPU (None where its peak is unknown, e.g. a CPU): the prompts
    from their FLOPs and host time, every other phase from its work on the reference CPU
    (Measure.estimate) converted to FLOPs at this model's size."""
    flops = peak_seconds(shape, plan.dtype, plan.sharing["tokens_forwarded"], device_card, "prompts")
    seconds = {"prompts": flops and flops + len(plan.encoded) * HOST_SECONDS_PER_PROMPT}
    scale = size_scale(shape)
    for phase, reference_seconds, _ in plan.estimate_seconds()[1:]:
        tokens = reference_seconds * CPU_FLOPS * scale / shape.flops_per_token()
        seconds[phase.replace("_", " ")] = peak_seconds(shape, plan.dtype, tokens, device_card, phase)
    return seconds


def run_seconds(plan: RunPlan, shape: Shape, device_card: str) -> tuple[float, dict, float]:
    """check's three parts of a run on a GPU: loading and hashing the weights (a folder's first run),
    each device phase's seconds (phase_seconds; None where the card's peak is unknown), statistics and
    report on the host."""
    loading = load_seconds(shape.weights(plan.dtype))
    return loading, phase_seconds(plan, shape, device_card), plan.report_seconds()


def working_bytes(plan: RunPlan) -> float:
    shape = Shape.of(plan.config)
    return max(phase_memory(plan, shape).values()) if shape else 0.0


def footprint_lines(plan: RunPlan, device: str) -> list[str]:
    """Memory against the device's free memory, and time where the device's peak is known."""
    shape = Shape.of(plan.config)
    if shape is None:
        return [f"memory: not estimated ({plan.spec}'s config needs its own code to count parameters)"]
    name, free, total = card(device)
    weights = shape.weights(plan.dtype)
    memory = phase_memory(plan, shape)
    each = ", ".join(f"{phase} {(weights + b) / GB:.1f} GB" for phase, b in memory.items())
    peak = weights + max(memory.values())
    verdict = "fits" if peak <= free else "does NOT fit: run refuses it (see --dtype, --device-map auto)"
    lines = [
        f"memory on {device} ({name}, {free / GB:.1f} of {total / GB:.1f} GB free): weights "
        f"{weights / GB:.2f} GB ({shape.parameters / 1e9:.2f} B parameters in {plan.dtype}); peak by phase: "
        f"{each}; {verdict}",
        _budget_line(plan, shape, device, free - peak),
    ]
    loading, seconds, host = run_seconds(plan, shape, name)
    if all(s is not None for s in seconds.values()):
        each = ", ".join(f"{phase} {s / 60:.2f} min" for phase, s in seconds.items())
        on_device = sum(seconds.values())
        lines.append(
            f"time on {name} in {plan.dtype}: about {on_device / 60:.2f} min ({each}), from "
            f"{shape.flops_per_token() / 1e9:.1f} GFLOP per token at the shares of the dense peak "
            "benchmarks/gpu_pace.py measured on an H200 (the full gender suite, Llama 3.1 8B shape); before "
            f"it, loading and hashing the weights about {loading / 60:.1f} min (hashed on these files' first "
            f"run only); after it, statistics and report about {host / 60:.1f} min on the host (2 CPU "
            f"cores): about {(loading + on_device + host) / 60:.1f} min in all"
        )
    return lines
