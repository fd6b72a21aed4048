"""Models of real shapes without their weights (random:NAME), memory and time from the config, the
refusal of a model that cannot fit, and benchmarks/gpu.py on the CPU (issue 54)."""

import json
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import forked_cli, no_weights, one_line_error

import attnprobe
from attnprobe.cli import main
from attnprobe.defaults import DEFAULT_CHUNK_SIZE, ROW_TOKENS
from attnprobe.errors import ModelSpecError
from attnprobe.model import footprint, shapes

REPO = Path(__file__).resolve().parents[2]
MINIMAL = str(REPO / "probes" / "minimal.yaml")
# parameters of each shipped shape (model/configs/SOURCES.md): what the model cards state
PARAMETERS = {
    "llama-3.2-1b": 1.236,
    "llama-3.1-8b": 8.030,
    "qwen-2.5-7b": 7.616,
    "gemma-3-4b": 3.880,
    "llama-3.1-70b": 70.554,
}


def test_every_shipped_shape_is_counted_as_its_model_card_says():
    assert shapes.shipped() == sorted(PARAMETERS)
    for name, billions in PARAMETERS.items():
        shape = footprint.Shape.of(shapes.shape_config(f"random:{name}"))
        assert round(shape.parameters / 1e9, 3) == billions
        assert shape.weights("bfloat16") == 2 * shape.parameters  # no weights built: counted on meta


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt2"])
def test_random_weights_draw_matrices_fast_and_the_rest_as_the_family_does(family):
    """random_model fills matrices uniform with the initialiser's std; norms, biases and buffers
    (rotary tables, Gemma's embedding scale) equal the family's own initialiser's, tied stay tied."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4)
    sizes |= dict(num_key_value_heads=2, head_dim=16, vocab_size=300, n_layer=2, n_embd=64, n_head=4)
    config = AutoConfig.for_model(family)
    for key, value in sizes.items():
        if hasattr(config, key):
            setattr(config, key, value)
    own = AutoModelForCausalLM.from_config(config)
    drawn = shapes.random_model("random:x", config, torch.float32, "cpu")
    ours, theirs = dict(drawn.named_parameters()), dict(own.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in theirs.items():
        if p.ndim < 2:
            assert torch.equal(ours[name], p), name
        else:
            assert abs(float(ours[name].std()) / config.initializer_range - 1) < 0.1, name
            assert float(ours[name].abs().max()) <= config.initializer_range * 3**0.5
    assert all(torch.equal(b, dict(own.named_buffers())[n]) for n, b in drawn.named_buffers())
    tied = drawn.get_output_embeddings().weight is drawn.get_input_embeddings().weight
    assert tied == (own.get_output_embeddings().weight is own.get_input_embeddings().weight)


@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_check_estimates_memory_and_time_on_a_gpu_without_weights(name, monkeypatch):
    no_weights(monkeypatch)
    args = ["check", MINIMAL, "--model", f"random:{name}", "--device", "cuda:0", "--dtype", "bfloat16"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    memory = next(line for line in result.output.splitlines() if line.startswith("memory on cuda:0"))
    assert f"({PARAMETERS[name]:.2f} B parameters in bfloat16)" in memory
    assert ("does NOT fit" in memory) == (name == "llama-3.1-70b")  # 141 GB of weights on an 80 GB card
    time_line = next(line for line in result.output.splitlines() if line.startswith("time on H100"))
    # the run's three parts and their sum: loading (its weights' bytes), the device's phases, the host's
    parts = [
        float(time_line.split(f"{what} about ")[1].split(" min")[0])
        for what in ("hashing the weights", "report")
    ]
    device = float(time_line.split(": about ")[1].split(" min")[0])
    total = float(time_line.split("about ")[-1].split(" min in all")[0])
    assert abs(total - (device + sum(parts))) <= 0.15 and parts[0] > 0 and parts[1] > 0
    assert "the weights are random" in result.output
    budget = next(line for line in result.output.splitlines() if line.startswith("prompt passes"))
    prompts = int(budget.split("up to ")[1].split(" prompts")[0])
    rows = int(budget.split("up to ")[2].split(" rows")[0].replace(",", ""))
    # a card with room beside the weights runs a chunk per prompt pass and patches in passes larger than
    # the CPU's; one without: one prompt a pass and the CPU's patch budget
    fits = name != "llama-3.1-70b"
    assert (rows > ROW_TOKENS) == fits and prompts == (DEFAULT_CHUNK_SIZE if fits else 1), budget


def test_a_prompt_batch_is_a_chunk_where_it_fits_and_fewer_where_it_would_not():
    """model.footprint.prompt_batch: a whole chunk on a card with room beside the weights; with less
    room (or longer prompts) the most prompts whose pass fits its share of that room, at least one."""
    shape = footprint.Shape.of(shapes.shape_config("random:llama-3.1-8b"))
    per_prompt = shape.forward_working("bfloat16", 4096, 1)
    assert footprint.prompt_batch(shape, "bfloat16", 64e9, 16, 512) == 512
    tight = footprint.prompt_batch(shape, "bfloat16", 64e9, 4096, 512)  # 4,096-token prompts
    assert 1 < tight < 512 and tight * per_prompt <= footprint.FREE_SHARE * 64e9 < (tight + 1) * per_prompt
    assert footprint.prompt_batch(shape, "bfloat16", -1e9, 16, 512) == 1  # the weights do not even fit


def test_a_patch_budget_fits_its_share_of_the_free_memory_and_grows_with_it():
    """model.footprint.patch_budget: the CPU's budget on a CPU; on a GPU a power of two whose pass
    takes at most half of the free memory, larger with more memory free, never below the CPU's."""
    shape = footprint.Shape.of(shapes.shape_config("random:llama-3.1-8b"))
    assert footprint.patch_budget(shape, "bfloat16", 80e9, 16, on_gpu=False) == ROW_TOKENS
    budgets = [
        footprint.patch_budget(shape, "bfloat16", free * 1e9, 16, on_gpu=True) for free in (1, 10, 40, 80)
    ]
    assert budgets[0] == ROW_TOKENS and budgets == sorted(budgets) and budgets[-1] > 8 * ROW_TOKENS
    per_token = shape.forward_working("bfloat16", 1, 0) + shape.H * 16 * 4 + shape.V * 4 / 16
    assert all(b & (b - 1) == 0 for b in budgets) and budgets[-1] * per_token <= footprint.FREE_SHARE * 80e9


