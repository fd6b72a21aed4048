"""The exact runs that judge circuits: x with a set of parts taking x''s output (graph.py).

Per comparison (x' the reference word's version, or another occupation's item: senders.compared_pairs)
and per circuit size n (graph.Graph.sizes, and 0: the embeddings alone):

  faithfulness, in-sample   x with every part outside C patched, C the top n on every item
  faithfulness, held-out    the same, C the top n on the item's opposite quarter (other units and
                            other templates: no item judges a circuit chosen on its unit or template)
  knocked out, held-out     x with C's parts (not the embeddings) patched: what is left without C
  a hypothesis              a circuit given (the run's top heads), in-sample, held out, knocked out
  subsets K                 completeness (Wang et al. 2022): C less K and the model less K, for
                            SUBSETS random halves of the held-out C and its top half by |score|
  faithfulness, random d    C n parts drawn at random (the same draw for every item): the baseline
  alone                     x with one part patched: AGREEMENT_TOP parts of largest |score| and as
                            many drawn at random, exact beside their attribution (agreement)

The last three on every graph.sampled_every-th pair only (4th for parts, 8th for edges). A run that
repeats another of its pair (the circuit of size 0 in- and out of sample; nothing patched) is
computed once.

Raw rows: the pair's item, y = y(x), y_cf = y(x'), and the run's family, measure, circuit, size (parts
beside the embeddings) and y_patched; the attributions per item and part; the tables (tables.py)
are made from them alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from ...attention.capture import editing
from ...intervene.engine import Bank, HeadPatch, aligned, halved_on_oom, mlp_patch
from ...intervene.rerun import rerun_y
from ...intervene.sites import behaviour_rows, mlp_outputs
from ...model.anatomy import mlp_modules
from ...model.footprint import device_patch_budget
from ..senders import pair_tensors
from .edge_passes import edge_pass, first_layer, rows_per_pass
from .edges import EdgeGraph
from .graph import Graph
from .wiring import edge_sites

RANDOM_CIRCUITS = 5  # random circuits per size (the baseline's spread)
AGREEMENT_TOP = 10  # parts patched alone: the top by |score| on every item, and as many at random
IN_SAMPLE, HELD_OUT, RANDOM = "in-sample", "held-out", "random"
ATTRIBUTED = "top n by EAP-IG"  # the family of the circuits found (others: the hypotheses' names)
FAITHFULNESS, KNOCKED_OUT, ALONE = "faithfulness", "knocked out", "alone"
LESS_C, LESS_M = "circuit less K", "model less K"  # completeness over subsets K (Wang et al. 2022)
GREEDY = "subset greedy"  # the worst subset found greedily (search.py)
SUBSETS = 3  # random halves of a circuit (and its top half by |score|) whose removal is judged
PARTS, EDGES = "parts", "edges"  # the grains a circuit is searched at
CIRCUITS_VERSION = 6  # of the raw rows (6: greedy subsets in rounds); a saved part of another is redone


@dataclass(frozen=True)
class Patching:
    """What every run of one comparison reads: the model, x's and x''s clean runs, the pairs, the
    label ids by x's rows, and the parts or edges (graph.Graph, edges.EdgeGraph)."""

    module: torch.nn.Module
    bank: Bank
    donor: Bank
    pairs: list
    labels: torch.Tensor
    graph: Graph | EdgeGraph

    @cached_property
    def sites(self):
        return edge_sites(self.module)


class Masks:
    """The distinct masks of patched parts or edges of a plan, each held once; runs name them by index."""

    def __init__(self):
        self.arrays: list[np.ndarray] = []
        self._ids: dict = {}

    def add(self, mask: np.ndarray) -> int:
        key = np.packbits(mask).tobytes()
        if key not in self._ids:
            self._ids[key] = len(self.arrays)
            self.arrays.append(mask)
        return self._ids[key]


@dataclass
class Plan:
    """The runs (pair, family, measure, circuit, size, mask id), the masks, and per (family, size) the
    in-sample circuit's (units kept, parts touched)."""

    runs: list
    masks: Masks
    counts: dict


