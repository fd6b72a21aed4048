"""The layer a per-layer edit (the stream's eraser, an MLP mode) is judged at, chosen so that no value
of its "chosen" row comes from a layer chosen on that value: the gate is what the edit keeps (the
definitional gap, its midpoint, the generated texts' KL), the score the share of the gradient it removes."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..edits import MLP_LAYERS, STREAM, STREAM_LAYERS, edit_tables, slope
from ..inference import cluster_mean_test
from .definitional import TEMPLATES

# what a chosen layer must keep: the definitional gap, the mean of the gendered prompts' log-odds
# within OFFSET_MAX nats, the texts' next-token distributions (OFFSET_MAX and KL_MAX are the goal's own
# bounds, stats/keeping/goal.py, which imports them from here)
GAP_KEPT, OFFSET_MAX, KL_MAX = 0.8, 0.1, 0.001
PER_ITEM = ("bias", "readout_before", "readout_after")  # a layer edit's rows of one item each


def stream_table(raw: pd.DataFrame, kind: str = STREAM) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(edits_stream: one row per layer the stream was erased at, then the "chosen" row; the chosen
    raw rows, kind STREAM_CHOSEN). No value of the chosen row comes from a layer chosen on it
    (chosen_layers): an item's values are those of the layer chosen on the other quarters' items, a
    control prompt's and a generated text's those of the layer whose gate was judged on the other
    half of the words and texts. Any other per-layer edit (`kind`: an MLP edit's mlp-MODE) alike,
    its chosen rows of kind KIND-chosen."""
    raw = raw[raw["kind"].isin(["none", kind])]  # all it reads: every later filter scans these alone
    none = raw[raw["kind"] == "none"]
    layers = raw[raw["kind"] == kind]
    if layers.empty:
        return pd.DataFrame(), layers
    summary, _ = edit_tables(pd.concat([none, layers], ignore_index=True))
    chosen = chosen_layers(raw, kind)
    rows = layers[layers["k"].to_numpy() == picked_layers(raw, layers, chosen)].copy()
    choice = " | ".join(described(chosen, _where(kind)))
    rows = rows.assign(kind=f"{kind}-chosen", k=chosen["all"], heads=choice)
    best, _ = edit_tables(pd.concat([none, rows], ignore_index=True))
    table = pd.concat([summary.assign(chosen=False), best.assign(chosen=True)], ignore_index=True)
    table = table.rename(columns={"k": "layer"}).drop(columns=["heads_all"])
    drawn = ("random", "n_random", "n_sampled", "gradient_removed_s", "note")  # no random sets here
    keep = [c for c in table.columns if not c.startswith(drawn)]
    return table[keep], rows


def described(chosen: dict, name) -> tuple[str, str]:
    """chosen_layers' choice in words, each choice k as `name(k)`: (the quarters', "q0: ... | q1:
    ...", the word and text halves', "words and texts of half 0: ..., of half 1: ...")."""
    quarters = " | ".join(f"q{f}: {name(chosen[f])}" for f in range(4) if f in chosen)
    return quarters, f"words and texts of half 0: {name(chosen['half0'])}, of half 1: {name(chosen['half1'])}"


def quarter_layers(chosen: dict, kind: str = STREAM) -> str:
    """The quarters' layers (for an edit of several layers, numbers of layers) of chosen_layers'
    choice for `kind`, as the chosen rows name them."""
    return described(chosen, _where(kind))[0]


def _where(kind: str):
    """How a chosen k of `kind` reads: "layer 16", or for an edit of several layers "5 layers"."""
    several = str(kind).startswith((MLP_LAYERS, STREAM_LAYERS))
    return (lambda k: f"{k} layers") if several else (lambda k: f"layer {k}")


def picked_layers(raw: pd.DataFrame, layers: pd.DataFrame, chosen: dict) -> np.ndarray:
    """Per row of `layers`, the layer whose value it gives to the chosen row: an item's (bias,
    readout) its quarter's; a control prompt of half h's words (edits.inputs.Inputs.words_half: in
    any frame) and the h-th half of the generated texts (alternately) that of half h ("halfH"); the
    rest (words no fit used, the user's text) the layer chosen on everything ("all")."""
    items = raw[(raw["target"] == "bias") & (raw["kind"] == "none")].set_index("index")["quarter"]
    target, index = layers["target"].to_numpy(), layers["index"].to_numpy()
    picked = np.full(len(layers), chosen["all"])
    per_item = np.isin(target, PER_ITEM)
    picked[per_item] = items.reindex(index[per_item]).map(chosen).to_numpy()
    words = (
        layers["words_half"] if "words_half" in layers else layers.get("half", pd.Series(-1, layers.index))
    )
    generated = _generated(raw)
    for h in (0, 1):
        picked[(target == "control") & (words.to_numpy() == h)] = chosen[f"half{h}"]
        picked[(target == "text") & np.isin(index, generated[h::2])] = chosen[f"half{h}"]
    return picked


def _generated(raw: pd.DataFrame) -> np.ndarray:
    """The indexes of the generated texts (not the user's), in order."""
    texts = raw[(raw["target"] == "text") & (raw["kind"] == "none")]
    user = texts["user_text"].astype(bool) if "user_text" in texts else pd.Series(False, texts.index)
    return np.sort(texts.loc[~user, "index"].to_numpy())


