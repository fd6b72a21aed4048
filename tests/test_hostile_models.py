"""Model files: only safetensors or GGUF load by default; no remote code unless asked."""

import json

import pytest
import torch
import transformers
from click.testing import CliRunner

import attnprobe
from attnprobe.cli import main
from attnprobe.errors import ModelSpecError

from test_models import _save_tiny_with_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow


def test_pickled_checkpoint_is_refused_without_flag(tmp_path, smollm):
    # a tiny Llama with the bundled tokenizer's vocabulary, so real text runs through it
    config = transformers.LlamaConfig(vocab_size=len(smollm.tokenizer), hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    smollm.tokenizer.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    from safetensors.torch import load_file

    torch.save(load_file(weights), tmp_path / "pytorch_model.bin")
    weights.unlink()
    with pytest.raises(ModelSpecError, match="only pickled weights .*pytorch_model.bin.*--allow-pickle"):
        attnprobe.load_model(str(tmp_path))
    assert attnprobe.load_model(str(tmp_path), allow_pickle=True).info.n_layers == 2
    runner = CliRunner()
    refused = runner.invoke(main, ["verify", "--model", str(tmp_path), "--text", "The nurse said"])
    assert refused.exit_code == 2 and "--allow-pickle" in refused.output
    allowed = runner.invoke(main, ["verify", "--model", str(tmp_path), "--text", "The nurse said", "--allow-pickle"])
    assert allowed.exit_code == 0, allowed.output


def test_checkpoint_with_its_own_code_is_refused(tmp_path, smollm):
    _save_tiny_with_tokenizer(tmp_path, smollm)
    config = json.loads((tmp_path / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "evil.Model"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "ran"
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    result = CliRunner().invoke(main, ["verify", "--model", str(tmp_path)])
    assert result.exit_code == 2 and "ships its own model code (AutoModelForCausalLM in config.json auto_map)" in result.output
    assert "--trust-remote-code" in result.output and not marker.exists()


def test_trust_remote_code_is_off_unless_asked(tmp_path, smollm, monkeypatch):
    _save_tiny_with_tokenizer(tmp_path, smollm)
    seen = []
    original = transformers.AutoModelForCausalLM.from_pretrained

    def record(*args, **kwargs):
        seen.append((kwargs.get("trust_remote_code"), kwargs.get("use_safetensors")))
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", record)
    attnprobe.load_model(str(tmp_path))
    attnprobe.load_model(str(tmp_path), trust_remote_code=True)
    assert seen == [(False, True), (True, True)]
