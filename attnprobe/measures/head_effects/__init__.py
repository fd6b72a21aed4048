"""The head-effects measure (activation patching): which heads and layers carry a behaviour from x' to x.

Behaviour: y(x) = log p(positive set | x) - log p(negative set | x) at the cut. A counterfactual x'
changes one slot (or is the item's other version). Per item, in log-odds units: the total effect
TE = y(x') - y(x); patch in y(x with activations from x') - y(x); patch out y(x') - y(x' with
them from x). The activations: a head's output (its per-head context z), its pattern alone, a
layer's attention or MLP output, and joint sets of heads. The rooms:

  declaration  the suite's `head_effects:` block, parsed; the manifest's summary; the plan's hash
  designs      SlotSwap and PairSwap: which items, x and x' (tokenizer only)
  attribution  first-order estimates of every head and layer from one backward pass
  screen       one chunk of the screen or of the selected heads

The items, sites, batched engine and head selection it runs on are the intervention library
(attnprobe.intervene), shared with the edits.

This module is the registered kind: its plan, its two phases (the screen of every item, held-out
items, every head patched exactly, in their own chunks and progress; then, once every item is
screened, the selected heads on every item), its files and statistics. The one-item reference these
are tested against lives in tests/reference_patching.py.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ... import store
from ...forward.estimates import head_effect_seconds, head_effects_text
from ...intervene.items import Counterfactual, Dropped, PatchItem, Selection
from ...intervene.selection import select
from ..base import Measure, Phase
from .declaration import KEYS, HeadEffectsMeasure, PairSwap, SlotSwap, parse, plan_sha256, summary
from .designs import per_value_column

__all__ = [
    "Counterfactual",
    "Dropped",
    "HeadEffects",
    "HeadEffectsMeasure",
    "HeadEffectsPlan",
    "PairSwap",
    "PatchItem",
    "Selection",
    "SlotSwap",
    "per_value_column",
]

EFFECT_CHUNK_ITEMS = 32  # items per chunk: at most this many items are redone after a kill
HELD_OUT_CHUNK_ITEMS = 2  # held-out items (every head patched exactly, ~60x the cost of another) per chunk
FILES = {  # the assembled tables, by chunk table
    "items": "head_effects_items.parquet",
    "layers": "head_effects_layers.parquet",
    "totals": "head_effects_totals.parquet",
}
SCREEN, SELECTED = "effects-", "selected-"


@dataclass(frozen=True)
class EffectsRecord:
    """What a run's head effects recorded (its manifest entry, written by `summary`), as the rooms
    that do not own it read it: by these fields, never by key."""

    entry: dict

    @classmethod
    def of(cls, manifest) -> EffectsRecord | None:
        """The run's record, or None where it measured no head effects."""
        entry = manifest.entry(HeadEffects.NAME)
        return cls(entry) if entry else None

    seconds = property(lambda self: float(self.entry.get("seconds", 0.0)))
    n_items = property(lambda self: int(self.entry["n_items"]))
    n_pairs = property(lambda self: int(self.entry.get("n_pairs", self.entry["n_items"])))
    dropped = property(lambda self: list(self.entry.get("dropped", [])))
    exact = property(lambda self: self.entry.get("exact"))  # "all", or the k heads patched exactly
    select = property(lambda self: self.entry.get("select"))
    halves_by = property(lambda self: self.entry.get("halves_by"))
    design = property(lambda self: self.entry.get("design", "slot"))

    @property
    def swap(self) -> tuple:
        """(the slot swapped, its counterfactual words), or (None, [])."""
        return next(iter(self.entry.get("counterfactual", {}).items()), (None, []))


@dataclass(frozen=True)
class HeadEffectsPlan:
    measure: HeadEffectsMeasure  # sized for the run's prompts
    items: list[PatchItem]
    dropped: list[Dropped]
    chunks: list[list[PatchItem]]  # held-out items first
    sha256: str  # chunks of another plan are redone
    heads: tuple[int, int]  # the model's layers and heads per layer (the every-head patching's work)


