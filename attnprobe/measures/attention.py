"""The attention measure: how much the tokens of a source span attend to each target span.

Per prompt, layer and head: `source_agg` over the source span's tokens (as query rows) of
`target_agg` over the target span's tokens (as keys) of the attention weights. With `at: before`
the query row is the token just before the source span instead (source label `before_<span>`):
the position a next-token prediction of that span is made from, where the causal metric reads. One forward
captures only the source rows (see capture.py); the values land in the long table
(prompt_id, layer, head, source, target, weight) of ATTENTION_SCHEMA.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..schema.analysis import BEFORE
from ..schema.yamllines import as_list, required_str
from ..store import atomic_write
from .base import BatchMeasure

if TYPE_CHECKING:  # torch is imported where the measure computes: a suite is parsed without it
    import torch

SOURCE_AGGREGATIONS = ("mean", "sum", "first", "last")
TARGET_AGGREGATIONS = ("sum", "mean", "max")
ATTENTION_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.int32()),
        ("layer", pa.int16()),
        ("head", pa.int16()),
        ("source", pa.large_string()),
        ("target", pa.large_string()),
        ("weight", pa.float32()),
    ]
)


@dataclass(frozen=True)
class AttentionMeasure:
    source: str
    targets: tuple[str, ...]
    source_agg: str = "mean"
    target_agg: str = "sum"
    at: str = "span"  # or "before": the token before the source span

    KEY = "attention"

    @property
    def spans(self) -> tuple[str, ...]:
        return (self.source, *self.targets)

    @property
    def label(self) -> str:
        """The source as the tables name it."""
        return self.source if self.at == "span" else f"{BEFORE}{self.source}"

    def source_range(self, spans: dict[str, tuple[int, int]]) -> tuple[int, int] | None:
        """The query rows (start, end) this measure reads in one prompt; None where it has none."""
        if self.source not in spans:
            return None
        start, end = spans[self.source]
        if self.at == "before":
            return (start - 1, start) if start > 0 else None
        return start, end

    def missing(self, span: str) -> str:
        what = (
            f"attention {self.source} -> {', '.join(self.targets)}"
            if span == self.source
            else f"attention {self.source} -> {span}"
        )
        return f"{what}: not measured where span '{span}' is absent"

    @staticmethod
    def parse(ctx, node) -> tuple[AttentionMeasure, ...]:
        measures = []
        for i, item in enumerate(node):
            if not isinstance(item, dict):
                ctx.fail(node, i, "each attention measure is a mapping with `source:` and `targets:`")
            ctx.check_keys(item, Attention.KEYS["attention"])
            at = item.get("at", "span")
            if at not in ("span", "before"):
                ctx.fail(item, "at", "`at` is span (the source's own tokens) or before (the token before it)")
            source = required_str(ctx, item, "source")
            targets = item.get("targets")
            if isinstance(targets, str):
                targets = [targets]
            if not isinstance(targets, list) or not targets:
                ctx.fail(item, "targets", "`targets` must list one or more span names")
            source_agg = item.get("source_agg", "mean")
            target_agg = item.get("target_agg", "sum")
            if source_agg not in SOURCE_AGGREGATIONS:
                ctx.fail(item, "source_agg", f"source_agg must be one of {', '.join(SOURCE_AGGREGATIONS)}")
            if target_agg not in TARGET_AGGREGATIONS:
                ctx.fail(item, "target_agg", f"target_agg must be one of {', '.join(TARGET_AGGREGATIONS)}")
            measure = AttentionMeasure(source, tuple(str(t) for t in targets), source_agg, target_agg, at)
            seen = {(m.label, t) for m in measures for t in m.targets}
            twice = next((t for t in measure.targets if (measure.label, t) in seen), None)
            if twice is not None:  # its rows would share a key with the earlier entry's, and be averaged
                ctx.fail(
                    item,
                    "targets",
                    f"attention {measure.label} -> {twice} is declared twice; the tables key rows by source "
                    "and target: keep one entry (one aggregation) per pair",
                )
            measures.append(measure)
        return tuple(measures)


class Attention(BatchMeasure):
    NAME = "attention"
    KEYS = {"attention": ("source", "targets", "source_agg", "target_agg", "at")}
    CONTRACT = ("gender", 16)
    NONE = ()
    ARTEFACTS = ("attention.parquet", "examples.json")
    CHUNKS = {"": ("attention.parquet",)}  # <k>.attention.parquet; the first kind names the rows
    READS = {"attention": "attention.parquet"}
    TABLES = ("head_stats", "layer_stats", "condition_means", "referent_accuracy")
    ON_DEVICE = True  # the captured rows are aggregated where they were computed
    PER_HEAD_STATISTICS = True

    def parse(self, ctx, doc, scope) -> tuple[AttentionMeasure, ...]:
        return AttentionMeasure.parse(ctx, as_list(ctx, doc, "attention", "measures {source, targets}"))

    def describe(self, declared, part) -> list[str]:
        return [
            f"attention: {m.label} -> {', '.join(m.targets)} ({m.source_agg} over source, {m.target_agg} "
            "over target)"
            for m in declared
        ]

    def manifest(self, declared, part) -> dict:
        return {}

    def ends(self, declared, prompt, spans) -> list[int]:
        return [spans[name][1] for m in declared for name in m.spans if name in spans]

    def request(self, declared, batch) -> tuple[dict, list[list[int]]]:
        """What this kind needs from the batch's forward pass (run_with_capture keywords), and the
        rows each prompt asked for: every token of every source span, padded by repeating the first."""
        import torch  # where the measure computes: a suite is parsed without torch

        rows_per_prompt = [source_rows(declared, e.spans) or [0] for e in batch]
        R = max(len(r) for r in rows_per_prompt)
        rows = torch.tensor([r + [r[0]] * (R - len(r)) for r in rows_per_prompt])  # (B, R)
        return {"rows": rows, "layers": None if declared else []}, rows_per_prompt

    def read(self, pm, declared, part, batch, captured, rows_per_prompt) -> list:
        """This batch's blocks (see `blocks`) from the captured weights."""
        import torch

        if not declared:
            return []
        W = torch.stack([captured.weights[layer] for layer in sorted(captured.weights)])  # (L, B, H, R, S)
        return blocks(declared, batch, rows_per_prompt, W)

    def chunk_table(self, parts: list[list], pm) -> pa.Table:
        blocks_ = [block for part in parts for block in part]
        return attention_table(blocks_, pm.info.n_layers, pm.info.n_heads)

    def assemble(self, directory, n_chunks: int) -> None:
        """Stream the chunk files into attention.parquet, one chunk in memory at a time."""
        chunk_dir = directory / "chunks"

        def write(path):
            with pq.ParquetWriter(path, ATTENTION_SCHEMA) as writer:
                for k in range(n_chunks):
                    writer.write_table(
                        pq.read_table(chunk_dir / f"{k:05d}.attention.parquet", schema=ATTENTION_SCHEMA)
                    )

        atomic_write(directory / "attention.parquet", write)

    def compute(self, declared, part, engine) -> None:
        """The report's attention view: every layer, head and row of a few prompts (examples.json),
        written by the unsharded run or the first shard, whatever the suite declares."""
        if engine.options.shard is None or engine.options.shard[0] == 1:
            examples = example_attention(engine.pm, engine.plan.encoded, engine.plan.suite.contrast)
            atomic_write(engine.directory / "examples.json", lambda p: p.write_text(json.dumps(examples)))

    def merge(self, shards: list, out, merged: dict) -> None:
        """The attention view's examples are the first shard's."""
        (out / "examples.json").write_bytes((shards[0][0] / "examples.json").read_bytes())

    def paired(self, a, b, scopes):
        from ..stats.compare import change_table
        from ..stats.kinds.attention import item_values

        values = [item_values(run) for run in (a, b)]
        if values[0] is None or values[1] is None:
            return {}
        return {"compare_attention": change_table(*values, a, scopes)}

    def statistics(self, run, tables: dict) -> dict:
        from ..stats.kinds.attention import condition_means, head_stats, layer_stats
        from ..stats.kinds.referents import referent_accuracy

        heads = head_stats(run)
        return {
            "head_stats": heads,
            "layer_stats": layer_stats(heads),
            "condition_means": condition_means(run),
            "referent_accuracy": referent_accuracy(run),
        }

    def section(self, run, tables: dict, figures) -> dict | None:
        from .sections import attention_section  # matplotlib: not loaded by a suite's parse

        heads = tables.get("head_stats")
        return attention_section(run, tables, figures) if heads is not None and len(heads) else None


