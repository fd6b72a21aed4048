"""The edges a circuit is made of (`attnprobe edit --circuits --grain edges`), and how edge circuits
are chosen.

Senders write to the residual stream: the token embeddings, every attention head (its output through
the output projection, and the norm after attention where the family has one) and every MLP (what
it adds). Receivers read it: each head's query input, each key/value head's key and value inputs
(one per key/value head on grouped-query models), each MLP's input, and the logits. An edge joins a
sender to a receiver that reads the stream after it, at one group of positions: the occupation (its
last token), the positions between it and the last, and the last (where y is read; the logits read
only there). Before the occupation's last token x and x' are not aligned, and nothing is patched.

Senders in topological order: 0 the embeddings, 1 + l (H + 1) + h head h of layer l, 1 + l (H + 1)
+ H layer l's MLP. Receivers: l W + j for layer l (W = H + 2 G + 1: H queries, G keys, G values,
the MLP), L W the logits. A circuit is a set of edges; every edge outside it carries its sender's x'
output into its receiver (wiring.py). Circuits chosen by score are pruned to the edges on a route
from the embeddings to the logits (`prune`): an edge from a part no circuit edge feeds carries x''s
output anyway, one into a part that reaches the logits by no circuit edge changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ...heads import HeadSet
from .graph import EMBEDDING

GROUPS = ("occupation", "between", "last")
LOGITS = "logits"
# circuit sizes in edges (and all of them: the whole model, faithful by construction)
EDGE_SIZES = (1, 2, 3, 5, 10, 30, 100, 300, 1000, 3000, 10_000, 30_000, 100_000)


@dataclass(frozen=True)
class EdgeGraph:
    """The edges of a model of `n_layers` layers, `n_heads` query heads and `n_kv` key/value heads."""

    n_layers: int
    n_heads: int
    n_kv: int
    always = 0  # no edge is in every circuit (the parts' graph keeps its embeddings)
    sampled_every = 8  # random circuits, subsets and single edges: on every 8th pair (cost)

    @property
    def width(self) -> int:  # receivers per layer
        return self.n_heads + 2 * self.n_kv + 1

    @property
    def n_senders(self) -> int:
        return 1 + self.n_layers * (self.n_heads + 1)

    @property
    def n_receivers(self) -> int:
        return self.n_layers * self.width + 1

    def sender(self, layer: int, head: int | None = None) -> int:
        """A head's sender index (head None: the layer's MLP)."""
        return 1 + layer * (self.n_heads + 1) + (self.n_heads if head is None else head)

    @cached_property
    def sender_order(self) -> np.ndarray:
        """(S,) 2 l for layer l's heads, 2 l + 1 for its MLP, -1 the embeddings."""
        order = np.full(self.n_senders, -1)
        for l in range(self.n_layers):
            order[self.sender(l, 0) : self.sender(l)] = 2 * l
            order[self.sender(l)] = 2 * l + 1
        return order

    @cached_property
    def receiver_order(self) -> np.ndarray:
        """(R,) what a receiver reads after: 2 l for layer l's heads, 2 l + 1 its MLP, 2 L the logits."""
        order = np.repeat(2 * np.arange(self.n_layers), self.width)
        order[self.width - 1 :: self.width] += 1
        return np.append(order, 2 * self.n_layers)

    @cached_property
    def reads(self) -> np.ndarray:
        """(R, S) bool: whether a receiver reads what a sender writes (the sender is below it)."""
        return self.sender_order[None, :] < self.receiver_order[:, None]

    @cached_property
    def limits(self) -> np.ndarray:
        """(R,) the senders a receiver can read are those below its limit (senders are in order)."""
        return self.reads.sum(1)

    def receivers_of(self, layer: int) -> tuple[slice, int]:
        """(the attention inputs' slice, the MLP's index) of one layer's receivers."""
        start = layer * self.width
        return slice(start, start + self.width - 1), start + self.width - 1

    @cached_property
    def valid(self) -> np.ndarray:
        """(R, S, 3) bool: the edges that exist (the sender writes before the receiver reads; the
        logits read the last position only)."""
        out = np.repeat(self.reads[:, :, None], len(GROUPS), 2)
        out[-1, :, :-1] = False
        return out

    @cached_property
    def index(self) -> np.ndarray:
        """(size,) each edge's flat index into (R, S, 3)."""
        return np.flatnonzero(self.valid)

    @property
    def size(self) -> int:
        return len(self.index)

    def dense(self, chosen: np.ndarray) -> np.ndarray:
        """(size,) bool -> (R, S, 3) bool."""
        out = np.zeros(self.valid.size, dtype=bool)
        out[self.index] = chosen
        return out.reshape(self.valid.shape)

    def sender_names(self) -> list[str]:
        names = [EMBEDDING]
        for l in range(self.n_layers):
            names += [HeadSet.name(l, h) for h in range(self.n_heads)] + [f"MLP{l}"]
        return names

    def receiver_names(self) -> list[str]:
        kv = (lambda l, g: HeadSet.name(l, g)) if self.n_kv == self.n_heads else (lambda l, g: f"L{l}KV{g}")
        names = []
        for l in range(self.n_layers):
            names += [f"{HeadSet.name(l, h)}.q" for h in range(self.n_heads)]
            names += [f"{kv(l, g)}.{side}" for side in "kv" for g in range(self.n_kv)] + [f"MLP{l}"]
        return [*names, LOGITS]

    def ends(self) -> tuple[list[str], list[str], list[str]]:
        """Per edge: its sender's name, its receiver's and its positions' group."""
        r, s, g = np.unravel_index(self.index, self.valid.shape)
        senders, receivers = self.sender_names(), self.receiver_names()
        return [senders[a] for a in s], [receivers[b] for b in r], [GROUPS[c] for c in g]

    def groups(self, chosen: np.ndarray) -> list[np.ndarray]:
        """The groups a worst subset of circuit `chosen` is drawn from (search.py): each sending
        part's edges in the circuit."""
        edges = np.flatnonzero(chosen)
        senders = np.unravel_index(self.index[edges], self.valid.shape)[1]
        return [edges[senders == s] for s in np.unique(senders)]

    def names(self) -> list[str]:
        """Each edge's name: 'sender -> receiver @ positions'."""
        return [f"{s} -> {r} @ {g}" for s, r, g in zip(*self.ends())]

    def sizes(self) -> list[int]:
        return [n for n in EDGE_SIZES if n < self.size] + [self.size]

    @cached_property
    def _heads_read(self) -> list[list[int]]:
        """Per attention receiver of a layer, the query heads whose output it changes (a key/value
        head's inputs serve its group of query heads)."""
        group = self.n_heads // self.n_kv
        per_kv = [list(range(g * group, (g + 1) * group)) for g in range(self.n_kv)]
        return [[h] for h in range(self.n_heads)] + per_kv + per_kv

    def prune(self, chosen: np.ndarray) -> np.ndarray:
        """(size,) bool: the chosen edges on a route from the embeddings to the logits (repeated
        until nothing more is dropped)."""
        kept = chosen.copy()
        while True:
            edges = self.dense(kept).any(2)  # (R, S)
            fed, useful = self._fed(edges), self._useful(edges)
            kept_now = kept & self.dense_to_edges(fed[None, :, None] & useful[:, None, None])
            if (kept_now == kept).all():
                return kept
            kept = kept_now

    def dense_to_edges(self, dense: np.ndarray) -> np.ndarray:
        return np.broadcast_to(dense, self.valid.shape).reshape(-1)[self.index]

    def _fed(self, edges: np.ndarray) -> np.ndarray:
        """(S,) the senders some circuit edge from a fed sender reaches (the embeddings are fed)."""
        fed = np.zeros(self.n_senders, dtype=bool)
        fed[0] = True
        for l in range(self.n_layers):
            attention, mlp = self.receivers_of(l)
            reached = (edges[attention] & fed).any(1)
            for r, heads in enumerate(self._heads_read):
                if reached[r]:
                    fed[[self.sender(l, h) for h in heads]] = True
            fed[self.sender(l)] = (edges[mlp] & fed).any()
        return fed

    def _useful(self, edges: np.ndarray) -> np.ndarray:
        """(R,) the receivers whose part reaches the logits through circuit edges."""
        feeds = np.zeros(self.n_senders, dtype=bool)  # senders with a circuit edge to a useful receiver
        useful = np.zeros(self.n_receivers, dtype=bool)
        useful[-1] = True
        feeds |= edges[-1]
        for l in reversed(range(self.n_layers)):
            attention, mlp = self.receivers_of(l)
            useful[mlp] = feeds[self.sender(l)]
            feeds |= edges[mlp] & useful[mlp]
            for r, heads in enumerate(self._heads_read):
                useful[attention.start + r] = feeds[[self.sender(l, h) for h in heads]].any()
            feeds |= (edges[attention] & useful[attention, None]).any(0)
        return useful

    def top(self, scores: np.ndarray, n: int) -> np.ndarray:
        """(size,) bool: the n edges of largest |score| (ties in index order), pruned."""
        order = np.argsort(-np.abs(np.nan_to_num(scores, nan=0.0)), kind="stable")
        chosen = np.zeros(self.size, dtype=bool)
        chosen[order[:n]] = True
        return self.prune(chosen)

    def random(self, n: int, rng) -> np.ndarray:
        """(size,) bool: n edges drawn at random, pruned (the baseline of a circuit of n)."""
        chosen = np.zeros(self.size, dtype=bool)
        chosen[rng.choice(self.size, n, replace=False)] = True
        return self.prune(chosen)

    def of_heads(self, heads) -> np.ndarray:
        """(size,) bool: the edges among the embeddings, these (layer, head) pairs and the logits
        (into the heads' queries and their key/value heads' keys and values): the parts' circuit of
        these heads at the grain of edges."""
        senders = np.zeros(self.n_senders, dtype=bool)
        senders[0] = True
        receivers = np.zeros(self.n_receivers, dtype=bool)
        receivers[-1] = True
        group = self.n_heads // self.n_kv
        for layer, head in heads:
            senders[self.sender(layer, head)] = True
            attention, _ = self.receivers_of(layer)
            g = head // group
            for j in (head, self.n_heads + g, self.n_heads + self.n_kv + g):
                receivers[attention.start + j] = True
        return self.dense_to_edges(receivers[:, None, None] & senders[None, :, None])

    def parts(self, chosen: np.ndarray) -> int:
        """How many parts (heads and MLPs; not the embeddings) a circuit's edges touch: those with an
        edge out, a query or MLP input with an edge in (a key or value input serves a group of heads:
        it counts through the heads of the group that send)."""
        edges = self.dense(chosen).any(2)
        touched = edges.any(0)
        touched[0] = False
        for l in range(self.n_layers):
            attention, mlp = self.receivers_of(l)
            for h in range(self.n_heads):
                touched[self.sender(l, h)] |= edges[attention.start + h].any()
            touched[self.sender(l)] |= edges[mlp].any()
        return int(touched.sum())
