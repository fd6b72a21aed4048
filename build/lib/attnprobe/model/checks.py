"""Checks made before any weights load: the device exists, the config has layers and heads, a GGUF
file is one, the checkpoint runs no code of its own unless asked; and how a loader's exception becomes one
line."""

from __future__ import annotations

import functools
import json
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch

from ..errors import ModelSpecError


def refuse_remote_code(source: str, local: bool, trust_remote_code: bool) -> None:
    """A local checkpoint whose config maps to its own Python files runs that code when loaded."""
    config = Path(source) / "config.json"
    if trust_remote_code or not local or not config.is_file():
        return
    try:
        auto_map = json.loads(config.read_text()).get("auto_map")
    except (ValueError, AttributeError):
        raise ModelSpecError(f"{config} is not a valid JSON object; fix or replace the checkpoint") from None
    if auto_map:
        raise ModelSpecError(
            f"{source} ships its own model code ({', '.join(sorted(auto_map))} in config.json auto_map); "
            "rerun with --trust-remote-code only if you trust it"
        )


def check_device(device: str) -> None:
    """Refuse a device string torch does not know, or a device this machine does not have."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelSpecError(
            f"--device '{device}' is not a torch device; use cpu, cuda, cuda:N or mps"
        ) from None
    available = {
        "cpu": lambda: True,
        "meta": lambda: True,
        "cuda": lambda: torch.cuda.is_available() and (parsed.index or 0) < torch.cuda.device_count(),
        "mps": lambda: torch.backends.mps.is_available(),
    }
    if not available.get(parsed.type, lambda: False)():
        raise ModelSpecError(f"--device '{device}' is not available on this machine; use --device cpu")


def check_shape(config, spec: str) -> None:
    """A config with no layers or no heads loads, but there is no attention to probe."""
    text = config.get_text_config()
    for key in ("num_hidden_layers", "num_attention_heads"):
        value = getattr(text, key, None)
        if isinstance(value, int) and value < 1:
            raise ModelSpecError(
                f"'{spec}': config.json sets {key} = {value}; a model to probe needs at least one"
            )


def check_vocabulary(tokenizer, model, spec: str) -> None:
    """A tokenizer with ids beyond the embedding table would fail on the first such token."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise ModelSpecError(
            f"'{spec}': the tokenizer has {len(tokenizer)} tokens but the model embeds only {rows}; "
            "the tokenizer files belong to another model, replace them"
        )


def check_gguf(path: Path) -> None:
    """Refuse a file that is not GGUF before the (slow) converter reads it."""
    with open(path, "rb") as handle:
        if handle.read(4) != b"GGUF":
            raise ModelSpecError(
                f"{path} is not a GGUF file (it does not start with the bytes 'GGUF'); "
                "give a .gguf model file or a checkpoint directory"
            )


@functools.cache
def hub_unreachable(timeout: float = 3.0) -> bool:
    """No connection to the hub opens within `timeout` seconds (asked once per process): without
    this check transformers retries for about a minute before failing."""
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return False
    except OSError:
        return True


def hub_offline_reason() -> str | None:
    """Why only the local cache of the hub can be read (None when the hub is reachable)."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return "HF_HUB_OFFLINE is set"
    return "the hub is unreachable from this machine" if hub_unreachable() else None


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else type(exc).__name__
