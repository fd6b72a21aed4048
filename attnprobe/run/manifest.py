"""The manifest a run writes (manifest.json): what was run, on what, how, and how it ended.

It carries a format number: a run directory written with another format is refused in one line by
everything that reads it (resume, report, merge, the notebook), never half-read. The settings that
change what is computed form the fingerprint a resumed run or a shard must share (plan.RunPlan).
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..errors import RunError
from ..version import __version__

FORMAT = 2  # 1: the unnumbered manifests of 0.1 (chunk markers without plans, no scored-continuation chunks)


def new_manifest(plan, pm, options, weights_sha: str | None, weights_content: str) -> dict:
    """The manifest of a run starting now (status running). `weights_sha`: of the files the weights
    came from; `weights_content`: of the weights in memory (what `attnprobe edit` checks)."""
    suite, info = plan.suite, pm.info
    return {
        "format": FORMAT,
        "fingerprint": plan.fingerprint,
        "status": "running",
        "shard": list(options.shard) if options.shard else None,
        "suite": {
            "name": suite.name,
            "path": suite.path,
            "sha256": suite.sha256,
            "description": suite.description,
            "contrast": suite.contrast,
            "templates": {t.id: t.text for t in suite.templates},
            "data_roots": [str(Path(r).expanduser().resolve()) for r in options.data_roots],
        },
        "analysis": suite.analysis.to_dict(),
        "model": {
            "spec": plan.spec,
            "name": plan.name,
            "family": info.family,
            "weights_sha256": weights_sha,
            "weights_content": weights_content,
            "n_layers": info.n_layers,
            "n_heads": info.n_heads,
            "n_kv_heads": info.n_kv_heads,
            # what RunFiles.reopen reloads it from anywhere: a local path resolved, else the spec; and how
            # it was loaded (a reopened run never turns on remote code or pickles from these)
            "source": str(Path(plan.spec).resolve()) if Path(plan.spec).exists() else plan.spec,
            "trust_remote_code": options.trust_remote_code,
            "allow_pickle": options.allow_pickle,
        },
        "edits": [edit.manifest(weights_content) for edit in options.edits],  # applied to every pass
        "dtype": str(pm.dtype).removeprefix("torch."),
        "seed": 0,  # nothing in a run is random; statistics that resample say what they used
        "settings": plan.settings,
        "versions": versions(),
        "n_prompts": len(plan.encoded),
        "n_chunks": len(plan.chunks),
        "prefix_sharing": plan.sharing,
        "skipped": list(suite.skipped),
        "notes": plan.notes,
        **{
            key: value
            for kind, declared, part in plan.kinds()
            for key, value in kind.manifest(declared, part).items()
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def check_format(manifest: dict, where) -> None:
    """Refuse, in one line, a manifest of another format."""
    found = manifest.get("format", 1)
    if found != FORMAT:
        made = manifest.get("settings", {}).get("attnprobe", "an earlier attnprobe")
        raise RunError(
            f"{where} was made by attnprobe {made} (run format {found}); this attnprobe {__version__} reads "
            f"format {FORMAT}: rerun the suite with `attnprobe run --fresh` into this directory or another"
        )


def versions() -> dict:
    import transformers

    return {
        "attnprobe": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "pandas": pd.__version__,
        "numpy": np.__version__,
    }
