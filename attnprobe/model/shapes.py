"""Models of real shapes without their weights: `random:NAME` (a shipped config) or `random:PATH` (a
directory holding a config.json, or the file itself), randomly initialised, for timing and memory only.

The shipped configs (model/configs/*.json, their sources in model/configs/SOURCES.md) are the published
config.json facts of Llama 3.2 1B, Llama 3.1 8B, Qwen 2.5 7B, Gemma 3 4B (its text model) and Llama 3.1
70B. The weights are random (seed 0; random_model says how they are drawn), so a run on them measures
speed and memory, never behaviour: every table of such a run describes noise, and its report says so.

Tokenizer: the directory's own where it holds one (a config and tokenizer fetched without weights),
else the bundled default model's (49,152 tokens, every id valid in every shipped vocabulary). Token
counts per prompt then differ from the real tokenizer's by a few percent on English text.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from ..defaults import DEFAULT_MODEL
from ..errors import ModelSpecError

PREFIX = "random:"
SHAPES = Path(__file__).parent / "configs"
SEED = 0


def is_random(spec) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def directory_name(spec: str) -> str:
    """`random-NAME` (a shipped shape) or `random-DIR` (the config's directory or file stem)."""
    path = Path(spec[len(PREFIX) :])
    if path.name == "config.json":
        return "random-" + (path.parent.name or "config")
    return "random-" + (path.stem if path.suffix == ".json" else path.name)


def refuse_random(spec: str, what: str) -> None:
    """Random weights serve timing and memory only: refuse what measures behaviour on them."""
    if is_random(spec):
        raise ModelSpecError(
            f"{what} measures what a model learned, and '{spec}' has random weights (for timing and memory "
            "only); run it on the model's real weights"
        )


def shipped() -> list[str]:
    """The names of the shipped shapes (`random:NAME`)."""
    return sorted(p.stem for p in SHAPES.glob("*.json"))


def shape_status() -> list[tuple[str, str]]:
    """(name, its layers and heads) of each shipped shape, read from its config.json."""
    rows = []
    for name in shipped():
        v = json.loads((SHAPES / f"{name}.json").read_text())
        layers, heads, kv = v["num_hidden_layers"], v["num_attention_heads"], v["num_key_value_heads"]
        rows.append((name, f"{v['model_type']}: {layers} layers, {heads} heads, {kv} kv heads"))
    return rows


def _source(spec: str) -> tuple[dict, Path | None]:
    """(config.json as a dict, the directory that may hold a tokenizer, or None)."""
    name = spec[len(PREFIX) :]
    path = Path(name).expanduser()
    if (SHAPES / f"{name}.json").is_file():
        file, folder = SHAPES / f"{name}.json", None
    elif path.is_dir() and (path / "config.json").is_file():
        file, folder = path / "config.json", path
    elif path.is_file():
        file, folder = path, path.parent
    else:
        raise ModelSpecError(
            f"'{spec}': no shipped shape or config.json of that name; use random:NAME with NAME one of "
            f"{', '.join(shipped())}, or random:PATH to a config.json or a directory holding one"
        )
    try:
        values = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelSpecError(
            f"'{spec}': {file} is not a readable JSON file ({exc}); fix or replace it"
        ) from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise ModelSpecError(f"'{spec}': {file} has no model_type; give a transformers config.json")
    check_values(values, f"'{spec}'" if folder is None else str(file))
    return values, folder


# The sizes a config may give, as (smallest, largest) whole numbers: each bound is above every
# published causal LM (126 layers, width 25,600, 262,144 tokens, 10 M positions) and keeps a model
# built on the meta device (check's parameter count) under a second. None allowed where transformers
# derives the value (key/value heads, head width, MLP width of GPT-2, no sliding window).
SIZES = {
    "num_hidden_layers": (1, 1024),
    "n_layer": (1, 1024),
    "num_layers": (1, 1024),
    "hidden_size": (1, 1 << 17),
    "n_embd": (1, 1 << 17),
    "d_model": (1, 1 << 17),
    "num_attention_heads": (1, 4096),
    "n_head": (1, 4096),
    "num_key_value_heads": (1, 4096),
    "head_dim": (1, 1 << 14),
    "intermediate_size": (1, 1 << 20),
    "n_inner": (1, 1 << 20),
    "ffn_dim": (1, 1 << 20),
    "vocab_size": (1, 1 << 23),
    "max_position_embeddings": (1, 1 << 24),
    "n_positions": (1, 1 << 24),
    "sliding_window": (1, 1 << 24),
}
DERIVED = {"num_key_value_heads", "head_dim", "n_inner", "sliding_window"}


def check_values(values: dict, where: str) -> None:
    """The config's sizes (and its text model's, for a multimodal config) checked for type and bounds
    before transformers or torch sees them: one ModelSpecError naming the field and what it takes."""
    if not isinstance(values.get("model_type"), str):
        raise ModelSpecError(f'{where}: model_type must be a name such as "llama"; fix it')
    _causal_family(values["model_type"], where)
    text = values.get("text_config")
    for part, name in ((values, ""), (text if isinstance(text, dict) else {}, "text_config.")):
        for key, (low, high) in SIZES.items():
            if key not in part or (part[key] is None and key in DERIVED):
                continue
            value = part[key]
            if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
                raise ModelSpecError(
                    f"{where}: {name}{key} is {json.dumps(value)[:40]}; it must be a whole number from "
                    f"{low:,} to {high:,}"
                )
        _heads_fit(part, where, name)


def _heads_fit(part: dict, where: str, name: str) -> None:
    """Query heads split the width (unless a head width is given), key/value heads the query heads."""
    heads = part.get("num_attention_heads", part.get("n_head"))
    width = part.get("hidden_size", part.get("n_embd"))
    kv = part.get("num_key_value_heads")
    if heads and width and part.get("head_dim") is None and width % heads:
        raise ModelSpecError(
            f"{where}: {name}hidden_size {width:,} is not divisible by {heads} attention heads; set "
            "head_dim or a head count that divides the width"
        )
    if heads and kv and heads % kv:
        raise ModelSpecError(
            f"{where}: {name}num_key_value_heads {kv} does not divide num_attention_heads {heads}"
        )


def _causal_family(model_type: str, where: str) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelSpecError(
            f"{where}: model_type {model_type[:40]!r} is not a causal language model transformers knows "
            "(e.g. llama, qwen2, gemma3_text, gpt2); give a decoder's config.json"
        )


def shape_config(spec: str):
    """The transformers config of a `random:` spec (no weights, no download)."""
    from transformers import AutoConfig

    values, _ = _source(spec)  # read afresh: popping its model_type changes no other caller's dict
    model_type = values.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **values)
    except Exception as exc:  # any field of any type reaches transformers' own checks
        raise ModelSpecError(f"'{spec}': transformers cannot build this config ({_reason(exc)})") from None
    try:  # the model is built from it (on the meta device, once: parameter_count reads the cache)
        _counted(config.to_json_string())
    except Exception as exc:
        raise ModelSpecError(
            f"'{spec}': transformers cannot build a model from this config ({_reason(exc)}); fix the field "
            "it names"
        ) from None
    return config


