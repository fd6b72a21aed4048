"""Batched activation patching: the patched variants of many items in few forward passes.

tests/reference_patching.effects patches one item at a time with whole forward passes (the reference this
module is tested against). Here, for a chunk of items:

- every x and x' runs once, all together (right padding), recording per layer the hidden state
  entering it, each head's output z and attention weights, and the MLP output (`Bank`);
- `Variants` say, per patched run, which sequence is patched (the base), which one donates, where
  the aligned positions start in each (patching runs from there to the end, as in the reference)
  and what is patched: head outputs, head patterns, MLP outputs;
- the layers below a variant's lowest patched layer compute exactly what the base's clean run
  computed, so they are skipped: variants are grouped by that layer, the layers below are replaced
  by pass-through stubs and the lowest one receives the recorded hidden state (rerun.py: the one
  edited pass, which the edit analyses run too). Patching a head of layer l costs (L - l) / L of a
  forward pass;
- attribution for every (x, x') pair (attribution.py) comes from one forward and one backward pass
  of each x, the chunk's x together.

Shapes: N sequences, T padded length, V variants, B rows of one pass, L layers, H heads, D head
dim, E model width, K label ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

import torch

from ..attention.capture import editing, expand_kv, picked_logits, run_with_capture
from ..forward.packing import pad_right
from ..forward.sharing import prefix_sharing_blocker
from ..model.anatomy import decoder_layers, mlp_modules, module_of
from ..model.footprint import device_patch_budget
from .rerun import Changes, narrowed_behaviour, rerun_logits
from .sites import Activations, behaviour_rows, last_position_mlp, mlp_outputs, recording_mlp, registered


@dataclass
class Bank:
    """The clean runs of N sequences (right padding): what patching and attribution read."""

    ids: torch.Tensor  # (N, T)
    lengths: torch.Tensor  # (N,)
    hidden: list[torch.Tensor]  # L x (N, T, E): the hidden state entering each layer
    keys: list[torch.Tensor]  # L x (N, Hkv, T, D) as the attention function receives them (rotary applied)
    values: list[torch.Tensor]  # L x (N, Hkv, T, D)
    outputs: list[torch.Tensor]  # L x (N, H, T, D)
    weights: list[torch.Tensor]  # L x (N, H, T, T)
    mlp: list[torch.Tensor] | None  # L x (N, T, E), None without MLP modules
    logits: torch.Tensor  # (N, vocab) after each sequence's last token
    returns_tuple: bool  # the family's decoder layers return a tuple, not a tensor

    @cached_property
    def sequences(self) -> list[tuple[int, ...]]:
        """Each sequence's token ids (its own length), read from the device once, not per use."""
        return [tuple(row[:n]) for row, n in zip(self.ids.tolist(), self.lengths.tolist())]


@torch.inference_mode()
def record(model, sequences: list[torch.Tensor]) -> Bank:
    """One forward pass of all sequences (right padding) recording what the variants read."""
    layers = decoder_layers(model)
    flat = torch.cat(list(sequences)).tolist()  # one read, not one per sequence
    ends = list(accumulate(len(s) for s in sequences))
    ids, mask = pad_right([flat[end - len(s) : end] for s, end in zip(sequences, ends)], 0)
    lengths = mask.sum(1)
    hidden, keys, values, acts, returned = {}, {}, {}, Activations(), []

    def recorder(site):
        keys[site.layer], values[site.layer] = site.key.detach(), site.value.detach()
        return acts(site)

    def entering(layer):
        def hook(module, args, kwargs):
            hidden[layer] = (args[0] if args else kwargs["hidden_states"]).detach()

        return hook

    handles = [
        layer.register_forward_pre_hook(entering(i), with_kwargs=True) for i, layer in enumerate(layers)
    ]
    handles.append(
        layers[0].register_forward_hook(
            lambda module, args, output: returned.append(isinstance(output, tuple))
        )
    )
    mlps = mlp_modules(model)
    with registered(handles), editing(recorder), recording_mlp(mlps, acts):
        logits = run_with_capture(model, ids, mask, layers=[], logit_positions=(lengths - 1)[:, None]).logits[
            :, 0
        ]
    n = len(layers)
    return Bank(
        ids,
        lengths,
        [hidden[i] for i in range(n)],
        [keys[i] for i in range(n)],
        [values[i] for i in range(n)],
        [acts.outputs[i] for i in range(n)],
        [acts.weights[i] for i in range(n)],
        [acts.mlp[i] for i in range(n)] if mlps else None,
        logits,
        returned[0],
    )


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
        return lowest_layer(self.output.any(-1) | self.pattern.any(-1) | self.mlp)


