"""`--model random:CONFIG` and `check` on configs a careless hand wrote (issue 67): each is one line
naming the field and what it takes, before anything is allocated; a fuzzer sends any JSON values
through `check`, which answers each with an estimate or one error within 2 s and 1 GB."""

import json
import resource
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import FUZZ_EXAMPLES, no_weights, one_line_error
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from attnprobe.cli import main
from attnprobe.model import shapes

REPO = Path(__file__).resolve().parents[2]
MINIMAL = str(REPO / "probes" / "minimal.yaml")
LLAMA = json.loads((shapes.SHAPES / "llama-3.2-1b.json").read_text())


def _check(config: dict, tmp_path: Path, device: str = "cuda:0"):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return CliRunner().invoke(main, ["check", MINIMAL, "--model", f"random:{path}", "--device", device])


@pytest.mark.parametrize(
    "change, phrases",
    [
        ({"num_hidden_layers": "16"}, ['num_hidden_layers is "16"', "whole number from 1 to 1,024"]),
        ({"hidden_size": 2048.5}, ["hidden_size is 2048.5", "whole number"]),
        ({"num_attention_heads": None}, ["num_attention_heads is null", "whole number from 1 to 4,096"]),
        ({"hidden_size": [2048]}, ["hidden_size is [2048]"]),
        ({"num_attention_heads": 30}, ["num_key_value_heads 8 does not divide num_attention_heads 30"]),
        (
            {"num_attention_heads": 24, "num_key_value_heads": 8, "hidden_size": 2000},
            ["is not a multiple of the number of attention heads (24)"],
        ),
        ({"num_attention_heads": 0}, ["num_attention_heads is 0"]),
        ({"num_hidden_layers": 10**7}, ["num_hidden_layers is 10000000"]),
        ({"hidden_size": -5}, ["hidden_size is -5"]),
        ({"vocab_size": 2**80}, ["vocab_size is 12089258196146291747"]),
        ({"model_type": "t5"}, ["model_type 't5' is not a causal language model"]),
        ({"model_type": 7}, ["model_type must be a name"]),
        ({"num_hidden_layers": True}, ["num_hidden_layers is true"]),
    ],
)
def test_a_config_with_wrong_types_or_sizes_is_one_line_naming_the_field(
    change, phrases, tmp_path, monkeypatch
):
    no_weights(monkeypatch)
    one_line_error(_check({**LLAMA, **change}, tmp_path), str(tmp_path / "config.json"), *phrases)


def test_a_very_deep_config_is_counted_at_once_and_exactly(tmp_path, monkeypatch):
    """1,024 layers of Llama 3.2 1B: was minutes and gigabytes on a meta build of every layer; now two
    shallow builds, and the count is exact (each layer's parameters are the same)."""
    no_weights(monkeypatch)
    started = time.perf_counter()
    result = _check({**LLAMA, "num_hidden_layers": 1024}, tmp_path)
    assert result.exit_code == 0, result.output
    assert time.perf_counter() - started < 10  # a bound that holds on a loaded machine; typically 1 s
    per_layer = (
        2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048
    )  # q,o; k,v (8 of 32 heads); MLP; norms
    total = 2048 * 128256 + 1024 * per_layer + 2048  # tied embeddings, layers, final norm
    assert f"({total / 1e9:.2f} B parameters in float32)" in result.output


def test_check_of_a_gpu_shape_prints_no_cpu_line_of_the_default_model(tmp_path, monkeypatch):
    no_weights(monkeypatch)
    result = CliRunner().invoke(
        main, ["check", MINIMAL, "--model", "random:llama-3.1-8b", "--device", "cuda:0"]
    )
    assert result.exit_code == 0, result.output
    assert "smollm2-135m" not in result.output
    assert "memory on cuda:0" in result.output


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.integers(0, 4096)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
BASES = [json.loads((shapes.SHAPES / f"{name}.json").read_text()) for name in ("llama-3.2-1b", "gemma-3-4b")]
FIELDS = sorted({key for base in BASES for key in base} | set(shapes.SIZES))


@settings(
    max_examples=max(FUZZ_EXAMPLES // 10, 20),
    deadline=None,  # timed below, per example, against the 2 s
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    base=st.sampled_from(range(len(BASES))),
    changes=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, min_size=1, max_size=3),
)
def test_fuzzed_configs_get_an_estimate_or_one_error_within_2_s_and_1_gb(
    base, changes, tmp_path, monkeypatch
):
    no_weights(monkeypatch)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux
    started = time.perf_counter()
    result = _check({**BASES[base], **changes}, tmp_path)
    seconds = time.perf_counter() - started
    if result.exit_code == 0:
        event("estimate")
        assert any(line.startswith("memory on cuda:0") for line in result.output.splitlines()), result.output
    else:
        event("refused")
        one_line_error(result)
    assert seconds < 2.0, (changes, seconds)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 1 << 20, changes


def test_models_lists_the_shapes_random_takes():
    result = CliRunner().invoke(main, ["models"])
    assert result.exit_code == 0, result.output
    for name in shapes.shipped():
        assert f"random:{name} " in result.output
