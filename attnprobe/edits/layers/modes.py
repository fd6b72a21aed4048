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
  dual       project, the direction removed only where it carries a larger share of the covariate's
             variance (over the items) than of the definitional label's (over the control prompts):
             the keep rule of 2DAMA (Limisiewicz, Marecek & Musil 2025), read as share against share

A mode that is `ranked` fits an edit of rank r at one site (`fit_ranked`: r rank-one parts applied in
order): project and dual remove r orthonormal directions, the weights of PLS1 of the covariate
(estimate.pls_directions, DAMA's subspace); dual drops each direction its rule does not keep. Every
other mode is rank one.

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
from ..estimate import (
    covariate_directions,
    definitional_directions,
    definitional_midpoints,
    erasers,
    explained,
    pls_directions,
)

Fitted = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (along, functional, mean), each (E,)


class SiteMode(ABC):
    """How an edit of one vector site is fitted. `fit(z, x, control, sign)`: z (N, E) the training
    items' vectors, x (N,) their covariate, control (M, E) the control prompts' vectors a keep
    constraint is fitted on and sign (M,) their labels (+1 or -1) -> (along, functional, mean)."""

    mode: ClassVar[str]
    replaces: ClassVar[bool] = False  # h -> mean, whatever h is
    fitted: ClassVar[bool] = True  # depends on where it is fitted (zero does not: measured once)
    covariate: ClassVar[bool] = True  # fitted on the covariate: the placebo refits it on permutations
    ranked: ClassVar[bool] = False  # fits an edit of several directions at one site (fit_ranked)

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

    @classmethod
    def fit_ranked(cls, z: torch.Tensor, x, control: torch.Tensor, sign, rank: int) -> list[Fitted]:
        """The `rank` rank-one parts of the site's edit, applied in order (a mode that is not `ranked`:
        rank 1, its `checked` fit)."""
        if rank != 1 and not cls.ranked:
            raise AttnprobeError(f"site mode {cls.mode!r} fits rank 1 only, not {rank}")
        return [cls.checked(z, x, control, sign)]


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
    mode, ranked = "project", True

    @classmethod
    def fit(cls, z, x, control, sign) -> Fitted:
        u = covariate_directions(z[:, None, None, :], x)[0, 0]
        return u, u, _zeros(z)

    @classmethod
    def directions(cls, z, x, control, sign, rank: int) -> torch.Tensor:
        """(rank, E) the orthonormal directions removed (zero rows: none)."""
        return pls_directions(z, x, rank)

    @classmethod
    def fit_ranked(cls, z, x, control, sign, rank: int) -> list[Fitted]:
        if rank == 1:
            return [cls.checked(z, x, control, sign)]
        return [(w, w, _zeros(z)) for w in cls.directions(z, x, control, sign, rank)]


class Dual(Project):
    """DAMA's projection with 2DAMA's keep rule: a PLS direction w is removed only where the items'
    scores z.w explain a larger share of the covariate's variance than the control prompts' explain of
    their label's (both squared correlations, on the rows fitted)."""

    mode = "dual"

    @classmethod
    def fit(cls, z, x, control, sign) -> Fitted:
        w = cls.directions(z, x, control, sign, 1)[0]
        return w, w, _zeros(z)

    @classmethod
    def directions(cls, z, x, control, sign, rank: int) -> torch.Tensor:
        w = pls_directions(z, x, rank)
        kept = explained(z @ w.T, x) > explained(control @ w.T, sign)
        return w * kept.to(w)[:, None]


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
for _mode in (Zero, Mean, Project, Leace, LeaceMid, Dual):
    SITE_MODES.register(_mode)