def lowest_layer(touched: torch.Tensor) -> torch.Tensor:
    """(V,) the first True layer of each row of touched (V, L); L for a row with none: below it,
    a variant's pass can start from the clean run's recorded hidden state."""
    L = touched.shape[1]
    return torch.where(touched.any(-1), touched.float().argmax(-1), torch.full((len(touched),), L))


def patched(
    model, bank: Bank, variants: Variants, share_prefix: bool = True, row_tokens: int | None = None
) -> torch.Tensor:
    """y of every variant, (V,) float64. Variants are grouped by their lowest patched layer, sorted
    by their first patched position and length, and run in passes of at most `row_tokens` rows x
    tokens (None: the device's budget, model.footprint.device_patch_budget). With `share_prefix` a
    pass leaves out the positions before its variants' first patched one (clean in every layer) and
    reads their recorded keys and values instead, where that is exact (sharing.prefix_sharing_blocker:
    no window the sequences reach)."""
    module = module_of(model)
    row_tokens = row_tokens or device_patch_budget(module, int(bank.lengths.max()))
    share_prefix = share_prefix and prefix_sharing_blocker(module.config, bank.ids.shape[1]) is None
    first = variants.first_layer()
    y = torch.empty(len(first), dtype=torch.float64)
    lengths = bank.lengths[variants.base]
    for layer in first.unique().tolist():
        group = (first == layer).nonzero()[:, 0]
        group = group[
            torch.argsort(variants.at[group] * (int(lengths.max()) + 1) + lengths[group], stable=True)
        ]
        if layer == len(bank.hidden):  # nothing patched: the clean run's y
            y[group] = (
                behaviour_rows(
                    bank.logits[variants.base[group]], variants.positive[group], variants.negative[group]
                )
                .double()
                .to(y.device)
            )
            continue
        for rows in plan_passes(
            group, lengths, variants.at if share_prefix else torch.zeros_like(lengths), row_tokens
        ):
            run = lambda part, layer=layer: _forward(
                model, bank, variants, part, layer, int(variants.at[part].min()) if share_prefix else 0
            )
            for part, values in halved_on_oom(run, rows):
                y[part] = values.double().to(y.device)
    return y.cpu()


def halved_on_oom(run, rows) -> list[tuple]:
    """[(rows, run(rows))], or where the device runs out of memory the same for each half of `rows` (row
    indices, a tensor or an array), recursively: a pass sized from an estimate of the free memory
    (model.footprint.patch_budget) that proves too large costs a retry, not the run."""
    try:
        return [(rows, run(rows))]
    except torch.OutOfMemoryError:
        if len(rows) == 1:
            raise
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        half = len(rows) // 2
        return halved_on_oom(run, rows[:half]) + halved_on_oom(run, rows[half:])


def plan_passes(
    group: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor, row_tokens: int, waste: float = 0.15
):
    """Consecutive runs of `group` (sorted by start, then length), each one pass: at most `row_tokens`
    rows x computed positions, and at most `waste` of them padding or a prefix computed again."""
    length, start = lengths[group].tolist(), starts[group].tolist()  # per row of `group`, as numbers
    begin = 0
    while begin < len(length):
        stop, useful, longest = begin + 1, length[begin] - start[begin], length[begin]
        while stop < len(length):
            width = max(longest, length[stop]) - start[begin]
            grown = useful + length[stop] - start[stop]
            if (stop + 1 - begin) * width > min(row_tokens, (1 + waste) * grown + 64):
                break
            stop, useful, longest = stop + 1, grown, max(longest, length[stop])
        yield group[begin:stop]
        begin = stop


