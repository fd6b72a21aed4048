"""Head edits: what replaces a chosen head's output, one small class per kind.

A head's output is its per-head context z (B, H, T, D) before the output projection, the site
`capture.editing` exposes (the same site patching uses). An edit replaces z of its heads at every
position:

  Zero      z -> 0                                   (zero ablation)
  Mean      z -> the head's mean z over a reference set's tokens
  Resample  z -> z the head produced at a reference token drawn at random (seeded, per position)
  Scale     z -> factor * z                          (factor 1 is the identity)
  Project   z -> z - (z . u) u, u a unit direction per head (e.g. the direction along which the
            head's output follows the stereotype covariate on training items)
  Orthogonal  Project along that direction made orthogonal to the head's definitional direction
  Leace     z -> z - u f.(z - mu): the covariate erased (LEACE), the definitional contrast kept
  LeaceMid  the same with the definitional midpoint kept too: each label's mean output unmoved
  LeaceMidLast  LeaceMid at the prediction position alone where a pass says which (the sweep's)

Heads are (layer, head) pairs; `edit.on(heads)` is the same edit on other heads. Each kind fits its
own parameters: `Kind.fit(inputs, on, options)` from the recorded inputs of the items in folds `on`
(edits.inputs; estimate.py holds the estimators). Within `edited(model, edit)` every forward pass of
the model runs edited.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import ClassVar

import numpy as np
import torch

from ..attention.capture import model_edit
from ..errors import AttnprobeError
from ..heads import HeadSet
from ..model import routes_attention
from ..registry import Registry
from .editor import RowEditor, at_predictions
from .estimate import (
    BANK_TOKENS,
    covariate_directions,
    definitional_directions,
    definitional_midpoints,
    erasers,
    last_outputs,
    orthogonal_directions,
    subset,
    token_means,
    token_sample,
)

Heads = tuple[tuple[int, int], ...]


def parse_heads(text: str, n_layers: int, n_heads: int) -> Heads:
    """'L26H2,L25H2' -> ((26, 2), (25, 2)) (HeadSet.parse; a head outside the model is refused)."""
    return HeadSet.parse(text, n_layers, n_heads).pairs


@dataclass(frozen=True)
class HeadEdit:
    """The edit of `heads`; subclasses say what replaces their output (`replacement`)."""

    kind: ClassVar[str]
    BOUNDS: ClassVar[dict] = {}  # parameter -> the largest magnitude a saved edit may hold
    DRAWN: ClassVar[bool] = False  # draws at random (seeded): values depend on the pass's shape
    COVARIATE: ClassVar[bool] = False  # fitted on the covariate (a placebo refits it on a permuted one)
    # edits the positions whose next token a pass predicts alone (edits.editor: the sweep's items and
    # control prompts, the positions a run reads); every position where the pass does not say (texts)
    AT_PREDICTION: ClassVar[bool] = False
    heads: Heads = ()

    def on(self, heads: Heads) -> HeadEdit:
        return replace(self, heads=tuple(heads))

    def replacement(self, layer: int, z: torch.Tensor) -> torch.Tensor:
        """What every head of `layer` would output under this edit: (B, H, T, D) from z (B, H, T, D)."""
        raise NotImplementedError

    def mask(self, n_layers: int, n_heads: int) -> torch.Tensor:
        """(L, H) bool: the edited heads."""
        return HeadSet(self.heads).mask(n_layers, n_heads)

    @classmethod
    def fit(cls, inputs, on, options) -> HeadEdit:
        """The edit with its parameters estimated on the items (and their reference sequences) of
        the folds `on`; a kind without parameters is itself."""
        return cls()

    def sites(self) -> str:
        return str(HeadSet(self.heads))

    def applied(self, model):
        """Within the block every pass of `model` (a ProbeModel) has the heads edited."""
        if not routes_attention(model.model.config):
            raise AttnprobeError(
                f"{model.info.spec}: head edits need attention routed through attnprobe, and this "
                "family bypasses it (eager-only)"
            )
        editor = RowEditor(self, self.mask(model.info.n_layers, model.info.n_heads)[None])
        return at_predictions(model.model, editor) if self.AT_PREDICTION else model_edit(editor)

    def stored(self) -> tuple[dict, dict, dict]:
        """(tensors, scalars, where) a saved file holds (edits.saved): each tensor parameter
        (L, H, ...) only at the edited heads, (k, ...) in the order of `heads`."""
        layers, heads = (torch.tensor(side, dtype=torch.long) for side in zip(*self.heads))
        tensors, scalars = {}, {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                tensors[f.name] = value[layers, heads].contiguous().float()
            elif f.name != "heads":
                scalars[f.name] = value
        return tensors, scalars, {"heads": self.sites()}

    @classmethod
    def restored(cls, record: dict, tensors: dict) -> HeadEdit:
        """The edit a saved file holds, its tensors back at the model's (L, H, ...) size (zero at
        the heads it does not edit)."""
        if not isinstance(record.get("heads"), str):
            raise ValueError(f"heads must be a string such as 'L26H2,L25H2', not {record.get('heads')!r}")
        pairs = HeadSet.parse(record["heads"], record["model"]["n_layers"], record["model"]["n_heads"]).pairs
        scalars, shape = record.get("parameters", {}), record["model"]
        defaults = {f.name: f.default for f in fields(cls) if f.name != "heads"}
        unknown = set(scalars) - set(defaults) if isinstance(scalars, dict) else {"(not a mapping)"}
        if unknown:
            raise ValueError(f"parameters {sorted(unknown)} are not the {cls.kind} kind's")
        for name, value in scalars.items():  # of the default's type: a seed a whole number, a factor a number
            whole = isinstance(defaults[name], int)
            if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
                raise ValueError(f"parameter {name} is {value!r}, not a {'whole ' * whole}number")
            if whole and not 0 <= value < 2**63:
                raise ValueError(f"parameter {name} is {value}, outside 0 .. 2**63 - 1")
            if abs(value) > cls.BOUNDS.get(name, float("inf")):  # 1e308 is finite, and overflows a pass
                raise ValueError(f"parameter {name} is {value}, beyond +-{cls.BOUNDS[name]:g}")
        full = {}
        for name, rows in tensors.items():
            if name not in defaults or len(rows) != len(pairs) or rows.dim() not in (2, 3):
                raise ValueError(f"tensor {name} {tuple(rows.shape)} does not fit {len(pairs)} heads")
            if rows.shape[-1] != shape["head_dim"]:
                raise ValueError(f"tensor {name} is {rows.shape[-1]} wide; the heads are {shape['head_dim']}")
            dense = rows.new_zeros(shape["n_layers"], shape["n_heads"], *rows.shape[1:])
            for i, (layer, head) in enumerate(pairs):
                dense[layer, head] = rows[i]
            full[name] = dense
        return cls(heads=tuple(pairs), **scalars, **full)


@dataclass(frozen=True)
class Zero(HeadEdit):
    kind: ClassVar[str] = "zero"

    def replacement(self, layer, z):
        return torch.zeros_like(z)


@dataclass(frozen=True)
class Mean(HeadEdit):
    """`means` (L, H, D): each head's mean output over the reference set's tokens."""

    kind: ClassVar[str] = "mean"
    means: torch.Tensor = field(default=None, repr=False)

    def replacement(self, layer, z):
        return self.means[layer].to(z)[None, :, None, :].expand_as(z)

    @classmethod
    def fit(cls, inputs, on, options) -> Mean:
        return cls(means=token_means(subset(inputs.reference, inputs.reference_fold, on)))


@dataclass(frozen=True)
class Resample(HeadEdit):
    """`bank` (L, H, N, D): each head's outputs at N reference tokens; every position of every row
    takes one of them, drawn with `seed` (the same draw for the same layer and input shape)."""

    kind: ClassVar[str] = "resample"
    DRAWN: ClassVar[bool] = True
    bank: torch.Tensor = field(default=None, repr=False)
    seed: int = 0

    def replacement(self, layer, z):
        B, H, T, D = z.shape
        generator = torch.Generator().manual_seed(self.seed * 100_003 + layer)
        pick = torch.randint(
            self.bank.shape[2], (B, H, T), generator=generator, device="cpu"
        )  # per row, head, position
        pick = pick.to(z.device)
        per_head = self.bank[layer].to(z)  # (H, N, D)
        return per_head[torch.arange(H, device=z.device)[None, :, None], pick]  # (B, H, T, D)

    @classmethod
    def fit(cls, inputs, on, options) -> Resample:
        reference = subset(inputs.reference, inputs.reference_fold, on)
        return cls(bank=token_sample(reference, BANK_TOKENS, options.seed), seed=options.seed)


@dataclass(frozen=True)
class Scale(HeadEdit):
    kind: ClassVar[str] = "scale"
    BOUNDS: ClassVar[dict] = {"factor": 100.0}  # as `attnprobe edit --factor`
    factor: float = 0.5

    def replacement(self, layer, z):
        return z * self.factor

    @classmethod
    def fit(cls, inputs, on, options) -> Scale:
        return cls(factor=options.factor)


@dataclass(frozen=True)
class Project(HeadEdit):
    """`directions` (L, H, D), unit length: each head's output loses its component along its own."""

    kind: ClassVar[str] = "project"
    COVARIATE: ClassVar[bool] = True
    directions: torch.Tensor = field(default=None, repr=False)

    def replacement(self, layer, z):
        u = self.directions[layer].to(z)[None, :, None, :]  # (1, H, 1, D)
        return z - (z * u).sum(-1, keepdim=True) * u

    @classmethod
    def fit(cls, inputs, on, options) -> Project:
        chosen = np.isin(inputs.fold, on)
        last = last_outputs(inputs.bank)[torch.as_tensor(chosen)]
        return cls(directions=covariate_directions(last, inputs.covariate[chosen]))


