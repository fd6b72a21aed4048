"""Activation patching: which heads and layers carry a behaviour from x' to x.

Behaviour: y(x) = log p(positive set | x) - log p(negative set | x) at the cut (a set's probability
is the sum over its words), e.g. log p(she) - log p(he) after "The nurse said that". A
counterfactual x' changes one slot ("The woman said that"). Patching runs at the positions the two
share: the slot's last token and everything after it, aligned from the end, so x and x' may
tokenise to different lengths. Per item, in log-odds units:

  total effect      TE = y(x') - y(x)
  patch in          y(x with some activations taken from x') - y(x): what they carry (denoising)
  patch out         y(x') - y(x' with those activations taken from x): what is lost without them (noising)

The activations: a head's output (its per-head context z, before the output projection: the
whole head), a head's attention pattern alone (weights from x' applied to x's values; x and x' of
equal length only), a layer's attention output (all its heads) and a layer's MLP output, and
joint sets of heads. Attribution estimates each head's patch-in effect to first order from one
forward and one backward pass: (z' - z) . dy/dz for the output, (A' - A) . dy/dA for the pattern.

Edits run inside attnprobe's registered attention function (`capture.editing`, the site whose
weights and outputs tests/e2e/test_capture.py checks against eager attention) and, for MLPs, in forward
hooks. Every patched variant of an item is one row of a batch; `Rows` says what each row patches.
`effects` patches one item with whole forward passes: the plain reference that attnprobe's batched
patching (attnprobe.measures.head_effects) is tested and benchmarked against. It lives with the tests and
shares no helper with the code it checks (its behaviour, layer lookup, MLP hooks and gradients are
its own), so a bug in a shared helper cannot pass both. Shapes: B rows, L layers, H heads,
T tokens, P patched positions, D head dim, E model width.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from attnprobe.attention.capture import AttentionSite, editing, run_with_capture

MAX_ROWS = 160  # patched variants per forward pass (memory: rows x tokens x model width)


def behaviour(logits: torch.Tensor, positive, negative) -> torch.Tensor:
    """y = log p(positive) - log p(negative) from next-token logits (..., V); each side is a token
    id or a list of ids whose probabilities add up (e.g. " him" + " his" against " her"). Written
    from the definition: probabilities in float64, summed per side, then the log ratio."""
    p = torch.softmax(logits.double(), dim=-1)
    side = lambda ids: p[..., torch.as_tensor(ids).reshape(-1)].sum(-1)
    return torch.log(side(positive)) - torch.log(side(negative))


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of the families these tests build, by their attribute paths."""
    model = model if isinstance(model, torch.nn.Module) else model.model
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        found = model
        for name in path.split("."):
            found = getattr(found, name, None)
        if found is not None:
            return list(found)
    raise AssertionError(f"the reference knows no layer path of {type(model).__name__}")


def mlp_modules(model) -> list[torch.nn.Module] | None:
    """Each decoder layer's `mlp` module, or None for a family whose layers have none (OPT keeps
    fc1 and fc2 in the layer itself: no MLP output to patch)."""
    found = [getattr(layer, "mlp", None) for layer in decoder_layers(model)]
    return None if any(m is None for m in found) else found


class Activations:
    """One sequence's patchable activations, by layer: each head's output z (1, H, T, D), its
    attention weights (1, H, T, T) and the MLP's output (1, T, E). As an editor it only records."""

    def __init__(self):
        self.outputs, self.weights, self.mlp = {}, {}, {}

    def __call__(self, site: AttentionSite) -> torch.Tensor:
        layer = site.layer
        self.outputs[layer], self.weights[layer] = site.output.detach(), site.weights().detach()
        return site.output


