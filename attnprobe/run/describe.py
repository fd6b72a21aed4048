"""What a run would do, in words: the lines `attnprobe check` prints for a plan."""

from __future__ import annotations

from ..estimates import REFERENCE_MODEL
from .plan import RunPlan


def describe(plan: RunPlan) -> list[str]:
    """Prompts, items, analysis, measures, head effects, notes, tokens and the time estimate."""
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
    for m in plan.suite.attention:
        targets = ", ".join(m.targets)
        lines.append(
            f"attention: {m.label} -> {targets} ({m.source_agg} over source, {m.target_agg} over target)"
        )
    for m in plan.suite.next_token:
        candidates = m.candidates if isinstance(m.candidates, str) else list(m.candidates)
        lines.append(f"next_token: at {m.cut}, candidates {candidates}")
    if plan.suite.referent_choice is not None:
        lines.append(f"referent_choice: {plan.suite.referent_choice.prompt!r} after each sentence")
    if plan.suite.multiple_choice is not None:
        prompt = plan.suite.multiple_choice.prompt
        lines.append(f"multiple_choice: each option scored after context + question + {prompt!r}")
    if plan.suite.likelihood is not None:
        by = f", also by {plan.suite.likelihood.by}" if plan.suite.likelihood.by else ""
        start = {
            "bos": "after the BOS (or end-of-text) token, as lm-eval's crows_pairs scores it",
            "keep": "from its second token (first_token: keep; the first is scored only if the tokenizer "
            "adds a BOS token)",
            "exclude": "from its second token (first_token: exclude)",
        }[plan.suite.first_token]
        lines.append(f"likelihood: log p of each sentence {start}, and of its shared words{by}")
    if plan.effects is not None:
        effects, items = plan.effects, plan.effect_items
        pairs = sum(len(i.counterfactuals) for i in items)
        reasons = sorted({d.reason for d in plan.dropped})
        design = "a pronoun swap" if effects.design == "pair" else f"{effects.slot} replaced"
        held = effects.held_out_ids(items)
        exact = (
            "every head"
            if effects.exact == "all"
            else f"{effects.exact} heads on every item and of every head on {len(held)} held-out items"
        )
        dropped = f"{len(plan.dropped)} dropped{': ' + '; '.join(reasons[:2]) if reasons else ''}"
        lines.append(
            f"head_effects ({design}): {len(items)} items x {len(effects.replacements)} counterfactuals = "
            f"{pairs} pairs ({dropped}), exact patching of {exact}"
        )
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
    prompt_seconds, effect_seconds, scored = plan.estimate_seconds()
    phases = "".join(
        f", {phase.replace('_', ' ')} {seconds / 60:.1f} min ({plan.scored_tokens[phase]:,} tokens)"
        for phase, seconds in scored.items()
    )
    total = prompt_seconds + effect_seconds + sum(scored.values())
    lines.append(
        f"estimate: about {total / 60:.1f} min for {REFERENCE_MODEL} on 2 CPU cores (prompts "
        f"{prompt_seconds / 60:.1f} min, head effects {effect_seconds / 60:.1f} min{phases}); larger models "
        "take longer in proportion to their size"
    )
    return lines