class HeadEffects(Measure):
    NAME = "head_effects"
    KEYS = KEYS
    CONTRACT = ("coref", 16)  # the pair design; the gender suite runs the slot swap
    ARTEFACTS = (*FILES.values(), "head_effects_totals.csv")
    CHUNKS = {
        SCREEN: ("items.parquet", "layers.parquet", "totals.parquet"),
        SELECTED: ("items.parquet", "totals.parquet"),
    }
    READS = {"head_effect_items": FILES["items"], "head_effect_totals": "head_effects_totals"}
    READS |= {"head_effect_layers": FILES["layers"]}
    TABLES = ("head_effects", "head_effects_layer_shares", "head_effects_summary")

    def present(self, directory, manifest) -> bool:
        return bool(manifest.entry(self.NAME)) or has_files(directory)

    def parse(self, ctx, doc, scope) -> HeadEffectsMeasure | None:
        declared = scope.declared
        effects = parse(
            ctx,
            doc,
            scope.slots,
            scope.template_ids,
            declared.get("next_token", ()),
            scope.analysis,
            declared.get("referent_choice"),
        )
        if effects is not None and effects.exact != "all" and effects.held_out == 0:
            scope.notes.append(
                "head_effects: held_out: 0 leaves no item on which every head is patched exactly, so "
                "attribution is not checked against exact patching (those columns stay empty); keep the "
                "default (8) or set held_out >= 2"
            )
        return effects

    def plan(self, declared, scope) -> HeadEffectsPlan | None:
        from ...model import routes_attention  # torch: not loaded by a suite's parse

        measure = declared.for_prompts(len(scope.encoded), len(scope.suite.prompts))
        measure.check_family(routes_attention(scope.config), scope.spec)
        items, dropped = measure.some_items(scope.tokenizer, scope.encoded)
        held_out = measure.held_out_ids(items)

        def split(part, size):
            return [part[i : i + size] for i in range(0, len(part), size)]

        chunks = split([i for i in items if i.item_id in held_out], HELD_OUT_CHUNK_ITEMS) + split(
            [i for i in items if i.item_id not in held_out], EFFECT_CHUNK_ITEMS
        )
        from ...model import head_shape

        heads = head_shape(scope.config)[:2]
        return HeadEffectsPlan(measure, items, dropped, chunks, plan_sha256(items, measure), heads)

    def describe(self, declared, part) -> list[str]:
        if part is None:
            return []
        effects, items = part.measure, part.items
        pairs = sum(len(i.counterfactuals) for i in items)
        reasons = sorted({d.reason for d in part.dropped})
        design = "a pronoun swap" if effects.design == "pair" else f"{effects.slot} replaced"
        held = effects.held_out_ids(items)
        exact = (
            "every head"
            if effects.exact == "all"
            else f"{effects.exact} heads on every item and of every head on {len(held)} held-out items"
        )
        dropped = f"{len(part.dropped)} dropped{': ' + '; '.join(reasons[:2]) if reasons else ''}"
        return [
            f"head_effects ({design}): {len(items)} items x {len(effects.replacements)} counterfactuals = "
            f"{pairs} pairs ({dropped}), exact patching of {exact}"
        ]

    def estimate(self, declared, part) -> list[tuple[str, float, int | None]]:
        seconds = head_effect_seconds(part.measure, part.items, heads=part.heads) if part else 0.0
        return [("head effects", seconds, None)]

    def held(self, declared, part) -> list[tuple[str, int, int]]:
        """The largest chunk's x and x' sequences, recorded at every layer (the Bank) with a backward
        pass for the attribution."""
        if not part or not part.chunks:
            return []
        count = lambda chunk, size: sum(size(i) * (1 + len(i.counterfactuals)) for i in chunk)
        tokens = max(count(chunk, lambda i: len(i.x)) for chunk in part.chunks)
        return [("head effects", tokens, max(count(chunk, lambda i: 1) for chunk in part.chunks))]

    def manifest(self, declared, part) -> dict:
        return {"n_effect_chunks": len(part.chunks) if part else 0, "effects_plan": part and part.sha256}

    def resumed(self, declared, part, previous, directory) -> dict:
        """A resumed run keeps the summary of the screen when the items are the same."""
        plan = previous and previous.entry("effects_plan")
        if (
            previous
            and previous.entry(self.NAME)
            and (part is None or plan == part.sha256)
            and has_files(directory)
        ):
            return {self.NAME: previous.entry(self.NAME), "effects_plan": plan}
        return {}

    def compute(self, declared, part, engine) -> None:
        if part is not None:
            _run(part, engine)

    def merge(self, shards: list, out: Path, merged) -> None:
        """The screen's chunks come from the shard that owns each (k mod n); the selected heads need
        every item: `attnprobe run` on the merged directory adds them."""
        n_chunks, n = merged.entry("n_effect_chunks", 0), len(shards)
        if not n_chunks:
            return
        for k in range(n_chunks):
            source = shards[k % n][0] / "chunks"
            files = self.CHUNKS[SCREEN]
            if k not in store.complete_chunks(
                source, n_chunks, lambda m: None, files, SCREEN, merged.entry("effects_plan")
            ):
                raise_missing(source, k)
            for suffix in (*files, "done"):
                name = f"{SCREEN}{k:05d}.{suffix}"
                shutil.copyfile(source / name, out / "chunks" / name)
        assemble(out, n_chunks)
        seconds = round(sum(m.entry(self.NAME)["seconds"] for _, m in shards), 3)
        merged.entries[self.NAME] = dict(merged.entry(self.NAME), seconds=seconds)

    def tables(self, run) -> tuple[str, ...]:
        return self.TABLES if run.has(self.NAME) else ()

    def statistics(self, run, tables: dict) -> dict:
        from ...stats.kinds.head_effects import head_effects

        return head_effects(run, tables.get("head_stats")) if run.has(self.NAME) else {}

    def section(self, run, tables: dict, figures) -> dict | None:
        if "head_effects" not in tables:
            return None
        from .section import effects_section  # matplotlib: loaded where a figure is drawn

        return effects_section(run, tables, figures, EffectsRecord.of(run.manifest) or EffectsRecord({}))


