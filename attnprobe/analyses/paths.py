"""The path the covariate takes into the top heads (`attnprobe edit --paths`): path patching (Wang
et al. 2022) on the head-effects items, x an item and x' its reference counterfactual (the
occupation replaced by "person"), p the occupation's position (the slot's last token; p' in x').

Receivers R (the run's top heads by gradient score, one at a time and the top 5 together; and the
top 5 chosen on each quarter's training quarters, so no item tests heads chosen on its own
outcome): one input of R is taken from x' in a run of x, everything else computed as it comes
(the layers below R's skipped: there the run is x's clean run):

  value       R reads x''s value vector at p:  z_R <- z_R + A_R[:, p] (v'_p' - v_p)  (A_R as computed)
  all values  R reads x''s value vector at every position: z_R <- A_R v'  (pairs of equal length)
  pattern     R attends as in x' (its weights; pairs of equal length only, NaN otherwise)
  output      R's output at the aligned positions is x''s (everything R passes on)

Both directions: noising runs x with R's input from x' (above); denoising runs x' with R's input
from x, which asks how much of the effect restoring that one input brings back (its TE is y(x) -
y(x')). And two references: x' the reference word's version, or (RESAMPLED) another item of the
same sentence with another occupation of as many tokens, drawn at random (senders.resample_pairs),
so a path's share does not hang on "person". Each raw row says which (`reference`, `direction`);
the tables are made per comparison, the selection null and the senders on the reference word's
noising only.

On the pairs of equal length these add up: stats.analyses.paths_parts splits the output effect into
the value at the occupation, the values elsewhere, the pattern and their interaction, and gives each
head a role by the size of its parts (a head moving a signal computed elsewhere carries it by its
value at the occupation; else by its pattern).

Senders, the edges into R's value at p (senders.py): what each earlier part wrote at p swapped
from x to x' on the one path into R's value, screened by attribution on the items of one quarter
(half the units, half the templates), the EDGES best per receiver measured exactly on the quarter of
the other units and the other templates (senders.edge_roles).

The selection null (stats.analyses.paths_tables) reselects the cross-fitted top 5 on SELECTION_DRAWS permuted
covariates and measures each set's value path to first order (intervene.gradients: one forward
and backward pass per batch gives every head's), the first SELECTION_EXACT draws also exactly, so
the table shows how far the first order is from the exact shares.

The circuit test (measure_circuits; paths_parts.circuit_table): per reference, the heads that move
the signal, path-patched alone by their value input at p: restored alone in x' (faithfulness), each
left out in turn (minimality), knocked out of x (completeness). The hypothesis uses the same items
it is tested on (the roles are decided on the selection-free items of every quarter).

The raw values (effects y_patched - y; TE = y(x') - y(x)) go to paths_items, paths_screen,
paths_edges_items and paths_circuit_items parquet files; the tables are made from them alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..attention.capture import editing
from ..heads import HeadSet
from ..intervene.engine import Bank, HeadPatch, aligned
from ..intervene.gradients import PairRows, value_path_attribution
from ..intervene.rerun import ROWS, rerun_y
from ..intervene.selection import chosen_heads
from ..model.anatomy import module_of
from ..stats.analyses.paths_parts import (
    CIRCUIT,
    NO_CIRCUIT,
    WITHOUT,
    circuit_heads,
    circuit_table,
    parts_table,
)
from ..stats.analyses.paths_tables import (
    CROSSFIT,
    DENOISING,
    FIRST_ORDER,
    LISTED,
    NOISING,
    NULL,
    RESAMPLED,
    TOP,
    edges_table,
    gradient_shares,
    paths_table,
)
from ..store import atomic_write, write_parquet, write_table
from .senders import Pair, Patching, compared_pairs, edge_roles, edges, pair_tensors, screen

PATHS = ("value", "pattern", "output", "all values")
EQUAL_LENGTH = ("pattern", "all values")  # paths defined only where x and x' have equal length
BASE = ("item_id", "unit", "template_id", "covariate", "y", "y_cf")  # every raw row's
RAW = {  # raw frame -> its own columns
    "paths_items": ("receiver", "path", "heads", "reference", "direction", "y_patched"),  # heads: the set
    "paths_screen": ("receiver", "sender", "attribution"),
    "paths_edges_items": ("receiver", "sender", "y_patched"),
    "paths_circuit_items": ("receiver", "path", "heads", "reference", "direction", "y_patched"),
}
PATHS_VERSION = 5  # of the raw rows: a saved part from another version is measured again
EDGES = 8  # senders confirmed exactly per receiver
SELECTION_DRAWS = 199  # the selection null's permutations, to first order (p floor 1/200)
SELECTION_EXACT = 19  # of which the first are also measured exactly (p floor 1/20), checking the first order


@dataclass(frozen=True)
class Planned:
    """What one direction's runs patch: the `sets` (name, HeadSet) on each of `paths`; per item its
    `crossfit` set (or None) and each `null` draw's set (per draw, per item), their value path alone."""

    sets: list
    crossfit: list | None = None
    null: tuple | list = ()
    paths: tuple = PATHS


