"""Attribution patching's gradients: one forward and one backward pass of a bank's sequences giving
the behaviour's gradient with respect to every head's output and pattern and every MLP's output (the
weights get none), and the first-order effect of each head's value path from them.

Used by head effects' screen (measures/head_effects/attribution.py), by the path analysis's
selection null (analyses/paths.py) and, frozen weights, by the circuits' attribution.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..attention.capture import editing, expand_kv, picked_logits
from ..model.anatomy import module_of
from .engine import Bank
from .sites import Gradients, behaviour_rows, mlp_outputs


def gradients(model, bank: Bank, xs, positive, negative, mlps) -> Gradients:
    """One forward and backward pass of the bank's sequences `xs`: the behaviour's gradients with
    respect to every head's output and pattern and every MLP's output in `mlps`."""
    grads, module, lengths = Gradients(), module_of(model), bank.lengths[xs]
    T, device = int(lengths.max()), bank.hidden[0].device
    ids, mask = bank.ids[xs, :T].to(device), (torch.arange(T)[None] < lengths[:, None]).long().to(device)
    with (
        frozen_weights(module),
        torch.enable_grad(),
        editing(grads),
        mlp_outputs(mlps, grads.keep_mlp),
        picked_logits(module, (torch.arange(len(xs)), lengths - 1)),
    ):
        out = module(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=0)
        behaviour_rows(out.logits[0], positive, negative).sum().backward()
    return grads


@contextmanager
def frozen_weights(module):
    """Within the block no parameter of `module` takes a gradient (only activations need them)."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    try:
        for p in trainable:
            p.requires_grad_(False)
        yield
    finally:
        for p in trainable:
            p.requires_grad_(True)


@dataclass(frozen=True)
class PairRows:
    """Rows of item pairs: x is row `xs[i]` of the items' bank and its counterfactual row `donors[i]`
    of the donors' bank, read at positions `at[i]` and `donor_at[i]` (each (n,))."""

    xs: torch.Tensor
    donors: torch.Tensor
    at: torch.Tensor
    donor_at: torch.Tensor


def value_path_attribution(
    model, bank: Bank, donor: Bank, pairs: PairRows, positive, negative
) -> torch.Tensor:
    """(n, L, H) float64: the first-order effect on y of each head reading the donor's value at one
    position, per pair (its x in `bank`, its counterfactual in `donor`):

      z[q] <- z[q] + A[q, p] (v'_p' - v_p)  for every query q   (p = at[i], p' = donor_at[i])
      effect ~ sum_q dy/dz[q] . A[q, p] (v'_p' - v_p)

    with A, v and dy/dz from x's clean run: engine.HeadPatch's `value` path to first order, summed
    over heads for a set (exact where the heads' effects do not interact)."""
    xs, donors, at, donor_at = pairs.xs, pairs.donors, pairs.at, pairs.donor_at
    grads = gradients(model, bank, xs, positive, negative, [])
    rows, out = torch.arange(len(xs)), []
    for layer in range(len(bank.hidden)):
        dy_dz = grads.outputs[layer].grad  # (n, H, T, D)
        H, T = dy_dz.shape[1], dy_dz.shape[2]
        column = bank.weights[layer][xs][rows, :, :T, at]  # (n, H, T): A[q, p] for every query q
        read = torch.einsum("nhtd,nht->nhd", dy_dz, column.to(dy_dz.dtype))
        v = expand_kv(bank.values[layer][xs], H)[rows, :, at]  # (n, H, D)
        v_cf = expand_kv(donor.values[layer][donors], H)[rows, :, donor_at]
        out.append(((v_cf - v).to(read.dtype) * read).sum(-1))
    return torch.stack(out, 1).detach().double().cpu()
