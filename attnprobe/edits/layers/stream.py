"""Erasure in the residual stream: the covariate erased (LEACE, estimate.erasers, with the
definitional mean difference kept) from the hidden state entering one decoder layer, at every
position, fitted at the prediction position (each item's last token).

  h -> h - u f.(h - mu)      u = Cov(h, x), f = a / a.u, mu the mean h (each of the model's width)

The stream is as wide as the model and the items fewer than its dimensions, so a = Sigma^+ u uses
the shrunk covariance (estimate.shrunk): with the plain one, directions the items barely span are
amplified and text far from the items (the first position above all) is moved by whole units, a KL
of 0.1 to 5 nats on SmolLM2. Applied at every position, an eraser fitted at the prediction position
still moves other positions more than it moves the items (their f.(h - mu) is larger): the texts'
KL is the price of editing every prediction, and the reason the head sites cost less.

The sweep (`measure_stream`) fits and measures it at every layer, as the head kinds are measured:
the bias on each quarter's items with the eraser fitted on its training quarters, the control
prompts and the texts with the one fitted on every item. Its raw rows are kind "stream", k = the
layer; edits_stream.csv holds one row per layer (the statistics of stats.edits.edit_tables) and a
"chosen" row (stats.keeping.layers): each item's values from the layer chosen on the other quarters'
items, each control prompt's and text's from the layer whose gate was judged on the other half of
the words and texts, so no value tests a layer chosen on it.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np
import pandas as pd
import torch

from ...attention.capture import model_edit
from ...intervene.engine import Bank
from ...intervene.rerun import ROWS, Changes, rerun_logits, rerun_y
from ...model.anatomy import decoder_layers, module_of
from ...stats.edits import STREAM as NAME
from ..passes import raw_rows, text_costs
from .modes import SITE_MODES

PARAMETERS = ("along", "functional", "mean")
STREAM_MODE = "leace"  # how the stream is edited at one layer, and over several unless told otherwise


@dataclass(frozen=True)
class StreamEdit:
    """The eraser of the stream entering `layer`; parameters (E,) or, inside the sweep, (B, E): one
    per row of the batch (each item's quarter's own)."""

    kind: ClassVar[str] = NAME
    layer: int = 0
    along: torch.Tensor = field(default=None, repr=False)
    functional: torch.Tensor = field(default=None, repr=False)
    mean: torch.Tensor = field(default=None, repr=False)

    def erase(self, h: torch.Tensor) -> torch.Tensor:
        """h (B, T, E) with the covariate erased at every position."""
        u, f, mu = (t.to(h)[:, None, :] if t.dim() == 2 else t.to(h) for t in self.params)
        return h - u * ((h - mu) * f).sum(-1, keepdim=True)

    @property
    def params(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.along, self.functional, self.mean

    def rows(self, rows: torch.Tensor) -> StreamEdit:
        """The edit of a batch whose row b has the parameters of row rows[b] (per-row parameters)."""
        return replace(self, **{name: t[rows] for name, t in zip(PARAMETERS, self.params)})

    @property
    def rowwise(self) -> bool:
        """Whether the parameters are one set per row of the sweep's bank ((B, E)), not one (E,)."""
        return self.along.dim() == 2

    @classmethod
    def stacked(cls, fitted: list, which: torch.Tensor):
        """One edit with per-row parameters: row n's are those of fitted[which[n]]."""
        params = {name: torch.stack([getattr(e, name) for e in fitted])[which] for name in PARAMETERS}
        return replace(fitted[0], **params)

    def sites(self) -> str:
        return f"stream entering layer {self.layer}"

    def stored(self) -> tuple[dict, dict, dict]:
        """(tensors, scalars, where) a saved file holds (edits.saved)."""
        tensors = {name: t.contiguous().float() for name, t in zip(PARAMETERS, self.params)}
        return tensors, {}, {"layer": self.layer}

    @classmethod
    def restored(cls, record: dict, tensors: dict) -> StreamEdit:
        width, layer = record["model"]["hidden_size"], record["layer"]
        if set(tensors) != set(PARAMETERS) or any(t.shape != (width,) for t in tensors.values()):
            raise ValueError(f"a stream edit holds along, functional and mean of size {width}")
        if not 0 <= layer < record["model"]["n_layers"]:
            raise ValueError(f"layer {layer} is not one of the model's")
        return cls(int(layer), tensors["along"], tensors["functional"], tensors["mean"])

    def hook(self, layer):
        """Register the edit on decoder layer `layer`: a pre-hook erasing the stream entering it. A
        pre-hook registered after another one (patching's recorded state, `skipping`) erases what
        that one put in."""

        def erase(_, args, kwargs):
            if args:
                return (self.erase(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": self.erase(kwargs["hidden_states"])}

        return layer.register_forward_pre_hook(erase, with_kwargs=True)

    @contextmanager
    def applied(self, model):
        """Within the block every pass of `model` (a ProbeModel or its module) has the edit at its
        layer (`hook`)."""
        handle = self.hook(decoder_layers(module_of(model))[self.layer])
        try:
            with model_edit(untouched):  # marks a model edit in force: run_suite refuses to run in one
                yield
        finally:
            handle.remove()

    @classmethod
    def fit(cls, inputs, layer: int, on) -> StreamEdit:
        """Fitted by LEACE (edits.layers.modes) on the items of folds `on` at their last token, keeping
        the definitional mean difference of half 0 of the control prompts."""
        items, control = (last_states(bank, layer)[:, 0, 0] for bank in (inputs.bank, inputs.control))
        return cls.fitted(inputs, layer, on, items, control)

    @classmethod
    def fitted(cls, inputs, layer: int, on, items, control, mode: str = STREAM_MODE) -> StreamEdit:
        """`fit` from the stream's states at every item's (N, E) and control prompt's (M, E) last token,
        by `mode` (edits.layers.modes; LEACE unless an edit of several layers names another)."""
        chosen = np.isin(inputs.fold, on)
        fit = inputs.keep_rows()
        x, keep = inputs.covariate[chosen], control[torch.as_tensor(fit)]
        z = items[torch.as_tensor(chosen)]
        return cls(layer, *SITE_MODES[mode].checked(z, x, keep, inputs.control_sign[fit]))


def untouched(site) -> torch.Tensor:
    """The head outputs as they are (a stream edit changes no head)."""
    return site.output


def last_states(bank: Bank, layer: int) -> torch.Tensor:
    """(N, 1, 1, E) the stream entering `layer` at each sequence's last token (one 'head' for the
    erasers' estimators)."""
    last = bank.lengths - 1
    return bank.hidden[layer][torch.arange(len(last)), last].float()[:, None, None, :]


def _batches(module, bank: Bank, edit: StreamEdit, only=None):
    """Per pass of ROWS sequences of `bank` (those of `only` where given): (rows, the recorded stream
    entering the edited layer, the eraser applied: its parameters for those rows where they are per
    row)."""
    order = torch.arange(len(bank.lengths)) if only is None else torch.as_tensor(only, dtype=torch.long)
    for start in range(0, len(order), ROWS):
        rows = order[start : start + ROWS]
        one = edit.rows(rows) if edit.rowwise else edit
        yield rows, bank.hidden[edit.layer][rows], [one.applied(module)]


def _passes(module, bank: Bank, edit: StreamEdit, vocabulary: torch.Tensor | None = None):
    """Erased passes of every sequence of `bank`, started at the edited layer from the recorded
    stream; with `vocabulary` the lm head narrowed to it (narrowed_head). Yields (rows, logits (B, T,
    vocab or the vocabulary's), whether they are narrowed)."""
    for rows, hidden, applied in _batches(module, bank, edit):
        yield rows, *rerun_logits(module, bank, rows, edit.layer, hidden, Changes(applied, vocabulary))


@torch.inference_mode()
def stream_behaviour(module, bank: Bank, edit: StreamEdit, labels: torch.Tensor, only=None) -> np.ndarray:
    """y (N,) of every sequence of `bank` (of those in `only` where given: NaN elsewhere) with the
    stream erased by `edit` (per row where its parameters are (N, E)); `labels` (N, 2, K)."""
    y = np.full(len(bank.lengths), np.nan)
    for rows, hidden, applied in _batches(module, bank, edit, only):
        y[rows.cpu().numpy()] = (
            rerun_y(module, bank, rows, edit.layer, hidden, labels[rows], applied).cpu().numpy()
        )
    return y


@torch.inference_mode()
def stream_text_costs(module, bank: Bank, clean_logp, edit: StreamEdit) -> tuple[np.ndarray, np.ndarray]:
    """Per text: mean KL(original || erased) over its predicted positions and its mean log-loss."""
    kl, loss = np.empty(len(bank.lengths)), np.empty(len(bank.lengths))
    for rows, logits, _ in _passes(module, bank, edit):
        for b, n in enumerate(rows.tolist()):
            kl[n], loss[n] = text_costs(logits[b], bank, n, clean_logp[n])
    return kl, loss


def per_row(fitted: list[StreamEdit], which) -> StreamEdit:
    """One edit with per-row parameters: row n's are those of fitted[which[n]] (each edit class stacks
    its own: StreamEdit.stacked, edits.layers.mlp.MlpLayers.stacked)."""
    return type(fitted[0]).stacked(fitted, torch.as_tensor(which))


def measure_stream(model, inputs, log=lambda m: None) -> pd.DataFrame:
    """Raw values (as sweep.measure_kind's; kind "stream", k = layer) of the stream erased at every
    layer."""
    site = lambda layer: last_states(inputs.bank, layer)[:, 0, 0]
    return measure_layers(
        model, inputs, PerLayer(StreamEdit.fit, site, NAME, "stream erased entering layer"), log
    )


@dataclass(frozen=True)
class PerLayer:
    """An edit measured layer by layer: `fit(inputs, k, folds)` (a StreamEdit, or an edit of several
    layers: MlpLayers), `site(k)` (N, E: the edited vector at each item's last token; None: no
    readout), the raw rows' kind `name`, `what` the edit is in words, and the k measured (`layers`;
    None: every layer of the model)."""

    fit: object
    site: object
    name: str
    what: str
    layers: tuple[int, ...] | None = None


def measure_layers(model, inputs, edit: PerLayer, log=lambda m: None) -> pd.DataFrame:
    """Raw values (kind `edit.name`, k = layer) of a per-layer edit at each of its layers: bias on
    every item (its quarter's edit, fitted on the quarter's training quarters), texts (the all-items
    edit) and control prompts (the all-items edit whose keep constraint was fitted on the other half
    of the control's words; a prompt no fit used: the one fitted on half 0); and the covariate read
    on held-out items from `edit.site(layer)` before and after its quarter's edit (sweep.erased)."""
    from ..sweep.erased import layer_readout_rows  # the sweep's module (it imports this one)

    module = model.model
    frames = []
    every = np.arange(4)
    fit, site, name, what, layers = edit.fit, edit.site, edit.name, edit.what, edit.layers
    for layer in range(model.info.n_layers) if layers is None else layers:
        quarters, y = quarters_bias(model, inputs, fit, layer)
        everywhere = fit(inputs, layer, every)
        crossed = per_row([everywhere, fit(inputs.other_half(), layer, every)], inputs.judged_by_other_half())
        n, m = len(inputs.items), len(inputs.control.lengths)
        y_control = stream_behaviour(module, inputs.control, crossed, inputs.control_labels)
        kl, loss = stream_text_costs(module, inputs.texts, inputs.clean_logp, everywhere)
        frames += [
            raw_rows("bias", [(layer, -1, i) for i in range(n)], y=y),
            raw_rows("control", [(layer, -1, i) for i in range(m)], y=y_control),
            raw_rows("text", [(layer, -1, i) for i in range(len(kl))], kl=kl, loss=loss),
            *(layer_readout_rows(site(layer), quarters, inputs, layer) if site else []),
        ]
        log(f"edit: {what} {layer}" + (f" of {model.info.n_layers}" if layers is None else ""))
    out = pd.concat(frames, ignore_index=True)
    out["heads"] = out["heads_all"] = [f"{what} {k}" for k in out["k"]]
    return out.assign(kind=name)


def quarters_bias(model, inputs, fit, layer: int) -> tuple[StreamEdit, np.ndarray]:
    """(the edit at `layer` with each item's quarter's parameters, fitted on the quarter's training
    quarters; y (N,) of every item so edited)."""
    quarters = per_row([fit(inputs, layer, inputs.training(f)) for f in range(4)], inputs.fold)
    return quarters, stream_behaviour(model.model, inputs.bank, quarters, inputs.labels)
