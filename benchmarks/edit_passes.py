"""The edit sweep's bias passes with and without shared prefixes.

    python benchmarks/edit_passes.py [--repeats 3] [--out benchmarks/results]

One process, the bundled smollm2-135m in float32, the gender suite's 480 single-entity head-effects
items (x up to the cut), and the variants one edit kind of `attnprobe edit` runs on them:
  default  its defaults until 2026-11-26 (now k = 1, 5): per quarter (unit half x template half)
           and k = 1, 2, 5, 10, 20, the
           quarter's k heads on its items and 20 random sets of other heads of the same layers on
           every 4th item (14,400 variants)
  listed   as with `--heads` naming two heads: the same two on every item, 20 random sets
           (2,880 variants)
The heads stand in for the ones a run finds: the first k of a fixed random order of heads of layers
9-29 (where the demo run's heads lie; a variant's cost is set by its lowest edited layer). Each
round runs `edits.passes.edited_behaviour` for the zero edit once packed (shared prefixes, the
default) and once with one padded row per variant, in turn; figures are medians of the rounds.
Agreement: the largest |y packed - y separate|. Writes edit_passes.json and .md.
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
from attnprobe.edits.passes import Variants, _groups, _packed_groups, _sequence, edited_behaviour
from attnprobe.edits.sweep.measure import RANDOM_EVERY
from attnprobe.forward.packing import pack_trie
from attnprobe.intervene.engine import record
from attnprobe.intervene.selection import folds, random_sets
from attnprobe.intervene.sites import label_ids

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import gender_prompts  # noqa: E402

KS, DRAWS = (1, 2, 5, 10, 20), 20


def sweep_variants(pm, items, bank, listed: bool, seed: int = 0):
    """(base, heads (V, L, H), positive, negative) as one kind of the sweep runs them
    (edits/sweep.measure_kind): per quarter (unit half x template half) and k, the quarter's k heads
    on its items and the k's random sets on its every-4th items. `listed`: as with `--heads` (two
    heads, the same on every quarter)."""
    L, H = pm.info.n_layers, pm.info.n_heads
    fold_of = folds(items)
    fold = np.array([fold_of[i.item_id] for i in items])
    sampled = np.arange(len(items)) % RANDOM_EVERY == 0
    rng = np.random.default_rng(seed)
    order = [int(h) for h in rng.permutation(np.arange(9 * H, L * H))]
    ks = (2,) if listed else KS
    found = {k: {f: tuple(sorted(order[0 if listed else f * 3 :][:k])) for f in range(4)} for k in ks}
    draws = {k: random_sets(tuple(sorted(order[:k])), H, rng, DRAWS, others=True) for k in ks}
    mask = lambda heads: heads_mask([divmod(h, H) for h in heads], L, H)
    base, masks = [], []
    for f in range(4):
        for k in ks:
            for index in np.flatnonzero(fold == f).tolist():
                base.append(index), masks.append(mask(found[k][f]))
                if sampled[index]:
                    for draw in draws[k]:
                        base.append(index), masks.append(mask(draw))
    base = torch.tensor(base)
    positive = label_ids([list(items[i].positive) for i in base.tolist()])
    negative = label_ids([list(items[i].negative) for i in base.tolist()])
    return base, torch.stack(masks), positive, negative


def computed_positions(bank, base, heads) -> dict:
    """Rows x width of every pass, and the layers each runs, for both schemes."""
    L = len(bank.hidden)
    separate = sum(
        len(rows) * int(bank.lengths[base[rows]].max()) * (L - first)
        for first, rows in _groups(bank, base, heads, 4096)
    )
    packed = sum(
        len(packs)
        * max(len(pack_trie([_sequence(bank, int(base[v])) for v in p])[0]) for p in packs)
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
    suite, encoded = gender_prompts(pm.tokenizer, 10**9)
    items = suite.head_effects.items(pm.tokenizer, encoded)[0][: args.items]
    bank = record(pm, [i.x for i in items])
    out = {
        "machine": {"cpus": torch.get_num_threads(), "torch": torch.__version__},
        "items": len(bank.lengths),
        "tokens_per_item": round(float(bank.lengths.float().mean()), 2),
    }
    for scenario in ("default", "listed"):
        base, heads, positive, negative = sweep_variants(pm, items, bank, scenario == "listed")
        times, results = {"packed": [], "separate": []}, {}
        for round_ in range(args.repeats):
            for name, share in (("packed", True), ("separate", False)):
                started = time.perf_counter()
                results[name] = edited_behaviour(
                    pm, Variants(bank, Zero(), base, heads), positive, negative, share=share
                )
                times[name].append(round(time.perf_counter() - started, 2))
                print(f"{scenario}, round {round_ + 1}: {name} {times[name][-1]} s", flush=True)
        out[scenario] = {
            "variants": len(base),
            **computed_positions(bank, base, heads),
            "packed_s": statistics.median(times["packed"]),
            "separate_s": statistics.median(times["separate"]),
            "packed_rounds_s": times["packed"],
            "separate_rounds_s": times["separate"],
            "max_abs_difference": float((results["packed"] - results["separate"]).abs().max()),
        }
        out[scenario]["speedup"] = round(out[scenario]["separate_s"] / out[scenario]["packed_s"], 3)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "edit_passes.json").write_text(json.dumps(out, indent=1))
    flat = {}
    for k, v in out.items():
        flat.update({f"{k} {n}": x for n, x in v.items()} if k in ("default", "listed") else {k: v})
    table = "| measure | value |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in flat.items())
    (Path(args.out) / "edit_passes.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
