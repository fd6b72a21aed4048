"""Exact patching of every head: attnprobe against TransformerLens, nnsight and its own reference.

    python benchmarks/patching_peers.py [--items 48] [--repeats 3] [--out benchmarks/results]

One process, the bundled smollm2-135m in float32, the first `--items` single-entity items of the
gender suite (plan order) that have a counterfactual x' of x's length with the occupation replaced
by "woman". For each item and every head (l, h): y = log p(positive) - log p(negative) at the cut of x
with head (l, h)'s output (its per-head z, before the output projection) taken from x' at every
position from the swapped word on. x and x' are equal up to the swapped word, so this is also the
patch at all positions that the peers' functions apply:

  attnprobe         intervene.engine: every variant starts at its layer from the recorded hidden state,
                    the clean prefix read from recorded keys and values, variants of all items in
                    shared passes, the lm head only on the label tokens
  transformer_lens  TransformerBridge + patching.get_act_patch_attn_head_out_all_pos (one forward per
                    head), items batched by token length (its best case: the function takes no mask)
  nnsight           the tutorial's loop: one trace per head setting the head's slice of o_proj's
                    input to x''s, items batched by token length
  reference         tests/reference_patching (whole forward passes, one item at a time), timed on a
                    few items and counted per item

The peers are timed where installed (pip install -e '.[bench]'). Figures are medians of rounds in
which every tool runs once in turn (the first round included: each round's times are written too).
Agreement: the largest |y - y attnprobe| over items and heads.
The floor: FLOPs of the patched suffixes (each variant's positions from the swapped word on, its
layers from the patched one up; in the top layer only keys and values there and the rest at the last
position; the label tokens' logits) at the matmul peak measured in this run.
Writes patching_peers.json and .md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import attnprobe
from attnprobe.intervene.engine import Variants, patched, record
from attnprobe.intervene.sites import label_ids

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import gender_prompts, matmul_peak  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORD = "woman"


def patch_pairs(pm, n_items: int) -> list[tuple]:
    """(x, x', label ids positive, negative) of the first n items with an equal-length x' for WORD."""
    suite, encoded = gender_prompts(pm.tokenizer, 10**9)
    out = []
    for item in suite.head_effects.items(pm.tokenizer, encoded)[0]:
        cf = next((c for c in item.counterfactuals if c.word == WORD and item.same_length(c)), None)
        if cf is not None and len(out) < n_items:
            out.append((item.x, cf.x_cf, list(item.positive), list(item.negative)))
    return out


def by_length(pairs: list[tuple]) -> list[list[int]]:
    """Indices of the pairs grouped by token length: the batches a tool without padding takes."""
    groups: dict[int, list[int]] = {}
    for i, (x, *_) in enumerate(pairs):
        groups.setdefault(len(x), []).append(i)
    return list(groups.values())


def y_of_logits(logits: torch.Tensor, positive: list[list[int]], negative: list[list[int]]) -> torch.Tensor:
    """y per row of last-position logits (B, V): log-sum-exp of each side's logits (the softmax's
    normaliser cancels in the difference)."""
    side = lambda sets: torch.stack([torch.logsumexp(row[ids], 0) for row, ids in zip(logits, sets)])
    return side(positive) - side(negative)


def first_patched(x: torch.Tensor, x_cf: torch.Tensor) -> int:
    return int((x != x_cf).nonzero()[0, 0])


def attnprobe_every_head(pm, pairs) -> torch.Tensor:
    """(N, L, H) through intervene.engine: one Variants row per item and head."""
    L, H, N = pm.info.n_layers, pm.info.n_heads, len(pairs)
    bank = record(pm, [x for x, *_ in pairs] + [x_cf for _, x_cf, *_ in pairs])
    heads = torch.eye(L * H, dtype=torch.bool).view(L * H, L, H)
    base = torch.arange(N).repeat_interleave(L * H)
    at = torch.tensor([first_patched(x, x_cf) for x, x_cf, *_ in pairs]).repeat_interleave(L * H)
    variants = Variants(
        base=base,
        donor=base + N,
        at=at,
        donor_at=at,
        output=heads.repeat(N, 1, 1),
        pattern=torch.zeros(N * L * H, L, H, dtype=torch.bool),
        mlp=torch.zeros(N * L * H, L, dtype=torch.bool),
        positive=label_ids([pairs[i][2] for i in base.tolist()]),
        negative=label_ids([pairs[i][3] for i in base.tolist()]),
    )
    return patched(pm, bank, variants).view(N, L, H)


def reference_every_head(pm, pairs) -> torch.Tensor:
    """(n, L, H) with tests/reference_patching, one item at a time."""
    sys.path.insert(0, str(ROOT / "tests"))
    from reference_patching import Rows, one_hot_heads, patched_behaviour
    from reference_patching import record as record_one

    L, H = pm.info.n_layers, pm.info.n_heads
    out = []
    for x, x_cf, positive, negative in pairs:
        at = torch.arange(first_patched(x, x_cf), len(x))
        _, donor = record_one(pm.model, x_cf, positive, negative)
        rows = Rows.empty(L * H, L, H)
        rows.output[:] = one_hot_heads(L, H)
        out.append(patched_behaviour(pm.model, x, rows, donor, at, at, positive, negative).view(L, H))
    return torch.stack(out)


def lens_every_head(pm, pairs):
    """A function computing (N, L, H) with TransformerLens, or None where it is not installed."""
    try:
        from transformer_lens import patching
        from transformer_lens.model_bridge import TransformerBridge
    except ImportError:
        return None
    bridge = TransformerBridge.boot_transformers(
        "HuggingFaceTB/SmolLM2-135M", hf_model=copy.deepcopy(pm.model), tokenizer=pm.tokenizer
    )
    bridge.enable_compatibility_mode(no_processing=True)  # hook_z etc., weights left as they are
    patching.tqdm = lambda rows, **_: rows  # its progress bar (a line per head) off, not timed
    groups = by_length(pairs)

    @torch.inference_mode()
    def run() -> torch.Tensor:
        y = torch.empty(len(pairs), pm.info.n_layers, pm.info.n_heads)
        for group in groups:
            x = torch.stack([pairs[i][0] for i in group])
            x_cf = torch.stack([pairs[i][1] for i in group])
            positive, negative = [pairs[i][2] for i in group], [pairs[i][3] for i in group]
            _, clean_cache = bridge.run_with_cache(x_cf)
            result = patching.get_act_patch_attn_head_out_all_pos(
                bridge,
                x,
                clean_cache,
                lambda logits, p=positive, n=negative: y_of_logits(logits[:, -1], p, n),
                reduce="none",
            )
            y[group] = result.values.permute(2, 0, 1).float()
        return y

    return run


def nnsight_every_head(pm, pairs):
    """A function computing (N, L, H) with nnsight's tutorial loop, or None where it is not installed."""
    try:
        from nnsight import LanguageModel
    except ImportError:
        return None
    traced = LanguageModel(copy.deepcopy(pm.model), tokenizer=pm.tokenizer)
    L, H = pm.info.n_layers, pm.info.n_heads
    D = pm.model.config.hidden_size // H
    groups = by_length(pairs)

    @torch.inference_mode()
    def run() -> torch.Tensor:
        y = torch.empty(len(pairs), L, H)
        for group in groups:
            x = torch.stack([pairs[i][0] for i in group])
            x_cf = torch.stack([pairs[i][1] for i in group])
            positive, negative = [pairs[i][2] for i in group], [pairs[i][3] for i in group]
            clean, got = [], []  # filled inside the traces (names bound there do not leave a function)
            with traced.trace(x_cf):
                clean.extend(layer.self_attn.o_proj.input.save() for layer in traced.model.layers)
            for layer in range(L):
                for head in range(H):
                    with traced.trace(x):
                        z = traced.model.layers[layer].self_attn.o_proj.input
                        z[:, :, head * D : (head + 1) * D] = clean[layer][:, :, head * D : (head + 1) * D]
                        got.append(traced.lm_head.output[:, -1].save())
                    logits = got.pop()
                    y[group, layer, head] = y_of_logits(logits, positive, negative).float()
        return y

    return run


