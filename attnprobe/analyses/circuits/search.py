"""The circuit search of one run (`attnprobe edit --circuits`), per comparison: every part's or
edge's attribution, the circuits it ranks judged by the planned exact runs (runs.py), and the greedy
worst subset of the circuits that meet the target otherwise.

Greedy worst subset (completeness, Wang et al. 2022's third way of choosing K): for a held-out
circuit C of fold f, K grows one group at a time (a part; at the grain of edges, every edge of C one
part sends), each of GREEDY_STEPS steps adding, of GREEDY_CANDIDATES groups of C less K drawn at
random, the one whose addition makes C less K and the model less K differ most: |slope over the
covariate of y(C less K) - y(model less K)| on GREEDY_PAIRS sampled pairs of the other folds (the
pairs C was chosen on). K is that of the step with the largest gap, judged like the random subsets
on fold f's own sampled pairs (circuit "subset greedy"): chosen on other items than it is judged
on. It is searched in rounds for the smallest circuit of each family that meets the target on every
other count (the row the verdict reads): where its greedy subset fails it, the next smallest that
meets the target is searched in the next round, so the verdict's circuit always had its search.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product

import numpy as np
import pandas as pd

from ...intervene.selection import chosen_heads
from ...model.anatomy import module_of
from ...stats.analyses.paths_parts import circuit_heads, parts_table
from ..paths import BASE, RAW
from ..senders import compared_pairs
from .edge_passes import edge_attributions
from .edges import EdgeGraph
from .graph import Graph, attributions, part_scores, size_ranks
from .runs import (
    AGREEMENT_TOP,
    ATTRIBUTED,
    EDGES,
    FAITHFULNESS,
    GREEDY,
    HELD_OUT,
    LESS_C,
    LESS_M,
    PARTS,
    RANDOM_CIRCUITS,
    SUBSETS,
    Masks,
    Patching,
    Plan,
    part_runs,
    plan_runs,
)
from .tables import circuits_table

TOP_HEADS = "top 5 heads by gradient score"  # the circuit hypothesis the edits' heads make
MOVERS = "movers by path patching (chosen on every item)"  # round 5's (paths_parts.csv's role)
FOLDS = (0, 1, 2, 3)  # the quarters (intervene.selection.folds)
# seconds of one planned exact run (attribution included) on 2 CPU cores: per GFLOP of its prompt's
# forward pass, and per 100,000 edges of the graph (the edge runs' sums). Parts: SmolLM2-135M's
# demo run; edges: fitted to SmolLM2-135M's and Gemma 3 270M's (2026-11-29, docs/performance.md)
CPU_SECONDS_PER_RUN = {PARTS: (0.0059, 0.0), EDGES: (0.0084, 0.0072)}
GREEDY_STEPS = 3  # groups added to K
GREEDY_CANDIDATES = 5  # groups of C less K tried at each step (all of them where there are fewer)
GREEDY_PAIRS = 16  # pairs of the other folds K is chosen on


def measure_run_circuits(
    model, inputs, word: str, log=lambda m: None, hypotheses=None, grain=PARTS
) -> pd.DataFrame:
    """`attnprobe edit --circuits`: attribution and exact runs per comparison; one long frame,
    its parts told apart by `table` (circuit_runs, and circuit_attribution per pair and part or
    circuit_edges per edge). `hypotheses`: name -> {"all": heads, fold: heads chosen without that
    fold's items} ((layer, head) pairs), or name -> {reference: that dict} for a hypothesis of each
    comparison's own (a comparison it does not name is judged without it): circuits given, judged
    beside the circuits found; `grain`: parts or edges."""
    bank = inputs.bank
    graph = Graph(len(bank.hidden), bank.outputs[0].shape[1], bank.mlp is not None)
    if grain == EDGES:
        graph = EdgeGraph(len(bank.hidden), bank.outputs[0].shape[1], bank.keys[0].shape[1])
    frames = []
    for name, (donor, pairs, base) in compared_pairs(
        inputs.items, bank, inputs.reference, inputs.labels, word
    ).items():
        log(f"circuits: attribution of {graph.size} {grain} on {len(pairs)} pairs against {name!r}")
        patching = Patching(module_of(model), bank, donor, pairs, inputs.labels, graph)
        fold = np.array([inputs.fold[p.item] for p in pairs], dtype=int)
        covariate = base["covariate"].to_numpy(dtype=float)
        if grain == EDGES:
            sums = edge_attributions(patching, patching.sites, covariate, fold)
            scores = {"all": sums["eap_ig"].slope()}
            scores.update({int(f): sums["eap_ig"].slope(inputs.training(int(f))) for f in np.unique(fold)})
            frames.append(_edge_rows(graph, sums, base).assign(table="circuit_edges", reference=name))
        else:
            attributed = attributions(patching)
            scores = fold_scores(attributed["eap_ig"], covariate, fold, inputs.training)
            frames.append(
                _attribution_rows(base, graph, attributed).assign(table="circuit_attribution", reference=name)
            )
        plan = plan_runs(graph, scores, fold, _given(graph, hypotheses or {}, name))
        log(f"circuits: {len(plan.runs)} patched runs against {name!r}")
        as_frame = _labelled(base, grain, name)
        runs = as_frame(plan, part_runs(patching, plan.runs, plan.masks, log))
        frames += [runs, greedy_rounds(patching, plan, runs, (fold, covariate), as_frame, log)]
    return pd.concat([f for f in frames if len(f)], ignore_index=True)


@dataclass
class _Search:
    """One greedy search: circuit C (units, bool) of a family and size held out for fold f, its
    groups (unit indices), the pairs K is chosen on and K so far (group indices)."""

    family: str
    size: int
    fold: int
    circuit: np.ndarray
    groups: list
    choosing: np.ndarray
    k: list = field(default_factory=list)

    def candidates(self, step: int) -> list[int]:
        """The groups tried at a step: GREEDY_CANDIDATES of those not in K at random (seeded by the
        search and step), or all of them where there are no more."""
        free = [g for g in range(len(self.groups)) if g not in self.k]
        if len(free) <= GREEDY_CANDIDATES:
            return free
        rng = np.random.default_rng([self.size, self.fold, step, len(self.family)])
        return sorted(rng.choice(free, GREEDY_CANDIDATES, replace=False).tolist())

    def runs(self, masks: Masks, chosen: list[int], pairs: np.ndarray) -> list[tuple]:
        """Per pair, the two runs of K = the chosen groups: C less K (every unit outside C less K
        patched) and the model less K (K patched), in that order."""
        without = np.zeros_like(self.circuit)
        if chosen:
            without[np.concatenate([self.groups[g] for g in chosen])] = True
        c, m = masks.add(~(self.circuit & ~without)), masks.add(without)
        named = (self.family, LESS_C, GREEDY, self.size, c), (self.family, LESS_M, GREEDY, self.size, m)
        return [(int(i), *run) for i in pairs for run in named]


def _labelled(base: pd.DataFrame, grain: str, reference: str):
    """`as_frame(plan, y)`: the raw rows of a plan's runs in one comparison (_runs_frame), labelled."""
    labels = {"grain": grain, "table": "circuit_runs", "reference": reference}
    return lambda plan, y: _runs_frame(base, plan, y).assign(**labels)


def greedy_rounds(patching: Patching, plan: Plan, runs: pd.DataFrame, pairs: tuple, as_frame, log):
    """The raw rows (`as_frame(plan, y)`) of the greedy worst subsets of one comparison's `plan`, whose
    raw rows are `runs` (`pairs`: fold and covariate per pair), searched in rounds (the module's
    docstring) until each family's smallest circuit meeting the target has had its search."""
    frames, searched = [], set()
    while True:
        table = circuits_table(pd.concat([runs, *frames], ignore_index=True))
        todo = [near for near in _near_misses(table) if near not in searched]
        if not todo:
            return pd.concat(frames, ignore_index=True) if frames else runs.iloc[:0]
        searched.update(todo)
        frames.append(as_frame(*greedy_subsets(patching, plan, todo, *pairs, log)))


def greedy_subsets(patching: Patching, plan: Plan, near: list, fold, covariate, log) -> tuple:
    """(Plan, y) of the greedy worst subsets' judging runs (the module's docstring), for one
    comparison's `plan` and the (family, size) of the circuits `near` (fold and covariate per pair)."""
    graph, masks = patching.graph, Masks()
    held = {
        (r[1], r[4], int(fold[r[0]])): ~plan.masks.arrays[r[-1]]
        for r in plan.runs
        if r[2:4] == (FAITHFULNESS, HELD_OUT)
    }
    sampled = np.arange(len(fold)) % graph.sampled_every == 0
    searches = []
    for (family, n), f in product(near, np.unique(fold)):
        circuit = held[(family, n, int(f))]
        other = np.flatnonzero(sampled & (fold != f))
        other = other[np.linspace(0, len(other) - 1, min(GREEDY_PAIRS, len(other))).astype(int)]
        searches.append(_Search(family, n, int(f), circuit, graph.groups(circuit), other))
    searches = [s for s in searches if len(s.groups) > 1 and len(s.choosing)]
    if not searches:
        return Plan([], masks, plan.counts), np.zeros(0)
    log(f"circuits: greedy worst subsets of {len(searches)} held-out circuits")
    grow(patching, searches, masks, covariate, log)
    judged = [r for s in searches for r in s.runs(masks, s.k, np.flatnonzero(sampled & (fold == s.fold)))]
    return Plan(judged, masks, plan.counts), part_runs(patching, judged, masks, log)


def grow(patching: Patching, searches: list, masks: Masks, covariate: np.ndarray, log) -> None:
    """Each search's K grown greedily for GREEDY_STEPS steps on its choosing pairs, then set to the K
    of the step whose gap was largest (a K grown past the worst can only hide it)."""
    best = [(-1.0, []) for _ in searches]
    for step in range(GREEDY_STEPS):
        tried = [s.candidates(step) for s in searches]
        step_runs = [
            r for s, cs in zip(searches, tried) for c in cs for r in s.runs(masks, [*s.k, c], s.choosing)
        ]
        y = iter(part_runs(patching, step_runs, masks, log).reshape(-1, 2))
        for j, (s, candidates) in enumerate(zip(searches, tried)):
            gaps = []
            for _ in candidates:  # |slope of y(C less K) - y(model less K)| on the choosing pairs
                pairs = np.array([next(y) for _ in s.choosing])
                gaps.append(abs(part_scores((pairs[:, 0] - pairs[:, 1])[:, None], covariate[s.choosing])[0]))
            gaps = np.nan_to_num(gaps, nan=-1.0)
            if len(candidates):
                s.k.append(candidates[int(np.argmax(gaps))])
                if gaps.max() > best[j][0]:
                    best[j] = (float(gaps.max()), list(s.k))
    for s, (_, k) in zip(searches, best):
        s.k = k


def _near_misses(table: pd.DataFrame) -> list[tuple]:
    """(family, size) of each family's smallest circuit short of the whole model that meets the target
    in `table` (circuits_table of the runs so far: the row a worst subset can still fail)."""
    if not len(table):
        return []
    whole = table.loc[table["circuit"] == ATTRIBUTED, "size"].max()  # every part: met by construction
    met = table[table["met"] & (table["size"] < whole)].sort_values("size", kind="stable")
    return [(family, int(sizes.iloc[0])) for family, sizes in met.groupby("circuit", sort=False)["size"]]


def planned_runs(graph, n_pairs: int, hypotheses: int = 1) -> int:
    """About how many exact runs one comparison of `n_pairs` pairs plans (runs.plan_runs, before the
    runs a pair repeats are merged and without the greedy subsets): per pair 3 for each size (and
    size 0) and hypothesis; on every sampled_every-th pair the random circuits, the subsets and the
    units patched alone."""
    sizes = len(graph.sizes()) + 1
    judged = sizes - 2 + hypotheses  # subsets of circuits of 2 or more units
    top = min(AGREEMENT_TOP, graph.size - graph.always)  # units patched alone: the top, as many at random
    alone = top + min(AGREEMENT_TOP, graph.size - graph.always - top)
    sampled = RANDOM_CIRCUITS * sizes + 2 * (SUBSETS + 1) * judged + alone
    return n_pairs * 3 * (sizes + hypotheses) + -(-n_pairs // graph.sampled_every) * sampled


def estimate_lines(shape: tuple[int, int, int], n_pairs: int, gflop_per_prompt: float) -> list[str]:
    """What `attnprobe check` says of `edit --circuits` at either grain for a model of `shape` (layers,
    heads, key/value heads): the exact runs planned for `n_pairs` pairs over both comparisons, and
    the time on 2 CPU cores at the measured rates (CPU_SECONDS_PER_RUN)."""
    out = []
    for grain, graph in ((PARTS, Graph(*shape[:2], True)), (EDGES, EdgeGraph(*shape))):
        runs = planned_runs(graph, n_pairs)
        per_gflop, per_edges = CPU_SECONDS_PER_RUN[grain]
        minutes = runs * (gflop_per_prompt * per_gflop + graph.size / 1e5 * per_edges) / 60
        out.append(
            f"edit --circuits --circuit-grain {grain}: {graph.size:,} {grain}, at most about {runs:,} exact "
            f"runs over {n_pairs:,} pairs, about {minutes:.0f} min on 2 CPU cores (at the bundled models' "
            "measured rates; the greedy subsets add up to a size's runs where a circuit meets the target)"
        )
    return out


def hypotheses(scores: dict, n_heads: int, paths: pd.DataFrame | None = None) -> dict:
    """The circuits judged beside those found (measure_run_circuits' `hypotheses`): the run's top 5
    heads by gradient score (`scores`: "all" and each fold's, flat l H + h; each fold's heads chosen
    as the edits choose them, without its items) and, given the raw rows of the path patching
    (analyses.paths), the heads paths_parts.csv calls movers in each comparison (round 5's
    hypothesis, chosen on every item: its held-out figure is not held out)."""
    out = {TOP_HEADS: {f: chosen_heads(scores[f], 5, n_heads) for f in ("all", *FOLDS)}}
    if paths is not None:
        own = paths.loc[paths["table"] == "paths_items"].reindex(columns=[*BASE, *RAW["paths_items"]])
        parts = parts_table(own)
        movers = {r: circuit_heads(parts, r) for r in (parts["reference"].unique() if len(parts) else ())}
        out[MOVERS] = {r: {f: heads for f in ("all", *FOLDS)} for r, heads in movers.items() if heads}
    return out


def _given(graph, hypotheses: dict, reference: str) -> dict:
    """The hypotheses judged in one comparison, as masks of the graph's units."""
    out = {}
    for name, sets in hypotheses.items():
        sets = sets if "all" in sets else sets.get(reference)
        if sets:
            out[name] = {k: graph.of_heads(v) for k, v in sets.items()}
    return out


def _runs_frame(base: pd.DataFrame, plan: Plan, y: np.ndarray) -> pd.DataFrame:
    """The raw rows of a plan's runs: the pair's row, the run's family, measure, circuit and size,
    y_patched, and the circuit's units kept and parts touched."""
    runs = base.iloc[[i for i, *_ in plan.runs]].reset_index(drop=True)
    columns = ("family", "measure", "circuit", "size")
    runs = runs.assign(**{c: [run[1 + k] for run in plan.runs] for k, c in enumerate(columns)}, y_patched=y)
    kept = [plan.counts.get((run[1], run[4]), (np.nan, np.nan)) for run in plan.runs]
    return runs.assign(kept=[k for k, _ in kept], parts=[p for _, p in kept])


def _attribution_rows(base: pd.DataFrame, graph: Graph, scores: dict) -> pd.DataFrame:
    """Per pair and part: its EAP and EAP-IG attribution."""
    rows = base.loc[base.index.repeat(graph.size)].reset_index(drop=True)
    return rows.assign(
        part=np.tile(graph.names(), len(base)),
        eap=scores["eap"].reshape(-1),
        eap_ig=scores["eap_ig"].reshape(-1),
    )


def _edge_rows(graph: EdgeGraph, sums: dict, base: pd.DataFrame) -> pd.DataFrame:
    """Per edge: its EAP and EAP-IG share of TE's covariate gradient on every pair (the slope of its
    attribution over the slope of TE = y(x') - y(x), OLS as the scores), and its rank by |EAP-IG|."""
    te = (base["y_cf"] - base["y"]).to_numpy()[:, None]
    te_slope = part_scores(te, base["covariate"].to_numpy(dtype=float))[0]
    senders, receivers, positions = graph.ends()
    frame = pd.DataFrame(
        {"edge": graph.names(), "sender": senders, "receiver": receivers, "positions": positions}
    )
    for method, fold_sums in sums.items():
        frame[f"{method}_share"] = fold_sums.slope() / te_slope
    frame["rank"] = pd.array(size_ranks(frame["eap_ig_share"]), dtype="Int64")
    return frame


def fold_scores(attribution: np.ndarray, covariate: np.ndarray, fold: np.ndarray, training) -> dict:
    """{"all": (size,), f: (size,)} each part's score on every item and on the items fold f's circuit
    is chosen from (`training(f)`: the folds whose items choose it)."""
    out = {"all": part_scores(attribution, covariate)}
    for f in np.unique(fold):
        on = np.isin(fold, training(int(f)))
        out[int(f)] = part_scores(attribution[on], covariate[on])
    return out
