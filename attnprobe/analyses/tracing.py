"""Where the effect sits in the residual stream (`attnprobe edit --trace`): for every layer and three
groups of positions, the hidden state entering that layer at those positions is patched from the
item's reference counterfactual x' (the occupation replaced by "person") into the clean run x, and
the run continues from there (causal tracing of the stream, Meng et al. 2022, with x' as the
corruption). Groups, aligned as the head-effects items align x and x' (Counterfactual.at is the
slot's last token, the tokens after it are the same in both):

  occupation   the slot's last token (x: at, x': at_cf)
  between      every token after the slot before the prediction (aligned one to one)
  prediction   the last token, where the next word is predicted

The effect of a patch is y_patched - y (y = log p(positive) - log p(negative) after x); the total
effect TE = y(x') - y(x). Per layer and group (tracing.csv): the share of TE the patch carries (ratio
of means) and the share of TE's covariate gradient (ratio of slopes), each with a two-way
cluster-robust CI (unit x template; stats.inference.ratio_test, slope_ratio_test). A group that
carries the whole effect at a layer holds all the information about the swap there: the layer at
which the share moves from the occupation to the prediction position is where it is moved.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from ..intervene.engine import Bank
from ..intervene.rerun import ROWS, rerun_y
from ..stats.analyses.paths_tables import effect_shares, wide_effects
from .senders import Pair, pair_frame, reference_pairs

GROUPS = ("occupation", "between", "prediction")


def _positions(pair: Pair, T: int, T_cf: int) -> dict[str, tuple[list[int], list[int]]]:
    """Per group the positions in x (T tokens) and the aligned ones in x' (T_cf tokens; empty where
    the group has none)."""
    between = list(range(pair.at + 1, T - 1))
    return {
        "occupation": ([pair.at], [pair.at_cf]),
        "between": (between, [p - pair.at + pair.at_cf for p in between]),
        "prediction": ([T - 1], [T_cf - 1]),
    }


@torch.inference_mode()
def _patched_y(module, bank: Bank, reference: Bank, layer: int, pairs, labels, group: str) -> np.ndarray:
    """y of every item with the stream entering `layer` at `group`'s positions taken from x'
    (NaN for an item whose group is empty). `pairs`: (item index, reference index, positions)."""
    y = np.full(len(bank.lengths), np.nan)
    todo = [(n, r, where[group]) for n, r, where in pairs if where[group][0]]
    for start in range(0, len(todo), ROWS):
        batch = todo[start : start + ROWS]
        rows = torch.tensor([n for n, _, _ in batch])
        hidden = bank.hidden[layer][rows].clone()
        for b, (_, r, (here, there)) in enumerate(batch):
            hidden[b, here] = reference.hidden[layer][r, there]
        y[rows.cpu().numpy()] = rerun_y(module, bank, rows, layer, hidden, labels[rows]).cpu().numpy()
    return y


def measure_tracing(model, inputs, word: str, log=lambda m: None) -> pd.DataFrame:
    """Raw values: per item its y, y(x'), and per layer and group y patched (long format: item_id,
    unit, template_id, covariate, layer, position, y, y_cf, y_patched)."""
    lengths, reference_lengths = inputs.bank.lengths.tolist(), inputs.reference.lengths.tolist()
    found = reference_pairs(inputs.items, word)
    pairs = [(p.item, p.donor, _positions(p, lengths[p.item], reference_lengths[p.donor])) for p in found]
    base = pair_frame(inputs.items, inputs.bank, inputs.reference, found, inputs.labels)
    which = np.array([p.item for p in found], dtype=np.int64)
    frames = []
    for layer in range(model.info.n_layers):
        for group in GROUPS:
            patched = _patched_y(
                model.model, inputs.bank, inputs.reference, layer, pairs, inputs.labels, group
            )
            frames.append(
                pd.DataFrame({"index": which, "layer": layer, "position": group, "y_patched": patched[which]})
            )
        log(f"trace: the stream entering layer {layer} of {model.info.n_layers} patched")
    out = pd.concat(frames, ignore_index=True)
    described = base.iloc[np.tile(np.arange(len(found)), len(frames))].reset_index(drop=True)
    return pd.concat([out, described], axis=1).dropna(subset=["y_cf"]).reset_index(drop=True)


def tracing_table(raw: pd.DataFrame) -> pd.DataFrame:
    """Per layer and group: the share of TE and of its covariate gradient the patch carries (CIs:
    two-way cluster-robust by unit x template), from the raw values alone."""
    items, effect, columns = wide_effects(raw, ["layer", "position"], "y_patched", sort=True)
    te_mean = float(np.nanmean((items["y_cf"] - items["y"]).to_numpy()))
    shares = effect_shares(items, effect)  # (n, layers x groups)
    share, gradient = shares["te"], shares["gradient"]
    rows = []
    for j, (layer, position) in enumerate(columns):
        rows.append(
            {
                "layer": int(layer),
                "position": position,
                "n_items": int(np.isfinite(effect[:, j]).sum()),
                "te_share": float(share["ratio"][j]),
                "te_share_ci_low": float(share["ci_low"][j]),
                "te_share_ci_high": float(share["ci_high"][j]),
                "gradient_share": float(gradient["ratio"][j]),
                "gradient_share_ci_low": float(gradient["ci_low"][j]),
                "gradient_share_ci_high": float(gradient["ci_high"][j]),
                "te_mean": te_mean,
                "clusters": "unit x template",
            }
        )
    order = {g: i for i, g in enumerate(GROUPS)}
    table = pd.DataFrame(rows)
    return table.sort_values(["layer", "position"], key=lambda s: s.map(order) if s.name == "position" else s)