@torch.inference_mode()
def _forward(model, bank: Bank, v: Variants, rows: torch.Tensor, first: int, prefix: int) -> torch.Tensor:
    """One pass of the variants `rows`, all patching nothing below layer `first` nor before position
    `prefix`: the pass starts at that layer and at that position."""
    module = module_of(model)
    device = bank.hidden[0].device
    base = v.base[rows]
    lengths = bank.lengths[base]
    T = int(lengths.max())
    where, donor_index = aligned(torch.arange(prefix, T), v.at[rows], v.donor_at[rows], lengths, bank)
    where, donor_index = where.to(device), donor_index.to(device)  # (B, T - prefix)
    patch = (v.output[rows].to(device), v.pattern[rows].to(device))
    edit = HeadPatch(bank, v.donor[rows], where, donor_index, *patch)
    found = mlp_modules(model)  # before the stubs replace the layers
    mlps = found if v.mlp[rows].any() else None
    labels = torch.cat([v.positive[rows], v.negative[rows]], 1)
    vocabulary = labels[labels >= 0].unique()  # y reads only these: log p(a) - log p(b) = logit a - logit b
    last = lengths - 1 - prefix
    contexts = [editing(edit, _Prefix(bank, base, prefix) if prefix else None)]
    if mlps:
        contexts.append(
            mlp_outputs(mlps, mlp_patch(bank, v.donor[rows], where, donor_index, v.mlp[rows].to(device)))
        )
    elif found:  # no MLP output patched: the top MLP only where the logits are read
        contexts.append(last_position_mlp(found[-1], last))
    contexts.append(picked_logits(module, (torch.arange(len(rows)), last)))
    hidden = bank.hidden[first][base, :T]
    logits, narrowed = rerun_logits(module, bank, base, first, hidden, Changes(contexts, vocabulary), prefix)
    return narrowed_behaviour(logits[0], v.positive[rows], v.negative[rows], vocabulary, narrowed)


@dataclass
class _Prefix:
    """Prepends, at every layer, the recorded keys and values of each row's first `length` positions
    (its clean prefix) to the keys and values of the positions the pass computes; every query sees
    the whole prefix."""

    bank: Bank
    base: torch.Tensor  # (B,)
    length: int

    def __call__(self, layer: int, key, value, mask):
        B, _, T, _ = key.shape
        key = torch.cat([self.bank.keys[layer][self.base, :, : self.length].to(key.dtype), key], 2)
        value = torch.cat([self.bank.values[layer][self.base, :, : self.length].to(value.dtype), value], 2)
        own = (
            torch.ones(T, T, dtype=torch.bool).tril()[None, None] if mask is None else mask
        )  # bool (sdpa_mask)
        seen = torch.ones(B, own.shape[1], T, self.length, dtype=torch.bool, device=key.device)
        return key, value, torch.cat([seen, own.to(key.device).expand(B, -1, -1, -1)], 3)


def aligned(positions, at, donor_at, lengths, donor: Bank):
    """(where (B, T), donor_index (B, T)) over `positions` (T,) of a pass: the patched positions of
    each row (from its `at` to its end) and the donor position aligned with each (the row's `at` is
    the donor's `donor_at`), clamped into the donor's bank."""
    where = (positions[None] >= at[:, None]) & (positions[None] < lengths[:, None])
    index = (positions[None] - at[:, None] + donor_at[:, None]).clamp(0, donor.ids.shape[1] - 1)
    return where, index


