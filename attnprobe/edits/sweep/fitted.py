"""The edits a sweep saves, fitted: per kind and k the heads chosen on every item (the edit to apply
to other suites) and, per quarter, the one whose values the sweep measured on that quarter (heads
chosen and parameters fitted on its training quarters); the stream's and the MLPs' edits likewise.
Each records where it comes from (the run, its suite, the options, this attnprobe) and the items
it never saw."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pandas as pd
import torch

from ...analyses.circuits.runs import ATTRIBUTED
from ...analyses.circuits.tables import chosen_circuit
from ...heads import HeadSet
from ...model.anatomy import decoder_layers, mlp_written, module_of
from ...stats.keeping.layers import chosen_layers
from ...store import own_directory
from ...version import __version__
from ..estimate import token_mask, token_means
from ..kinds import Mean
from ..layers.asked import asked
from ..layers.mlp import MlpEdit
from ..layers.several import MlpLayers
from ..saved import CircuitKnockout, save_edit
from .options import Sweep, head_kinds

CIRCUIT = "circuit"  # the saved circuits' names: circuit-REFERENCE


def _source(sweep: Sweep, source: dict) -> dict:
    """Where a saved edit comes from: the run, its suite, the sweep's options, this attnprobe."""
    own_directory(own_directory(sweep.directory / "edits") / "quarters")  # no planted link written through
    manifest = sweep.manifest
    return {
        "run": str(sweep.directory.resolve()),
        "run_fingerprint": manifest.fingerprint,
        "suite": manifest.suite.path,
        "suite_sha256": manifest.suite.sha256,
        "options": asdict(sweep.options),
        "attnprobe": __version__,
        **source,
    }


def _held_out(inputs, f: int) -> list:
    """The items of quarter f: `compare` reports them as a scope of their own."""
    return [i.item_id for i, g in zip(inputs.items, inputs.fold) if g == f]


def _save(sweep: Sweep, edit, name: str, about: dict) -> None:
    """One fitted edit, saved as RUN_DIR/edits/NAME with its source and `about`."""
    save_edit(edit, sweep.directory / "edits" / name, sweep.model, about, sweep.weights)


def save_layers(sweep: Sweep, tables: tuple, raw, source: dict) -> int:
    """The chosen per-layer edits of `tables` (the stream's, the MLPs'; either may be empty): the
    stream's erasers as edits/stream (the layer chosen on every item, fitted on every item) and
    edits/quarters/stream-qF (quarter F's layer chosen on the other quarters' items, fitted on its
    training quarters: the edit the chosen row's values of quarter F come from); the stream's erasers
    of several layers as edits/stream-layers (and its quarters'); each MLP mode's as edits/mlp-MODE
    and edits/quarters/mlp-MODE-qF. The layers are chosen as the tables' chosen rows
    were (stats.keeping.layers.chosen_layers). Returns how many."""
    source, n = _source(sweep, source), 0
    measured = set().union(*(table["kind"] for table in tables if len(table)))
    for kind in asked(sweep.options, sweep.inputs):
        if measured & {kind.name, f"{kind.name}-chosen"}:
            n += _save_layers(sweep, raw, source, kind.name, kind.fit(sweep))
    return n


def _save_layers(sweep: Sweep, raw, source: dict, name: str, fit) -> int:
    """A per-layer edit's chosen edits (`fit(inputs, layer, folds)`), saved as NAME and
    quarters/NAME-qF."""
    inputs, chosen = sweep.inputs, chosen_layers(raw, name)
    about = {"fitted_on": "all items", "layer_chosen_on": "all items"}
    _save(sweep, fit(inputs, int(chosen["all"]), np.arange(4)), name, {**source, **about})
    for f in (f for f in range(4) if f in chosen):
        training = [int(g) for g in inputs.training(f)]
        about = {
            "quarter": f,
            "fitted_on": f"quarters {training}",
            "layer_chosen_on": f"the items outside quarter {f}",
            "held_out_items": _held_out(inputs, f),
        }
        _save(
            sweep,
            fit(inputs, int(chosen[f]), inputs.training(f)),
            f"quarters/{name}-q{f}",
            {**source, **about},
        )
    return 1 + sum(f in chosen for f in range(4))  # the all-items edit and one per quarter