def source_rows(measures, spans: dict[str, tuple[int, int]]) -> list[int]:
    """The query rows one prompt needs: every row every measure reads in it."""
    return sorted({t for m in measures if (r := m.source_range(spans)) for t in range(*r)})


def _aggregate(w: torch.Tensor, how: str, dim: int) -> torch.Tensor:
    if how == "mean":
        return w.mean(dim)
    if how == "sum":
        return w.sum(dim)
    if how == "max":
        return w.amax(dim)
    return w.select(dim, 0 if how == "first" else -1)


def blocks(measures, batch, rows_per_prompt: list[list[int]], W: torch.Tensor) -> list:
    """(prompt_id, source, target, (L*H,) weights, layer-major) per prompt and measured pair.
    W: (L, B, H, R, S) the captured rows of every layer, on the model's device; rows_per_prompt[b]
    names row r of W. The pairs are aggregated on W's device in groups of one shape (source and
    target token counts, aggregations), so a batch costs a few gathers and one copy to the CPU,
    whatever its number of prompts."""
    import torch

    wanted, groups = [], {}  # wanted: (prompt_id, label, target); groups: shape -> [(n, b, rows, keys)]
    for b, e in enumerate(batch):
        for m in measures:
            if (read := m.source_range(e.spans)) is None:
                continue
            rows = [rows_per_prompt[b].index(t) for t in range(*read)]
            for target in m.targets:
                if target not in e.spans:
                    continue
                keys = list(range(*e.spans[target]))
                shape = (len(rows), len(keys), m.source_agg, m.target_agg)
                groups.setdefault(shape, []).append((len(wanted), b, rows, keys))
                wanted.append((e.prompt.prompt_id, m.label, target))
    if not wanted:
        return []
    L, _, H = W.shape[:3]
    by_prompt = W.permute(1, 3, 4, 0, 2)  # (B, R, S, L, H): one gather picks every pair's block
    values = torch.empty(len(wanted), L, H, dtype=W.dtype, device=W.device)
    for (_, _, source_agg, target_agg), members in groups.items():
        at, b, rows, keys = (torch.tensor(x, device=W.device) for x in zip(*members))
        block = by_prompt[b[:, None, None], rows[:, :, None], keys[:, None, :]]  # (n, rows, keys, L, H)
        values[at] = _aggregate(_aggregate(block, target_agg, 2), source_agg, 1)
    flat = values.reshape(len(wanted), L * H).cpu().numpy().astype(np.float32)
    return [(*key, row) for key, row in zip(wanted, flat)]