@dataclass(frozen=True)
class Orthogonal(Project):
    """Project, with each head's covariate direction made orthogonal to its definitional direction
    (estimate.orthogonal_directions): the output's component along that direction is kept exactly."""

    kind: ClassVar[str] = "orthogonal"
    COVARIATE: ClassVar[bool] = True

    @classmethod
    def fit(cls, inputs, on, options) -> Orthogonal:
        chosen = np.isin(inputs.fold, on)
        last = last_outputs(inputs.bank)[torch.as_tensor(chosen)]
        u = covariate_directions(last, inputs.covariate[chosen])
        return cls(directions=orthogonal_directions(u, _definitional(inputs)))


@dataclass(frozen=True)
class Leace(HeadEdit):
    """z -> z - along * functional.(z - mean) (estimate.erasers): the covariate erased from each
    head's output (no linear covariance with it left on the items fitted on) at least change under a
    shrunk covariance (estimate.shrunk), with the definitional mean difference between the control
    prompts' labels kept."""

    kind: ClassVar[str] = "leace"
    COVARIATE: ClassVar[bool] = True
    along: torch.Tensor = field(default=None, repr=False)  # (L, H, D) Cov(z, covariate)
    functional: torch.Tensor = field(default=None, repr=False)  # (L, H, D) a / a.along
    mean: torch.Tensor = field(default=None, repr=False)  # (L, H, D)

    def replacement(self, layer, z):
        u, f, mu = (t[layer].to(z)[None, :, None, :] for t in (self.along, self.functional, self.mean))
        return z - u * ((z - mu) * f).sum(-1, keepdim=True)

    @classmethod
    def fit(cls, inputs, on, options) -> Leace:
        chosen = np.isin(inputs.fold, on)
        last = last_outputs(inputs.bank)[torch.as_tensor(chosen)]
        # shrunk as the stream's: a head is fitted on about as many items as it has dimensions
        along, functional, mean = erasers(last, inputs.covariate[chosen], _definitional(inputs), shrink=True)
        return cls(along=along, functional=functional, mean=mean)


