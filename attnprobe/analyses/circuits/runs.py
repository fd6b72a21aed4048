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

The last three on every SAMPLED_EVERY-th pair only. A run that repeats another of its pair (the
circuit of size 0 in- and out of sample; nothing patched) is computed once.

Raw rows: the pair's item, y = y(x), y_cf = y(x'), and the run's family, measure, circuit, size (parts
beside the embeddings) and y_patched; the attributions per item and part; the tables (tables.py)
are made from them alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from ...attention.capture import editing
from ...intervene.engine import Bank, HeadPatch, aligned, halved_on_oom, mlp_patch
from ...intervene.rerun import rerun_y
from ...intervene.sites import behaviour_rows, mlp_outputs
from ...model.anatomy import mlp_modules, module_of
from ...model.footprint import device_patch_budget
from ..senders import compared_pairs, pair_tensors
from .eap import attributions
from .graph import Graph, part_scores, random_parts, top_parts

RANDOM_CIRCUITS = 5  # random circuits per size (the baseline's spread)
AGREEMENT_TOP = 10  # parts patched alone: the top by |score| on every item, and as many at random
SAMPLED_EVERY = 4  # the random circuits and the parts alone are run on every 4th pair (a quarter of the cost)
IN_SAMPLE, HELD_OUT, RANDOM = "in-sample", "held-out", "random"
ATTRIBUTED = "top n by EAP-IG"  # the family of the circuits found (others: the hypotheses' names)
FAITHFULNESS, KNOCKED_OUT, ALONE = "faithfulness", "knocked out", "alone"
LESS_C, LESS_M = "circuit less K", "model less K"  # completeness over subsets K (Wang et al. 2022)
SUBSETS = 3  # random halves of a circuit (and its top half by |score|) whose removal is judged
CIRCUITS_VERSION = 3  # of the raw rows: a saved part of another version is measured again


@dataclass(frozen=True)
class Patching:
    """What every run of one comparison reads: the model, x's and x''s clean runs, the pairs, the
    label ids by x's rows, and the parts."""

    module: torch.nn.Module
    bank: Bank
    donor: Bank
    pairs: list
    labels: torch.Tensor
    graph: Graph


def measure_run_circuits(model, inputs, word: str, log=lambda m: None, heads=None) -> pd.DataFrame:
    """`attnprobe edit --circuits`: attribution and exact runs per comparison; one long frame,
    its parts told apart by `table` (circuit_runs, circuit_attribution). `heads`: name -> {"all":
    heads, fold: heads chosen without that fold's items} ((layer, head) pairs), hypotheses judged
    beside the circuits found."""
    module = module_of(model)
    bank = inputs.bank
    graph = Graph(len(bank.hidden), bank.outputs[0].shape[1], bank.mlp is not None)
    frames = []
    for name, (donor, pairs, base) in compared_pairs(
        inputs.items, bank, inputs.reference, inputs.labels, word
    ).items():
        log(f"circuits: attribution of {graph.size} parts on {len(pairs)} pairs against {name!r}")
        patching = Patching(module, bank, donor, pairs, inputs.labels, graph)
        scores = attributions(patching)
        fold = np.array([inputs.fold[p.item] for p in pairs])
        given = {h: {k: graph.of_heads(v) for k, v in sets.items()} for h, sets in (heads or {}).items()}
        plan = plan_runs(graph, scores["eap_ig"], base["covariate"].to_numpy(), fold, inputs.training, given)
        log(f"circuits: {len(plan)} patched runs against {name!r}")
        y = part_runs(patching, plan)
        runs = base.iloc[[i for i, *_ in plan]].reset_index(drop=True)
        columns = ("family", "measure", "circuit", "size")
        runs = runs.assign(**{c: [run[1 + k] for run in plan] for k, c in enumerate(columns)}, y_patched=y)
        frames += [runs.assign(table="circuit_runs", reference=name)]
        frames += [_attribution_rows(base, graph, scores).assign(table="circuit_attribution", reference=name)]
    return pd.concat(frames, ignore_index=True)


def _attribution_rows(base: pd.DataFrame, graph: Graph, scores: dict) -> pd.DataFrame:
    """Per pair and part: its EAP and EAP-IG attribution."""
    rows = base.loc[base.index.repeat(graph.size)].reset_index(drop=True)
    return rows.assign(
        part=np.tile(graph.names(), len(base)),
        eap=scores["eap"].reshape(-1),
        eap_ig=scores["eap_ig"].reshape(-1),
    )