def plan_runs(graph, scores: dict, fold, hypotheses=None, seed: int = 0) -> Plan:
    """Every run, as the module says. `scores`: fold_scores; `hypotheses`: name -> {"all": (size,) bool,
    fold: chosen without that fold's items}, circuits given rather than found, judged the same way
    (their family is their name)."""
    masks, rng = Masks(), np.random.default_rng(seed)
    sizes = [0, *graph.sizes()]
    grid = {n: {f: graph.top(q, n) for f, q in scores.items()} for n in sizes}
    drawn = {n: [masks.add(~graph.random(n, rng)) for _ in range(RANDOM_CIRCUITS)] for n in sizes}
    sampled = _sampled_parts(masks, graph, scores["all"], rng)
    counts, judged, subsets = {}, {}, {}
    for family, n, parts in [(ATTRIBUTED, n, grid[n]) for n in sizes] + [
        (name, int(p["all"].sum()) - graph.always, p) for name, p in (hypotheses or {}).items()
    ]:
        counts[(family, n)] = _count(graph, parts["all"])
        for f in np.unique(fold):
            f = int(f)
            judged[(family, n, f)] = _judged(masks, graph, parts, f)
            subsets[(family, n, f)] = _subsets(masks, graph, n, f, parts[f], scores[f])
    plan = []
    for i, f in enumerate(fold):
        sampled_pair = i % graph.sampled_every == 0
        for (family, n, g), runs in judged.items():
            if g != f:
                continue
            plan += [(i, family, *run[:2], n, run[2]) for run in runs]
            if sampled_pair:
                plan += [(i, family, *run[:2], n, run[2]) for run in subsets[(family, n, g)]]
                if family == ATTRIBUTED:
                    plan += [(i, family, FAITHFULNESS, f"{RANDOM} {d}", n, m) for d, m in enumerate(drawn[n])]
        if sampled_pair:
            plan += [(i, ALONE, ALONE, name, 1, m) for name, m in sampled]
    return Plan(plan, masks, counts)


def _count(graph, chosen: np.ndarray) -> tuple[int, int]:
    """(units kept: parts beside the embeddings or edges, parts touched with the embeddings)."""
    if isinstance(graph, EdgeGraph):
        return int(chosen.sum()), graph.parts(chosen) + 1
    return int(chosen.sum()) - 1, int(chosen.sum())


def _judged(masks: Masks, graph, parts: dict, fold: int) -> list[tuple]:
    """A fold's runs of one circuit: faithfulness in-sample (parts["all"]) and held out (parts[fold]),
    and the held-out circuit knocked out (its parts but the embeddings): (measure, circuit, mask id)."""
    held = parts[fold]
    knocked = held.copy()
    knocked[: graph.always] = False
    return [
        (FAITHFULNESS, IN_SAMPLE, masks.add(~parts["all"])),
        (FAITHFULNESS, HELD_OUT, masks.add(~held)),
        (KNOCKED_OUT, HELD_OUT, masks.add(knocked)),
    ]


def _subsets(masks: Masks, graph, n: int, fold: int, held: np.ndarray, scores: np.ndarray) -> list[tuple]:
    """A fold's completeness runs of its held-out circuit C (Wang et al. 2022): for subsets K of C's
    units (SUBSETS random halves, seeded per size and quarter, and the half of largest |score|), C
    less K (every unit outside C \\ K patched) and the model less K (K patched): a complete circuit
    loses as much without K as the model does. (measure, circuit, mask id)."""
    parts = np.flatnonzero(held[graph.always :]) + graph.always
    if len(parts) < 2:
        return []
    half, rng = len(parts) // 2, np.random.default_rng([n, fold])
    subsets = [rng.choice(parts, half, replace=False) for _ in range(SUBSETS)]
    subsets.append(parts[np.argsort(-np.abs(np.nan_to_num(scores[parts])), kind="stable")[:half]])
    out = []
    for d, chosen in enumerate(subsets):
        k = np.zeros_like(held)
        k[chosen] = True
        name = "subset top half" if d == SUBSETS else f"subset {d}"
        out += [(LESS_C, name, masks.add(~(held & ~k))), (LESS_M, name, masks.add(k))]
    return out


def _sampled_parts(masks: Masks, graph, scores: np.ndarray, rng) -> list[tuple[str, int]]:
    """(name, mask id) of the units patched alone: AGREEMENT_TOP of largest |score| and as many others
    at random."""
    free = graph.always
    ranked = np.argsort(-np.abs(np.nan_to_num(scores[free:])), kind="stable")[:AGREEMENT_TOP] + free
    others = np.setdiff1d(np.arange(free, len(scores)), ranked)
    chosen = [*ranked, *rng.choice(others, min(AGREEMENT_TOP, len(others)), replace=False)]
    names = graph.names()
    return [(names[j], masks.add(np.arange(len(scores)) == j)) for j in chosen]