def raise_missing(source: Path, k: int) -> None:
    from ...errors import RunError

    raise RunError(f"{source} lacks head-effects chunk {k}; rerun that shard's command to finish it")


def has_files(directory: Path) -> bool:
    """The assembled head-effect tables exist and their Parquet footers read (a truncated file is
    assembled again from the chunks instead of failing every later report)."""
    try:
        return all(pq.read_metadata(directory / name).num_rows >= 0 for name in FILES.values())
    except (OSError, pa.ArrowException):
        return False


def assemble(directory: Path, n_chunks: int, selected_plan: str | None = None) -> None:
    """Join the screen's chunks into head_effects_items/layers.parquet and head_effects_totals, with
    the selected-heads phase merged in when it is complete for `selected_plan`: the cross-fitted
    sets' columns join the totals, the suite's exactly patched heads fill the per-head table."""
    chunks = HeadEffects.CHUNKS
    tables = store.read_chunks(directory, n_chunks, chunks[SCREEN], SCREEN)
    done = store.complete_chunks(
        directory / "chunks", n_chunks, lambda m: None, chunks[SELECTED], SELECTED, selected_plan
    )
    if selected_plan and len(done) == n_chunks:
        selected = store.read_chunks(directory, n_chunks, chunks[SELECTED], SELECTED)
        keys = ["item_id", "counterfactual"]
        tables["totals"] = tables["totals"].merge(selected["totals"], on=keys, how="left")
        head_keys = [*keys, "layer", "head"]
        items = tables["items"].set_index(head_keys)
        items.update(selected["items"].set_index(head_keys))
        tables["items"] = items.reset_index()
    for table in ("items", "layers"):
        store.atomic_write(directory / FILES[table], lambda p, t=tables[table]: t.to_parquet(p, index=False))
    store.write_table(directory, "head_effects_totals", tables["totals"])


