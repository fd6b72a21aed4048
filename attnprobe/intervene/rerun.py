"""The one edited forward pass: recorded sequences run from a decoder layer with given hidden states.

The layers below `layer` are replaced by pass-through stubs and `layer` receives the given states
(the clean run's recorded ones, or changed ones: tracing and the stream eraser change them, at layer 0
too, where they replace the embeddings); the lm head is narrowed to the label words y needs. Every
patched or edited run goes through `forward_from`: activation patching (engine.py, with a clean
prefix read from recorded keys and values), the edit sweep's packed tries and padded rows
(edits/passes.py), the stream eraser, tracing, path patching and its senders. What a run changes
is given as context managers (editors on the heads' outputs, hooks on MLPs, the picked logits).

Shapes: B rows, T positions, E model width.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from ..model.anatomy import decoder_layers, module_of
from .sites import behaviour_rows

ROWS = 64  # sequences per pass of the edit analyses


@dataclass(frozen=True)
class Changes:
    """What a rerun changes and reads: the `contexts` entered around the pass (editors on the heads'
    outputs, hooks on MLPs, the picked logits), after the lm head is narrowed to `vocabulary` (the
    label ids y needs; None: every logit), so a hook on the lm head hooks the narrowed one."""

    contexts: tuple | list = ()
    vocabulary: torch.Tensor | None = None


def forward_from(module, layer: int, hidden, inputs: dict, changes: Changes = Changes(), returns_tuple=True):
    """(logits, narrowed): the model on `inputs` (input_ids (B, T), attention_mask 2-D padding or 4-D
    packed, position_ids or None: 0..T-1), run from `layer`, which receives `hidden` (B, T, E), with
    the `changes` (narrowed True where the head could be narrowed). Gradients flow where the caller
    enables them."""
    with ExitStack() as stack:
        stack.enter_context(skipping(module, layer, hidden, returns_tuple))
        vocabulary = changes.vocabulary
        narrowed = vocabulary is not None and stack.enter_context(narrowed_head(module, vocabulary))
        for context in changes.contexts:
            stack.enter_context(context)
        out = module(**inputs, use_cache=False)
    return out.logits, narrowed


def rerun_logits(module, bank, rows, layer: int, hidden, changes: Changes = Changes(), start: int = 0):
    """forward_from for the sequences `rows` of a Bank over positions start..T (T their longest
    length; `hidden` (B, >= T, E) from position 0): (logits (B, T - start, vocab or the
    vocabulary's), narrowed)."""
    T = int(bank.lengths[rows].max())
    device = hidden.device
    positions = torch.arange(start, T)[None]
    inputs = {
        "input_ids": bank.ids[rows, start:T].to(device),
        "attention_mask": (positions < bank.lengths[rows, None]).long().to(device),
        "position_ids": positions.expand(len(rows), -1).to(device),
    }
    return forward_from(module, layer, hidden[:, start:T], inputs, changes, bank.returns_tuple)


class Reached(Exception):
    """Raised by a hook or editor once what a rerun is run for is caught: rerun_until stops there."""


def rerun_until(module, bank, rows, layer: int, hidden, contexts) -> None:
    """rerun_logits of the sequences `rows` from `layer` (receiving `hidden`) with the `contexts`,
    stopped where one of them raises Reached: the layers above it are not run."""
    try:
        rerun_logits(module, bank, rows, layer, hidden, Changes(contexts))
    except Reached:
        pass


def rerun_y(module, bank, rows: torch.Tensor, layer: int, hidden: torch.Tensor, labels, contexts=()):
    """y (B,) float64 of the rows run as rerun_logits does; `labels` (B, 2, K) their label ids."""
    vocabulary = labels[labels >= 0].unique()
    logits, narrowed = rerun_logits(module, bank, rows, layer, hidden, Changes(contexts, vocabulary))
    last = logits[torch.arange(len(rows)), bank.lengths[rows] - 1]
    return narrowed_behaviour(last, *labels.unbind(1), vocabulary, narrowed).double()


def narrowed_behaviour(logits, positive, negative, vocabulary: torch.Tensor, narrowed: bool) -> torch.Tensor:
    """behaviour_rows of logits (B, V) that `narrowed_head` may have narrowed to `vocabulary`: label
    ids (B, K) are then read at their place in it (-1 padding kept)."""
    if narrowed:
        place = lambda ids: torch.where(ids >= 0, torch.searchsorted(vocabulary, ids.clamp(min=0)), -1)
        positive, negative = place(positive), place(negative)
    return behaviour_rows(logits, positive, negative)


@contextmanager
def narrowed_head(model, vocabulary: torch.Tensor):
    """Within the block the lm head computes the logits of `vocabulary` (sorted ids) only, in that
    order, and yields True. Elementwise steps after it (soft-capping, logit scales) still apply. A
    head that is not a plain linear layer is left whole (yields False: logits by vocabulary id)."""
    module = module_of(model)
    head = module.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        yield False
        return
    narrow = torch.nn.Linear(
        head.in_features,
        len(vocabulary),
        bias=head.bias is not None,
        device=head.weight.device,
        dtype=head.weight.dtype,
    )
    narrow.weight = torch.nn.Parameter(head.weight[vocabulary], requires_grad=False)
    if head.bias is not None:
        narrow.bias = torch.nn.Parameter(head.bias[vocabulary], requires_grad=False)
    module.set_output_embeddings(narrow)
    try:
        yield True
    finally:
        module.set_output_embeddings(head)


class _Skipped(torch.nn.Module):
    """Stands in for a decoder layer below the lowest patched one: passes the hidden state on."""

    def __init__(self, layer: torch.nn.Module, returns_tuple: bool):
        super().__init__()
        self.returns_tuple = returns_tuple
        if hasattr(layer, "attention_type"):  # read by the decoder loop of sliding-window families
            self.attention_type = layer.attention_type

    def forward(self, hidden_states, *args, **kwargs):
        return (hidden_states,) if self.returns_tuple else hidden_states


@contextmanager
def skipping(model, first: int, hidden: torch.Tensor, returns_tuple: bool):
    """Within the block the decoder layers below `first` pass their input on and layer `first`
    receives `hidden` (B, T, E): the clean hidden state recorded at its input, or one changed from it
    (analyses.tracing patches it, at layer 0 too: there it replaces the embeddings)."""
    layers = decoder_layers(model)
    originals = [layers[i] for i in range(first)]

    def inject(module, args, kwargs):
        return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})

    for i, layer in enumerate(originals):
        layers[i] = _Skipped(layer, returns_tuple)
    handle = layers[first].register_forward_pre_hook(inject, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
        for i, layer in enumerate(originals):
            layers[i] = layer
