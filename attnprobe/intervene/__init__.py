"""The intervention library: what activation patching, edits, path patching, direct attribution and
tracing run on, whichever measure or analysis asks.

  items      typed PatchItem (x and its counterfactuals), Counterfactual, Dropped, Selection
  sites      behaviour y from logits, label ids, MLP hooks, activations and gradients
  rerun      the one edited forward pass: recorded sequences run from a decoder layer
  engine     batched patching: Bank (recorded clean runs), Variants, patched passes
  selection  folds, cross-fitted head sets and the suite's k heads
  gradients  gradients of y for attribution patching; first-order value paths

It sits above `forward` (capture, packing) and `model` (loading, anatomy) and below `measures` and
`edits`, which both use it; it imports neither.
"""