def _screen_phases(part: HeadEffectsPlan, engine) -> list[Phase]:
    """The screen: held-out items (every head patched exactly, ~60x the cost of another item) in
    their own chunks and progress, then the others."""
    from . import screen as effect_phases  # torch: not loaded by a suite's parse

    chunks, held_out = part.chunks, part.measure.held_out_ids(part.items)

    def compute(k, advance):
        tables = effect_phases.screen(engine.pm, part.measure, chunks[k], held_out, engine.shared)
        advance(len(chunks[k]))
        return tables

    mine = [k for k in range(len(chunks)) if engine.options.owns(k)]
    held = tuple(k for k in mine if any(i.item_id in held_out for i in chunks[k]))
    others = tuple(k for k in mine if k not in held)
    args = (SCREEN, part.sha256, len(chunks))
    size = lambda k: len(chunks[k])
    return [
        Phase("head-effects", *args, held, compute, size, unit="item", desc="held-out items"),
        Phase("head-effects", *args, others, compute, size, unit="item", desc="head effects", rate=True),
    ]


def _selected_phase(part: HeadEffectsPlan, engine) -> tuple[Phase, object]:
    """The selected heads on every item, once every item is screened; and the selection."""
    from . import screen as effect_phases

    chunks, info = part.chunks, engine.pm.info
    first = store.read_chunks(engine.directory, len(chunks), HeadEffects.CHUNKS[SCREEN], SCREEN)
    selection = select(part.measure, part.items, first["totals"], first["items"], info.n_layers, info.n_heads)
    key = f"{part.sha256}|{selection.crossfit}|{selection.suite}|{selection.random}"
    selected_plan = hashlib.sha256(key.encode()).hexdigest()

    def compute(k, advance):
        tables = effect_phases.selected(engine.pm, chunks[k], selection, engine.shared)
        advance(len(chunks[k]))
        return tables

    n = len(chunks)
    size = lambda k: len(chunks[k])
    phase = Phase("selected-heads", SELECTED, selected_plan, n, tuple(range(n)), compute, size, "item")
    return replace(phase, desc="selected heads"), selection


def _screened(part: HeadEffectsPlan, engine) -> bool:
    """Every item screened (an unsharded run, or a merged directory run again)."""
    n = len(part.chunks)
    return engine.options.shard is None and len(engine.complete(SCREEN, n, part.sha256)) == n


def _run(part: HeadEffectsPlan, engine) -> None:
    """Both phases; the tables are assembled and the manifest records the summary."""
    effects, items, log, manifest = part.measure, part.items, engine.options.log, engine.manifest
    summarise = lambda seconds, *selection: summary(effects, items, part.dropped, seconds, *selection)
    if not _screened(part, engine):
        pairs, held = sum(len(i.counterfactuals) for i in items), len(effects.held_out_ids(items))
        n = len(part.chunks)
        held_text = f", {held} items held out: every head and layer patched exactly" if held else ""
        log(
            f"head effects: {len(items)} items ({pairs} counterfactual pairs{held_text}) in {n} "
            f"chunk{'s' * (n > 1)}; about {head_effects_text(effects, items, engine.pm.model, part.heads)}, "
            "the time per item is known after the first chunk"
        )
    seconds = sum(engine.run(phase) for phase in _screen_phases(part, engine))
    if not _screened(part, engine):
        if seconds or HeadEffects.NAME not in manifest.entries:
            manifest.entries[HeadEffects.NAME] = summarise(seconds)
        return
    phase, selection = _selected_phase(part, engine)
    what = (
        "cross-fitted sets"
        if effects.exact == "all"
        else f"the suite's top {effects.exact} one by one and cross-fitted sets"
    )
    if len(engine.complete(phase.prefix, phase.n_chunks, phase.plan)) < phase.n_chunks:
        log(f"head effects: patching the selected heads ({what}) on {len(items)} items")
    seconds += engine.run(phase)
    previous = manifest.entry(HeadEffects.NAME, {})
    if seconds or not has_files(engine.directory) or "crossfit_heads" not in previous:
        before = previous.get("seconds", 0.0)  # e.g. the shards' time in a merged directory
        manifest.entries[HeadEffects.NAME] = summarise(before + seconds, selection, engine.pm.info.n_heads)
        assemble(engine.directory, phase.n_chunks, phase.plan)