@torch.inference_mode()
def part_runs(patching: Patching, plan: list[tuple], masks: Masks, log=lambda m: None) -> np.ndarray:
    """y (float64) of each planned run: its pair's x with the patched parts' outputs (or edges' senders'
    writes) from x' at the aligned positions, run from the lowest layer a patch reaches. `log` hears
    how many distinct runs are done, once a minute."""
    graph = patching.graph
    edges = isinstance(graph, EdgeGraph)
    pair_of = np.array([p[0] for p in plan], dtype=int)
    ids = np.array([p[-1] for p in plan], dtype=int)
    unique, again = np.unique(np.stack([pair_of, ids], 1).reshape(-1, 2), axis=0, return_inverse=True)
    pair_of, ids = unique[:, 0], unique[:, 1]  # each distinct run once
    first = np.array([(first_layer if edges else _first_layer)(graph, m) for m in masks.arrays], dtype=int)[
        ids
    ]
    lengths = patching.bank.lengths.numpy()[[patching.pairs[i].item for i in pair_of]]
    longest = int(lengths.max()) if len(lengths) else 1
    rows = max(1, device_patch_budget(patching.module, longest) // longest)
    if edges:
        aligned = max(int(patching.bank.lengths[p.item]) - p.at for p in patching.pairs)
        rows = min(rows, rows_per_pass(graph, patching.bank.hidden[0].shape[-1], aligned, 2))
    y = np.full(len(ids), np.nan)
    said = time.monotonic()
    for layer in np.unique(first):
        todo = np.flatnonzero(first == layer)
        todo = todo[np.argsort(lengths[todo], kind="stable")]  # rows of like length share a pass
        for start in range(0, len(todo), rows):

            def run(part, layer=int(layer)):
                patched = np.stack([masks.arrays[m] for m in ids[part]])
                if edges and layer < graph.n_layers:
                    return edge_pass(patching, patching.sites, pair_of[part], patched, layer)
                return _pass(patching, pair_of[part], patched, layer)

            for part, values in halved_on_oom(run, todo[start : start + rows]):
                y[part] = values
            if time.monotonic() - said > 60:
                said = time.monotonic()
                log(f"circuits: {np.isfinite(y).sum():,} of {len(y):,} distinct runs done")
    return y[again.reshape(-1)]


def _first_layer(graph: Graph, patched: np.ndarray) -> int:
    """The lowest layer of a patched part (the embeddings: 0), or n_layers where none is patched."""
    return (
        int(np.where(patched, np.maximum(graph.layers(), 0), graph.n_layers).min())
        if patched.any()
        else graph.n_layers
    )


def _pass(patching: Patching, pair_of: np.ndarray, patched: np.ndarray, layer: int) -> np.ndarray:
    bank, donor, graph, labels = patching.bank, patching.donor, patching.graph, patching.labels
    rows, donors, at, at_cf = pair_tensors(
        [patching.pairs[i] for i in pair_of], "item", "donor", "at", "at_cf"
    )
    if layer == graph.n_layers:  # nothing patched: x's clean y
        return behaviour_rows(bank.logits[rows], labels[rows, 0], labels[rows, 1]).double().cpu().numpy()
    device = bank.hidden[0].device
    T = int(bank.lengths[rows].max())
    where, index = aligned(torch.arange(T), at, at_cf, bank.lengths[rows], donor)
    where, index = where.to(device), index.to(device)
    embedding, heads, mlp = (
        None if m is None else torch.as_tensor(m).to(device) for m in graph.masks(patched)
    )
    contexts = [editing(HeadPatch(donor, donors, where, index, heads, torch.zeros_like(heads)))]
    if mlp is not None:
        mlps = mlp_modules(patching.module)
        contexts.append(mlp_outputs(mlps, mlp_patch(donor, donors, where, index, mlp)))
    hidden = bank.hidden[layer][rows][:, :T]
    if layer == 0 and embedding.any():
        given = donor.hidden[0][donors].gather(1, index[:, :, None].expand(-1, -1, hidden.shape[-1]))
        hidden = torch.where(embedding[:, None, None] & where[:, :, None], given.to(hidden.dtype), hidden)
    return rerun_y(patching.module, bank, rows, layer, hidden, labels[rows], contexts).cpu().numpy()