def test_patched_passes_give_the_same_values_whatever_their_budget(tiny_llama_dir, monkeypatch):
    """The head effects and the edits read the device's budget (1 pass or many): the same y."""
    from attnprobe.edits.kinds import Zero
    from attnprobe.edits.passes import Variants, edited_behaviour
    from attnprobe.intervene.engine import record

    model = attnprobe.load_model(str(tiny_llama_dir))
    g = torch.Generator().manual_seed(0)
    bank = record(
        model,
        [torch.randint(5, 90, (int(n),), generator=g) for n in torch.randint(4, 12, (40,), generator=g)],
    )
    n = len(bank.lengths)
    heads = torch.zeros(n, model.info.n_layers, model.info.n_heads, dtype=torch.bool)
    heads[:, 1, 0] = True
    variants = Variants(bank, Zero(heads=((1, 0),)), torch.arange(n), heads)
    labels = torch.tensor([[7]] * n), torch.tensor([[9]] * n)
    values = {}
    for budget in (16, 1 << 16):
        monkeypatch.setattr("attnprobe.edits.passes.device_patch_budget", lambda module, longest, b=budget: b)
        values[budget] = edited_behaviour(model, variants, *labels)
    assert torch.allclose(values[16], values[1 << 16], atol=1e-5)


def test_an_8b_shape_is_refused_on_a_24_gb_machine_before_loading(monkeypatch, tmp_path):
    """float32 needs 32 GB: refused in one line naming the dtype that fits; nothing is created."""
    monkeypatch.setattr(footprint, "_available_cpu_memory", lambda: 24e9)
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["run", MINIMAL, "--model", "random:llama-3.1-8b", "--out", str(out)])
    one_line_error(result, "needs about 32.", "float32", "24.0 GB free", "--dtype bfloat16 (16.")
    assert not out.exists()
    with pytest.raises(ModelSpecError, match="141.1 GB in bfloat16.*--device-map auto"):
        attnprobe.load_model("random:llama-3.1-70b", dtype="bfloat16")


def test_random_specs_are_explained_and_refused_where_behaviour_is_measured(tmp_path):
    with pytest.raises(ModelSpecError, match="no shipped shape.*llama-3.1-8b"):
        shapes.shape_config("random:llama-9")
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(ModelSpecError, match="has no model_type"):
        shapes.shape_config(f"random:{tmp_path}")
    with pytest.raises(ModelSpecError, match="random weights .* run it on the model's real weights"):
        shapes.refuse_random("random:llama-3.2-1b", "attnprobe edit")
    assert shapes.directory_name("random:llama-3.1-8b") == "random-llama-3.1-8b"
    assert shapes.directory_name(f"random:{tmp_path / 'config.json'}") == f"random-{tmp_path.name}"


