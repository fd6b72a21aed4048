"""Saved edits: one fitted edit as NAME.safetensors (its parameters) beside NAME.json (what it is
and where it came from), written by `attnprobe edit`, applied by `attnprobe run --edit FILE`,
`attnprobe.load_edit` and `attnprobe.edited`.

Each kind says what it stores (`stored`) and how it is rebuilt (`restored`): a head edit stores
each tensor parameter (L, H, ...) only for its heads, as (k, ...), row i for the i-th head of
`heads`, and is rebuilt with the rows back in zeros of the model's (L, H, ...) (the other heads are
never read); a stream edit (edits.layers.stream) stores its layer and its (E,) parameters, an MLP edit
(edits.layers.mlp) also its mode. Scalar
parameters (a factor, a seed) are in the JSON. The JSON also records the model the edit was fitted
on (spec, layers, heads, head size, width, weights' content hash), the run, suite and items it was
fitted on, and the SHA-256 of the tensor file, so a damaged, truncated or swapped file is refused.
"""

from __future__ import annotations

import hashlib
import json
import math
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import AttnprobeError
from ..model import head_shape
from ..model.bundled import files_sha256
from ..run.files.layout import content_sha
from ..store import atomic_write
from .kinds import KINDS as HEAD_KINDS
from .kinds import HeadEdit, Mean
from .layers.mlp import MlpEdit
from .layers.several import MlpLayers, StreamLayers
from .layers.stream import StreamEdit


def saved_kinds() -> dict:
    """What a saved file may hold: every registered head kind (KINDS, at the time of reading), the
    stream, an MLP output, the MLP outputs or the stream of several layers, a circuit knocked out."""
    return {
        **HEAD_KINDS,
        StreamEdit.kind: StreamEdit,
        MlpEdit.kind: MlpEdit,
        MlpLayers.kind: MlpLayers,
        StreamLayers.kind: StreamLayers,
        CircuitKnockout.kind: CircuitKnockout,
    }


@dataclass(frozen=True)
class CircuitKnockout:
    """A circuit of heads and MLPs knocked out (`attnprobe edit --circuits`): at every position its
    heads' outputs (a Mean head edit) and its MLPs' (mean MLP edits) replaced by their mean over the
    tokens of the reference prompts, the mean ablation a knockout applies where no counterfactual of
    each prompt is at hand. Either part may be None."""

    kind: ClassVar[str] = "circuit_knockout"
    OPTIONAL: ClassVar[tuple] = ("heads", "mlps")
    heads: Mean | None = None
    mlps: MlpLayers | None = None

    @property
    def parts(self) -> tuple:
        return tuple(part for part in (self.heads, self.mlps) if part is not None)

    def sites(self) -> str:
        heads = [self.heads.sites()] if self.heads else []
        return ", ".join(heads + [f"MLP{part.layer}" for part in (self.mlps.parts if self.mlps else ())])

    @contextmanager
    def applied(self, model):
        with ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.applied(model))
            yield

    def stored(self) -> tuple[dict, dict, dict]:
        tensors, where = {}, {}
        for prefix, part in (("heads", self.heads), ("mlps", self.mlps)):
            if part is not None:
                own, _, at = part.stored()
                tensors.update({f"{prefix}.{name}": t for name, t in own.items()})
                where.update({key: at[key] for key in ("heads", "layers") if key in at})
        return tensors, {}, where

    @classmethod
    def restored(cls, record: dict, tensors: dict) -> CircuitKnockout:
        own = lambda prefix: {k.split(".", 1)[1]: t for k, t in tensors.items() if k.startswith(prefix + ".")}
        if not all(k.startswith(("heads.", "mlps.")) for k in tensors):
            raise ValueError("a circuit knockout holds heads.* and mlps.* tensors only")
        heads = Mean.restored({**record, "parameters": {}}, own("heads")) if "heads" in record else None
        layers = {**record, "mode": "mean", "fitted_at": "last"}
        mlps = MlpLayers.restored(layers, own("mlps")) if "layers" in record else None
        if heads is None and mlps is None:
            raise ValueError("a circuit knockout names heads, MLP layers or both")
        return cls(heads, mlps)


