"""Every held-out claim of a run in one table, each beside what chance gives (its null baseline).

- attention: per (source, target), the top 5 heads by |r| chosen on half the units and half the
  templates keep their sign on the other halves (count; the same for random heads of the chosen
  heads' layers) and their mean held-out r against random heads' (p over 2,000 draws); beside it
  the same p over 100 random splits (their median and the share below 0.05: one split can be lucky);
- head effects: per counterfactual word, the share of TE (and of its covariate gradient) that the
  cross-fitted heads carry, against random head sets of the same layers on the same items.

Each p is a share of random draws reaching the claim, so it cannot fall below its floor
1 / (1 + draws) (`p_floor`); `p_holm` adjusts the table's p values for their number (Holm), each
taken at least at its floor.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .inference import holm
from .kinds.attention import HELD_OUT_DRAWS, held_out_interaction

COLUMNS = [
    "claim",
    "source",
    "target",
    "counterfactual",
    "statistic",
    "value",
    "null",
    "p",
    "p_floor",
    "p_holm",
    "split",
    "splits",
    "splits_median_p",
    "splits_share_p05",
]


def _splits(group: pd.DataFrame) -> dict:
    """The same claim over random unit x template splits (head_stats' held_out_splits_* columns)."""
    if "held_out_splits_median_p" not in group:
        return {}
    first = group.iloc[0]
    return {
        "splits": first["held_out_splits"],
        "splits_median_p": first["held_out_splits_median_p"],
        "splits_share_p05": first["held_out_splits_share_p05"],
    }


def held_out_summary(heads: pd.DataFrame, effects_summary: pd.DataFrame | None) -> pd.DataFrame:
    rows = []
    pooled = heads[heads["scope"] == "all"] if "interaction_r_half_a" in heads else heads.iloc[0:0]
    for (source, target), group in pooled.groupby(["source", "target"], sort=False):
        if group["interaction_r_half_a"].isna().all():
            continue
        held = held_out_interaction(group)
        base = {"claim": "attention interaction, top 5 heads", "source": source, "target": target}
        rows.append(
            {
                **base,
                "statistic": "heads keeping their sign",
                "value": held["n_same_sign"],
                "null": held["n_same_sign_null"],
                "split": held["split"],
            }
        )
        rows.append(
            {
                **base,
                "statistic": "mean held-out r",
                "value": held["mean_held_out_r"],
                "null": held["mean_held_out_r_null"],
                "p": held["held_out_p"],
                "p_floor": 1 / (1 + HELD_OUT_DRAWS),
                "split": held["split"],
                **_splits(group),
            }
        )
    for row in effects_summary.to_dict("records") if effects_summary is not None else []:
        for what, text in (("share", "share of TE"), ("gradient_share", "share of TE's covariate gradient")):
            if (
                f"{what}_crossfit_random_p" in row
                and row[f"{what}_crossfit_random_p"] == row[f"{what}_crossfit_random_p"]
            ):
                rows.append(
                    {
                        "claim": f"cross-fitted heads' {text}",
                        "counterfactual": row["counterfactual"],
                        "statistic": "patched in (null: random head sets of the same layers, mean)",
                        "value": row[f"{what}_crossfit_in_null_items"],
                        "null": row[f"{what}_random_in_mean"],
                        "p": row[f"{what}_crossfit_random_p"],
                        "p_floor": 1 / (1 + row["n_random_draws"]),
                        "split": "units x templates, opposite quarter",
                    }
                )
    table = pd.DataFrame(rows, columns=COLUMNS)
    tested = table["p"].notna().to_numpy()
    if tested.any():
        at_floor = np.maximum(table["p"].to_numpy(dtype=float), table["p_floor"].to_numpy(dtype=float))
        adjusted = np.full(len(table), np.nan)
        adjusted[tested] = holm(at_floor[tested])
        table["p_holm"] = adjusted
    return table