@dataclass
class Rows:
    """What each batch row patches: head outputs and head patterns (B, L, H), MLP outputs (B, L)."""

    output: torch.Tensor
    pattern: torch.Tensor
    mlp: torch.Tensor

    @classmethod
    def empty(cls, n: int, L: int, H: int) -> Rows:
        return cls(
            torch.zeros(n, L, H, dtype=torch.bool),
            torch.zeros(n, L, H, dtype=torch.bool),
            torch.zeros(n, L, dtype=torch.bool),
        )

    def __len__(self) -> int:
        return len(self.output)

    def slice(self, start: int, stop: int) -> Rows:
        return Rows(self.output[start:stop], self.pattern[start:stop], self.mlp[start:stop])


@dataclass
class Patch:
    """Editor: in the rows and heads `rows` selects, replace the head's output (or its pattern) at
    positions `at` by the donor's at the aligned positions `donor_at`."""

    rows: Rows
    donor: Activations
    at: torch.Tensor  # (P,) positions in the patched run
    donor_at: torch.Tensor  # (P,) the same positions in the donor run

    def __call__(self, site: AttentionSite) -> torch.Tensor:
        output_rows, pattern_rows = (
            self.rows.output[:, site.layer],
            self.rows.pattern[:, site.layer],
        )  # (B, H)
        if not (output_rows.any() or pattern_rows.any()):
            return site.output
        out = site.output.clone()
        here = out[:, :, self.at]  # (B, H, P, D)
        if output_rows.any():
            donor = self.donor.outputs[site.layer][:, :, self.donor_at].to(out.dtype)  # (1, H, P, D)
            here = torch.where(output_rows[:, :, None, None].to(out.device), donor, here)
        if pattern_rows.any():  # x and x' have equal length: the donor's weights index x's keys
            weights = self.donor.weights[site.layer][:, :, self.donor_at]  # (1, H, P, S)
            mixed = torch.matmul(weights.to(site.value.dtype), site.values())  # (B, H, P, D)
            here = torch.where(pattern_rows[:, :, None, None].to(out.device), mixed, here)
        out[:, :, self.at] = here
        return out


