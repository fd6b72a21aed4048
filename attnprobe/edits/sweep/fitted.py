"""The edits a sweep saves, fitted: per kind and k the heads chosen on every item (the edit to apply
to other suites) and, per quarter, the one whose values the sweep measured on that quarter (heads
chosen and parameters fitted on its training quarters); the stream's and the MLPs' edits likewise.
Each records where it comes from (the run, its suite, the options, this attnprobe) and the items
it never saw."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np

from ...run.files.fresh import own_directory
from ...stats.edits import STREAM
from ...stats.keeping.layers import chosen_layers
from ...version import __version__
from ..kinds import KINDS
from ..mlp import FITTED, POSITIONS, Recorded, kind_of
from ..saved import save_edit
from ..stream import StreamEdit
from .options import EditOptions


def _source(directory: Path, manifest, options: EditOptions, source: dict) -> dict:
    """Where a saved edit comes from: the run, its suite, the sweep's options, this attnprobe."""
    own_directory(own_directory(directory / "edits") / "quarters")  # no planted link written through
    return {
        "run": str(directory.resolve()),
        "run_fingerprint": manifest.fingerprint,
        "suite": manifest.suite.path,
        "suite_sha256": manifest.suite.sha256,
        "options": asdict(options),
        "attnprobe": __version__,
        **source,
    }


def _held_out(inputs, f: int) -> list:
    """The items of quarter f: `compare` reports them as a scope of their own."""
    return [i.item_id for i, g in zip(inputs.items, inputs.fold) if g == f]


def save_layers(directory, manifest, model, weights, inputs, options, tables, raw, source) -> int:
    """The chosen per-layer edits of `tables` (the stream's, the MLPs'; either may be empty)."""
    stream, mlp = tables
    n = (
        save_stream(directory, manifest, model, weights, inputs, options, stream, raw, source)
        if len(stream)
        else 0
    )
    return n + (
        save_mlp(directory, manifest, model, weights, inputs, options, mlp, raw, source) if len(mlp) else 0
    )


def save_stream(directory, manifest, model, weights, inputs, options, table, raw, source) -> int:
    """Write the chosen stream erasers: edits/stream (the layer chosen on every item, fitted on every
    item) and edits/quarters/stream-qF (quarter F's layer chosen on the other quarters' items,
    fitted on its training quarters: the edit the chosen row's values of quarter F come from). The
    layers are chosen as the table's chosen row was (stats.keeping.layers.chosen_layers)."""
    source = _source(directory, manifest, options, source)
    return _save_layers(directory, model, weights, inputs, raw, source, STREAM, StreamEdit.fit)


def save_mlp(directory, manifest, model, weights, inputs, options, table, raw, source) -> int:
    """Write each MLP mode's chosen edits as the stream's are written: edits/mlp-MODE and
    edits/quarters/mlp-MODE-qF."""
    source, n = _source(directory, manifest, options, source), 0
    recorded = {at: Recorded(model.model, inputs, at) for at in POSITIONS}
    for mode, at in FITTED:
        kind = kind_of(mode, at)
        if table["kind"].isin([kind, f"{kind}-chosen"]).any():
            n += _save_layers(directory, model, weights, inputs, raw, source, kind, recorded[at].fit(mode))
    return n


def _save_layers(directory, model, weights, inputs, raw, source, name: str, fit) -> int:
    """A per-layer edit's chosen edits (`fit(inputs, layer, folds)`), saved as NAME and
    quarters/NAME-qF."""
    chosen = chosen_layers(raw, name)
    about = {"fitted_on": "all items", "layer_chosen_on": "all items"}
    save_edit(
        fit(inputs, int(chosen["all"]), np.arange(4)),
        directory / "edits" / name,
        model,
        {**source, **about},
        weights,
    )
    for f in (f for f in range(4) if f in chosen):
        training = [int(g) for g in inputs.training(f)]
        about = {
            "quarter": f,
            "fitted_on": f"quarters {training}",
            "layer_chosen_on": f"the items outside quarter {f}",
            "held_out_items": _held_out(inputs, f),
        }
        edit = fit(inputs, int(chosen[f]), inputs.training(f))
        save_edit(
            edit, directory / "edits" / "quarters" / f"{name}-q{f}", model, {**source, **about}, weights
        )
    return 1 + sum(f in chosen for f in range(4))  # the all-items edit and one per quarter


def save_chosen(
    directory: Path,
    manifest,
    model,
    weights: str,
    inputs,
    sets: dict,
    options: EditOptions,
    source: dict,
) -> int:
    """Write every edit the sweep measured, fitted, to RUN_DIR/edits/: per kind and k the edit of
    the heads chosen on all items with parameters fitted on all items (KIND-kK: the one to apply to
    other suites), and under edits/quarters/ each quarter's own (heads chosen and parameters fitted
    on its training quarters: KIND-kK-qF, the edit the sweep's "after" values of quarter F come
    from). Returns how many."""
    source = _source(directory, manifest, options, source)
    chosen = f"--heads {options.heads}" if options.heads else None  # else the items' ranking
    n = 0
    for kind in options.kinds:
        everywhere = KINDS[kind].fit(inputs, np.arange(4), options)
        quarters = [KINDS[kind].fit(inputs, inputs.training(f), options) for f in range(4)]
        for k, per_fold in sets.items():
            about = {"k": k, "fitted_on": "all items", "heads_chosen_on": chosen or "all items"}
            save_edit(
                everywhere.on(per_fold["all"]),
                directory / "edits" / f"{kind}-k{k}",
                model,
                {**source, **about},
                weights,
            )
            for f, edit in enumerate(quarters):
                training = [int(g) for g in inputs.training(f)]
                about = {
                    "k": k,
                    "quarter": f,
                    "fitted_on": f"quarters {training}",
                    "heads_chosen_on": chosen or f"quarters {training}",
                    "held_out_items": _held_out(inputs, f),
                }
                path = directory / "edits" / "quarters" / f"{kind}-k{k}-q{f}"
                save_edit(edit.on(per_fold[f]), path, model, {**source, **about}, weights)
            n += 5
    return n