def test_a_config_directory_with_its_own_tokenizer(smollm_tokenizer, tmp_path):
    """random:DIR (a config.json and a tokenizer fetched without weights) uses that tokenizer; one
    larger than the config's vocabulary is refused."""
    config = json.loads((shapes.SHAPES / "llama-3.2-1b.json").read_text())
    config.update(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4)
    config.update(num_key_value_heads=2, head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps(config))
    smollm_tokenizer.save_pretrained(tmp_path)
    pm = attnprobe.load_model(f"random:{tmp_path}")
    assert pm.info.name == f"random-{tmp_path.name}" and len(pm.tokenizer) == len(smollm_tokenizer)
    config["vocab_size"] = 1000
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelSpecError, match="tokenizer has 49,152 tokens but the config's vocabulary 1,000"):
        attnprobe.load_model(f"random:{tmp_path}")


@pytest.mark.slow
def test_the_1b_shape_runs_the_gender_suite_end_to_end_on_cpu(tmp_path):
    """Llama 3.2 1B's shape with random weights (1.24 B parameters, float32) through the real CLI and
    the report, every measure but head effects (every head of 4 held-out items patched exactly: about
    9 min on 2 cores; the GPU benchmark times them); the report says the weights were random, and
    `edit` refuses the run."""
    out = tmp_path / "r"
    args = ["run", str(REPO / "probes" / "gender.yaml"), "--model", "random:llama-3.2-1b", "--limit", "4"]
    args += ["--no-head-effects"]
    process = forked_cli([*args, "--out", out], tmp_path / "run.log")
    process.join()
    assert process.exitcode == 0, (tmp_path / "run.log").read_text()[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["n_layers"] == 16 and manifest["model"]["n_heads"] == 32
    assert manifest["direct_attribution"] and manifest["prompt_phase"]["device"] == "cpu"
    assert "the weights are random" in (out / "report.html").read_text()
    edit = CliRunner().invoke(main, ["edit", str(out)])
    one_line_error(edit, "random weights")


def _benchmark(name: str):
    """benchmarks/NAME.py as a module, run in this process (the test's imports are the script's)."""
    import importlib.util

    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_gpu_benchmark_runs_on_the_cpu_with_tiny_shapes(tmp_path):
    """benchmarks/gpu.py --tiny: parity in three dtypes (device = the CPU standing in for a GPU here;
    one of its six families: the others differ in the model only, which the family tests cover), the
    tiny shape's row and every command, written as JSON and markdown."""
    args = ["--tiny", "--out", str(tmp_path), "--limit", "24", "--parity-limit", "8"]
    args += ["--families", "llama"]
    assert _benchmark("gpu").main(args) == 0
    found = json.loads((tmp_path / "gpu.json").read_text())
    assert len(found["parity"]) == 3 and all(r["passed"] for r in found["parity"])
    assert {r["family"] for r in found["parity"]} == {"llama"}
    (row,) = found["shapes"]
    assert row["prompt_phase_s"] > 0 and row["head_effect_pairs"] > 0 and row["verify_passed"]
    assert [r["exit"] for r in found["commands"]] == [0] * 6
    assert "## The commands on the device" in (tmp_path / "gpu.md").read_text()


@pytest.mark.slow
def test_the_gpu_pace_benchmark_runs_on_the_cpu_with_a_tiny_shape(tmp_path):
    """benchmarks/gpu_pace.py --tiny (the device: the CPU standing in for a GPU): the prompt phase cold
    and warm beside the eager loop, single-head patches, and the profile, written as JSON and
    markdown, so the script a lent GPU runs has run before it gets there."""
    args = ["--tiny", "--out", str(tmp_path), "--limit", "24", "--pairs", "1", "--profile", "tiny-llama"]
    assert _benchmark("gpu_pace").main(args) == 0
    (row,) = json.loads((tmp_path / "gpu_pace.json").read_text())["pace"]
    assert row["prompt_phase_warm_s"] > 0 and row["eager_warm_s"] > 0
    assert row["single_head_patches"] == 8 and row["patches_per_s"] > 0  # 2 layers x 4 heads, one pair
    assert "## patches" in (tmp_path / "gpu_profile.md").read_text()


def test_a_pass_too_large_for_the_device_is_run_again_in_halves():
    """intervene.engine.halved_on_oom: a pass that runs out of memory is split until its halves fit,
    every row computed once with the values it would have had."""
    from attnprobe.intervene.engine import halved_on_oom

    calls = []

    def run(rows):
        calls.append(len(rows))
        if len(rows) > 3:
            raise torch.OutOfMemoryError("CUDA out of memory (planted)")
        return rows * 10

    parts = halved_on_oom(run, torch.arange(10))
    assert torch.equal(torch.cat([p for p, _ in parts]), torch.arange(10))
    assert all(torch.equal(values, rows * 10) for rows, values in parts)
    assert max(len(p) for p, _ in parts) <= 3 and calls[0] == 10
    with pytest.raises(torch.OutOfMemoryError):
        halved_on_oom(lambda rows: (_ for _ in ()).throw(torch.OutOfMemoryError("always")), torch.arange(2))
