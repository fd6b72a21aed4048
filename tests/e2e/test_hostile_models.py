"""Model files: only safetensors or GGUF load by default; no remote code unless asked."""

import json

import pytest
import torch
import transformers
from click.testing import CliRunner
from conftest import one_line_error, save_tiny_with_tokenizer  # noqa: E402

import attnprobe
from attnprobe.cli import main
from attnprobe.errors import ModelSpecError

pytestmark = pytest.mark.slow


def test_pickled_checkpoint_is_refused_without_flag(tmp_path, smollm):
    # a tiny Llama with the bundled tokenizer's vocabulary, so real text runs through it
    config = transformers.LlamaConfig(
        vocab_size=len(smollm.tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
    )
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
    allowed = runner.invoke(
        main, ["verify", "--model", str(tmp_path), "--text", "The nurse said", "--allow-pickle"]
    )
    assert allowed.exit_code == 0, allowed.output


def test_checkpoint_with_its_own_code_is_refused(tmp_path, smollm):
    save_tiny_with_tokenizer(tmp_path, smollm.tokenizer)
    config = json.loads((tmp_path / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "evil.Model"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "ran"
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    result = CliRunner().invoke(main, ["verify", "--model", str(tmp_path)])
    assert (
        result.exit_code == 2
        and "ships its own model code (AutoModelForCausalLM in config.json auto_map)" in result.output
    )
    assert "--trust-remote-code" in result.output and not marker.exists()


def test_trust_remote_code_is_off_unless_asked(tmp_path, smollm, monkeypatch):
    save_tiny_with_tokenizer(tmp_path, smollm.tokenizer)
    seen = []
    original = transformers.AutoModelForCausalLM.from_pretrained

    def record(*args, **kwargs):
        seen.append((kwargs.get("trust_remote_code"), kwargs.get("use_safetensors")))
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", record)
    attnprobe.load_model(str(tmp_path))
    attnprobe.load_model(str(tmp_path), trust_remote_code=True)
    assert seen == [(False, True), (True, True)]


def _damaged(tmp_path, smollm, damage):
    save_tiny_with_tokenizer(tmp_path, smollm.tokenizer)
    damage(tmp_path)
    return CliRunner().invoke(main, ["verify", "--model", str(tmp_path), "--text", "The nurse said"])


def _set_config(key, value):
    def damage(folder):
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(dict(config, **{key: value})))

    return damage


def _truncate(name, keep):
    def damage(folder):
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[:keep])

    return damage


@pytest.mark.parametrize(
    "damage, phrases",
    [
        (_truncate("model.safetensors", 5), ("SafetensorError", "damaged or inconsistent, replace them")),
        (_truncate("tokenizer.json", 20), ("cannot load", "tmp")),
        (
            _set_config("num_hidden_layers", 0),
            ("config.json sets num_hidden_layers = 0", "needs at least one"),
        ),
        (_set_config("num_attention_heads", 0), ("cannot load", "damaged or inconsistent")),
        (_set_config("hidden_size", "x"), ("cannot load",)),
    ],
    ids=["truncated-weights", "truncated-tokenizer", "zero-layers", "zero-heads", "text-hidden-size"],
)
def test_damaged_checkpoints_are_one_line(tmp_path, smollm, damage, phrases):
    one_line_error(_damaged(tmp_path, smollm, damage), *phrases)


@pytest.mark.parametrize(
    "device, phrase",
    [
        ("bogus", "--device 'bogus' is not a torch device; use cpu, cuda, cuda:N or mps"),
        ("cuda:x", "is not a torch device"),
        ("cuda:7", "--device 'cuda:7' is not available on this machine; use --device cpu"),
    ],
)
def test_a_device_that_does_not_exist_is_refused_before_anything_is_written(tmp_path, device, phrase):
    if device == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has that device")
    result = CliRunner().invoke(
        main, ["run", "probes/gender.yaml", "--device", device, "--out", str(tmp_path / "out")]
    )
    one_line_error(result, phrase)
    assert not (tmp_path / "out").exists()


def test_verify_json_into_a_new_or_an_impossible_directory(tmp_path, smollm):
    save_tiny_with_tokenizer(tmp_path / "model", smollm.tokenizer)
    target = tmp_path / "new" / "deeper" / "verify.json"
    result = CliRunner().invoke(
        main,
        ["verify", "--model", str(tmp_path / "model"), "--text", "The nurse said", "--json", str(target)],
    )
    assert result.exit_code == 0 and len(json.loads(target.read_text())) == 2, result.output
    (tmp_path / "file").write_text("x")
    result = CliRunner().invoke(
        main,
        [
            "verify",
            "--model",
            str(tmp_path / "model"),
            "--text",
            "The nurse said",
            "--json",
            str(tmp_path / "file" / "v.json"),
        ],
    )
    one_line_error(result, "--json", "cannot create", "choose a writable path")


def test_a_tokenizer_larger_than_the_embeddings_is_one_line(tmp_path, smollm):
    from conftest import build_tiny

    build_tiny("llama", attn_implementation="eager").save_pretrained(tmp_path)  # 100 embedding rows
    smollm.tokenizer.save_pretrained(tmp_path)
    result = CliRunner().invoke(main, ["verify", "--model", str(tmp_path), "--text", "The nurse said"])
    one_line_error(result, f"the tokenizer has {len(smollm.tokenizer)} tokens but the model embeds only 100")


@pytest.mark.parametrize(
    "head, phrase",
    [
        (b"\x00" * 64, "is not a GGUF file (it does not start with the bytes 'GGUF')"),
        (b"GGUF" + bytes(range(256)) * 4, "cannot read GGUF file"),
    ],
)
def test_a_random_or_damaged_gguf_is_one_line(tmp_path, head, phrase, monkeypatch):
    monkeypatch.setenv("ATTNPROBE_CACHE", str(tmp_path / "cache"))  # no conversion cache outside tmp_path
    (tmp_path / "m.gguf").write_bytes(head)
    one_line_error(CliRunner().invoke(main, ["verify", "--model", str(tmp_path / "m.gguf")]), phrase)
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]  # no half conversion left behind