def _reason(exc: Exception) -> str:
    """The line of an exception that says why (a validator's reason comes last)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1][:200] if lines else type(exc).__name__


def shape_tokenizer(spec: str, config):
    """The tokenizer of a `random:` spec: the config directory's own, else the default model's."""
    from . import load_tokenizer
    from .tokenizers import read_tokenizer

    _, folder = _source(spec)
    has_own = folder is not None and any(
        (folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")
    )
    tokenizer = read_tokenizer(str(folder), True, False) if has_own else load_tokenizer(DEFAULT_MODEL)[0]
    vocabulary = config.get_text_config().vocab_size
    if len(tokenizer) > vocabulary:
        raise ModelSpecError(
            f"'{spec}': its tokenizer has {len(tokenizer):,} tokens but the config's vocabulary "
            f"{vocabulary:,}; put the model's own tokenizer beside its config.json"
        )
    return tokenizer


def random_model(spec: str, config, dtype: torch.dtype, device: str):
    """The model of `config` with seeded random weights (seed 0) on `device`, built directly in `dtype`:
    every matrix uniform with the config's initializer_range as its standard deviation (a normal draw
    of 1.2 B values takes 16 s on 2 CPU cores, a uniform one 5 s; families that scale some matrices,
    as GPT-2 its output projections, get the unscaled value), padding rows zero, everything else
    (norms, biases, rotary tables) from the family's own initialiser. Where that fails, the family's
    initialiser throughout."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        _draw_uniform(model.to_empty(device=device), config)
    except Exception:  # a family whose initialiser needs its own construction
        torch.manual_seed(SEED)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.name_or_path = spec
    return model