@dataclass(frozen=True)
class PathsDesign:
    """What measure_paths measures: the `receivers` (the top heads, in order: each alone and all
    together as `set_name`); `roles` per item (1 screens senders, 0 confirms them, -1 neither);
    `crossfit` per item the top set chosen without it (or None); `null` per draw, per item the set
    chosen on a permuted covariate (its value path to first order; the first `exact` draws also
    exactly); `hypotheses` per reference the circuit to test (default: its movers, measure_circuits)."""

    receivers: HeadSet
    roles: np.ndarray
    crossfit: list | None = None
    null: tuple | list = ()
    set_name: str = TOP
    exact: int = SELECTION_EXACT
    hypotheses: dict | None = None


@dataclass(frozen=True)
class HeadChoice:
    """How `attnprobe edit --paths` chooses: the gradient `scores` ("all" and per quarter), a
    `rescored(covariate by item id)` -> scores per quarter (the selection null's), the heads
    `listed` with --heads (then no cross-fitting and no null) and `n_heads`."""

    scores: dict
    rescored: Callable
    listed: tuple
    n_heads: int  # per layer


@torch.inference_mode()
def path_runs(patching: Patching, pairs: list[Pair], runs: list) -> np.ndarray:
    """y of each run (pair index, path, HeadSet): the pair's x with the set's `path` input from x'
    ("pattern+all values": both at once, which is the output path)."""
    module, bank, reference, labels = patching.module, patching.bank, patching.donor, patching.labels
    L, H = len(bank.hidden), bank.outputs[0].shape[1]
    first = np.array([min(layer for layer, _ in heads) for _, _, heads in runs])
    y = np.full(len(runs), np.nan)
    for layer in np.unique(first):
        todo = np.flatnonzero(first == layer)
        for start in range(0, len(todo), ROWS):
            batch = todo[start : start + ROWS]
            ps = [pairs[runs[i][0]] for i in batch]
            masks = {path: torch.zeros(len(batch), L, H, dtype=torch.bool) for path in PATHS}
            for b, i in enumerate(batch):
                _, path, heads = runs[i]
                for one in path.split("+"):
                    masks[one][b] = heads.mask(L, H)
            donor, at, at_cf = pair_tensors(ps, "donor", "at", "at_cf")
            rows = pair_tensors(ps, "item")[0]
            whole = (masks["pattern"] | masks["all values"]).any((1, 2))  # every position (equal lengths)
            begin, donor_begin = torch.where(whole, 0, at), torch.where(whole, 0, at_cf)
            T = int(bank.lengths[rows].max())
            where, index = aligned(torch.arange(T), begin, donor_begin, bank.lengths[rows], reference)
            edit = HeadPatch(
                reference, donor, where, index, masks["output"], masks["pattern"], masks["value"], at,
                masks["all values"],
            )  # fmt: skip
            hidden = bank.hidden[int(layer)][rows]
            y[batch] = (
                rerun_y(module, bank, rows, int(layer), hidden, labels[rows], [editing(edit)]).cpu().numpy()
            )
    return y


