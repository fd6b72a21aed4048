"""Head edits: remove or steer heads and measure the bias removed against what it costs.

kinds    Zero, Mean, Resample, Scale, Project (one class each), `edited(model, edit)`
estimate the edits' parameters from recorded head outputs
passes   batched edited forward passes (from the lowest edited layer)
sweep    the sweep of `attnprobe edit`: heads per fold, values per kind and k
command  `attnprobe edit RUN_DIR`: inputs, resume, tables and figure
saved    a fitted edit as NAME.safetensors + NAME.json: `save_edit`, `load_edit`
"""

from .command import run_edits
from .kinds import KINDS, HeadEdit, Mean, Project, Resample, Scale, Zero, edited, parse_heads
from .saved import SavedEdit, load_edit, save_edit
from .sweep import EditOptions

__all__ = [
    "KINDS",
    "EditOptions",
    "HeadEdit",
    "Mean",
    "Project",
    "Resample",
    "SavedEdit",
    "Scale",
    "Zero",
    "edited",
    "load_edit",
    "parse_heads",
    "run_edits",
    "save_edit",
]