def floor_gflop(pm, pairs) -> float:
    """GFLOP of the patched suffixes: per variant, its positions from the swapped word on times the
    layers from the patched one up below the top (2 x each layer's parameters per token); in the top
    layer only the keys and values at those positions and the rest of the layer at the last one
    (nothing else of the top layer reaches the logits); plus two label logits."""
    L, H = pm.info.n_layers, pm.info.n_heads
    layers = pm.model.model.layers
    per_layer = 2 * sum(p.numel() for p in layers[0].parameters())
    attention = layers[-1].self_attn
    keys_values = 2 * sum(p.numel() for m in (attention.k_proj, attention.v_proj) for p in m.parameters())
    width = pm.model.config.hidden_size
    total = 0.0
    for x, x_cf, *_ in pairs:
        positions = len(x) - first_patched(x, x_cf)
        top = positions * keys_values + (per_layer - keys_values)
        total += H * sum(positions * (L - 1 - layer) * per_layer + top + 2 * 2 * width for layer in range(L))
    return total / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reference-items", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    pm = attnprobe.load_model("smollm2-135m")
    pairs = patch_pairs(pm, args.items)
    tools = {"attnprobe": lambda: attnprobe_every_head(pm, pairs)}
    for name, make in (("transformer_lens", lens_every_head), ("nnsight", nnsight_every_head)):
        run = make(pm, pairs)
        if run is not None:
            tools[name] = run
    peak_before = matmul_peak()
    rounds, answers = {name: [] for name in tools}, {}
    for k in range(args.repeats):  # every tool once per round, in turn; the first round is timed too
        for name, run in tools.items():
            start = time.perf_counter()
            answers[name] = run()
            rounds[name].append(time.perf_counter() - start)
            print(f"round {k + 1}: {name} {rounds[name][-1]:.1f} s", flush=True)
    seconds = {name: statistics.median(spent) for name, spent in rounds.items()}
    reference = pairs[: args.reference_items]
    start = time.perf_counter()
    answers["reference"] = reference_every_head(pm, reference)
    seconds["reference"] = (time.perf_counter() - start) * len(pairs) / len(reference)
    peak = (peak_before + matmul_peak()) / 2
    mine = answers["attnprobe"]
    result = {
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        "items": len(pairs),
        "heads": pm.info.n_layers * pm.info.n_heads,
        "variants": len(pairs) * pm.info.n_layers * pm.info.n_heads,
        "length_groups": len(by_length(pairs)),
        "matmul_peak_gflop_s": peak,
        "floor_s": floor_gflop(pm, pairs) / peak,
        **{f"{name}_s": s for name, s in seconds.items()},
        **{f"{name}_rounds_s": [round(t, 2) for t in spent] for name, spent in rounds.items()},
        **{
            f"attnprobe_over_{name}": s / seconds["attnprobe"]
            for name, s in seconds.items()
            if name != "attnprobe"
        },
        **{
            f"max_abs_difference_{name}": float((y - mine[: len(y)]).abs().max())
            for name, y in answers.items()
            if name != "attnprobe"
        },
    }
    result["attnprobe_share_of_floor"] = result["floor_s"] / seconds["attnprobe"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "patching_peers.json").write_text(json.dumps(result, indent=1))
    lines = ["| measure | value |", "|---|---|"] + [
        f"| {key} | {value:.4g} |" if isinstance(value, float) else f"| {key} | {value} |"
        for key, value in result.items()
    ]
    (args.out / "patching_peers.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
