"""attnprobe: attention extraction, from-scratch verification and bias probing for causal LMs."""

__version__ = "0.1.0"

from . import capture  # registers the "attnprobe" attention function with transformers
from .capture import Captured, encode, run_with_capture
from .errors import AttnprobeError
from .models import DEFAULT_MODEL, ModelInfo, ProbeModel, load_model
from .runner import Run, run_suite
from .suite import Suite, load_suite
from .verify import verify
from .views import head_view

__all__ = [
    "AttnprobeError",
    "Captured",
    "DEFAULT_MODEL",
    "ModelInfo",
    "ProbeModel",
    "Run",
    "Suite",
    "capture",
    "encode",
    "head_view",
    "load_model",
    "load_suite",
    "run_suite",
    "run_with_capture",
    "verify",
]
