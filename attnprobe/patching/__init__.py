"""Activation patching: which heads and layers carry a behaviour from x' to x.

Behaviour: y(x) = log p(positive set | x) - log p(negative set | x) at the cut. A counterfactual x'
changes one slot (or is the item's other version). Per item, in log-odds units: the total effect
TE = y(x') - y(x); patch in y(x with activations from x') - y(x); patch out y(x') - y(x' with
them from x). The activations: a head's output (its per-head context z), its pattern alone, a
layer's attention or MLP output, and joint sets of heads.

  items       typed PatchItem, Counterfactual, Dropped, Selection
  designs     SlotSwap and PairSwap: which items, x and x' (tokenizer only)
  sites       the primitives edits go through (behaviour, layers, MLP hooks, gradients)
  engine      batched patching: Bank (recorded clean runs), Variants, patched passes
  attribution first-order estimates of every head and layer from one backward pass
  selection   halves, cross-fitted sets and the suite's k heads

The one-item reference these are tested against lives in tests/reference_patching.py.
"""

from .designs import HeadEffectsMeasure, PairSwap, SlotSwap
from .items import Counterfactual, Dropped, PatchItem, Selection

__all__ = [
    "Counterfactual",
    "Dropped",
    "HeadEffectsMeasure",
    "PairSwap",
    "PatchItem",
    "Selection",
    "SlotSwap",
]