@dataclass(frozen=True)
class LeaceMid(Leace):
    """Leace keeping, besides the definitional mean difference, the definitional midpoint (the mean of
    the two labels' mean outputs on the control prompts fitted on): the eraser is centred on the
    occupation items' mean, so plain Leace moves a gendered prompt by as far as its label's mean lies
    from the items'; with both kept, neither label's mean output moves (estimate.erasers)."""

    kind: ClassVar[str] = "leace_mid"

    @classmethod
    def fit(cls, inputs, on, options) -> LeaceMid:
        chosen = np.isin(inputs.fold, on)
        last = last_outputs(inputs.bank)[torch.as_tensor(chosen)]
        fit = inputs.keep_rows()
        control, sign = last_outputs(inputs.control)[torch.as_tensor(fit)], inputs.control_sign[fit]
        along, functional, mean = erasers(
            last,
            inputs.covariate[chosen],
            definitional_directions(control, sign),
            shrink=True,
            midpoint=definitional_midpoints(control, sign),
        )
        return cls(along=along, functional=functional, mean=mean)


@dataclass(frozen=True)
class LeaceMidLast(LeaceMid):
    """leace_mid applied where it is fitted: at each item's and control prompt's prediction position
    only (the outputs at the positions before it, which it was not fitted on, are left as they are),
    and at every position of a text (each predicts). Applied to a whole model (run --edit, `edited`)
    it edits the positions whose next-token prediction each pass reads (edits.editor), and every
    position of a pass that does not say (a notebook's own call of the model)."""

    kind: ClassVar[str] = "leace_mid_last"
    AT_PREDICTION: ClassVar[bool] = True