FORMAT = "attnprobe-edit"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class SavedEdit:
    """A fitted edit and its record (the JSON's content); `applied(model)` checks and applies it."""

    edit: HeadEdit | StreamEdit  # or an MlpEdit, a StreamEdit of another site
    record: dict
    path: Path

    @property
    def name(self) -> str:
        return self.path.stem

    @property
    def key(self) -> str:
        """What the edit does, as one hash: its kind, sites, parameters and its tensors' SHA-256 (not
        where it came from). Zero and scale edits store no tensors, so the tensors' hash alone would
        give every one of them the same key."""
        what = {key: value for key, value in self.record.items() if key not in ("source", "model")}
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()

    def check_shape(self, config, spec: str) -> None:
        """Refuse, in one line, a model (its config) whose layers, heads, head size or width differ
        from the ones the edit was fitted on (the weights may differ: another checkpoint of the same
        architecture)."""
        fitted = self.record["model"]
        found = model_shape(config)
        if any(fitted.get(key) is not None and fitted[key] != found[key] for key in found):
            raise AttnprobeError(
                f"{self.path}: this edit was fitted on {fitted['spec']} ({_shape_text(fitted)}) and "
                f"{spec} has {_shape_text(found)}; apply it to a model of the same shape"
            )

    def applied(self, model):
        """The edit applied to every pass of `model` (a ProbeModel) within the block, once the
        model is checked to have its shape."""
        self.check_shape(model.model.config, model.info.spec)
        return self.edit.applied(model)

    def manifest(self, weights: str | None = None) -> dict:
        """What a run records of an edit it applied (`weights`: the run model's content hash)."""
        out = {
            "file": str(self.path),
            "name": self.name,
            "kind": self.edit.kind,
            "heads": self.edit.sites(),
            "sha256": self.record["sha256"],
            "key": self.key,
            "source": self.record.get("source", {}),
            "fitted_on_model": self.record["model"].get("spec"),
        }
        fitted = self.record["model"].get("weights_content")
        out["same_weights"] = None if not (fitted and weights) else fitted == weights
        return out


def model_shape(config) -> dict:
    """What a saved edit must fit: layers, heads per layer, head size and width of a config."""
    n_layers, n_heads, head_dim = head_shape(config)
    return {
        "n_layers": n_layers,
        "n_heads": n_heads,
        "head_dim": head_dim,
        "hidden_size": config.get_text_config().hidden_size,
    }


def _shape_text(shape: dict) -> str:
    width = f", width {shape['hidden_size']}" if shape.get("hidden_size") else ""
    return f"{shape['n_layers']} layers x {shape['n_heads']} heads of size {shape['head_dim']}{width}"


def save_edit(edit, path: str | Path, model, source: dict, weights: str | None = None) -> Path:
    """Write `edit` (a head or stream edit fitted for `model`, a ProbeModel) to PATH.safetensors +
    PATH.json; `source` says where it came from (run, suite, the items it was fitted and chosen on);
    `weights`: the model's content hash when the caller has it (computed otherwise)."""
    path = Path(path).with_suffix("")
    tensors, scalars, where = edit.stored()
    tensor_path = path.with_name(path.name + ".safetensors")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(tensor_path, lambda p: save_file(tensors, str(p), metadata={"format": FORMAT}))
    record = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": edit.kind,
        **where,
        "parameters": scalars,
        "tensors": sorted(tensors),
        "model": {
            "spec": model.info.spec,
            **model_shape(model.model.config),
            "weights_content": weights or content_sha(model.model),
        },
        "source": source,
        "sha256": files_sha256([tensor_path]),
    }
    json_path = path.with_name(path.name + ".json")
    atomic_write(json_path, lambda p: p.write_text(json.dumps(record, indent=2, default=str) + "\n"))
    return json_path


