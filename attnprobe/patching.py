"""Batched activation patching: the patched variants of many items in few forward passes.

interventions.effects patches one item at a time with whole forward passes (the reference this
module is tested against). Here, for a chunk of items:

- every x and x' runs once, all together (right padding), recording per layer the hidden state
  entering it, each head's output z and attention weights, and the MLP output (`Bank`);
- `Variants` say, per patched run, which sequence is patched (the base), which one donates, where
  the aligned positions start in each (patching runs from there to the end, as in interventions)
  and what is patched: head outputs, head patterns, MLP outputs;
- the layers below a variant's lowest patched layer compute exactly what the base's clean run
  computed, so they are skipped: variants are grouped by that layer, the layers below are replaced
  by pass-through stubs and the lowest one receives the recorded hidden state. Patching a head of
  layer l costs (L - l) / L of a forward pass;
- attribution for every (x, x') pair comes from one forward and one backward pass of each x, the
  chunk's x together, with the weights' gradients switched off (only activations need them).

Shapes: N sequences, T padded length, V variants, B rows of one pass, L layers, H heads, D head
dim, E model width, K label ids.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from .capture import editing, pad_right, picked_logits, run_with_capture
from .interventions import Activations, decoder_layers, mlp_hooks, mlp_modules

ROW_TOKENS = 4096  # rows x padded length of one patched forward pass


def behaviour_rows(logits: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """y = log p(positive set) - log p(negative set) per row of logits (B, vocab); label ids (B, K),
    -1 where a row has fewer than K (interventions.behaviour, one set per row)."""
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)

    def side(ids):
        picked = logp.gather(1, ids.clamp(min=0).to(logp.device))
        return torch.logsumexp(picked.masked_fill((ids < 0).to(logp.device), float("-inf")), dim=-1)

    return side(positive) - side(negative)


def label_ids(sets: list[list[int]]) -> torch.Tensor:
    """Label id lists -> (n, K), padded with -1."""
    out = torch.full((len(sets), max(len(s) for s in sets)), -1, dtype=torch.long)
    for i, ids in enumerate(sets):
        out[i, : len(ids)] = torch.as_tensor(ids)
    return out


@dataclass
class Bank:
    """The clean runs of N sequences (right padding): what patching and attribution read."""

    ids: torch.Tensor  # (N, T)
    lengths: torch.Tensor  # (N,)
    hidden: list[torch.Tensor]  # L x (N, T, E): the hidden state entering each layer
    outputs: list[torch.Tensor]  # L x (N, H, T, D)
    weights: list[torch.Tensor]  # L x (N, H, T, T)
    mlp: list[torch.Tensor] | None  # L x (N, T, E), None without MLP modules
    logits: torch.Tensor  # (N, vocab) after each sequence's last token
    returns_tuple: bool  # the family's decoder layers return a tuple, not a tensor


@torch.inference_mode()
def record(model, sequences: list[torch.Tensor]) -> Bank:
    """One forward pass of all sequences (right padding) recording what the variants read."""
    layers = decoder_layers(model)
    ids, mask = pad_right([s.tolist() for s in sequences], 0)
    lengths = mask.sum(1)
    hidden, acts, returned = {}, Activations(), []

    def entering(layer):
        def hook(module, args, kwargs):
            hidden[layer] = (args[0] if args else kwargs["hidden_states"]).detach()
        return hook

    handles = [layer.register_forward_pre_hook(entering(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles.append(layers[0].register_forward_hook(lambda module, args, output: returned.append(isinstance(output, tuple))))
    mlps = mlp_modules(model)
    try:
        with editing(acts), mlp_hooks(mlps, record=acts):
            logits = run_with_capture(model, ids, mask, layers=[], logit_positions=(lengths - 1)[:, None]).logits[:, 0]
    finally:
        for handle in handles:
            handle.remove()
    n = len(layers)
    return Bank(ids, lengths, [hidden[i] for i in range(n)], [acts.outputs[i] for i in range(n)],
                [acts.weights[i] for i in range(n)], [acts.mlp[i] for i in range(n)] if mlps else None, logits, returned[0])


@dataclass
class Variants:
    """Patched runs: base and donor sequence indices into a Bank, the first aligned position in
    each, what is patched, and the label ids of y."""

    base: torch.Tensor  # (V,)
    donor: torch.Tensor  # (V,)
    at: torch.Tensor  # (V,) first patched position in the base (patching runs to its end)
    donor_at: torch.Tensor  # (V,) the aligned position in the donor
    output: torch.Tensor  # (V, L, H) head outputs patched
    pattern: torch.Tensor  # (V, L, H) head patterns patched (base and donor of equal length)
    mlp: torch.Tensor  # (V, L) MLP outputs patched
    positive: torch.Tensor  # (V, K)
    negative: torch.Tensor  # (V, K)

    def first_layer(self) -> torch.Tensor:
        """(V,) the lowest layer each variant patches; L for a variant that patches nothing."""
        L = self.mlp.shape[1]
        touched = self.output.any(-1) | self.pattern.any(-1) | self.mlp  # (V, L)
        return torch.where(touched.any(-1), touched.float().argmax(-1), torch.full_like(self.base, L))


def patched(model, bank: Bank, variants: Variants, row_tokens: int = ROW_TOKENS) -> torch.Tensor:
    """y of every variant, (V,) float64. Variants are grouped by their lowest patched layer and
    sorted by length; a group runs in passes of at most `row_tokens` rows x tokens."""
    first = variants.first_layer()
    y = torch.empty(len(first), dtype=torch.float64)
    lengths = bank.lengths[variants.base]
    for layer in first.unique().tolist():
        group = (first == layer).nonzero()[:, 0]
        group = group[torch.argsort(lengths[group], stable=True)]
        if layer == len(bank.hidden):  # nothing patched: the clean run's y
            y[group] = behaviour_rows(bank.logits[variants.base[group]], variants.positive[group], variants.negative[group]).double()
            continue
        start = 0
        while start < len(group):
            stop = start + 1
            while stop < len(group) and (stop + 1 - start) * int(lengths[group[stop]]) <= row_tokens:
                stop += 1
            rows = group[start:stop]
            y[rows] = _forward(model, bank, variants, rows, layer).double()
            start = stop
    return y


@torch.inference_mode()
def _forward(model, bank: Bank, v: Variants, rows: torch.Tensor, first: int) -> torch.Tensor:
    """One pass of the variants `rows`, all patching nothing below layer `first`."""
    base = v.base[rows]
    lengths = bank.lengths[base]
    T = int(lengths.max())
    positions = torch.arange(T)[None]
    where = (positions >= v.at[rows, None]) & (positions < lengths[:, None])  # (B, T) the patched positions
    donor_index = (positions - v.at[rows, None] + v.donor_at[rows, None]).clamp(0, bank.ids.shape[1] - 1)  # (B, T)
    edit = _Edit(bank, v.donor[rows], where, donor_index, v.output[rows], v.pattern[rows])
    mlps = mlp_modules(model) if v.mlp[rows].any() else None  # found before the stubs replace the layers
    with ExitStack() as stack:
        stack.enter_context(skipping(model, first, bank.hidden[first][base, :T], bank.returns_tuple))
        stack.enter_context(editing(edit))
        if mlps:
            stack.enter_context(_mlp_patch(mlps, bank, v.donor[rows], where, donor_index, v.mlp[rows]))
        labels = torch.cat([v.positive[rows], v.negative[rows]], 1)
        vocabulary = labels[labels >= 0].unique()  # y needs only these logits: log p(a) - log p(b) = logit a - logit b
        narrowed = stack.enter_context(narrowed_head(model, vocabulary))
        mask = (positions < lengths[:, None]).long()
        logits = run_with_capture(model, bank.ids[base, :T], mask, layers=[], logit_positions=(lengths - 1)[:, None]).logits[:, 0]
    if not narrowed:
        return behaviour_rows(logits, v.positive[rows], v.negative[rows])
    narrow = lambda ids: torch.where(ids >= 0, torch.searchsorted(vocabulary, ids.clamp(min=0)), -1)  # noqa: E731
    return behaviour_rows(logits, narrow(v.positive[rows]), narrow(v.negative[rows]))


@contextmanager
def narrowed_head(model, vocabulary: torch.Tensor):
    """Within the block the lm head computes the logits of `vocabulary` (sorted ids) only, in that
    order, and yields True. Elementwise steps after it (soft-capping, logit scales) still apply. A
    head that is not a plain linear layer is left whole (yields False: logits by vocabulary id)."""
    module = model if isinstance(model, torch.nn.Module) else model.model
    head = module.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        yield False
        return
    narrow = torch.nn.Linear(head.in_features, len(vocabulary), bias=head.bias is not None, device=head.weight.device, dtype=head.weight.dtype)
    narrow.weight = torch.nn.Parameter(head.weight[vocabulary], requires_grad=False)
    if head.bias is not None:
        narrow.bias = torch.nn.Parameter(head.bias[vocabulary], requires_grad=False)
    module.set_output_embeddings(narrow)
    try:
        yield True
    finally:
        module.set_output_embeddings(head)


@dataclass
class _Edit:
    """Editor: per row, the heads it patches take the donor's output (or the donor's weights applied
    to the row's own values) at the patched positions."""

    bank: Bank
    donor: torch.Tensor  # (B,)
    where: torch.Tensor  # (B, T)
    donor_index: torch.Tensor  # (B, T) the aligned donor position of each position
    output: torch.Tensor  # (B, L, H)
    pattern: torch.Tensor  # (B, L, H)

    def __call__(self, site) -> torch.Tensor:
        out, layer = site.output, site.layer
        B, H, T, D = out.shape
        index = self.donor_index[:, None, :, None]
        for rows, kind in ((self.output[:, layer], "output"), (self.pattern[:, layer], "pattern")):
            if not rows.any():
                continue
            if kind == "output":
                new = self.bank.outputs[layer][self.donor].gather(2, index.expand(B, H, T, D)).to(out.dtype)
            else:  # the donor's weights over the row's keys (equal lengths: the same key positions)
                weights = self.bank.weights[layer][self.donor]  # (B, H, Tb, Tb)
                weights = weights.gather(2, index.expand(B, H, T, weights.shape[-1]))[..., : site.key.shape[2]]
                new = torch.matmul(weights.to(site.value.dtype), site.values())
            out = torch.where(rows[:, :, None, None] & self.where[:, None, :, None], new, out)
        return out