@contextmanager
def mlp_hooks(
    modules,
    rows: torch.Tensor | None = None,
    donor: Activations | None = None,
    at=None,
    donor_at=None,
    record: Activations | None = None,
):
    """Record each layer's MLP output into `record`, or replace it in the rows `rows` (B, L) selects
    at positions `at` by `donor`'s at `donor_at`."""

    def change(layer, out):
        if record is not None:
            record.mlp[layer] = out.detach()
            return None
        chosen = rows[:, layer].to(out.device)
        if not chosen.any():
            return None
        out = out.clone()
        out[:, at] = torch.where(
            chosen[:, None, None], donor.mlp[layer][:, donor_at].to(out.dtype), out[:, at]
        )
        return out

    # the families these tests build return the MLP's output as a plain tensor
    handles = [
        m.register_forward_hook(lambda module, args, out, layer=layer: change(layer, out))
        for layer, m in enumerate(modules or [])
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Next-token logits after the last token of each row of ids (B, T)."""
    mask = torch.ones_like(ids)
    return run_with_capture(
        model, ids, mask, layers=[], logit_positions=torch.tensor([ids.shape[1] - 1])
    ).logits[:, 0]


def record(model, ids: torch.Tensor, positive, negative) -> tuple[float, Activations]:
    """y and every patchable activation of one sequence ids (T,)."""
    acts = Activations()
    with editing(acts), mlp_hooks(mlp_modules(model), record=acts):
        logits = _logits(model, ids[None])
    return float(behaviour(logits[0], positive, negative)), acts


def patched_behaviour(
    model, ids: torch.Tensor, rows: Rows, donor: Activations, at, donor_at, positive, negative
) -> torch.Tensor:
    """y of ids (T,) under each row's patch: (B,). Runs MAX_ROWS rows per forward pass."""
    ys = []
    for start in range(0, len(rows), MAX_ROWS):
        part = rows.slice(start, start + MAX_ROWS)
        editor = Patch(part, donor, at, donor_at)
        with editing(editor), mlp_hooks(mlp_modules(model), part.mlp, donor, at, donor_at):
            ys.append(behaviour(_logits(model, ids[None].expand(len(part), -1)), positive, negative))
    return torch.cat(ys)


def one_hot_heads(n_layers: int, n_heads: int) -> torch.Tensor:
    """(L H, L, H): row l H + h selects head (l, h) alone."""
    heads = torch.zeros(n_layers * n_heads, n_layers, n_heads, dtype=torch.bool)
    index = torch.arange(n_layers * n_heads)
    heads[index, index // n_heads, index % n_heads] = True
    return heads


def effects(
    model,
    x: torch.Tensor,
    x_cf: torch.Tensor,
    at: torch.Tensor,
    at_cf: torch.Tensor,
    positive,
    negative,
    singles: torch.Tensor,
    sets: dict[str, torch.Tensor] | None = None,
    layers: bool = True,
    every: bool = True,
) -> dict:
    """Patching effects of one item. x, x_cf: (T,), (T',) token ids; at, at_cf: (P,) aligned positions.

    `singles` (L, H) bool: heads patched one at a time (output in and out, pattern in); `sets`:
    name -> (L, H) bool head sets patched jointly (in and out), with all heads jointly and the
    attribution unless `every` is off; `layers`: each layer's attention and MLP output (in and out).
    Returns y, y_cf, te, per head (L, H) output_in, output_out,
    pattern_in (NaN where not patched), attribution_output, attribution_pattern; per layer (L,)
    attention_in/out, mlp_in/out; per set set_in/out; and all_heads_pattern_in."""
    L, H = singles.shape
    same_length = len(x) == len(x_cf)
    mlps = mlp_modules(model) if layers else None
    y, own = record(model, x, positive, negative)
    y_cf, donor = record(model, x_cf, positive, negative)
    result = {"y": y, "y_cf": y_cf, "te": y_cf - y}
    if every:
        result.update(attribution(model, x, donor, at, at_cf, positive, negative, L, same_length))
        sets = {"all_heads": torch.ones(L, H, dtype=torch.bool), **(sets or {})}
    sets = sets or {}
    chosen = one_hot_heads(L, H)[singles.flatten()]  # (n, L, H)
    layer_heads = torch.eye(L, dtype=torch.bool)[:, :, None].expand(L, L, H)  # row l: every head of layer l

    def build(direction: str) -> tuple[Rows, dict[str, slice]]:
        blocks = {"base": Rows.empty(1, L, H), "output": Rows.empty(len(chosen), L, H)}
        blocks["output"].output[:] = chosen
        if direction == "in" and same_length and len(chosen):
            blocks["pattern"] = Rows.empty(len(chosen), L, H)
            blocks["pattern"].pattern[:] = chosen
        if direction == "in" and same_length and every:
            blocks["all_heads_pattern"] = Rows.empty(1, L, H)
            blocks["all_heads_pattern"].pattern[:] = True
        if layers:
            blocks["attention"] = Rows.empty(L, L, H)
            blocks["attention"].output[:] = layer_heads
            if mlps is not None:
                blocks["mlp"] = Rows.empty(L, L, H)
                blocks["mlp"].mlp[:] = torch.eye(L, dtype=torch.bool)
        for name, heads in sets.items():
            blocks[f"set:{name}"] = Rows.empty(1, L, H)
            blocks[f"set:{name}"].output[:] = heads
        where, start = {}, 0
        for name, block in blocks.items():
            where[name] = slice(start, start + len(block))
            start += len(block)
        rows = Rows(
            *(torch.cat([getattr(b, f) for b in blocks.values()]) for f in ("output", "pattern", "mlp"))
        )
        return rows, where

    nan_heads = lambda: torch.full((L, H), float("nan"), dtype=torch.float64)
    for direction, base, donor_acts, base_at, donor_at in (
        ("in", x, donor, at, at_cf),
        ("out", x_cf, own, at_cf, at),
    ):
        rows, where = build(direction)
        ys = patched_behaviour(model, base, rows, donor_acts, base_at, donor_at, positive, negative).double()
        # patch in: how far the patch moves y(x) toward y(x'); patch out: how much of y(x') it removes
        delta = ys - ys[0] if direction == "in" else ys[0] - ys
        for kind in ("output", "pattern"):
            if kind in where:
                heads = nan_heads()
                heads[singles] = delta[where[kind]]
                result[f"{kind}_{direction}"] = heads
        for kind in ("attention", "mlp"):
            result[f"{kind}_{direction}"] = (
                delta[where[kind]] if kind in where else torch.full((L,), float("nan"), dtype=torch.float64)
            )
        for name in sets:
            result[f"{name}_{direction}"] = float(delta[where[f"set:{name}"]][0])
        if "all_heads_pattern" in where:
            result["all_heads_pattern_in"] = float(delta[where["all_heads_pattern"]][0])
    for key in ("pattern_in", "attribution_output", "attribution_pattern"):
        result.setdefault(key, nan_heads())
    result.setdefault("all_heads_pattern_in", float("nan"))
    return result


class _Tape:
    """Editor for attribution: each layer's attention weights and per-head output as tensors in the
    autograd graph (weights recomputed by the site, output = weights @ values), kept by layer so that
    torch.autograd.grad can differentiate y with respect to them afterwards."""

    def __init__(self):
        self.weights: dict[int, torch.Tensor] = {}  # layer -> (1, H, T, T)
        self.outputs: dict[int, torch.Tensor] = {}  # layer -> (1, H, T, D)

    def __call__(self, site: AttentionSite) -> torch.Tensor:
        weights = site.weights()
        if not weights.requires_grad:  # nothing upstream needs a gradient: make it a leaf
            weights.requires_grad_(True)
        self.weights[site.layer] = weights
        self.outputs[site.layer] = torch.matmul(weights.to(site.value.dtype), site.values())
        return self.outputs[site.layer]


def attribution(
    model, x, donor: Activations, at, at_cf, positive, negative, n_layers: int, same_length: bool
) -> dict:
    """First-order estimates of every head's patch-in effect, from one forward and one backward
    pass of x: (z' - z) . dy/dz over the aligned positions (output) and (A' - A) . dy/dA (pattern,
    equal lengths only; NaN otherwise). Returns attribution_output and attribution_pattern (L, H)."""
    tape = _Tape()
    module = model if isinstance(model, torch.nn.Module) else model.model
    ids = x[None]
    with torch.enable_grad(), editing(tape):
        out = module(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, logits_to_keep=1)
        y = behaviour(out.logits[0, -1], positive, negative)
        zs = [tape.outputs[layer] for layer in range(n_layers)]
        ws = [tape.weights[layer] for layer in range(n_layers)]
        gradients = torch.autograd.grad(y, zs + ws, allow_unused=True)
    dz_dy, dw_dy = gradients[:n_layers], gradients[n_layers:]
    output, pattern = [], []
    for layer, (z, w) in enumerate(zip(zs, ws)):
        dz = donor.outputs[layer][:, :, at_cf].to(z.dtype) - z.detach()[:, :, at]  # (1, H, P, D)
        output.append((dz * dz_dy[layer][:, :, at]).sum((0, 2, 3)))
        if same_length and dw_dy[layer] is not None:
            dw = donor.weights[layer][:, :, at_cf].to(w.dtype) - w.detach()[:, :, at]  # (1, H, P, S)
            pattern.append((dw * dw_dy[layer][:, :, at]).sum((0, 2, 3)))
        else:
            pattern.append(torch.full_like(output[-1], float("nan")))
    return {
        "attribution_output": torch.stack(output).detach().double(),
        "attribution_pattern": torch.stack(pattern).detach().double(),
    }