def plan_runs(graph: Graph, attribution, covariate, fold, training, hypotheses=None, seed: int = 0) -> list:
    """(pair, family, measure, circuit, size, patched parts (size,) bool) of every run, as the module
    says. `training(f)`: the folds whose items choose the circuit fold f's items are judged with;
    `hypotheses`: name -> {"all": parts (size,) bool, fold: parts chosen without that fold's items},
    circuits given rather than found, judged the same way (their family is their name)."""
    everything = part_scores(attribution, covariate)
    chosen = {}
    for f in np.unique(fold):
        on = np.isin(fold, training(int(f)))
        chosen[int(f)] = part_scores(attribution[on], covariate[on])
    rng = np.random.default_rng(seed)
    sizes = [0, *graph.sizes()]
    grid = {
        n: {"all": top_parts(everything, n), **{f: top_parts(q, n) for f, q in chosen.items()}} for n in sizes
    }
    drawn = {n: [random_parts(graph.size, n, rng) for _ in range(RANDOM_CIRCUITS)] for n in sizes}
    sampled = _sampled_parts(everything, rng)
    plan = []
    for i, f in enumerate(fold):
        sampled_pair = i % SAMPLED_EVERY == 0
        for n in sizes:
            plan += _judged(i, int(f), ATTRIBUTED, n, grid[n])
            if sampled_pair:
                plan += [
                    (i, ATTRIBUTED, FAITHFULNESS, f"{RANDOM} {d}", n, ~c) for d, c in enumerate(drawn[n])
                ]
                plan += _subsets(i, int(f), ATTRIBUTED, n, grid[n][int(f)], chosen[int(f)])
        for name, parts in (hypotheses or {}).items():
            n = int(parts["all"].sum()) - 1
            plan += _judged(i, int(f), name, n, parts)
            plan += _subsets(i, int(f), name, n, parts[int(f)], chosen[int(f)]) if sampled_pair else []
        for j in sampled if i % SAMPLED_EVERY == 0 else ():
            plan.append((i, ALONE, ALONE, graph.names()[j], 1, np.arange(graph.size) == j))
    return plan


def _judged(i: int, fold: int, family: str, n: int, parts: dict) -> list[tuple]:
    """Pair i's runs of one circuit: faithfulness in-sample (parts["all"]) and held out (parts[fold]),
    and the held-out circuit knocked out (its parts but the embeddings)."""
    held = parts[fold]
    knocked = held.copy()
    knocked[0] = False
    return [
        (i, family, FAITHFULNESS, IN_SAMPLE, n, ~parts["all"]),
        (i, family, FAITHFULNESS, HELD_OUT, n, ~held),
        (i, family, KNOCKED_OUT, HELD_OUT, n, knocked),
    ]


def _subsets(i: int, fold: int, family: str, n: int, held: np.ndarray, scores: np.ndarray) -> list[tuple]:
    """Pair i's completeness runs of its held-out circuit C (Wang et al. 2022): for subsets K of C's
    parts (SUBSETS random halves, seeded per size and quarter, and the half of largest |score|), C
    less K (x with every part outside C \\ K patched) and the model less K (x with K patched): a
    complete circuit loses as much without K as the model does."""
    parts = np.flatnonzero(held[1:]) + 1
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
        out += [(i, family, LESS_C, name, n, ~(held & ~k)), (i, family, LESS_M, name, n, k)]
    return out


def _sampled_parts(scores: np.ndarray, rng) -> list[int]:
    """The parts patched alone: AGREEMENT_TOP of largest |score| and as many others at random."""
    ranked = np.argsort(-np.abs(np.nan_to_num(scores[1:])), kind="stable")[:AGREEMENT_TOP] + 1
    others = np.setdiff1d(np.arange(1, len(scores)), ranked)
    return [*ranked, *rng.choice(others, min(AGREEMENT_TOP, len(others)), replace=False)]


@torch.inference_mode()
def part_runs(patching: Patching, plan: list[tuple]) -> np.ndarray:
    """y (float64) of each planned run: its pair's x with the patched parts' outputs from x' at the
    aligned positions, run from the lowest patched layer (the embeddings: layer 0 with x''s there)."""
    graph = patching.graph
    pair_of = np.array([p[0] for p in plan], dtype=int)
    patched = np.stack([p[-1] for p in plan]) if plan else np.zeros((0, graph.size), dtype=bool)
    unique, again = np.unique(np.concatenate([pair_of[:, None], patched], 1), axis=0, return_inverse=True)
    pair_of, patched = unique[:, 0], unique[:, 1:].astype(bool)  # each distinct run once
    first = np.where(
        patched.any(1),
        np.where(patched, np.maximum(graph.layers(), 0), graph.n_layers).min(1),
        graph.n_layers,
    )
    lengths = patching.bank.lengths.numpy()[[patching.pairs[i].item for i in pair_of]]
    y = np.full(len(patched), np.nan)
    for layer in np.unique(first):
        todo = np.flatnonzero(first == layer)
        todo = todo[np.argsort(lengths[todo], kind="stable")]  # rows of like length share a pass
        rows = max(1, device_patch_budget(patching.module, int(lengths.max())) // int(lengths.max()))
        for start in range(0, len(todo), rows):
            run = lambda part, layer=layer: _pass(patching, pair_of[part], patched[part], int(layer))
            for part, values in halved_on_oom(run, todo[start : start + rows]):
                y[part] = values
    return y[again.reshape(-1)]


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
