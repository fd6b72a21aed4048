"""What an edit of a vector site does: the stream entering a decoder layer (edits.layers.stream) or
what one layer's MLP adds to it (edits.layers.mlp). Every mode is one affine map of the site's vector
h (the model's width E) at every position, fitted on the training items' vectors at the site:

  h -> h - u f.(h - mu)      u `along`, f `functional`, mu `mean` (a projection or an eraser)
  h -> mu                    a mode that `replaces` the vector (zero, mean)

  zero       mu = 0 (the same wherever it is fitted)
  mean       mu = the items' mean vector
  project    u = f = the unit least-squares slope of h on the covariate, mu = 0 (DAMA's projection)
  leace      the covariate erased keeping the definitional mean difference (estimate.erasers, with the
             shrunk covariance: the site is as wide as the model and the items are fewer)
  leace_mid  leace keeping the definitional midpoint too: neither label's mean vector moves

Modes are kinds by name (registry.Registry): these, then those other packages register under the
entry-point group "attnprobe.site_modes" (docs/extending.md). A mode's name names the sweep's rows and
saved files (mlp-NAME, mlp-NAME-slot), so "layers" (the prefix of the edits of several layers) is
refused, as a name another mode has.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from ...errors import AttnprobeError
from ...registry import Registry
from ..estimate import covariate_directions, definitional_directions, definitional_midpoints, erasers

Fitted = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (along, functional, mean), each (E,)


class SiteMode(ABC):
    """How an edit of one vector site is fitted. `fit(z, x, control, sign)`: z (N, E) the training
    items' vectors, x (N,) their covariate, control (M, E) the control prompts' vectors a keep
    constraint is fitted on and sign (M,) their labels (+1 or -1) -> (along, functional, mean)."""

    mode: ClassVar[str]
    replaces: ClassVar[bool] = False  # h -> mean, whatever h is
    fitted: ClassVar[bool] = True  # depends on where it is fitted (zero does not: measured once)
    covariate: ClassVar[bool] = True  # fitted on the covariate: the placebo refits it on permutations

    @classmethod
    @abstractmethod
    def fit(cls, z: torch.Tensor, x, control: torch.Tensor, sign) -> Fitted: ...

    @classmethod
    def checked(cls, z: torch.Tensor, x, control: torch.Tensor, sign) -> Fitted:
        """`fit`, its output checked: three finite vectors of the site's width (a plug-in's that are not
        would broadcast or poison every pass), else one line naming the mode."""
        width = z.shape[-1]
        try:
            made = tuple(cls.fit(z, x, control, sign))
        except Exception as exc:  # a plug-in's own failure: named, not a traceback
            raise AttnprobeError(f"site mode {cls.mode!r}: fit raised {type(exc).__name__}: {exc}") from None
        if len(made) != 3 or not all(
            isinstance(t, torch.Tensor) and t.shape == (width,) and bool(torch.isfinite(t).all())
            for t in made
        ):
            raise AttnprobeError(
                f"site mode {cls.mode!r}: fit must return (along, functional, mean), three finite vectors "
                f"of the site's width {width}; fix the mode"
            )
        return tuple(t.to(z) for t in made)


def _zeros(z: torch.Tensor) -> torch.Tensor:
    return torch.zeros(z.shape[-1], dtype=z.dtype, device=z.device)


class Zero(SiteMode):
    mode, replaces, fitted, covariate = "zero", True, False, False

    @classmethod
    def fit(cls, z, x, control, sign) -> Fitted:
        return _zeros(z), _zeros(z), _zeros(z)


class Mean(SiteMode):
    mode, replaces, covariate = "mean", True, False

    @classmethod
    def fit(cls, z, x, control, sign) -> Fitted:
        return _zeros(z), _zeros(z), z.mean(0)


class Project(SiteMode):
    mode = "project"

    @classmethod
    def fit(cls, z, x, control, sign) -> Fitted:
        u = covariate_directions(z[:, None, None, :], x)[0, 0]
        return u, u, _zeros(z)


class Leace(SiteMode):
    mode = "leace"
    midpoint: ClassVar[bool] = False

    @classmethod
    def fit(cls, z, x, control, sign) -> Fitted:
        kept = control[:, None, None, :]
        midpoint = definitional_midpoints(kept, sign) if cls.midpoint else None
        g = definitional_directions(kept, sign)
        along, functional, mean = erasers(z[:, None, None, :], x, g, shrink=True, midpoint=midpoint)
        return along[0, 0], functional[0, 0], mean[0, 0]


class LeaceMid(Leace):
    mode, midpoint = "leace_mid", True


SEVERAL = "layers"  # the edits of several layers' prefix (mlp-layers-MODE): no mode may be named so
SITE_MODES = Registry(
    "attnprobe.site_modes",
    SiteMode,
    "mode",
    clash=lambda kind, others: (
        f"is named {SEVERAL!r}, the prefix of the edits of several layers" if kind.mode == SEVERAL else None
    ),
)
for _mode in (Zero, Mean, Project, Leace, LeaceMid):
    SITE_MODES.register(_mode)