def _refuse_non_finite(json_path: Path, parameters, tensors: dict) -> None:
    """An edit whose numbers are NaN or infinite would write them into every forward pass and give
    tables of NaN (or of noise) with exit code 0: refused before it is ever applied."""
    bad = [name for name, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if isinstance(parameters, dict):
        bad += [name for name, v in parameters.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise AttnprobeError(
            f"{json_path}: {', '.join(sorted(bad))} not finite (NaN or infinite); fit the edit again with "
            "`attnprobe edit`"
        )


def load_edit(path: str | Path) -> SavedEdit:
    """The edit saved at `path` (NAME.json, NAME.safetensors or NAME); a missing, damaged,
    truncated or unknown file is one AttnprobeError naming it and the fix."""
    if not isinstance(path, (str, Path)) or not str(path):
        raise AttnprobeError(
            f"load_edit({path!r}): give the path of a saved edit, e.g. RUN_DIR/edits/leace-k5.json"
        )
    path = Path(path)
    stem = path.with_suffix("") if path.suffix in (".json", ".safetensors") else path
    json_path, tensor_path = (stem.with_name(stem.name + s) for s in (".json", ".safetensors"))
    for file in (json_path, tensor_path):
        if not file.is_file():
            raise AttnprobeError(
                f"{path}: no edit file {file.name} there; an edit is NAME.json with NAME.safetensors "
                "beside it, as `attnprobe edit` writes them into RUN_DIR/edits/"
            )
    record = _record(json_path)
    if record.get("format") != FORMAT:
        raise AttnprobeError(f'{json_path}: not an attnprobe edit (no "format": "{FORMAT}")')
    version = record.get("format_version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise AttnprobeError(
            f"{json_path}: format_version {version!r} is not a whole number; rerun `attnprobe edit`"
        )
    if version > FORMAT_VERSION:
        raise AttnprobeError(
            f"{json_path}: written by a newer attnprobe (edit format {record['format_version']}, this "
            f"version reads {FORMAT_VERSION}); upgrade attnprobe"
        )
    kind = record.get("kind")
    kinds = saved_kinds()
    if not isinstance(kind, str) or kind not in kinds:
        raise AttnprobeError(
            f"{json_path}: edit kind {kind!r} is not one this attnprobe knows ({', '.join(kinds)}); "
            "upgrade attnprobe or fit the edit again"
        )
    if files_sha256([tensor_path]) != record.get("sha256"):  # read in blocks: memory stays flat
        raise AttnprobeError(
            f"{tensor_path}: damaged or truncated (its SHA-256 is not the one {json_path.name} records); "
            "copy both files again or rerun `attnprobe edit`"
        )
    try:
        tensors = load_file(str(tensor_path))
        _refuse_non_finite(json_path, record.get("parameters"), tensors)
        edit = kinds[kind].restored(record, tensors)
    except (
        SafetensorError,
        KeyError,
        TypeError,
        ValueError,
        IndexError,
        AttributeError,
        AttnprobeError,
    ) as exc:
        raise AttnprobeError(
            f"{json_path}: the edit cannot be read ({exc}); rerun `attnprobe edit`"
        ) from None
    return SavedEdit(edit, record, json_path)


def _record(json_path: Path) -> dict:
    """An edit's JSON record with a model of a plausible shape, or one line saying it is not one."""
    try:
        record = json.loads(json_path.read_text())
        if not isinstance(record, dict) or not isinstance(record.get("model"), dict):
            raise ValueError("not a JSON object with a model")
        shape = {key: record["model"].get(key) for key in ("n_layers", "n_heads", "head_dim")}
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 2**16 for v in shape.values()):
            raise ValueError(f"the model's shape {shape} is not three whole numbers up to 65,536")
        if shape["n_layers"] * shape["n_heads"] > 2**20:  # the edit's tensors are allocated at that size
            raise ValueError(f"the model's shape {shape} holds more heads than any model (1,048,576)")
        if not isinstance(record["model"].get("hidden_size", 0), (int, type(None))):
            raise ValueError("the model's hidden_size is not a whole number")
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise AttnprobeError(
            f"{json_path}: not an edit record ({exc}); write it again with `attnprobe edit`"
        ) from None
    return record
