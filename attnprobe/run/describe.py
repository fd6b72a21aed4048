"""What a run would do, in words: the lines `attnprobe check` prints for a plan."""

from __future__ import annotations

from ..forward.estimates import REFERENCE_MODEL
from .plan import RunPlan


def describe(plan: RunPlan, device: str = "cpu") -> list[str]:
    """Prompts, items, analysis, measures, head effects, notes, tokens and, on a CPU, the time
    estimate (another device's time is resources.footprint_lines')."""
    lines = []
    prompts = [e.prompt for e in plan.encoded]
    a = plan.suite.analysis
    n_templates, n_items = len({p.template_id for p in prompts}), len({p.item_id for p in prompts})
    lines.append(
        f"suite {plan.suite.name} ({plan.suite.path}): {n_templates} templates or sentence sets, "
        f"{len(prompts)} prompts, {n_items} items"
    )
    if a.paired:
        covariate = (
            f"; covariate {a.name(a.covariate)} across {a.name(a.unit)}s" if a.covariate else "; no covariate"
        )
        groups = "".join(f"; group {g} ({len(ids)})" for g, ids in a.groups.items())
        lines.append(
            f"analysis: {a.positive} - {a.negative} by {a.name(a.contrast)}; clusters "
            f"{a.cluster_text}{covariate}{groups}"
        )
    else:
        labels = ", ".join(a.labels) or "none"
        lines.append(f"analysis: no two labels compared (labels: {labels}): descriptive tables only")
    for kind, declared, part in plan.kinds():
        if kind.declared(plan.suite):
            lines += kind.describe(declared, part)
    for line in plan.suite.skipped:
        lines.append(f"skipped: {line}")
    for line in plan.notes:
        lines.append(f"note: {line}")
    n, shared = max(1, len(plan.encoded)), plan.sharing
    sharing = (
        f"{shared['tokens_forwarded'] / n:.2f} with shared prefixes once"
        if plan.blocker is None
        else f"prefixes not shared: {plan.blocker}"
    )
    longest = max((len(e.ids) for e in plan.encoded), default=0)
    lines.append(
        f"tokens ({plan.spec} tokenizer): {shared['tokens_without_sharing'] / n:.2f} forwarded per prompt "
        f"({sharing}), longest prompt {longest}"
    )
    return lines + (_cpu_estimate(plan) if device.startswith("cpu") else [])


def _cpu_estimate(plan: RunPlan) -> list[str]:
    """The phases at the reference model's measured rates on 2 CPU cores, scaled to this model by its
    parameters besides the embeddings (the head effects' every-head patching also by its layers and
    heads: Measure.estimate); the reference's own time where the config's size is unknown."""
    from ..model.footprint import Shape
    from .resources import size_scale

    shape = Shape.of(plan.config)
    scale = size_scale(shape) if shape else 1.0
    phases = [(name, seconds * scale, tokens) for name, seconds, tokens in plan.estimate_seconds()]
    each = ", ".join(
        f"{name.replace('_', ' ')} {seconds / 60:.1f} min"
        + (f" ({tokens:,} tokens)" if tokens is not None else "")
        for name, seconds, tokens in phases
    )
    report = plan.report_seconds()
    total = sum(seconds for _, seconds, _ in phases) + report
    if not shape:
        scaled = f"{REFERENCE_MODEL}'s time (this config's size is unknown; larger models take longer)"
    else:  # the rates are FLOP-bound: a much smaller model's fixed costs per pass and layer stay
        scaled = f"{REFERENCE_MODEL}'s measured rates x {scale:.2f} by parameters besides the embeddings"
        scaled += "; a lower bound at this size, where fixed costs per layer dominate" * (scale < 0.5)
    return [
        f"estimate: about {total / 60:.1f} min on 2 CPU cores ({each}, statistics and report "
        f"{report / 60:.1f} min): {scaled}"
    ]
