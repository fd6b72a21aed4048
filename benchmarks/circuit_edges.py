"""The edge search's cost (`edit --circuits --circuit-grain edges`): the attribution of every edge,
and exact edge runs per second at several pass sizes.

The gender suite's first N items on a bundled model, x' their "person" versions; the runs are the
circuits of every size of the edge grid, chosen by random scores and pruned (as the search prunes
its own), each on every pair. The same runs are timed with each PASS_BYTES (--log2-bytes: the
memory one pass's per-edge tensors may take, which sizes its rows); their y must agree.

    .venv/bin/python benchmarks/circuit_edges.py [--model smollm2-135m] [--items 48] [--repeats 3]

Prints the attribution's time (EAP and EAP-IG of every edge), then one line per pass size: rows per
pass, median seconds over the repeats, runs per second, and the largest difference in y from the
first pass size.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import attnprobe
from attnprobe.analyses.circuits import edge_passes
from attnprobe.analyses.circuits.edges import EdgeGraph
from attnprobe.analyses.circuits.runs import Masks, Patching, part_runs
from attnprobe.analyses.senders import reference_pairs
from attnprobe.edits.inputs import _pairs
from attnprobe.intervene.engine import record
from attnprobe.run import RunOptions, plan_run
from attnprobe.suite import load_suite


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--items", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--log2-bytes", default="28,26,30", help="PASS_BYTES to time, as powers of two")
    args = parser.parse_args()
    torch.manual_seed(0)
    plan = plan_run(load_suite("probes/gender.yaml"), args.model, RunOptions())
    items = plan.parts["head_effects"].items[: args.items]
    model = attnprobe.load_model(plan.spec)
    module = model.model
    bank = record(module, [i.x for i in items])
    donor = record(module, [cf.x_cf for i in items for cf in i.counterfactuals if cf.word == "person"])
    pairs = reference_pairs(items, "person")
    labels = _pairs([(i.positive, i.negative) for i in items])
    graph = EdgeGraph(len(bank.hidden), bank.outputs[0].shape[1], bank.keys[0].shape[1])
    patching = Patching(module, bank, donor, pairs, labels, graph)
    started = time.perf_counter()
    fold = np.arange(len(pairs)) % 4
    edge_passes.edge_attributions(patching, patching.sites, rng_covariate(len(pairs)), fold)
    seconds = time.perf_counter() - started
    print(f"{plan.spec}: the attribution of {graph.size:,} edges on {len(pairs)} pairs in {seconds:.1f} s")
    rng, masks = np.random.default_rng(0), Masks()
    scores = rng.normal(size=graph.size)
    ids = [masks.add(~graph.top(scores, n)) for n in graph.sizes()]
    runs = [(i, "", "", 0, m) for m in ids for i in range(len(pairs))]
    first = None
    for size in [2 ** int(b) for b in args.log2_bytes.split(",")]:
        edge_passes.PASS_BYTES = size
        seconds = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            y = part_runs(patching, runs, masks)
            seconds.append(time.perf_counter() - started)
        first = y if first is None else first
        rows = edge_passes.rows_per_pass(graph, bank.hidden[0].shape[-1], 8, 2)
        median = float(np.median(seconds))
        print(
            f"{plan.spec}: PASS_BYTES 2^{int(np.log2(size))} (about {rows} rows at 8 aligned positions): "
            f"{len(runs)} runs in {median:.1f} s median of {args.repeats}, {len(runs) / median:.1f} runs/s, "
            f"largest |y - y(first)| {np.abs(y - first).max():.2e}"
        )


def rng_covariate(n: int) -> np.ndarray:
    return np.random.default_rng(1).random(n)


if __name__ == "__main__":
    main()