@torch.no_grad()
def _draw_uniform(model, config) -> None:
    """Fill every matrix uniform on [-a, a] with a = std sqrt(3) (the std transformers' initialiser
    draws from), then let the family's initialiser set the rest (it skips what is marked done)."""
    text = config.get_text_config()
    std = getattr(text, "initializer_range", None) or 0.02
    bound = std * 3**0.5
    generator = torch.Generator(model.device).manual_seed(SEED)
    for parameter in model.parameters():
        if parameter.ndim >= 2:
            parameter.uniform_(-bound, bound, generator=generator)
            parameter._is_hf_initialized = True
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
            module.weight[module.padding_idx] = 0
    for module in model.modules():  # the meta build marked every module done
        module.__dict__.pop("_is_hf_initialized", None)
    model.initialize_weights()
    model.tie_weights()


def parameter_count(config) -> tuple[int, int] | None:
    """(every parameter, the embeddings' among them) of `config`'s causal LM, counted on the meta
    device: exact for any family, no memory, about 0.1 s (2 s for Gemma 3's initialiser), once."""
    try:
        return _counted(config.to_json_string())
    except Exception:  # a config transformers cannot rebuild (its own code): no estimate, no refusal
        return None


BUILT_LAYERS = 128  # deeper configs are counted from two shallow builds (a meta layer costs ~4 ms)


@functools.lru_cache(maxsize=16)
def _counted(config_json: str) -> tuple[int, int]:
    """Counted on a meta build; past BUILT_LAYERS layers, from builds of 2 and 4 layers (the layers of
    one config have the same parameters), so a 1,024-layer config answers in a fraction of a second."""
    values = json.loads(config_json)
    layers = _layer_count(values)
    if layers is None or layers <= BUILT_LAYERS:
        return _built(values)
    (two, embedded), (four, _) = _built(_with_layers(values, 2)), _built(_with_layers(values, 4))
    return two + (layers - 2) * (four - two) // 2, embedded


def _layer_count(values: dict) -> int | None:
    text = values.get("text_config") if isinstance(values.get("text_config"), dict) else values
    return next((text[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if k in text), None)


def _with_layers(values: dict, n: int) -> dict:
    out = json.loads(json.dumps(values))
    text = out["text_config"] if isinstance(out.get("text_config"), dict) else out
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if key in text:
            text[key] = n
    text.pop("layer_types", None)  # one per layer: rebuilt from the pattern for n layers
    return out


def _built(values: dict) -> tuple[int, int]:
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(values)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        return module_parameters(AutoModelForCausalLM.from_config(config))


def module_parameters(module) -> tuple[int, int]:
    """(every parameter, the input and output embeddings' among them) of a built model; a tensor two
    modules share (tied embeddings) counts once, as module.parameters() yields it once."""
    embeddings = {
        id(m.weight): m.weight.numel()
        for m in (module.get_input_embeddings(), module.get_output_embeddings())
        if m is not None
    }
    return sum(p.numel() for p in module.parameters()), sum(embeddings.values())