def measure_paths(model, recorded, word: str, design: PathsDesign, log=lambda m: None):
    """Raw values of path patching on `recorded` (items, their bank, the reference bank and labels:
    edits.inputs.Inputs, or any object with those four) as `design` says. Returns (paths, screen,
    edges, circuit) long frames."""
    module, bank, reference, labels = module_of(model), recorded.bank, recorded.reference, recorded.labels
    compared = compared_pairs(recorded.items, bank, reference, labels, word)
    _, pairs, base = compared[word]
    sets = [(HeadSet.name(*r), HeadSet((r,))) for r in design.receivers]
    sets.append((design.set_name, HeadSet(tuple(design.receivers))))
    noising = Patching(module, bank, reference, labels)
    noising.sites  # noqa: B018 (read for its check: a model without the senders' sites is refused here, before any run)
    planned = Planned(sets, design.crossfit, design.null[: design.exact])
    frames = [_direction_rows(noising, pairs, base, planned, NOISING, word, log)]
    if design.crossfit is not None and design.null:
        log(f"paths: the selection null's {len(design.null)} draws to first order")
        named = [(CROSSFIT, design.crossfit)] + [(f"{NULL} {d}", s_) for d, s_ in enumerate(design.null)]
        frames.append(first_order_rows(noising, pairs, base, named).assign(reference=word))
    denoising = Patching(module, reference, bank, _donor_labels(labels, reference is bank, pairs))
    frames.append(_direction_rows(denoising, pairs, base, Planned(sets), DENOISING, word, log))
    if RESAMPLED in compared:  # x' another item of the same template and fill (the items' own bank)
        _, resampled, other = compared[RESAMPLED]
        own = Patching(module, bank, bank, labels)
        for direction in (NOISING, DENOISING):
            frames.append(_direction_rows(own, resampled, other, Planned(sets), direction, RESAMPLED, log))
    screens, confirmed = _senders(noising, pairs, base, design, log)
    paths = pd.concat(frames, ignore_index=True)
    circuits = measure_circuits(module, bank, compared, labels, paths, log, design.hypotheses)
    return paths, screens, confirmed, circuits


def _donor_labels(labels, donors_are_items: bool, pairs):
    """The labels by the rows of x''s bank (denoising runs x'): the items' own for a resample (same
    labels), else each pair's item's (reference row r is pairs[r]'s x')."""
    return labels if donors_are_items else labels[[p.item for p in pairs]]


def measure_circuits(module, bank: Bank, compared: dict, labels, paths, log, hypotheses=None) -> pd.DataFrame:
    """Raw rows of the circuit test (paths_circuit_items). Per comparison (compared_pairs), C is the
    heads whose role is "moves" in its noising parts (circuit_heads), or `hypotheses[reference]`:
    their value input at p, path-patched alone. Denoising runs x' with C's values at p from x
    (faithfulness), and with C less each head in turn (minimality); noising runs x with C's values
    from x' (completeness: what is left once C is knocked out)."""
    parts = parts_table(paths) if hypotheses is None else None
    frames = []
    for name, (donor_bank, pairs, base) in compared.items():
        heads = circuit_heads(parts, name) if hypotheses is None else hypotheses.get(name, ())
        if not heads or not pairs:
            continue
        circuit = HeadSet(tuple(heads))
        sets = [(CIRCUIT, circuit)] + [
            (f"{WITHOUT} {HeadSet.name(*h)}", HeadSet(tuple(o for o in circuit if o != h)))
            for h in circuit
            if len(circuit) > 1
        ]
        denoised = _donor_labels(labels, donor_bank is bank, pairs)
        for direction, patching, named in (
            (NOISING, Patching(module, bank, donor_bank, labels), sets[:1]),
            (DENOISING, Patching(module, donor_bank, bank, denoised), sets),
        ):
            planned = Planned(named, paths=("value",))
            frames.append(_direction_rows(patching, pairs, base, planned, direction, name, log))
    if not frames:  # no hypothesis: no mover in either comparison
        return pd.DataFrame(columns=[*BASE, *RAW["paths_circuit_items"]])
    return pd.concat(frames, ignore_index=True)


def _rows(base: pd.DataFrame, names, runs, y: np.ndarray, direction: str) -> pd.DataFrame:
    """Raw rows of patched runs: each pair's base row with the run's receiver, path, heads and y."""
    rows = base.iloc[[i for i, _, _ in names]].reset_index(drop=True)
    return rows.assign(
        receiver=[n for _, n, _ in names],
        path=[p for _, _, p in names],
        heads=[str(h) for _, _, h in runs],
        direction=direction,
        y_patched=y,
    )


