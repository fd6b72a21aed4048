"""The parts a circuit is made of, how they are ranked, and which circuits are evaluated.

Parts (nodes): the token embeddings, every attention head (its output z, before the output
projection) and every MLP (its output). A circuit C is the embeddings and a set of heads and MLPs;
run on x, every part outside C gives the output it had in x' (at the aligned positions, from the
occupation's last token on), every part in C computes from what reaches it. The embeddings are in
every circuit: without them every part reads x''s stream and y is y(x') whatever C holds. Since
each part reads the sum of all earlier parts' outputs, any such set is connected from the
embeddings to the logits, so at this grain pruning changes nothing (edges are the next grain).

Ranking: a part's score on a set of items is the slope, over the items' covariate, of its
attribution (eap.py: its first-order effect on y of taking x''s output), i.e. to first
order the part's contribution to TE's covariate gradient; parts are ranked by its absolute value,
as EAP-IG ranks edges (Hanna et al. 2024).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...heads import HeadSet

EMBEDDING = "embedding"
SIZES = (1, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)  # parts beside the embeddings; + all


@dataclass(frozen=True)
class Graph:
    """The parts of a model of `n_layers` x `n_heads` (and an MLP per layer where `mlps`), indexed
    0 (the embeddings), 1 + l H + h (head h of layer l), 1 + L H + l (layer l's MLP)."""

    n_layers: int
    n_heads: int
    mlps: bool
    always = 1  # the embeddings are in every circuit
    sampled_every = 4  # random circuits, subsets and single parts are run on every 4th pair

    def top(self, scores: np.ndarray, n: int) -> np.ndarray:
        return top_parts(scores, n)

    def random(self, n: int, rng) -> np.ndarray:
        return random_parts(self.size, n, rng)

    @property
    def size(self) -> int:
        return 1 + self.n_layers * self.n_heads + self.n_layers * self.mlps

    def names(self) -> list[str]:
        L, H = self.n_layers, self.n_heads
        heads = [HeadSet.name(l, h) for l in range(L) for h in range(H)]
        return [EMBEDDING, *heads, *([f"MLP{l}" for l in range(L)] if self.mlps else [])]

    def layers(self) -> np.ndarray:
        """(size,) the layer each part is in (-1: the embeddings)."""
        L, H = self.n_layers, self.n_heads
        return np.concatenate([[-1], np.repeat(np.arange(L), H), np.arange(L) if self.mlps else []]).astype(
            int
        )

    def masks(self, patched: np.ndarray):
        """(embeddings (V,), heads (V, L, H), MLPs (V, L) or None) of boolean part masks (V, size)."""
        L, H = self.n_layers, self.n_heads
        heads = patched[:, 1 : 1 + L * H].reshape(-1, L, H)
        return patched[:, 0], heads, patched[:, 1 + L * H :] if self.mlps else None

    def of_heads(self, heads) -> np.ndarray:
        """(size,) bool: the embeddings and these (layer, head) pairs."""
        chosen = np.zeros(self.size, dtype=bool)
        chosen[0] = True
        for layer, head in heads:
            chosen[1 + layer * self.n_heads + head] = True
        return chosen

    def sizes(self) -> list[int]:
        """The circuit sizes evaluated (parts beside the embeddings): SIZES below the parts there
        are, and all of them (the full model, faithful by construction: a check)."""
        parts = self.size - 1
        return [n for n in SIZES if n < parts] + [parts]


def part_scores(attribution: np.ndarray, covariate: np.ndarray) -> np.ndarray:
    """(size,) each part's score on these items: the OLS slope of its attribution (n, size) on the
    covariate (n,); NaN where the covariate does not vary."""
    x = covariate - covariate.mean()
    spread = float(x @ x)
    if len(x) < 2 or spread == 0:
        return np.full(attribution.shape[1], np.nan)
    return x @ np.nan_to_num(attribution) / spread


def top_parts(scores: np.ndarray, n: int) -> np.ndarray:
    """(size,) bool: the embeddings and the n parts of largest |score| (ties in index order)."""
    order = np.argsort(-np.abs(np.nan_to_num(scores[1:], nan=0.0)), kind="stable")
    chosen = np.zeros(len(scores), dtype=bool)
    chosen[0] = True
    chosen[1 + order[:n]] = True
    return chosen


def random_parts(size: int, n: int, rng) -> np.ndarray:
    """(size,) bool: the embeddings and n parts drawn at random (the baseline of a circuit of n)."""
    chosen = np.zeros(size, dtype=bool)
    chosen[0] = True
    chosen[1 + rng.choice(size - 1, n, replace=False)] = True
    return chosen
