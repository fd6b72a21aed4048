"""What `attnprobe edit` and `Run.edit` are asked (EditOptions, checked when made), the context of
one sweep (Sweep), the heads a user lists, and the hash of the settings that determine an edit
kind's values (its chunk's key)."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...defaults import (
    DEFAULT_EDIT_COUNTS,
    DEFAULT_EDIT_K,
    DEFAULT_EDIT_KINDS,
    MAX_EDIT_COUNTS,
    MIN_EDIT_COUNTS,
)
from ...errors import AttnprobeError
from ...version import __version__
from ..inputs import text_head
from ..kinds import KINDS, Heads, parse_heads
from ..layers.mlp import MODES as MLP_MODES
from ..layers.modes import SITE_MODES
from ..layers.several import MAX_RANK

DEFAULT_KINDS, DEFAULT_K = DEFAULT_EDIT_KINDS, DEFAULT_EDIT_K
# the options that are lists: (the type of each entry, what they are, what a wrongly typed list is shown)
LISTS = {
    "kinds": (str, "kind names", "('zero', 'leace')"),
    "ks": (int, "whole numbers", "(1, 5)"),
    "mlp_modes": (str, "mode names", "('mean', 'leace')"),
    "mlp_ranks": (int, "whole numbers", "(1, 8)"),
}


@dataclass(frozen=True)
class EditOptions:
    kinds: tuple[str, ...] = DEFAULT_KINDS
    ks: tuple[int, ...] = DEFAULT_K
    heads: str | None = None  # "L26H2,L25H2": these heads on every item instead of the run's ranking
    draws: int = DEFAULT_EDIT_COUNTS["draws"]
    factor: float = 0.5  # of the scale edit
    reference: str | None = None  # counterfactual word of the reference set; default the suite's last
    text: str | None = None  # a text file whose log-loss change is reported
    seed: int = 0
    alone: int = DEFAULT_EDIT_COUNTS["alone"]  # the top heads each zeroed alone (edits_heads); 0: none
    texts: int = DEFAULT_EDIT_COUNTS["texts"]  # generated texts (of the shipped openings) the cost is on
    # covariate permutations each covariate-fitted kind is refitted on (edits.sweep.permuted); 0: none
    placebo: int = DEFAULT_EDIT_COUNTS["placebo"]
    stream: bool = False  # also the stream erased at every layer (edits_stream, edits.layers.stream)
    mlp: bool = False  # also each MLP's output edited at every layer (edits_mlp, edits.layers.mlp)
    mlp_modes: tuple[str, ...] = MLP_MODES  # the modes --mlp measures (edits.layers.modes)
    mlp_layers: bool = False  # also several consecutive MLP outputs edited at once (DAMA's design; edits_mlp)
    mlp_ranks: tuple[int, ...] = (1,)  # the directions per layer project and dual remove there (1 to 64)
    trace: bool = False  # also the stream patched per layer and position (tracing, analyses.tracing)
    paths: bool = False  # also the top heads' inputs and senders patched (paths, analyses.paths)
    circuits: bool = False  # also circuits found by attribution and judged held out (analyses.circuits)
    circuit_grain: str = "parts"  # what the circuits are made of: parts (heads, MLPs) or edges

    def __post_init__(self):
        for name, (kind, what, example) in LISTS.items():  # Run.edit(ks=5) was a TypeError after recording
            values = getattr(self, name)
            if not isinstance(values, (tuple, list)) or not all(
                isinstance(v, kind) and not isinstance(v, bool) for v in values
            ):
                raise AttnprobeError(f"{name} {values!r}: give a list of {what}, e.g. {example}")
        for name in ("draws", "alone", "texts", "placebo"):
            value, low, high = getattr(self, name), MIN_EDIT_COUNTS[name], MAX_EDIT_COUNTS[name]
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise AttnprobeError(f"--{name} {value!r}: give a whole number from {low} to {high:,}")
        named = ((self.kinds, KINDS, "edit kind", "kinds"), (self.mlp_modes, SITE_MODES, "MLP mode", "modes"))
        for values, registry, noun, plural in named:
            unknown = [v for v in values if v not in registry]
            if unknown or not values:
                raise AttnprobeError(
                    f"unknown {noun} {', '.join(unknown) or '(none)'}; {plural}: {', '.join(registry)}"
                )
        for option, values in (
            ("--kinds", self.kinds),
            ("--k", self.ks),
            ("--mlp-modes", self.mlp_modes),
            ("--mlp-ranks", self.mlp_ranks),
        ):
            repeated = sorted({str(v) for v in values if list(values).count(v) > 1})
            if repeated:
                raise AttnprobeError(f"{option} lists {', '.join(repeated)} twice; give each once")
        if self.circuit_grain not in ("parts", "edges"):
            raise AttnprobeError(f"--circuit-grain {self.circuit_grain!r}: give parts or edges")
        if not self.mlp_ranks or not all(1 <= r <= MAX_RANK for r in self.mlp_ranks):
            raise AttnprobeError(
                f"--mlp-ranks {self.mlp_ranks!r}: give whole numbers from 1 to {MAX_RANK}, e.g. 1,8"
            )
        if tuple(self.mlp_ranks) != (1,):  # a rank is of the edits of several layers: asking for it asks them
            object.__setattr__(self, "mlp_layers", True)
        if not self.ks or min(self.ks) < 1:
            raise AttnprobeError("k must be whole numbers of heads >= 1, e.g. --k 1,2,5,10,20")
        if not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise AttnprobeError(f"--seed {self.seed!r}: give a whole number from 0 to 2**63 - 1")
        if (
            not (isinstance(self.factor, (int, float)) and math.isfinite(self.factor))
            or abs(self.factor) > 100
        ):
            raise AttnprobeError(
                f"--factor {self.factor!r}: the scale edit's factor must be a finite number between -100 and "
                "100 (0 zeroes the heads, 1 leaves them, 0.5 halves them)"
            )


@dataclass(frozen=True)
class Sweep:
    """One `attnprobe edit`, built once and handed to its parts: the run directory and manifest, the
    model and its weights' content hash, the recorded inputs (edits.inputs.Inputs), the options and
    the log."""

    directory: Path
    manifest: object
    model: object
    weights: str
    inputs: object
    options: EditOptions
    log: Callable[[str], None] = field(default=lambda m: None)

    @property
    def n_heads(self) -> int:
        return self.manifest.model.n_heads


def settings_hash(run_fingerprint: str, options: EditOptions, weights: str, control: str = "") -> str:
    """What determines an edit kind's values: the run, the options (but the lists of kinds and MLP modes:
    adding a kind to a sweep keeps the kinds already measured; and --alone, --placebo and the analyses, which
    have parts of their own), the model's weights, this attnprobe's version, how the neutral texts are
    sampled, the control prompts measured (`control`: their tokens, the file's and those put in the
    templates) and the part of --text that is read."""
    own_files = ("kinds", "alone", "placebo", "stream", "mlp", "mlp_layers", "trace", "paths", "circuits")
    own_files += ("circuit_grain", "mlp_modes", "mlp_ranks")
    settings = {k: v for k, v in asdict(options).items() if k not in own_files}
    payload = json.dumps(
        {
            "run": run_fingerprint,
            "weights": weights,
            "attnprobe": __version__,
            "texts": "batched",
            "readout": "trained on rows the edit was not fitted on",  # sweep.erased, since round 6
            "crossing": "judged by the other half's fit wherever its words are",  # edits.inputs
            "control": hashlib.sha256(control.encode()).hexdigest(),
            **settings,
        },
        sort_keys=True,
        default=str,
    )
    if options.text:
        payload += hashlib.sha256(text_head(options.text)).hexdigest()
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def listed_heads(options: EditOptions, n_layers: int, n_heads: int) -> Heads | None:
    if options.heads is None:
        if max(options.ks) >= n_layers * n_heads:
            raise AttnprobeError(
                f"k {max(options.ks)} leaves none of this model's {n_layers * n_heads} heads ({n_layers} "
                f"layers x {n_heads}) to compare with as random sets; choose k < {n_layers * n_heads}"
            )
        return None
    return parse_heads(options.heads, n_layers, n_heads)
