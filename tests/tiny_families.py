"""Tiny random-initialised models of every causal-LM family in transformers' auto mapping, and
the verify coverage table over them (family -> verified / unsupported (reason) / failed / not built).

Run as a script to print the table: `python tests/tiny_families.py` (the test runs the same).
"""

from __future__ import annotations

import sys
import warnings

import torch
from conftest import VOCAB

SIZES = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    moe_intermediate_size=32,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    shared_expert_intermediate_size=32,
    n_embd=32,
    n_layer=2,
    n_head=4,
    n_positions=128,
    d_model=32,
    n_heads=4,
    n_layers=2,
    num_layers=2,
    num_heads=4,
    ffn_hidden_size=64,
    kv_channels=8,
    hidden_dim=64,
    num_kv_heads=2,
    rotary_dim=4,
    window_size=4,
    sliding_window=4,
    attention_chunk_size=4,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.3,
)
# Families that cannot be built small on CPU here, with the reason.
NOT_BUILT = {
    "blt": "its byte-level patcher allocates tens of GB even with a tiny config (the process is killed)"
}


def _set(config, name, value) -> None:
    if not hasattr(config, name) or isinstance(getattr(config, name), (list, dict)):
        return
    if getattr(config, name) is None and name not in (
        "pad_token_id",
        "sliding_window",
        "attention_chunk_size",
    ):
        return
    try:
        setattr(config, name, value)
    except (AttributeError, TypeError, ValueError):
        pass  # a derived property, or validated against another field


def _other_parts(config, text) -> list:
    """The sub-configs of a multimodal config beside its text config (vision, audio, ...)."""
    from transformers import PretrainedConfig

    return [part for part in vars(config).values() if isinstance(part, PretrainedConfig) and part is not text]


def tiny_config(name: str, **overrides):
    """The family's default config shrunk to 2 layers of 4 heads (2 key/value heads), width 32;
    windows and chunks of 4 tokens so that they act on short texts; mixed layer types kept mixed.
    `overrides` are then set on the text config as given."""
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[name]()
    text = config.get_text_config()
    for key, value in SIZES.items():
        _set(text, key, value)
    for part in _other_parts(config, text):  # a multimodal family's encoders: shrunk too (building
        for key, value in SIZES.items():  # Phi-4-multimodal's full-size ones took 15 s a dtype)
            _set(part, key, value)
    for key, value in overrides.items():
        setattr(text, key, value)
    layer_types = getattr(text, "layer_types", None)
    if isinstance(layer_types, list) and layer_types:
        distinct = list(dict.fromkeys(layer_types))
        try:
            text.layer_types = (distinct + distinct)[:2]
        except (AttributeError, TypeError, ValueError):
            pass
    return config


def build(name: str, dtype=torch.float32, seed: int = 0, **overrides):
    """A tiny model of the family (its text model, for multimodal families), in eval mode."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(name, **overrides)
    text = config.get_text_config()
    torch.manual_seed(seed)
    # eager attention (verify switches the interface families to attnprobe's); eager experts, as
    # the grouped-matmul kernel of mixture-of-experts layers has no float64
    implementations = {"attn_implementation": "eager", "experts_implementation": "eager"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = AutoModelForCausalLM.from_config(config, **implementations)
        except ValueError:
            if text is config:
                raise
            model = AutoModelForCausalLM.from_config(text, **implementations)
    return model.to(dtype).eval()


def coverage(tokenizer, names=None, dtypes=(torch.float32, torch.float64)) -> list[dict]:
    """One row per family: its verify status at each dtype and the reason when not verified."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from attnprobe.errors import UnsupportedFamily
    from attnprobe.model import from_pretrained_objects
    from attnprobe.verify import verify

    rows = []
    for name in names or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        row = {"family": name, "status": "verified", "reason": ""}
        if name in NOT_BUILT:
            row.update(status="not built", reason=NOT_BUILT[name])
            rows.append(row)
            continue
        for dtype in dtypes:
            label = str(dtype).removeprefix("torch.")
            try:
                model = build(name, dtype)
                ids = torch.randint(3, VOCAB, (1, 5))
                with torch.no_grad():
                    model(input_ids=ids, attention_mask=torch.ones_like(ids))
            except Exception as exc:  # the family's own code fails on a tiny config
                row.update(
                    status="not built",
                    reason=f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}",
                )
                break
            if getattr(model.config.get_text_config(), "num_attention_heads", None) is None:
                row.update(
                    status="unsupported", reason="no attention heads (a state-space or recurrent model)"
                )
                break
            try:
                table = verify(from_pretrained_objects(model, tokenizer, name))
            except UnsupportedFamily as exc:
                row.update(status="unsupported", reason=str(exc))
                break
            except Exception as exc:
                row.update(
                    status="failed",
                    reason=f"{label}: {type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:160] if str(exc) else ''}",
                )
                break
            row[f"dweights_{label}"] = float(
                table[["max_dweights_eager", "max_dweights_capture"]].max().max()
            )
            row[f"dweights_capture_{label}"] = float(table["max_dweights_capture"].max())
            if not table["passed"].all():
                row.update(
                    status="failed",
                    reason=f"{label}: out of tolerance in {int((~table['passed']).sum())} layer(s)",
                )
                break
        rows.append(row)
    return rows


def format_coverage(rows: list[dict]) -> str:
    lines = [f"{'family':<26} {'status':<12} {'max dweights f32':>17} {'capture f64':>12}  reason"]
    for r in rows:
        f32, f64 = r.get("dweights_float32"), r.get("dweights_capture_float64")
        lines.append(
            f"{r['family']:<26} {r['status']:<12} {'' if f32 is None else f'{f32:.1e}':>17} "
            f"{'' if f64 is None else f'{f64:.1e}':>12}  {r['reason']}"
        )
    counts = {
        status: sum(r["status"] == status for r in rows)
        for status in ("verified", "unsupported", "failed", "not built")
    }
    lines.append(", ".join(f"{n} {status}" for status, n in counts.items()) + f" of {len(rows)} families")
    return "\n".join(lines)


class ModuloTokenizer:
    """The bundled tokenizer with ids folded into a tiny model's vocabulary (real text, real padding)."""

    pad_token = "<pad>"
    padding_side = "right"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, texts, **kwargs):
        enc = self.tokenizer(texts, **kwargs)
        enc["input_ids"] = enc["input_ids"] % VOCAB
        return enc


if __name__ == "__main__":
    import attnprobe

    tokenizer = ModuloTokenizer(attnprobe.load_model("smollm2-135m").tokenizer)
    print(format_coverage(coverage(tokenizer, sys.argv[1:] or None)))
