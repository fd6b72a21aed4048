"""attnprobe: attention extraction, from-scratch verification and bias probing for causal LMs."""

from . import capture
from .capture import Captured, encode, run_with_capture
from .errors import AttnprobeError
from .models import DEFAULT_MODEL, ModelInfo, ProbeModel, load_model

__all__ = [
    "AttnprobeError",
    "Captured",
    "DEFAULT_MODEL",
    "ModelInfo",
    "ProbeModel",
    "capture",
    "encode",
    "load_model",
    "run_with_capture",
]