def _direction_rows(
    patching: Patching, pairs, base, planned: Planned, direction: str, reference: str, log
) -> pd.DataFrame:
    """Raw rows of every path of every planned set for `pairs` in one direction: noising runs each
    pair's x (patching.bank) with one input from its x' (patching.donor); denoising runs the x' with
    one input from x (pairs swapped, base's y and y_cf too; the patching's banks given swapped).
    The patching's labels are indexed by the rows of the bank that runs."""
    if direction == DENOISING:
        pairs = [Pair(p.donor, p.item, p.at_cf, p.at, p.same_length) for p in pairs]
        base = base.rename(columns={"y": "y_cf", "y_cf": "y"})
    runs, names = _planned_runs(pairs, planned)
    log(f"paths: {len(runs)} patched runs, {direction} against {reference!r}")
    y = path_runs(patching, pairs, runs)
    return _rows(base, names, runs, y, direction).assign(reference=reference)


def _senders(patching: Patching, pairs, base, design: PathsDesign, log) -> tuple:
    """(screen, edges) long frames: each receiver's senders screened by attribution on the items
    whose role is 1, the EDGES best measured exactly on those whose role is 0."""
    screening = [i for i, p in enumerate(pairs) if design.roles[p.item] == 1]
    confirming = [i for i, p in enumerate(pairs) if design.roles[p.item] == 0]
    empty = base.iloc[[]]
    screens = [_long(empty, np.zeros((0, 0)), [], "attribution").assign(receiver="")]
    confirmed = [_long(empty, np.zeros((0, 0)), [], "y_patched").assign(receiver="")]
    if not screening or not confirming:
        log("paths: no senders screened (they need items of both halves of the units)")
    for receiver in design.receivers if screening and confirming else ():
        name = HeadSet.name(*receiver)
        senders, values = screen(patching, [pairs[i] for i in screening], receiver)
        frame = base.iloc[screening].reset_index(drop=True)
        screens.append(_long(frame, values, senders, "attribution").assign(receiver=name))
        chosen = chosen_senders(screens[-1], EDGES)
        exact = edges(patching, [pairs[i] for i in confirming], receiver, chosen)
        frame = base.iloc[confirming].reset_index(drop=True)
        confirmed.append(_long(frame, exact, chosen, "y_patched").assign(receiver=name))
        log(f"paths: senders into {name}'s value screened, {len(chosen)} confirmed")
    return pd.concat(screens, ignore_index=True), pd.concat(confirmed, ignore_index=True)


def _planned_runs(pairs, planned: Planned) -> tuple[list, list]:
    """Per pair: every path of every named head set (EQUAL_LENGTH ones only where lengths match), the value
    path of its cross-fitted set and of each selection-null set (chosen on a permuted covariate);
    (runs: (pair, path, heads), names: (pair, set name, path))."""
    crossfit, null, runs, names = planned.crossfit, planned.null, [], []
    for i, pair in enumerate(pairs):
        for name, heads in planned.sets:
            for path in planned.paths:
                if path not in EQUAL_LENGTH or pair.same_length:
                    runs.append((i, path, heads))
                    names.append((i, name, path))
        if crossfit is not None and crossfit[pair.item] is not None:
            runs.append((i, "value", crossfit[pair.item]))
            names.append((i, CROSSFIT, "value"))
        for d, sets_ in enumerate(null):
            runs.append((i, "value", sets_[pair.item]))
            names.append((i, f"{NULL} {d}", "value"))
    return runs, names


