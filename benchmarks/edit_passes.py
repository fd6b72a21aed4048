"""The edit sweep's bias passes with and without shared prefixes.

    python benchmarks/edit_passes.py [--repeats 3] [--out benchmarks/results]

One process, the bundled smollm2-135m in float32, the gender suite's 480 single-entity head-effects
items (x up to the cut), and the variants one edit kind of `attnprobe edit` runs on them with its
defaults: per quarter of the items and k = 1, 2, 5, 10, 20, its k heads on the quarter's items and
20 random sets of other heads of the same layers on every 4th item (14,400 variants). The heads
stand in for the ones a run finds: the first k of a fixed random order of heads of layers 9-29
(where the demo run's heads lie; a variant's cost is set by its lowest edited layer). Each round
runs `edits.passes.edited_behaviour` for the zero edit once packed (shared prefixes, the default)
and once with one padded row per variant, in turn; figures are medians of the rounds. Agreement:
the largest |y packed - y separate|. Writes edit_passes.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import attnprobe
from attnprobe.edits.kinds import Zero, heads_mask
from attnprobe.edits.passes import _groups, _packed_groups, edited_behaviour
from attnprobe.packing import pack_trie
from attnprobe.patching.engine import record
from attnprobe.patching.selection import random_sets
from attnprobe.patching.sites import label_ids

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import gender_prompts  # noqa: E402

KS, DRAWS, EVERY = (1, 2, 5, 10, 20), 20, 4


def sweep_variants(pm, n_items: int, seed: int = 0):
    """(bank, base, heads (V, L, H), positive, negative) as one kind of the sweep runs them."""
    suite, encoded = gender_prompts(pm.tokenizer, 10**9)
    items = suite.head_effects.items(pm.tokenizer, encoded)[0][:n_items]
    bank = record(pm, [i.x for i in items])
    L, H = pm.info.n_layers, pm.info.n_heads
    rng = np.random.default_rng(seed)
    order = [int(h) for h in rng.permutation(np.arange(9 * H, L * H))]
    base, masks = [], []
    for f in range(4):  # a quarter of the items each
        for k in KS:
            found = tuple(sorted(order[f * 3 : f * 3 + k]))
            draws = random_sets(found, H, rng, DRAWS, others=True)
            for index in range(f, len(items), 4):
                base.append(index), masks.append(heads_mask([divmod(h, H) for h in found], L, H))
                if index % EVERY == 0:
                    for draw in draws:
                        base.append(index), masks.append(heads_mask([divmod(h, H) for h in draw], L, H))
    base = torch.tensor(base)
    positive = label_ids([list(items[i].positive) for i in base.tolist()])
    negative = label_ids([list(items[i].negative) for i in base.tolist()])
    return bank, base, torch.stack(masks), positive, negative


def computed_positions(bank, base, heads) -> dict:
    """Rows x width of every pass, and the layers each runs, for both schemes."""
    L = len(bank.hidden)
    separate = sum(
        len(rows) * int(bank.lengths[base[rows]].max()) * (L - first)
        for first, rows in _groups(bank, base, heads, 4096)
    )
    packed = sum(
        len(packs)
        * max(
            len(pack_trie([tuple(bank.ids[base[v], : bank.lengths[base[v]]].tolist()) for v in p])[0])
            for p in packs
        )
        * (L - first)
        for first, packs in _packed_groups(bank, base, heads, 4096)
    )
    return {"separate_position_layers": separate, "packed_position_layers": packed}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=480)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()
    torch.manual_seed(0)
    pm = attnprobe.load_model("smollm2-135m")
    bank, base, heads, positive, negative = sweep_variants(pm, args.items)
    times = {"packed": [], "separate": []}
    results = {}
    for round_ in range(args.repeats):
        for name, share in (("packed", True), ("separate", False)):
            started = time.perf_counter()
            results[name] = edited_behaviour(pm, bank, Zero(), base, heads, positive, negative, share=share)
            times[name].append(round(time.perf_counter() - started, 2))
            print(f"round {round_ + 1}: {name} {times[name][-1]} s", flush=True)
    out = {
        "machine": {"cpus": torch.get_num_threads(), "torch": torch.__version__},
        "items": len(bank.lengths),
        "variants": len(base),
        "tokens_per_item": float(bank.lengths.float().mean()),
        **computed_positions(bank, base, heads),
        "packed_s": statistics.median(times["packed"]),
        "separate_s": statistics.median(times["separate"]),
        "packed_rounds_s": times["packed"],
        "separate_rounds_s": times["separate"],
        "max_abs_difference": float((results["packed"] - results["separate"]).abs().max()),
    }
    out["speedup"] = out["separate_s"] / out["packed_s"]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "edit_passes.json").write_text(json.dumps(out, indent=1))
    table = "| measure | value |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in out.items())
    (Path(args.out) / "edit_passes.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