@dataclass
class HeadPatch:
    """Editor: per row, the heads it patches take, at the patched positions, the donor's output
    (`output`), the donor's weights applied to the row's own values (`pattern`: base and donor of
    equal length), or (`value`) their own live weights applied to values where the row's value at
    position `at` is the donor's (aligned) one, or (`values`) where every patched position's value
    is the donor's; `pattern` with `values` is the donor's weights over the donor's values. The donor
    bank may be another bank than the rows' (path patching's x'), narrower than the pass; `values`
    needs a pass without a shared prefix (its keys are the pass's positions)."""

    bank: Bank  # the donors' clean runs
    donor: torch.Tensor  # (B,)
    where: torch.Tensor  # (B, T)
    donor_index: torch.Tensor  # (B, T) the aligned donor position of each position
    output: torch.Tensor  # (B, L, H)
    pattern: torch.Tensor  # (B, L, H)
    value: torch.Tensor | None = None  # (B, L, H)
    at: torch.Tensor | None = None  # (B,) the position whose value `value` patches
    values: torch.Tensor | None = None  # (B, L, H)

    def __post_init__(self):
        # the layers each mask patches, read once (one wait for the device), not once per layer
        self.touched = {
            name: set(mask.any(0).any(-1).nonzero().flatten().tolist()) if mask is not None else set()
            for name, mask in (
                ("output", self.output),
                ("pattern", self.pattern),
                ("value", self.value),
                ("values", self.values),
            )
        }

    def __call__(self, site) -> torch.Tensor:
        out, layer = site.output, site.layer
        B, H, T, D = out.shape
        index = self.donor_index[:, None, :, None]
        values = None  # the values the heads read, where a patch needs them (GQA-expanded: not free)
        if layer in self.touched["values"]:
            values, out = self._every_value(site, layer, out)
        if layer in self.touched["value"]:
            # z <- z + A[:, p] (v'_p' - v_p): the row's live weights, the donor's value at p'
            rows, at = torch.arange(B), self.at
            live = site.values()[rows, :, at]  # (B, H, D)
            given = self.bank.values[layer][self.donor, :, self.donor_index[rows, at]]  # (B, Hkv, D)
            donor = expand_kv(given[:, :, None], H)[:, :, 0].to(live.dtype)  # the aligned position only
            reach = site.weights()[rows, :, :, at]  # (B, H, T): how much each position reads p
            new = out + reach[..., None].to(out.dtype) * (donor - live)[:, :, None, :]
            out = torch.where(self.value[:, layer, :, None, None], new, out)
        for rows, kind in ((self.output[:, layer], "output"), (self.pattern[:, layer], "pattern")):
            if layer not in self.touched[kind]:
                continue
            if kind == "output":
                new = self.bank.outputs[layer][self.donor].gather(2, index.expand(B, H, T, D)).to(out.dtype)
            else:  # the donor's weights over the row's keys (equal lengths: the same key positions)
                weights = self.bank.weights[layer][self.donor]  # (B, H, Tb, Tb)
                weights = weights.gather(2, index.expand(B, H, T, weights.shape[-1]))
                S = site.key.shape[2]
                weights = torch.nn.functional.pad(weights[..., :S], (0, max(0, S - weights.shape[-1])))
                values = site.values() if values is None else values
                new = torch.matmul(weights.to(values.dtype), values)
            out = torch.where(rows[:, :, None, None] & self.where[:, None, :, None], new, out)
        return out

    def _every_value(self, site, layer: int, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, out): the values (B, H, S, D) with the donor's at the patched positions for the
        heads `values` patches, and the output with those heads' live weights over them."""
        own = site.values()
        B, H, S, D = own.shape
        assert S == self.where.shape[1], "`values` patches a pass without a shared prefix"
        given = expand_kv(self.bank.values[layer][self.donor], H)  # (B, H, Tb, D)
        donor = given.gather(2, self.donor_index[:, None, :, None].expand(B, H, S, D)).to(own.dtype)
        heads = self.values[:, layer, :, None, None]
        values = torch.where(heads & self.where[:, None, :, None], donor, own)
        new = torch.matmul(site.weights().to(values.dtype), values).to(out.dtype)
        return values, torch.where(heads, new, out)


def mlp_patch(bank: Bank, donor, where, donor_index, rows):
    """For `sites.mlp_outputs`: in the rows `rows` (B, L) selects, the MLP output at the
    patched positions is the donor's."""

    touched = set(rows.any(0).nonzero().flatten().tolist())  # read once, not once per layer

    def change(layer, out):  # (B, T, E)
        if layer not in touched:
            return None
        new = (
            bank.mlp[layer][donor]
            .gather(1, donor_index[:, :, None].expand(-1, -1, out.shape[-1]))
            .to(out.dtype)
        )
        return torch.where(rows[:, layer, None, None] & where[:, :, None], new, out)

    return change
