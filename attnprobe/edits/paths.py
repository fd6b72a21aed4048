"""The path the covariate takes into the top heads (`attnprobe edit --paths`): path patching (Wang
et al. 2022) on the head-effects items, x an item and x' its reference counterfactual (the
occupation replaced by "person"), p the occupation's position (the slot's last token; p' in x').

Receivers R (the run's top heads by gradient score, one at a time and the top 5 together; and the
top 5 chosen on each quarter's training quarters, so no item tests heads chosen on its own
outcome): one input of R is taken from x' in a run of x, everything else computed as it comes
(the layers below R's skipped: there the run is x's clean run):

  value     R reads x''s value vector at p:  z_R <- z_R + A_R[:, p] (v'_p' - v_p)  (A_R as computed)
  pattern   R attends as in x' (its weights; pairs of equal length only, NaN otherwise)
  output    R's output at the aligned positions is x''s (everything R passes on)

A head that moves a signal computed elsewhere carries the gradient through its value input from the
occupation; one that computes it from where it attends carries it through its pattern.

Senders, the edges into R's value at p: what one earlier part S wrote into the stream at p (the
embedding, a head of a lower layer, a lower layer's MLP; through the post-norm where the family has
one) is swapped for what it wrote in x', on the one path into R's value:

  R's value at p is read from N(h_p - c_S(x) + c_S(x'))   (N the layer's pre-attention norm)

with R's weights and the layer's other heads as in x's clean run; the layers above run on. Senders
are screened by attribution on the items of one half of the units (g . (c_S(x') - c_S(x)), g =
dy/dh_p along that path: one backward pass per item and receiver, exact up to the layers above R)
and the EDGES best per receiver measured exactly on the other half's items.

The raw values (effects y_patched - y; TE = y(x') - y(x)) go to paths_items, paths_screen and
paths_edges_items parquet files; paths_tables.py makes the tables from them alone.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from ..errors import RunError
from ..forward.capture import editing, expand_kv
from ..heads import HeadSet
from ..measures.direct_attribution.compute import parts_of
from ..measures.head_effects.engine import Bank
from ..measures.head_effects.sites import behaviour_rows, decoder_layers, mlp_modules
from .paths_tables import CROSSFIT, TOP, gradient_shares
from .rerun import ROWS, rerun_y

PATHS = ("value", "pattern", "output")
EDGES = 8  # senders confirmed exactly per receiver
EMBEDDING = "embedding"
PRE_NORMS = ("input_layernorm", "ln_1", "self_attn_layer_norm", "attention_norm", "norm_1", "ln_attn")


@dataclass(frozen=True)
class Pair:
    """An item (its row in the items' bank) and its reference x' (its row in the reference bank),
    with the occupation's position in each."""

    item: int
    donor: int
    at: int
    at_cf: int
    same_length: bool


def reference_pairs(items, word: str) -> list[Pair]:
    """The items having a `word` counterfactual, in the reference bank's order (inputs.record_inputs)."""
    out = []
    for n, item in enumerate(items):
        for cf in item.counterfactuals:
            if cf.word == word:
                out.append(Pair(n, len(out), cf.at, cf.at_cf, item.same_length(cf)))
    return out


@dataclass(frozen=True)
class Anatomy:
    """Per layer: the attention module, its pre-attention norm, the output projection, the norm
    after attention (None where its output is added as it is), what the MLP adds and whether that is
    a norm of the MLP's output (Gemma 2/3) rather than the MLP itself."""

    attention: list
    pre_norm: list
    outputs: list
    after_attention: list
    mlp_added: list
    mlp_normed: list

    @classmethod
    def of(cls, module) -> Anatomy:
        parts = parts_of(module)
        layers = decoder_layers(module)
        attention = [
            next((m for m in la.modules() if type(m).__name__.endswith("Attention")), None) for la in layers
        ]
        pre = [next((getattr(la, n) for n in PRE_NORMS if hasattr(la, n)), None) for la in layers]
        if parts is None or None in attention or None in pre:
            raise RunError(
                f"--paths: {type(module).__name__} has no attention module, pre-attention norm, output "
                "projection, MLP or final norm where path patching looks; run without --paths"
            )
        outputs, after_attention, mlp_added, _, _ = parts
        mlps = mlp_modules(module)
        return cls(
            attention, pre, outputs, after_attention, mlp_added, [a is not m for a, m in zip(mlp_added, mlps)]
        )


@dataclass
class _PathEdit:
    """Editor: per row (B), the heads of `value` read x''s value at p, those of `pattern` attend as
    in x', those of `output` give x''s output at the aligned positions; masks (B, L, H)."""

    reference: Bank
    donor: torch.Tensor
    at: torch.Tensor
    at_cf: torch.Tensor
    value: torch.Tensor
    pattern: torch.Tensor
    output: torch.Tensor

    def __call__(self, site) -> torch.Tensor:
        out, layer = site.output, site.layer
        B, H, T, D = out.shape
        rows = torch.arange(B)
        if self.value[:, layer].any():
            values = site.values()  # (B, H, S, D)
            live = values[rows, :, self.at]  # (B, H, D)
            donor = expand_kv(self.reference.values[layer][self.donor], H)[rows, :, self.at_cf].to(live.dtype)
            reach = site.weights()[rows, :, :, self.at]  # (B, H, T): how much each row reads p
            new = out + reach[..., None].to(out.dtype) * (donor - live)[:, :, None, :]
            out = torch.where(self.value[:, layer, :, None, None], new, out)
        if self.pattern[:, layer].any():
            given = self.reference.weights[layer][self.donor]  # (B, H, T', T') equal lengths: same keys
            S = site.key.shape[2]
            weights = torch.zeros(B, H, T, S, dtype=site.value.dtype)
            t, s = min(T, given.shape[2]), min(S, given.shape[3])
            weights[..., :t, :s] = given[..., :t, :s]
            new = torch.matmul(weights, site.values())
            out = torch.where(self.pattern[:, layer, :, None, None], new, out)
        if self.output[:, layer].any():
            given = self.reference.outputs[layer][self.donor]  # (B, H, T', D)
            positions = torch.arange(T)[None]
            index = (positions - self.at[:, None] + self.at_cf[:, None]).clamp(0, given.shape[2] - 1)
            new = given.gather(2, index[:, None, :, None].expand(B, H, T, D)).to(out.dtype)
            aligned = (positions >= self.at[:, None])[:, None, :, None]
            out = torch.where(self.output[:, layer, :, None, None] & aligned, new, out)
        return out


@torch.inference_mode()
def path_runs(module, bank: Bank, reference: Bank, pairs: list[Pair], labels, runs: list) -> np.ndarray:
    """y of each run (pair index, path, HeadSet): the pair's x with the set's `path` input from x'."""
    L, H = len(bank.hidden), bank.outputs[0].shape[1]
    first = np.array([min(layer for layer, _ in heads) for _, _, heads in runs])
    y = np.full(len(runs), np.nan)
    for layer in np.unique(first):
        todo = np.flatnonzero(first == layer)
        for start in range(0, len(todo), ROWS):
            batch = todo[start : start + ROWS]
            ps = [pairs[runs[i][0]] for i in batch]
            masks = {path: torch.zeros(len(batch), L, H, dtype=torch.bool) for path in PATHS}
            for b, i in enumerate(batch):
                _, path, heads = runs[i]
                masks[path][b] = heads.mask(L, H)
            edit = _PathEdit(reference, *_tensors(ps, "donor", "at", "at_cf"), **masks)
            rows = _tensors(ps, "item")[0]
            hidden = bank.hidden[int(layer)][rows]
            y[batch] = rerun_y(module, bank, rows, int(layer), hidden, labels[rows], [editing(edit)]).numpy()
    return y


def _tensors(pairs: list[Pair], *fields) -> list[torch.Tensor]:
    return [torch.tensor([getattr(p, f) for p in pairs]) for f in fields]


def writes(anatomy: Anatomy, bank: Bank, reference: Bank, pairs: list[Pair], below: int):
    """(sender names, (B, S, E)): what each part below layer `below` wrote at p in x' minus in x."""
    n, r, at, at_cf = _tensors(pairs, "item", "donor", "at", "at_cf")
    rows = torch.arange(len(pairs))
    names = [EMBEDDING]
    parts = [(reference.hidden[0][r, at_cf] - bank.hidden[0][n, at])[:, None]]
    for j in range(below):
        z, z_cf = bank.outputs[j][n][rows, :, at], reference.outputs[j][r][rows, :, at_cf]  # (B, H, D)
        B, H, D = z.shape
        project = anatomy.outputs[j]
        diagonal = torch.zeros(B, H, H, D, dtype=z.dtype)
        diagonal[:, torch.arange(H), torch.arange(H)] = z_cf - z
        per_head = project(diagonal.view(B * H, H * D)).view(B, H, -1) - project(
            torch.zeros(1, H * D, dtype=z.dtype)
        )
        post = anatomy.after_attention[j]
        if (
            post is not None
        ):  # the norm after attention applied to the layer's whole output, x's other heads kept
            whole = project(z.reshape(B, H * D))[:, None]
            per_head = post(whole + per_head) - post(whole)
        parts.append(per_head)
        names += [HeadSet.name(j, h) for h in range(H)]
        m, m_cf = bank.mlp[j][n, at], reference.mlp[j][r, at_cf]
        if anatomy.mlp_normed[j]:
            m, m_cf = anatomy.mlp_added[j](m), anatomy.mlp_added[j](m_cf)
        parts.append((m_cf - m)[:, None])
        names.append(f"MLP {j}")
    return names, torch.cat(parts, 1)


@dataclass
class _ValueOnly:
    """Editor at `layer`: every head's output as in x's clean run, but the receiver `head` (per row)
    reads the values computed in this run with its clean weights: only its value input changes."""

    layer: int
    head: torch.Tensor  # (B,)
    outputs: torch.Tensor  # (B, H, T, D) clean
    weights: torch.Tensor  # (B, H, T, T) clean

    def __call__(self, site) -> torch.Tensor:
        if site.layer != self.layer:
            return site.output
        B, H, T, _ = site.output.shape
        rows = torch.arange(B)
        own = torch.matmul(
            self.weights[rows, self.head, :T, :T].to(site.value.dtype), site.values()[rows, self.head]
        )
        chosen = (torch.arange(H)[None] == self.head[:, None])[:, :, None, None]
        return torch.where(chosen, own[:, None], self.outputs[:, :, :T].to(site.output.dtype))


@contextmanager
def _read_at(anatomy: Anatomy, layer: int, h: torch.Tensor, at: torch.Tensor, delta: torch.Tensor):
    """Within the block layer `layer`'s attention reads N(h + delta) (B, E) at each row's position
    `at` (N its pre-attention norm); the residual stream itself is left as it is."""

    def hook(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        new = anatomy.pre_norm[layer](h + delta).to(x.dtype)
        x = x.index_put((torch.arange(len(at)), at), new)
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    handle = anatomy.attention[layer].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _sender_pass(module, anatomy, bank, pairs: list[Pair], heads, layer: int, labels, delta):
    """y of the pairs' x with each receiver's (`heads` (B,) of `layer`) value at p read from
    N(h_p + delta) (B, E); under grad mode when delta needs one."""
    rows, at = _tensors(pairs, "item", "at")
    T = int(bank.lengths[rows].max())
    editor = _ValueOnly(layer, heads, bank.outputs[layer][rows, :, :T], bank.weights[layer][rows, :, :T, :T])
    hidden = bank.hidden[layer][rows]
    h = hidden[torch.arange(len(rows)), at]
    contexts = [editing(editor), _read_at(anatomy, layer, h, at, delta)]
    return rerun_y(module, bank, rows, layer, hidden, labels[rows], contexts)


def screen(module, anatomy, bank, reference, pairs: list[Pair], receiver: tuple[int, int], labels):
    """(sender names, (n pairs, S) attribution of each sender's edge into the receiver's value)."""
    layer, head = receiver
    names, out = None, []
    for start in range(0, len(pairs), ROWS):
        batch = pairs[start : start + ROWS]
        delta = torch.zeros(len(batch), bank.hidden[0].shape[-1], requires_grad=True)
        with torch.enable_grad():
            y = _sender_pass(
                module, anatomy, bank, batch, torch.full((len(batch),), head), layer, labels, delta
            )
            (g,) = torch.autograd.grad(y.sum(), delta)
        with torch.inference_mode():
            names, parts = writes(anatomy, bank, reference, batch, layer)
            out.append(torch.einsum("be,bse->bs", g.to(parts.dtype), parts).double().numpy())
    return names, np.concatenate(out)


@torch.inference_mode()
def edges(
    module, anatomy, bank, reference, pairs: list[Pair], receiver, senders: list[str], labels
) -> np.ndarray:
    """(n pairs, len(senders)) y with each sender's write at p swapped on its path into the
    receiver's value."""
    layer, head = receiver
    out = np.empty((len(pairs), len(senders)))
    per_pair = ROWS // max(1, len(senders)) or 1
    for start in range(0, len(pairs), per_pair):
        batch = pairs[start : start + per_pair]
        names, parts = writes(anatomy, bank, reference, batch, layer)
        picked = parts[:, [names.index(s) for s in senders]]  # (b, s, E)
        rows = [p for p in batch for _ in senders]
        heads = torch.full((len(rows),), head)
        y = _sender_pass(module, anatomy, bank, rows, heads, layer, labels, picked.reshape(len(rows), -1))
        out[start : start + len(batch)] = y.numpy().reshape(len(batch), len(senders))
    return out


def measure_paths(
    model,
    items,
    bank: Bank,
    reference: Bank,
    labels,
    word: str,
    receivers: HeadSet,
    crossfit,
    screen_half,
    log=lambda m: None,
):
    """Raw values of path patching. `receivers`: the top heads (in order); `crossfit`: per item the
    top set chosen without it (HeadSet, or None); `screen_half`: per item True where its unit screens
    senders (the others confirm them). Returns (paths, screen, edges) long frames."""
    module = model if isinstance(model, torch.nn.Module) else model.model
    anatomy = Anatomy.of(module)
    pairs = reference_pairs(items, word)
    top = HeadSet(tuple(receivers)[:5])
    sets = [(HeadSet.name(*r), HeadSet((r,))) for r in receivers] + [(TOP, top)]
    runs, names = [], []
    for i, pair in enumerate(pairs):
        for name, heads in sets:
            for path in PATHS:
                if path != "pattern" or pair.same_length:
                    runs.append((i, path, heads))
                    names.append((i, name, path))
        if crossfit is not None and crossfit[pair.item] is not None:
            runs.append((i, "value", crossfit[pair.item]))
            names.append((i, CROSSFIT, "value"))
    log(f"paths: {len(runs)} patched runs ({len(pairs)} items)")
    y = path_runs(module, bank, reference, pairs, labels, runs)
    paths = _frame(items, bank, reference, pairs, labels, [i for i, _, _ in names])
    paths = paths.assign(receiver=[n for _, n, _ in names], path=[p for _, _, p in names], y_patched=y)
    screening = [i for i, p in enumerate(pairs) if screen_half[p.item]]
    confirming = [i for i, p in enumerate(pairs) if not screen_half[p.item]]
    screens, confirmed = [], []
    for receiver in receivers:
        name = HeadSet.name(*receiver)
        senders, values = screen(
            module, anatomy, bank, reference, [pairs[i] for i in screening], receiver, labels
        )
        frame = _frame(items, bank, reference, pairs, labels, screening)
        screens.append(_long(frame, values, senders, "attribution").assign(receiver=name))
        chosen = chosen_senders(screens[-1], EDGES)
        exact = edges(
            module, anatomy, bank, reference, [pairs[i] for i in confirming], receiver, chosen, labels
        )
        frame = _frame(items, bank, reference, pairs, labels, confirming)
        confirmed.append(_long(frame, exact, chosen, "y_patched").assign(receiver=name))
        log(f"paths: senders into {name}'s value screened, {len(chosen)} confirmed")
    return paths, pd.concat(screens, ignore_index=True), pd.concat(confirmed, ignore_index=True)


def _frame(items, bank, reference, pairs, labels, which: list[int]) -> pd.DataFrame:
    """Per pair index in `which`: its item's ids, covariate, y and y(x')."""
    ps = [pairs[i] for i in which]
    n, r = _tensors(ps, "item", "donor") if ps else (torch.zeros(0, dtype=torch.long),) * 2
    y = behaviour_rows(bank.logits[n], labels[n, 0], labels[n, 1]).double().numpy()
    y_cf = behaviour_rows(reference.logits[r], labels[n, 0], labels[n, 1]).double().numpy()
    return pd.DataFrame(
        {
            "item_id": [items[p.item].item_id for p in ps],
            "unit": [items[p.item].unit for p in ps],
            "template_id": [items[p.item].template_id for p in ps],
            "covariate": [items[p.item].covariate for p in ps],
            "y": y,
            "y_cf": y_cf,
        }
    )


def _long(frame: pd.DataFrame, values: np.ndarray, senders: list[str], column: str) -> pd.DataFrame:
    """frame's rows repeated per sender, with values (rows, senders) in `column`."""
    out = frame.loc[frame.index.repeat(len(senders))].reset_index(drop=True)
    return out.assign(sender=np.tile(senders, len(frame)), **{column: values.reshape(-1)})


def chosen_senders(screen_rows: pd.DataFrame, k: int) -> list[str]:
    """The k senders whose attribution carries the largest share (absolute) of TE's gradient."""
    shares = gradient_shares(screen_rows, "attribution")
    return shares.abs().sort_values(ascending=False, kind="stable").index[:k].tolist()
