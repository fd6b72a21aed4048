"""attnprobe: attention extraction, from-scratch verification and bias probing for causal LMs."""

from . import capture  # registers the "attnprobe" attention function with transformers
from .adhoc import probe, span_tokens, str_tokens
from .api import Run, merge_shards, run_suite
from .capture import Captured, encode, run_with_capture
from .edits import EditOptions, edited
from .errors import (
    AnalysisError,
    AttnprobeError,
    CaptureError,
    ModelSpecError,
    RunError,
    RunInterrupted,
    SuiteError,
    UnsupportedFamily,
)
from .heads import HeadSet
from .models import DEFAULT_MODEL, ModelInfo, ProbeModel, load_model
from .readout import linear_readout
from .suite import Suite, load_suite
from .verify import verify
from .version import __version__
from .views import attention_view, head_view, model_view

__all__ = [
    "AnalysisError",
    "AttnprobeError",
    "CaptureError",
    "Captured",
    "DEFAULT_MODEL",
    "EditOptions",
    "HeadSet",
    "ModelInfo",
    "ModelSpecError",
    "ProbeModel",
    "Run",
    "RunError",
    "RunInterrupted",
    "Suite",
    "SuiteError",
    "UnsupportedFamily",
    "__version__",
    "attention_view",
    "capture",
    "edited",
    "edits",
    "encode",
    "head_view",
    "linear_readout",
    "load_model",
    "load_suite",
    "merge_shards",
    "model_view",
    "probe",
    "run_suite",
    "run_with_capture",
    "span_tokens",
    "str_tokens",
    "verify",
]
