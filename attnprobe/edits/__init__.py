"""Head edits: remove or steer heads and measure the bias removed against what it costs.

kinds    Zero, Mean, Resample, Scale, Project, Orthogonal, Leace (one class each), `edited(model, *edits)`
editor   where in a pass a head edit acts (RowEditor; an edit at the prediction alone, where a pass reads it)
sequential  heads at several layers fitted in order, each layer's on the model edited below it (--sequential)
estimate the edits' parameters from recorded head outputs (means, banks, directions, erasers)
passes   batched edited forward passes (from the lowest edited layer)
sweep    the sweep of `attnprobe edit`: heads per fold, values per kind and k, the null's sets,
         each top head zeroed alone (edits_heads), the chosen edits applied to other suites (--also)
stream   StreamEdit: the covariate erased from the residual stream entering a layer (edits_stream)
mlp      MlpEdit: a layer's MLP output zeroed, replaced by its mean, projected or erased (edits_mlp)
command  `attnprobe edit RUN_DIR`: inputs, resume, tables, figure and the saved edits; it runs the
         analyses of attnprobe.analyses (paths, tracing, readout) on the same inputs
saved    a fitted edit as NAME.safetensors + NAME.json: `save_edit`, `load_edit`
"""

from .kinds import (
    KINDS,
    HeadEdit,
    Leace,
    Mean,
    Orthogonal,
    Project,
    Resample,
    Scale,
    Zero,
    edited,
    parse_heads,
)
from .layers.mlp import MlpEdit
from .layers.stream import StreamEdit
from .saved import SavedEdit, load_edit, save_edit
from .sweep.command import run_edits
from .sweep.options import EditOptions

__all__ = [
    "KINDS",
    "EditOptions",
    "HeadEdit",
    "Leace",
    "Mean",
    "MlpEdit",
    "Orthogonal",
    "Project",
    "Resample",
    "SavedEdit",
    "Scale",
    "StreamEdit",
    "Zero",
    "edited",
    "load_edit",
    "parse_heads",
    "run_edits",
    "save_edit",
]