@contextmanager
def _mlp_patch(modules, bank: Bank, donor, where, donor_index, rows):
    """Forward hooks: in the rows `rows` (B, L) selects, the MLP output at the patched positions is the donor's."""
    def hook(layer):
        def replace(module, args, output):
            out = output[0] if isinstance(output, tuple) else output  # (B, T, E)
            if not rows[:, layer].any():
                return output
            new = bank.mlp[layer][donor].gather(1, donor_index[:, :, None].expand(-1, -1, out.shape[-1])).to(out.dtype)
            out = torch.where(rows[:, layer, None, None] & where[:, :, None], new, out)
            return (out, *output[1:]) if isinstance(output, tuple) else out
        return replace

    handles = [m.register_forward_hook(hook(layer)) for layer, m in enumerate(modules)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


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
    receives `hidden` (B, T, E), the clean hidden state recorded at its input."""
    if first == 0:
        yield
        return
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


@dataclass
class Pairs:
    """(x, x') pairs for attribution: x's index into the attribution batch, x' in the Bank, and
    the first aligned position in each."""

    x: torch.Tensor  # (n,) index into the sequences passed to `attribution`
    donor: torch.Tensor  # (n,) bank index of x'
    at: torch.Tensor  # (n,)
    donor_at: torch.Tensor  # (n,)
    same_length: torch.Tensor  # (n,) bool: the pattern attribution is defined


def attribution(model, bank: Bank, xs: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor, pairs: Pairs) -> dict:
    """First-order estimates of every pair's patch-in effects, from one forward and one backward
    pass of the bank's sequences `xs` (n_x,): per head (z' - z) . dy/dz (output) and (A' - A) . dy/dA
    (pattern; NaN for pairs of different lengths), per layer (m' - m) . dy/dm (MLP output); sums over
    the aligned positions. Returns attribution_output, attribution_pattern (n, L, H), attribution_mlp (n, L)."""
    grads = _Gradients()
    module = model if isinstance(model, torch.nn.Module) else model.model
    lengths = bank.lengths[xs]
    T = int(lengths.max())
    ids, mask = bank.ids[xs, :T], (torch.arange(T)[None] < lengths[:, None]).long()
    trainable = [p for p in module.parameters() if p.requires_grad]
    mlps = mlp_modules(model)
    handles = [m.register_forward_hook(grads.mlp_hook(i)) for i, m in enumerate(mlps or [])]
    try:
        for p in trainable:  # only activations need gradients
            p.requires_grad_(False)
        with torch.enable_grad(), editing(grads), picked_logits(module, (torch.arange(len(xs)), lengths - 1)):
            out = module(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=0)
            behaviour_rows(out.logits[0], positive, negative).sum().backward()
    finally:
        for p in trainable:
            p.requires_grad_(True)
        for handle in handles:
            handle.remove()
    n, L = len(pairs.x), len(bank.hidden)
    positions = torch.arange(T)[None]
    where = (positions >= pairs.at[:, None]) & (positions < lengths[pairs.x, None])  # (n, T)
    index = (positions - pairs.at[:, None] + pairs.donor_at[:, None]).clamp(0, bank.ids.shape[1] - 1)
    result = {"attribution_output": [], "attribution_pattern": [], "attribution_mlp": []}
    for layer in range(L):
        Z, W = grads.outputs[layer], grads.weights[layer]  # (n_x, H, T, D), (n_x, H, T, T)
        z, dy_dz, w, dy_dw = Z.detach()[pairs.x], Z.grad[pairs.x], W.detach()[pairs.x], W.grad[pairs.x]
        H = z.shape[1]
        donor_z = bank.outputs[layer][pairs.donor].gather(2, index[:, None, :, None].expand(n, H, T, z.shape[-1]))
        dz = torch.where(where[:, None, :, None], donor_z.to(z.dtype) - z, 0)
        result["attribution_output"].append((dz * dy_dz).sum((2, 3)))
        donor_w = bank.weights[layer][pairs.donor]
        donor_w = donor_w.gather(2, index[:, None, :, None].expand(n, H, T, donor_w.shape[-1]))[..., :T]
        dw = torch.where(where[:, None, :, None], donor_w.to(w.dtype) - w, 0)
        pattern = (dw * dy_dw).sum((2, 3))
        result["attribution_pattern"].append(torch.where(pairs.same_length[:, None], pattern, float("nan")))
        if mlps:
            M = grads.mlp[layer]  # (n_x, T, E)
            donor_m = bank.mlp[layer][pairs.donor].gather(1, index[:, :, None].expand(n, T, M.shape[-1]))
            dm = torch.where(where[:, :, None], donor_m.to(M.dtype) - M.detach()[pairs.x], 0)
            result["attribution_mlp"].append((dm * M.grad[pairs.x]).sum((1, 2)))
        else:
            result["attribution_mlp"].append(torch.full((n,), float("nan")))
    return {key: torch.stack(values, 1).detach().double() for key, values in result.items()}


class _Gradients:
    """Editor for attribution: recomputes each head's output from weights that keep their gradient
    (at the first layer, where nothing requires a gradient yet, the weights become the leaf)."""

    def __init__(self):
        self.weights, self.outputs, self.mlp = {}, {}, {}

    def __call__(self, site) -> torch.Tensor:
        weights = site.weights()
        if not weights.requires_grad:
            weights.requires_grad_(True)
        else:
            weights.retain_grad()
        output = torch.matmul(weights.to(site.value.dtype), site.values())
        output.retain_grad()
        self.weights[site.layer], self.outputs[site.layer] = weights, output
        return output

    def mlp_hook(self, layer: int):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            if out.requires_grad:
                out.retain_grad()
            else:  # a parallel block's first MLP (GPT-NeoX, GPT-J) does not depend on any attention output
                out.requires_grad_(True)
            self.mlp[layer] = out
        return hook