def _definitional(inputs) -> torch.Tensor:
    """(L, H, D) each head's definitional direction, from half 0 of the control prompts."""
    fit = inputs.keep_rows()
    last = last_outputs(inputs.control)[torch.as_tensor(fit)]
    return definitional_directions(last, inputs.control_sign[fit])


# the built-in kinds, then those other packages register (entry points "attnprobe.edit_kinds", read
# when the registry is first used; docs/extending.md)
# the names the sweep's own rows and files carry (the clean model, each head alone, the stream's
# erasure, its parts' chunks): a head kind of one of them would mix its rows or files with theirs
SWEEP_NAMES = ("none", "single", "stream", "placebo", "paths", "tracing", "readout", "transfer")
KINDS = Registry(
    "attnprobe.edit_kinds",
    HeadEdit,
    "kind",
    clash=lambda kind, others: (
        f"is named {kind.kind!r}, a name the edit sweep's own rows carry"
        if kind.kind in SWEEP_NAMES
        else None
    ),
)
for _kind in (Zero, Mean, Resample, Scale, Project, Orthogonal, Leace, LeaceMid, LeaceMidLast):
    KINDS.register(_kind)


@contextmanager
def edited(model, *edits):
    """Within the block, `model` (a ProbeModel) runs with `edits` applied, in order: every forward
    pass, capture, probe or run of it sees the edited model. An edit is a head edit, a stream edit
    (edits.layers.stream) or one loaded from a file (`load_edit`: checked against the model first)."""
    for edit in edits:  # checked before the model runs: one error naming the argument
        if not hasattr(edit, "applied"):
            raise AttnprobeError(
                f"edited: {edit!r} is not an edit; give an edit of attnprobe.edits (Zero(heads=((26, 2),)), "
                "Mean(heads=..., means=...), ...) or attnprobe.load_edit(path)"
            )
        optional = getattr(edit, "OPTIONAL", ("heads",))  # fields an edit may leave None
        missing = [
            f.name for f in fields(edit) if f.name not in optional and getattr(edit, f.name, 0) is None
        ]
        if missing:
            raise AttnprobeError(
                f"edited: the {getattr(edit, 'kind', 'given')} edit lacks {', '.join(missing)}; fit it "
                "(attnprobe edit saves fitted edits) or give the values"
            )
    with ExitStack() as stack:
        for edit in edits:
            stack.enter_context(edit.applied(model))
        yield model