def layer_tables(raw: pd.DataFrame, prefix: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per raw kind starting with `prefix` its rows per layer and its chosen row: edits_stream with
    STREAM (the stream at one layer, at several), edits_mlp with MLP (each MLP mode, at one layer, at
    several); the chosen raw rows), both empty without such kinds."""
    kinds = [kind for kind in raw["kind"].unique() if str(kind).startswith(prefix)]
    tables = [stream_table(raw, kind) for kind in kinds]
    if not tables:
        return pd.DataFrame(), raw.iloc[:0]
    return pd.concat([t for t, _ in tables], ignore_index=True), pd.concat([c for _, c in tables])


def chosen_layers(raw: pd.DataFrame, kind: str = STREAM) -> dict:
    """quarter -> layer, "all" -> layer, "half0" and "half1" -> layer: among the layers whose gate
    passes (the all-items edit keeps at least GAP_KEPT of the definitional gap, moves the gendered
    prompts by at most OFFSET_MAX nats on average, with KL's upper bound at most KL_MAX), the one
    removing the share of the gradient closest to all of it (a share s scores min(s, 2 - s):
    removing more than there was reverses the stereotype and is no credit);
    where no layer passes, the one of largest score - |1 - gap kept|. The share is taken on the items
    outside the quarter (for a quarter) or on every item; the gate on every control prompt and text,
    but for "halfH" (the layer of the prompts of word half H and of half H of the texts) on the other
    half's."""
    items = raw[(raw["target"] == "bias") & (raw["kind"] == "none")].set_index("index").sort_index()
    after = raw[(raw["target"] == "bias") & (raw["kind"] == kind)]
    after = after.pivot(index="index", columns="k", values="y").reindex(items.index)
    x, before = items["covariate"].to_numpy(dtype=float), items["y"].to_numpy()

    def removed(on: np.ndarray) -> pd.Series:  # per layer, the share of the gradient removed on `on`
        return pd.Series(
            {k: 1 - slope(x[on], after[k].to_numpy()[on]) / slope(x[on], before[on]) for k in after.columns}
        )

    def best(removed: pd.Series, gate: tuple[pd.Series, pd.Series]) -> int:
        removed = removed.where(removed <= 1, 2 - removed)  # over-removal is no credit
        passes, kept = gate[0].reindex(removed.index, fill_value=False), gate[1].reindex(removed.index)
        score = removed[passes] if passes.any() else removed - (1 - kept).abs()
        return int((score if score.notna().any() else removed).idxmax())

    every, quarter, on_all = _gate(raw, kind), items["quarter"].to_numpy(), removed(np.ones(len(items), bool))
    out = {int(f): best(removed(quarter != f), every) for f in sorted(np.unique(quarter))}
    out["all"] = best(on_all, every)
    for h in (0, 1):
        out[f"half{h}"] = best(on_all, _gate(raw, kind, 1 - h))
    return out


def _gate(raw: pd.DataFrame, kind: str, half: int | None = None) -> tuple[pd.Series, pd.Series]:
    """Per layer of `kind`: (whether its all-items edit passes the gate, the definitional gap it
    keeps), judged on the control prompts of word half `half` and on that half of the generated
    texts (alternately; None: on every one)."""
    control0 = raw[(raw["target"] == "control") & (raw["kind"] == "none")].set_index("index").sort_index()
    # the prompts whose gap control_columns reports as definitional_gap_kept: those of word halves
    # 0 and 1 outside the items' templates (its ratio of sums, here without the interval)
    in_templates = control0["set"].fillna("").astype(str).str.endswith(TEMPLATES)
    control0 = control0[(control0["half"] != 2) & ~in_templates]
    texts = _generated(raw)
    if half is not None:
        control0, texts = control0[control0["half"] == half], texts[half::2]
    sign, before = control0["sign"].to_numpy(dtype=float), control0["y"].to_numpy()
    y0 = sign * before  # toward the right label
    passes, kept = {}, {}
    for k, rows in raw[(raw["kind"] == kind) & (raw["draw"] == -1)].groupby("k"):
        after = rows[rows["target"] == "control"].set_index("index")["y"].reindex(control0.index).to_numpy()
        y1 = sign * after
        both = np.isfinite(y1) & np.isfinite(y0)
        kept[k] = y1[both].sum() / y0[both].sum() if both.any() else np.nan
        offset = np.mean((after - before)[both]) if both.any() else np.nan  # toward the positive label
        kl = rows[rows["target"] == "text"].set_index("index")["kl"].reindex(texts).to_numpy()
        one_each = [np.arange(len(kl))]  # each text its own cluster
        high = cluster_mean_test(kl, np.ones(len(kl)), one_each)["ci_high"][0] if len(kl) > 1 else np.nan
        passes[k] = bool(kept[k] >= GAP_KEPT and abs(offset) <= OFFSET_MAX and high <= KL_MAX)
    return pd.Series(passes, dtype=bool), pd.Series(kept, dtype=float)
