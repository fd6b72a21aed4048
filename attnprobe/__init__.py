"""attnprobe: attention extraction, from-scratch verification and bias probing for causal LMs."""

from . import model
from .edits import EditOptions, edited, load_edit
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
from .forward import capture  # registers the "attnprobe" attention function with transformers
from .forward.capture import Captured, encode, run_with_capture
from .heads import HeadSet
from .model import DEFAULT_MODEL, ModelInfo, ProbeModel, load_model
from .notebook.adhoc import probe, span_tokens, str_tokens
from .notebook.api import Run, merge_shards, run_suite
from .notebook.readout import linear_readout
from .notebook.views import attention_view, head_view, model_view
from .report.compare import compare_runs
from .suite import Suite, load_suite
from .verify import verify
from .version import __version__

model.register(  # pm.capture(texts), pm.edited(edit), pm.probe(sentences), pm.verify(), ...
    capture=capture.capture_texts,
    edited=edited,
    probe=probe,
    str_tokens=str_tokens,
    span_tokens=span_tokens,
    verify=verify,
    head_view=head_view,
    model_view=model_view,
)

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
    "compare_runs",
    "edited",
    "edits",
    "encode",
    "head_view",
    "linear_readout",
    "load_edit",
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