def test_an_unreachable_hub_fails_at_once_without_retries(monkeypatch, tmp_path):
    import socket
    import time

    from attnprobe.model.checks import hub_unreachable

    def refuse(*args, **kwargs):
        raise OSError("no route")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty hub cache
    hub_unreachable.cache_clear()
    started = time.perf_counter()
    try:
        result = CliRunner().invoke(main, ["verify", "--model", "someone/nothing-here"])
    finally:
        hub_unreachable.cache_clear()
    one_line_error(
        result,
        "cannot fetch 'someone/nothing-here'",
        "the hub is unreachable from this machine, and the id is not in the local cache",
    )
    assert time.perf_counter() - started < 10  # transformers alone retries for about a minute


def test_a_checkpoint_with_nan_weights_is_refused_by_run_and_verify(tmp_path, smollm):
    """It used to run with exit 0 (NaN attention written as 0, every log-probability NaN) and verify
    printed PASS, "bit-identical"."""
    from safetensors.torch import load_file, save_file

    save_tiny_with_tokenizer(tmp_path / "m", smollm.tokenizer)
    weights = load_file(tmp_path / "m" / "model.safetensors")
    name = next(k for k in weights if "q_proj" in k)
    weights[name][0, 0] = float("nan")
    save_file(weights, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    phrase = f"{name} holds 1 non-finite values (NaN or inf); the checkpoint is damaged"
    one_line_error(CliRunner().invoke(main, ["verify", "--model", str(tmp_path / "m")]), phrase)
    suite = tmp_path / "s.yaml"
    suite.write_text(
        "name: s\nslots: {occupation: [nurse]}\ntemplates:\n  - {id: t, text: 'The {occupation} left.'}\n"
        "attention: [{source: occupation, targets: occupation}]\n"
    )
    result = CliRunner().invoke(
        main, ["run", str(suite), "--model", str(tmp_path / "m"), "--out", str(tmp_path / "o")]
    )
    one_line_error(result, phrase)
