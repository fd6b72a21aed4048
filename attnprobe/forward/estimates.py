"""Dated, measured time constants and the estimates built from them (the one place for both).

Every figure was measured by `attnprobe run probes/gender.yaml` (SmolLM2-135M, float32, 2 idle CPU
cores, prefixes shared; the median of two fresh runs) on 2026-11-30 unless its comment says
otherwise; other models scale by their parameters besides the embeddings (and the every-head
patching by their layers and heads), and another device is unknown until its first chunk.
"""

from __future__ import annotations

SCORED_BATCH = 256  # sequences per scored pass (run options' default batch size)

REFERENCE_MODEL = "smollm2-135m"
REFERENCE_PARAMETERS = 106e6  # SmolLM2-135M's parameters besides the embeddings
REFERENCE_HEADS = (30, 9)  # its layers and heads per layer
PROMPTS_PER_SECOND = 358.0  # the prompt phase, prefixes shared (190 on 2026-11-23)
# Seconds per (item, counterfactual) pair, for x of REFERENCE_TOKENS tokens on average: the screen,
# every head and layer exact (held-out items, exact: all; at the reference's heads), each head of
# exact: k, the cross-fitted set (0.041, 2.9, 0.008 and 0.01 on 2026-11-23).
PAIR_SECONDS = {"screen": 0.0226, "every_head": 1.60, "head": 0.0052, "set": 0.0066}
REFERENCE_TOKENS = 5.6
# Scored continuations (likelihood, multiple choice, referent choice): distinct tokens forwarded per
# second, prefixes shared, logits only where a scored token is read (benchmarks/run.py --only scoring,
# 2026-11-23)
SCORED_TOKENS_PER_SECOND = 604.0
# Direct attribution: tokens a second of its passes (each head's write at the cut recorded), 6,737
# tokens in 33 s; it was charged the scored rate before, a third of its time
DIRECT_TOKENS_PER_SECOND = 203.0
# The reference's rate in FLOP/s (2 FLOPs per parameter and forwarded token, prompts of
# REFERENCE_TOKENS): how GPU estimates convert the CPU-measured phases into work (run/resources.py).
CPU_FLOPS = PROMPTS_PER_SECOND * REFERENCE_TOKENS * 2 * REFERENCE_PARAMETERS


def exact_passes(n_layers: int, n_heads: int) -> float:
    """Forward passes, in whole-model equivalents, of one pair's every-head patching (screen.py): each
    head's output in and out and its pattern in (3 H a layer), each layer's attention and MLP output in
    and out (4), each rerun from its own layer on ((L + 1) / 2 of the L layers on average), and all
    heads' output in and out and patterns in (3 whole passes)."""
    return (3 * n_heads + 4) * (n_layers + 1) / 2 + 3


# Statistics and report (run on the host whatever the device): a base and a cost per head and prompt
# of a suite with a measure that has statistics per head (attention's head_stats). Fitted on the full
# gender suite (6,840 prompts, float32, 2 CPU cores, write_report in one process) at 144 heads (12.4 s)
# and 1,024 heads (47.2 s, the mean of two; random Llama shapes of tiny width), 2026-11-30 after the
# slope tests fitted each pattern of missing values at once (1,024 heads took 60.0 s before, in the same
# sitting); SmolLM2's 270 heads then took 17.7 s against 17.4 s predicted.
REPORT_SECONDS = 6.71
REPORT_SECONDS_PER_HEAD_PROMPT = 5.78e-6


def report_seconds(n_heads: int, n_prompts: int, per_head: bool) -> float:
    """Statistics and report of a run on 2 CPU cores (`per_head`: a measure with statistics per head)."""
    return REPORT_SECONDS + (REPORT_SECONDS_PER_HEAD_PROMPT * n_heads * n_prompts if per_head else 0.0)


# Before a run computes: loading its weights and, on the first run of a folder's files, hashing them
# (the files and the weights in memory at once; cached after). A 1.38 GB bfloat16 checkpoint of a
# random Llama on 2 CPU cores, 2026-11-30, the files in the page cache: loaded in 0.64 s, hashed in
# 1.1 s; the imports 3.9 s.
LOAD_BYTES_PER_SECOND = 2.2e9
HASH_BYTES_PER_SECOND = 1.25e9
START_SECONDS = 3.9


def load_seconds(weight_bytes: float) -> float:
    """Start-up, loading and hashing (a folder's first run; later runs take the hashes from the cache)."""
    return START_SECONDS + weight_bytes / LOAD_BYTES_PER_SECOND + weight_bytes / HASH_BYTES_PER_SECOND


def prompt_seconds(n_prompts: int) -> float:
    """The prompt phase of the reference model."""
    return n_prompts / PROMPTS_PER_SECOND


def scored_seconds(n_tokens: int, rate: float = SCORED_TOKENS_PER_SECOND) -> float:
    """A phase of the prompts that forwards `n_tokens` distinct tokens at `rate` tokens a second (the
    scored phases', or DIRECT_TOKENS_PER_SECOND), on the reference model's 2 CPU cores."""
    return n_tokens / rate


def forwarded_tokens(encoded, sequences) -> int:
    """The tokens a scored phase forwards: every prompt's (prefix + tail) sequences, sorted and packed
    as scoring.py packs them (each pack's trie nodes once)."""
    rows = []
    for e in encoded:
        scored = sequences(e)
        if scored is not None and scored[1]:
            rows += [tuple(scored[0]) + tuple(tail) for _, tail in scored[1].values()]
    from .packing import sorted_packs  # torch: imported where a count is made, not by a suite's parse

    return sum(sorted_packs(rows, SCORED_BATCH)[1])


def head_effect_seconds(
    measure, items, parameters: float = REFERENCE_PARAMETERS, heads: tuple[int, int] = REFERENCE_HEADS
) -> float:
    """Both head-effect phases of `items` (PatchItem) on 2 CPU cores: the reference speed scaled by
    sequence length and by the model's parameters besides the embeddings; the every-head patching of
    the held-out items also by the passes it takes at this model's (layers, heads)."""
    c, held = PAIR_SECONDS, measure.held_out_ids(items)
    per_pair = c["screen"] + c["set"] + c["head"] * (0 if measure.exact == "all" else measure.exact)
    every_head = c["every_head"] * exact_passes(*heads) / exact_passes(*REFERENCE_HEADS)
    seconds = sum(
        len(item.counterfactuals)
        * len(item.x)
        / REFERENCE_TOKENS
        * (per_pair + every_head * (measure.exact == "all" or item.item_id in held))
        for item in items
    )
    return seconds * parameters / REFERENCE_PARAMETERS


def model_parameters(module) -> int:
    """Parameters besides the input and output embeddings (tied: one tensor, as parameters() counts it)."""
    from ..model.shapes import module_parameters

    total, embeddings = module_parameters(module)
    return max(total - embeddings, 1)


def head_effects_text(measure, items, module, heads: tuple[int, int]) -> str:
    """The expected time of the head effects on this model (its `heads`: layers, heads per layer), as
    the run logs it."""
    if next(module.parameters()).device.type != "cpu":
        return "time unknown on this device"
    minutes = head_effect_seconds(measure, items, model_parameters(module), heads) / 60
    return f"{minutes:.1f} min on 2 CPU cores"
