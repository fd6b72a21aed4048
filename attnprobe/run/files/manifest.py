"""The manifest a run writes (manifest.json): what was run, on what, how, and how it ended.

It carries a format number: a run directory written with another format is refused in one line by
everything that reads it (resume, report, merge, the notebook), never half-read. The settings that
change what is computed form the fingerprint a resumed run or a shard must share (plan.RunPlan).

`Manifest` is the one place its keys are named: every reader gets typed fields (`manifest.model.spec`,
`manifest.suite.sha256`, `manifest.n_prompts`); the entries a measure records (its `manifest()`)
are that measure's own, read with `manifest.entry(name)`. A field of the wrong type is one line
saying the manifest is damaged.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import RunError
from ...store import atomic_write
from ...version import __version__

FORMAT = 2  # 1: the unnumbered manifests of 0.1 (chunk markers without plans, no scored-continuation chunks)


@dataclass
class SuiteRecord:
    """The suite a run was made from, as it was then."""

    name: str | None = None
    path: str | None = None
    sha256: str | None = None
    description: str = ""
    contrast: str | None = None
    templates: dict = field(default_factory=dict)  # id -> text: the report shows them without the suite
    data_roots: list | None = None
    copy: str | None = None  # the run's own copy of the suite file, relative to the run directory


@dataclass
class ModelRecord:
    """The model a run was made on and how it was loaded."""

    spec: str | None = None
    name: str | None = None
    family: str | None = None
    weights_sha256: str | None = None  # of the files the weights came from
    weights_content: str | None = None  # of the weights in memory (what `attnprobe edit` checks)
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    # what RunFiles.reopen reloads it from anywhere: a local path resolved, else the spec; and how it
    # was loaded (a reopened run never turns on remote code or pickles from these)
    source: str | None = None
    trust_remote_code: bool = False
    allow_pickle: bool = False


@dataclass
class Manifest:
    """manifest.json, typed. Keys it does not name are measures' entries (`entries`), kept in order."""

    fingerprint: str
    settings: dict
    versions: dict
    format: int = FORMAT
    status: str = "running"
    shard: list | None = None  # [k, n] of `run --shard K/N`
    suite: SuiteRecord = field(default_factory=SuiteRecord)
    analysis: dict | None = None
    model: ModelRecord = field(default_factory=ModelRecord)
    edits: list = field(default_factory=list)  # saved edits applied to every pass
    dtype: str | None = None
    seed: int = 0  # nothing in a run is random; statistics that resample say what they used
    n_prompts: int | None = None
    n_chunks: int | None = None
    prefix_sharing: dict | None = None
    skipped: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    entries: dict = field(default_factory=dict)  # each measure's own keys (Measure.manifest)
    started: str | None = None
    prompt_phase: dict | None = None
    finished: str | None = None
    compute_seconds_this_session: float | None = None
    error: str | None = None
    interrupted: str | None = None
    merged_from: list | None = None

    def entry(self, name: str, default=None):
        """What a measure recorded under `name` (its Measure.manifest), or `default`."""
        return self.entries.get(name, default)

    def require(self, *dotted: str, where) -> None:
        """The fields a reader is about to use (dotted: "suite.sha256"), each set, or one line saying
        the manifest in `where` is damaged."""
        for name in dotted:
            value = self
            for part in name.split("."):
                value = getattr(value, part, None)
            if value is None:
                kind = _hint(name).__name__
                raise RunError(
                    f"{where}/manifest.json: {name} is missing or not a {kind}; the manifest is damaged: "
                    "rerun the run's command with --fresh"
                )

    def to_dict(self) -> dict:
        """The JSON object (fields left unset are left out, the measures' entries in their place)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "entries":
                out.update(value)
            elif dataclasses.is_dataclass(value):
                out[f.name] = dataclasses.asdict(value)
            elif value is not None or f.name in _ALWAYS:
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, raw: dict, where) -> Manifest:
        """The manifest of a parsed manifest.json in `where`; a field of the wrong type is one line."""
        known = {f.name for f in dataclasses.fields(cls)} - {"entries"}
        values = _typed(cls, {k: v for k, v in raw.items() if k in known - {"suite", "model"}}, where, "")
        values["suite"] = SuiteRecord(**_typed(SuiteRecord, raw.get("suite") or {}, where, "suite."))
        values["model"] = ModelRecord(**_typed(ModelRecord, raw.get("model") or {}, where, "model."))
        return cls(**values, entries={k: v for k, v in raw.items() if k not in known})

    def write(self, directory: Path) -> None:
        """manifest.json in `directory`, written atomically."""
        text = json.dumps(self.to_dict(), indent=1)
        atomic_write(directory / "manifest.json", lambda p: p.write_text(text))

    @classmethod
    def read(cls, path: Path, check: bool = True) -> Manifest:
        """An attnprobe manifest, or a RunError saying the file belongs to something else (or, with
        `check`, to another run format)."""
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise RunError(
                f"{path}: cannot read it as an attnprobe manifest ({exc}); choose another --out"
            ) from None
        if not isinstance(raw, dict) or not {"fingerprint", "settings", "versions"} <= set(raw):
            raise RunError(f"{path} was not written by attnprobe; nothing was deleted: choose another --out")
        if check:
            check_format(raw, path.parent)
        return cls.from_dict(raw, path.parent)


_ALWAYS = {"shard", "analysis", "dtype", "n_prompts", "n_chunks", "prefix_sharing", "started"}


def _hint(dotted: str):
    """The runtime type a dotted field holds (its annotation without None)."""
    owner, name = Manifest, dotted
    if "." in dotted:
        head, name = dotted.split(".", 1)
        owner = {"suite": SuiteRecord, "model": ModelRecord}[head]
    return _runtime(typing.get_type_hints(owner)[name])


def _runtime(hint):
    """The type an annotation asks for, None aside (`str | None` -> str)."""
    kinds = [k for k in typing.get_args(hint) if k is not type(None)] or [hint]
    return kinds[0]


def _typed(cls, raw: dict, where, prefix: str) -> dict:
    """`raw`'s values for the fields of `cls`, each None or of its declared type (an int stands for a
    float); anything else is one line naming the field."""
    if not isinstance(raw, dict):
        raise RunError(
            f"{where}/manifest.json: {prefix.rstrip('.')} is not an object; the manifest is damaged"
        )
    hints = typing.get_type_hints(cls)
    out = {}
    for name, value in raw.items():
        if name not in hints:
            continue  # a field a later attnprobe added: not read by this one
        kind = _runtime(hints[name])
        fits = isinstance(value, (int, float) if kind is float else kind) and not (
            kind is not bool and isinstance(value, bool) and kind in (int, float)
        )
        if value is not None and not fits:
            raise RunError(
                f"{where}/manifest.json: {prefix}{name} is missing or not a {kind.__name__}; the manifest "
                "is damaged: rerun the run's command with --fresh"
            )
        out[name] = value
    return out


def new_manifest(plan, pm, options, weights_sha: str | None, weights_content: str) -> Manifest:
    """The manifest of a run starting now (status running). `weights_sha`: of the files the weights
    came from; `weights_content`: of the weights in memory (what `attnprobe edit` checks)."""
    suite, info = plan.suite, pm.info
    return Manifest(
        fingerprint=plan.fingerprint,
        shard=list(options.shard) if options.shard else None,
        suite=SuiteRecord(
            name=suite.name,
            path=suite.path,
            sha256=suite.sha256,
            description=suite.description,
            contrast=suite.contrast,
            templates={t.id: t.text for t in suite.templates},
            data_roots=[str(Path(r).expanduser().resolve()) for r in options.data_roots],
        ),
        analysis=suite.analysis.to_dict(),
        model=ModelRecord(
            spec=plan.spec,
            name=plan.name,
            family=info.family,
            weights_sha256=weights_sha,
            weights_content=weights_content,
            n_layers=info.n_layers,
            n_heads=info.n_heads,
            n_kv_heads=info.n_kv_heads,
            source=str(Path(plan.spec).resolve()) if Path(plan.spec).exists() else plan.spec,
            trust_remote_code=options.trust_remote_code,
            allow_pickle=options.allow_pickle,
        ),
        edits=[edit.manifest(weights_content) for edit in options.edits],
        dtype=str(pm.dtype).removeprefix("torch."),
        settings=plan.settings,
        versions=versions(),
        n_prompts=len(plan.encoded),
        n_chunks=len(plan.chunks),
        prefix_sharing=plan.sharing,
        skipped=list(suite.skipped),
        notes=plan.notes,
        entries={
            key: value
            for kind, declared, part in plan.kinds()
            for key, value in kind.manifest(declared, part).items()
        },
        started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )


def check_format(raw: dict, where) -> None:
    """Refuse, in one line, a manifest of another format."""
    found = raw.get("format", 1)
    if found != FORMAT:
        made = (raw.get("settings") or {}).get("attnprobe", "an earlier attnprobe")
        raise RunError(
            f"{where} was made by attnprobe {made} (run format {found}); this attnprobe {__version__} reads "
            f"format {FORMAT}: rerun the suite with `attnprobe run --fresh` into this directory or another"
        )


def versions() -> dict:
    import numpy as np
    import pandas as pd
    import torch
    import transformers

    return {
        "attnprobe": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "pandas": pd.__version__,
        "numpy": np.__version__,
    }
