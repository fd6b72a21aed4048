"""Each of the sweep's top heads zeroed alone on every item, control prompt and text: what one head
carries of the stereotype gradient, of the definitional gap and their difference (specificity),
each with its CI, and its KL cost (edits_heads.csv, the statistics of stats.edits.edit_tables with
one row per head).

The heads are the TOP with the largest gradient score on all items (the ranking the sweep's sets
are drawn from), measured on those same items: the first rows carry the winner's curse of being
ranked first (the sweep's cross-fitted k = 1 row is the selection-free estimate for a top head).
The raw rows are those of an edit kind named "single", k = the head's rank, so the sweep's
statistics and resume apply unchanged.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from ...heads import HeadSet
from ..kinds import Zero
from ..passes import edited_text_costs, raw_rows
from .measure import behaviour_values

TOP = 10
NAME = "single"


def ranked_heads(scores: np.ndarray, n_heads: int, top: int = TOP) -> list[tuple[int, int]]:
    """The `top` heads with the largest finite scores (flat l H + h), largest first."""
    order = np.argsort(-np.where(np.isfinite(scores), scores, -np.inf), kind="stable")
    return [(int(i) // n_heads, int(i) % n_heads) for i in order[:top] if np.isfinite(scores[i])]


def measure_single(
    model, inputs, scores: np.ndarray, n_heads: int, top: int = TOP, log=lambda m: None
) -> pd.DataFrame:
    """Raw values (as sweep.measure_kind's) of each of the `top` heads zeroed alone: bias on every
    item, control on every prompt, KL and loss on every text."""
    L = model.info.n_layers
    heads = ranked_heads(scores, n_heads, top)
    if not heads:
        columns = ["target", "k", "draw", "index", "y", "kl", "loss", "heads", "heads_all", "kind"]
        return pd.DataFrame(columns=columns)
    frames = []
    for target, bank in (("bias", inputs.bank), ("control", inputs.control), ("text", inputs.texts)):
        n = len(bank.lengths)
        base = [index for _ in heads for index in range(n)]
        masks = [HeadSet((head,)).mask(L, n_heads) for head in heads for _ in range(n)]
        keys = [(rank, -1, index) for rank in range(1, len(heads) + 1) for index in range(n)]
        if target == "text":
            kl, loss = edited_text_costs(model, bank, inputs.clean_logp, Zero(), torch.stack(masks))
            frames.append(raw_rows(target, keys, kl=kl.cpu().numpy(), loss=loss.cpu().numpy()))
        else:
            labels = inputs.labels if target == "bias" else inputs.control_labels
            frames.append(
                raw_rows(target, keys, y=behaviour_values(model, bank, Zero(), base, masks, labels))
            )
        log(f"edit: each of the top {len(heads)} heads alone, {target}")
    out = pd.concat(frames, ignore_index=True)
    out["heads"] = out["heads_all"] = [str(HeadSet((heads[k - 1],))) for k in out["k"]]
    return out.assign(kind=NAME)