def save_chosen(sweep: Sweep, sets: dict, source: dict) -> int:
    """Write every edit the sweep measured, fitted, to RUN_DIR/edits/: per kind and k the edit of
    the heads chosen on all items with parameters fitted on all items (KIND-kK: the one to apply to
    other suites), and under edits/quarters/ each quarter's own (heads chosen and parameters fitted
    on its training quarters: KIND-kK-qF, the edit the sweep's "after" values of quarter F come
    from). Returns how many."""
    source, inputs, options = _source(sweep, source), sweep.inputs, sweep.options
    chosen = f"--heads {options.heads}" if options.heads else None  # else the items' ranking
    n = 0
    for kind in head_kinds(options):
        fit = sweep.head_fit(kind)  # the fits its measures made
        order = {"fitted": "in order, each layer's heads with those below edited"} if fit.sequential else {}
        for k, per_fold in sets.items():
            about = {"k": k, "fitted_on": "all items", "heads_chosen_on": chosen or "all items", **order}
            everywhere = fit(inputs, np.arange(4), per_fold["all"])
            _save(sweep, everywhere, f"{kind}-k{k}", {**source, **about})
            for f in range(4):
                training = [int(g) for g in inputs.training(f)]
                edit = fit(inputs, training, per_fold[f])
                about = {
                    "k": k,
                    "quarter": f,
                    "fitted_on": f"quarters {training}",
                    "heads_chosen_on": chosen or f"quarters {training}",
                    "held_out_items": _held_out(inputs, f),
                    **order,
                }
                _save(sweep, edit, f"quarters/{kind}-k{k}-q{f}", {**source, **about})
            n += 5
    return n


def save_circuits(sweep: Sweep, source: dict) -> int:
    """Per comparison, the smallest circuit of parts meeting the target short of the whole model
    (circuits.csv's first such row of the circuits found), as chosen on every item (circuit_parts.csv's
    parts ranked 1 to its size), saved as edits/circuit-REFERENCE: a knockout whose heads' and MLPs'
    outputs are their mean over the reference prompts' tokens (CircuitKnockout). None at the grain
    of edges (a knockout of edges needs each receiver's own copy of the stream, which `run --edit`
    does not build). A circuit saved by an earlier search is removed first. Returns how many."""
    for old in own_directory(sweep.directory / "edits").glob(f"{CIRCUIT}-*.*"):
        old.unlink()
    table, parts = (pd.read_csv(sweep.directory / f"{name}.csv") for name in ("circuits", "circuit_parts"))
    if "met" not in table or "rank" not in parts:  # a note only: no runs, or circuits of edges
        return 0
    bank, n, m = sweep.inputs.reference, 0, sweep.manifest.model
    for reference, rows in table[table["circuit"] == ATTRIBUTED].groupby("reference", sort=False):
        row, met = chosen_circuit(rows)
        if not met:
            continue
        size = int(row["size"])
        names = parts.loc[(parts["reference"] == reference) & (parts["rank"] <= size), "part"]
        # a set of heads, written in layer and head order whatever the ranks of tied parts
        heads = sorted(HeadSet.parse(p, m.n_layers, m.n_heads).pairs[0] for p in names if p.startswith("L"))
        layers = sorted(int(p[3:]) for p in names if p.startswith("MLP"))
        knockout = CircuitKnockout(
            Mean(tuple(heads), token_means(bank)) if heads else None,
            MlpLayers(tuple(_mean_mlp(sweep.model, bank, layer) for layer in layers)) if layers else None,
        )
        about = {
            "comparison": reference,
            "circuit": ATTRIBUTED.replace(" n ", f" {size} "),
            "chosen_on": "all items",
        }
        name = f"{CIRCUIT}-{reference.replace(' ', '-')}"
        _save(sweep, knockout, name, {**_source(sweep, source), **about})
        n += 1
    return n


@torch.inference_mode()
def _mean_mlp(model, bank, layer: int) -> MlpEdit:
    """The mean MLP edit of `layer`: what its MLP adds, averaged over every token of `bank`."""
    site = decoder_layers(module_of(model.model))[layer]
    added = mlp_written(site, bank.mlp[layer].to(next(site.parameters()).device))
    mu = added[token_mask(bank).to(added.device)].float().mean(0)
    zero = torch.zeros_like(mu)
    return MlpEdit(layer, zero, zero, mu, mode="mean")