def first_order_rows(patching: Patching, pairs: list[Pair], base, named) -> pd.DataFrame:
    """Raw rows (path FIRST_ORDER) of each named per-item head set's value path to first order: the
    sum over the set's heads of each head's attribution (one forward and backward pass per batch)."""
    module, bank, reference, labels = patching.module, patching.bank, patching.donor, patching.labels
    L, H = len(bank.hidden), bank.outputs[0].shape[1]
    parts = []
    for start in range(0, len(pairs), ROWS):
        rows = PairRows(*pair_tensors(pairs[start : start + ROWS], "item", "donor", "at", "at_cf"))
        positive, negative = labels[rows.xs, 0], labels[rows.xs, 1]
        attributed = value_path_attribution(module, bank, reference, rows, positive, negative)
        parts.append(attributed.reshape(len(rows.xs), L * H).numpy())
    attribution = np.concatenate(parts)
    masks: dict = {}

    def mask(heads: HeadSet) -> np.ndarray:
        if heads not in masks:
            masks[heads] = heads.mask(L, H).reshape(-1).double().cpu().numpy()
        return masks[heads]

    frames = []
    for name, per_item in named:
        chosen = [i for i, p in enumerate(pairs) if per_item[p.item] is not None]
        effect = [attribution[i] @ mask(per_item[pairs[i].item]) for i in chosen]
        frame = base.iloc[chosen].reset_index(drop=True)
        heads = [str(per_item[pairs[i].item]) for i in chosen]
        frames.append(
            frame.assign(
                receiver=name, path=FIRST_ORDER, heads=heads, direction=NOISING, y_patched=frame["y"] + effect
            )
        )
    return pd.concat(frames, ignore_index=True)


def _long(frame: pd.DataFrame, values: np.ndarray, senders: list[str], column: str) -> pd.DataFrame:
    """frame's rows repeated per sender, with values (rows, senders) in `column`."""
    out = frame.loc[frame.index.repeat(len(senders))].reset_index(drop=True)
    return out.assign(sender=np.tile(senders, len(frame)), **{column: values.reshape(-1)})


def chosen_senders(screen_rows: pd.DataFrame, k: int) -> list[str]:
    """The k senders whose attribution carries the largest share (absolute) of TE's gradient."""
    shares = gradient_shares(screen_rows, "attribution")
    return shares.abs().sort_values(ascending=False, kind="stable").index[:k].tolist()


def measure_run_paths(model, inputs, word: str, choice: HeadChoice, log, draws: int = SELECTION_DRAWS):
    """`attnprobe edit --paths`: the receivers are the heads listed (--heads) or the top 5 by the
    gradient score on every item; each item's cross-fitted set the top 5 on its training quarters;
    senders screened on one quarter and confirmed on the quarter of other units and templates. The
    selection null: `draws` times the covariate permuted over units, the heads reselected on it
    (choice.rescored) and their value path measured against the real covariate, to first order (the
    first SELECTION_EXACT draws also exactly). The four raw frames in one, told apart by `table`."""
    listed, H = choice.listed, choice.n_heads
    receivers = HeadSet(listed) if listed else HeadSet(chosen_heads(choice.scores["all"], 5, H))
    per_item = lambda quarters: [HeadSet(chosen_heads(quarters[int(f)], 5, H)) for f in inputs.fold]
    crossfit, null = (None, []) if listed else (per_item(choice.scores), [])
    rng = np.random.default_rng(0)
    units = {i.unit: i.covariate for i in inputs.items}
    for _ in range(0 if listed else draws):
        shuffled = dict(zip(units, rng.permutation(list(units.values()))))
        null.append(per_item(choice.rescored({i.item_id: shuffled[i.unit] for i in inputs.items})))
    design = PathsDesign(receivers, edge_roles(inputs.fold), crossfit, null, LISTED if listed else TOP)
    frames = measure_paths(model, inputs, word, design, log)
    return pd.concat([f.assign(table=t) for f, t in zip(frames, RAW)], ignore_index=True)


def write_paths(directory, raw: pd.DataFrame) -> None:
    """The raw frames (paths_items, paths_screen, paths_edges_items, paths_circuit_items) and the
    tables made from them (paths.csv, paths_parts.csv, paths_edges.csv, paths_circuit.csv) into the
    run directory. A part saved before the circuit test has no circuit rows (an empty table)."""
    frames = {t: raw.loc[raw["table"] == t].reindex(columns=[*BASE, *own]) for t, own in RAW.items()}
    for t, frame in frames.items():
        atomic_write(Path(directory) / f"{t}.parquet", lambda p, frame=frame: write_parquet(frame, p))
    write_table(directory, "paths", paths_table(frames["paths_items"]))
    write_table(directory, "paths_parts", parts_table(frames["paths_items"]))
    edges_ = edges_table(frames["paths_screen"], frames["paths_edges_items"], frames["paths_items"])
    write_table(directory, "paths_edges", edges_)
    write_table(directory, "paths_circuit", circuit_table(frames["paths_circuit_items"]), NO_CIRCUIT)