def attention_table(blocks: list, n_layers: int, n_heads: int) -> pa.Table:
    """The long attention table of a chunk, sorted by prompt, source, target, layer, head. Each block
    is one (prompt, source, target) with its L*H weights already in (layer, head) order, so sorting
    the blocks sorts the rows: no sort over millions of rows with string keys."""
    blocks = sorted(blocks, key=lambda block: block[:3])  # stable: repeated keys keep measure order
    n, per_block = len(blocks), n_layers * n_heads
    if n == 0:
        return ATTENTION_SCHEMA.empty_table()

    def labels(i):  # each block's label repeated per layer and head: a take from the few distinct ones
        names, codes = np.unique(np.array([block[i] for block in blocks], dtype=object), return_inverse=True)
        return pa.array(names.tolist(), pa.large_string()).take(np.repeat(codes.astype(np.int32), per_block))

    return pa.table(
        {
            "prompt_id": np.repeat(np.array([block[0] for block in blocks], dtype=np.int32), per_block),
            "layer": np.tile(np.repeat(np.arange(n_layers, dtype=np.int16), n_heads), n),
            "head": np.tile(np.arange(n_heads, dtype=np.int16), n * n_layers),
            "source": labels(1),
            "target": labels(2),
            "weight": np.concatenate([block[3] for block in blocks]),
        },
        schema=ATTENTION_SCHEMA,
    )


def pack_weights(weights: torch.Tensor) -> tuple[list[int], str]:
    """(L, H, T, T) weights in [0, 1] for the attention view: quantised to uint16 (error <= 8e-6)
    and base64-encoded, compact and quick to write."""
    import torch

    quantised = torch.round(weights.clamp(0, 1) * 65535).to(torch.int32).cpu().numpy().astype("<u2")
    return list(quantised.shape), base64.b64encode(quantised.tobytes()).decode()


def example_attention(pm, encoded: list, contrast: str | None, n_items: int = 2) -> list[dict]:
    """Full attention (every layer, head, row) of a few prompts, for the report's attention view:
    every variant of the first item of the first and of the last template."""
    import torch

    from ..attention.capture import run_with_capture
    from ..forward.packing import pad_right

    templates = list(dict.fromkeys(e.prompt.template_id for e in encoded))
    wanted_templates = list(dict.fromkeys([templates[0], templates[-1]]))[:n_items]
    chosen = []
    for template in wanted_templates:
        first_item = next(e.prompt.item_id for e in encoded if e.prompt.template_id == template)
        chosen += [e for e in encoded if e.prompt.item_id == first_item]
    ids, mask = pad_right([e.ids for e in chosen], pm.tokenizer.pad_token_id)
    captured = run_with_capture(pm, ids, mask)  # one batch, every row
    weights = torch.stack(
        [captured.weights[layer] for layer in sorted(captured.weights)], dim=1
    )  # (B, L, H, T, T)
    examples = []
    for b, e in enumerate(chosen):
        T = len(e.ids)
        shape, packed = pack_weights(weights[b, :, :, :T, :T])
        examples.append(
            {
                "prompt_id": e.prompt.prompt_id,
                "item_id": e.prompt.item_id,
                "text": e.prompt.text,
                "label": str(e.prompt.meta.get(f"{contrast}_label", "")),
                "tokens": [pm.tokenizer.decode([i]) for i in e.ids],
                "spans": e.spans,
                "shape": shape,
                "weights_u16_base64": packed,
            }
        )
    return examples
