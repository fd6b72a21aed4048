"""What `attnprobe edit` and `Run.edit` are asked (EditOptions, checked when made), the context of
one sweep (Sweep), the heads a user lists, the hash of the settings that determine an edit kind's
values (its chunk's key), and the run and options checked before any weights load."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ...defaults import (
    DEFAULT_EDIT_COUNTS,
    DEFAULT_EDIT_K,
    DEFAULT_EDIT_KINDS,
    MAX_EDIT_COUNTS,
    MIN_EDIT_COUNTS,
)
from ...errors import AttnprobeError, RunError
from ...measures.head_effects import EffectsRecord, SlotSwap, per_value_column
from ...model import refuse_random
from ...run.files.reader import RunFiles
from ...version import __version__
from ..inputs import check_text, text_head
from ..kinds import KINDS, Heads, parse_heads
from ..layers.mlp import MODES as MLP_MODES
from ..layers.mlp import Recorded
from ..layers.modes import SITE_MODES
from ..layers.several import LAYERS_MODES, MAX_RANK
from ..layers.stream import STREAM_MODE
from ..sequential import HeadFit, sequential_kinds

DEFAULT_KINDS, DEFAULT_K = DEFAULT_EDIT_KINDS, DEFAULT_EDIT_K
# the options that are lists: (the type of each entry, what they are, what a wrongly typed list is shown)
LISTS = {
    "kinds": (str, "kind names", "('zero', 'leace')"),
    "ks": (int, "whole numbers", "(1, 5)"),
    "mlp_modes": (str, "mode names", "('mean', 'leace')"),
    "mlp_ranks": (int, "whole numbers", "(1, 8)"),
    "mlp_layer_modes": (str, "mode names", "('project', 'leace')"),
    "stream_layer_modes": (str, "mode names", "('leace', 'leace_mid')"),
}

# the lists that say what a per-layer edit measures, and the option each asks for (given, it is set)
IMPLIES = {
    "mlp_modes": "mlp",
    "mlp_ranks": "mlp_layers",
    "mlp_layer_modes": "mlp_layers",
    "stream_layer_modes": "stream_layers",
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
    sequential: bool = False  # also each kind's heads fitted in order, layer by layer (edits.sequential)
    stream: bool = False  # also the stream erased at every layer (edits_stream, edits.layers.stream)
    stream_layers: bool = False  # also the stream erased entering several consecutive layers at once
    stream_layer_modes: tuple[str, ...] = (STREAM_MODE,)  # the modes --stream-layers measures
    mlp: bool = False  # also each MLP's output edited at every layer (edits_mlp, edits.layers.mlp)
    mlp_modes: tuple[str, ...] = MLP_MODES  # the modes --mlp measures (edits.layers.modes)
    mlp_layers: bool = False  # also several consecutive MLP outputs edited at once (DAMA's design; edits_mlp)
    mlp_ranks: tuple[int, ...] = (1,)  # the directions per layer project and dual remove there (1 to 64)
    mlp_layer_modes: tuple[str, ...] = LAYERS_MODES  # the modes --mlp-layers measures (edits.layers.modes)
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
        named = (
            (self.kinds, KINDS, "edit kind", "kinds"),
            (self.mlp_modes, SITE_MODES, "MLP mode", "modes"),
            (self.mlp_layer_modes, SITE_MODES, "MLP mode", "modes"),
            (self.stream_layer_modes, SITE_MODES, "stream mode", "modes"),
        )
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
            ("--mlp-layer-modes", self.mlp_layer_modes),
            ("--stream-layer-modes", self.stream_layer_modes),
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
        defaults = {f.name: f.default for f in fields(self)}
        for name, flag in IMPLIES.items():  # a list of modes or ranks other than the default asks for them
            if tuple(getattr(self, name)) != defaults[name]:
                object.__setattr__(self, flag, True)
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


def head_kinds(options: EditOptions) -> tuple[str, ...]:
    """The raw head kinds a sweep measures: --kinds, and with --sequential each one's twin fitted in
    order (KIND-seq) where its parameters are fitted."""
    return tuple(options.kinds) + (sequential_kinds(options.kinds) if options.sequential else ())


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
    fits: dict = field(default_factory=dict, repr=False)  # raw head kind -> its HeadFit
    outputs: dict = field(default_factory=dict, repr=False)  # position -> its recorded MLP outputs

    @property
    def n_heads(self) -> int:
        return self.manifest.model.n_heads

    def head_fit(self, kind: str) -> HeadFit:
        """The fit of a raw head kind, one per sweep: its measures and its saved edits share fits."""
        if kind not in self.fits:
            self.fits[kind] = HeadFit(kind, self.options, self.model.model)
        return self.fits[kind]

    def recorded(self, at: str) -> Recorded:
        """The MLP outputs where the edits fitted `at` ("last", "slot") are fitted, one per sweep and
        recorded on first use: its measures and its saved edits share them."""
        if at not in self.outputs:
            self.outputs[at] = Recorded(self.model.model, self.inputs, at)
        return self.outputs[at]


def settings_hash(run_fingerprint: str, options: EditOptions, weights: str, control: str = "") -> str:
    """What determines an edit kind's values: the run, the options (but the lists of kinds and MLP modes:
    adding a kind to a sweep keeps the kinds already measured; and --alone, --placebo and the analyses, which
    have parts of their own), the model's weights, this attnprobe's version, how the neutral texts are
    sampled, the control prompts measured (`control`: their tokens, the file's and those put in the
    templates) and the part of --text that is read."""
    own_files = ("kinds", "alone", "placebo", "stream", "mlp", "mlp_layers", "trace", "paths", "circuits")
    own_files += ("circuit_grain", "mlp_modes", "mlp_ranks", "mlp_layer_modes", "stream_layers", "sequential")
    own_files += ("stream_layer_modes",)
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


def checked_options(options: EditOptions, manifest, suite) -> tuple:
    """What the sweep needs from its options, checked before any weights load: the listed heads (or
    None) and the reference word; a bad head, k, --text or reference is one AttnprobeError."""
    if not manifest.model.weights_content:
        raise RunError(
            f"this run's manifest.json records no content hash of its model's weights "
            f"(model.weights_content), so `attnprobe edit` cannot tell whether {manifest.model.spec} still "
            "holds the weights the run was made with; run the suite again (run --fresh) and edit that run"
        )
    listed = listed_heads(options, manifest.model.n_layers, manifest.model.n_heads)
    check_text(options.text)
    words = suite.head_effects.replacements
    literal = [w for w in words if per_value_column(w) is None]  # the reference is one word for all items
    word = options.reference or (literal or words)[-1]
    if word not in words:
        raise RunError(
            f"--reference {word!r} is not one of the run's counterfactual words: {', '.join(words)}"
        )
    return listed, word


def run_and_suite(directory: Path):
    """The run `attnprobe edit` reads and its suite, refused in one line where no edit can be measured
    on it (edited, no head effects, no control or covariate, a degenerate design)."""
    run = RunFiles(directory)
    run.require("model.spec", "model.n_layers", "model.n_heads", "dtype")
    run.require_complete()
    m = run.manifest
    refuse_random(m.model.spec, "attnprobe edit")
    if m.edits:
        names = ", ".join(e["name"] for e in m.edits)
        raise RunError(
            f"{directory}: this run was made with the edit(s) {names} applied; `attnprobe edit` fits edits "
            "of the unedited model: give it a run made without --edit"
        )
    if EffectsRecord.of(m) is None or not run.has("head_effects"):
        raise RunError(
            f"{directory}: this run has no head effects, the behaviour and head ranking edits are "
            "measured with; add `head_effects:` (with a next_token cut) to the suite and rerun it"
        )
    reopened = run.reopen()  # the run's own copy of its suite, wherever the run now is
    suite, path = reopened.suite, Path(m.suite.path)  # messages name the suite the user wrote
    if not isinstance(suite.head_effects, SlotSwap):
        raise RunError(f"{path}: edits measure a next-token behaviour; its head_effects use sentence pairs")
    if suite.control is None:
        raise RunError(
            f"{path}: edits check that definitional words stay right (the control); declare them in "
            'the suite: control: {file: definitional.tsv, words: {<positive>: " word", <negative>: " word"}}'
        )
    if not suite.head_effects.covariate:
        raise RunError(
            f"{path}: edits measure the gradient of the behaviour over the suite's covariate, and this "
            "suite declares none; add `analysis: {covariate: slot.field}` and rerun the suite"
        )
    _refuse_degenerate(path, run, suite)
    return run, reopened


MIN_UNITS = 2  # edits are fitted on one half of the units and measured on the other: one unit each at least


def _refuse_degenerate(path: Path, run, suite) -> None:
    """A design the edits cannot measure, refused in one line before the model loads (from the run's
    own tables): too few units with a covariate value, a covariate equal for every unit, or scored
    outputs equal for every prompt (a share removed would be a ratio of rounding noise)."""
    name, unit, covariate = suite.analysis.name, suite.analysis.unit, suite.head_effects.covariate
    values = run.prompts.groupby(unit)[covariate].first().dropna()
    if len(values) < MIN_UNITS:
        raise RunError(
            f"{path}: edits are fitted on half of the {name(unit)}s and measured on the other half; this "
            f"run has {len(values)} {name(unit)}(s) with a value of {name(covariate)}: give the suite at "
            f"least {MIN_UNITS}"
        )
    if values.nunique() < 2:
        raise RunError(
            f"{path}: every {name(unit)} has the same {name(covariate)} ({values.iloc[0]:g}), so there is no "
            "gradient to remove; give the suite a covariate that varies across them"
        )
    ordered = values.sort_index(kind="stable").sort_values(kind="stable")  # as intervene.selection.folds
    halves = [ordered.iloc[h::2] for h in (0, 1)]
    if min(half.nunique() for half in halves) < 2:
        raise RunError(
            f"{path}: edits choose heads on one half of the {name(unit)}s and test them on the other, and "
            f"a half needs two different values of {name(covariate)} for a gradient; this run's halves "
            f"have {' and '.join(str(h.nunique()) for h in halves)}: give the suite at least 4 {name(unit)}s "
            "with different values"
        )
    spread = run.logprobs.groupby("candidate_label")["logprob"].agg(lambda v: v.max() - v.min())
    if len(spread) and spread.max() < 1e-6:  # float32 noise aside, the model says the same everywhere
        raise RunError(
            f"{run.directory}: the model scores every candidate the same in every prompt (spread "
            f"{spread.max():.1g} nats): its outputs do not vary, so no edit can change a gradient"
        )
