"""Shared fixtures: tiny random-initialised models of every covered family, and the bundled model."""

from __future__ import annotations

import copy
import fcntl
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

VOCAB = 100

# This machine sets PYTHONDONTWRITEBYTECODE=1: every process a test starts (a CLI run, each fork of
# the import test) would compile attnprobe's own modules from source again, since pip compiles an
# editable install's dependencies but not its source. Within the tests they are compiled once, into
# the checkout's __pycache__ folders (ignored by git), and read back by every later process.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    sys.dont_write_bytecode = False


def pytest_configure(config):
    """torch, transformers and attnprobe (~8 s of imports) load in the processes that run tests, not in
    pytest-xdist's controller, which only hands tests to its workers and would hold them back."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    _import_heavy()


def _import_heavy() -> None:
    """The modules and tables this file's helpers use, as module globals (tests import them from here)."""
    global pd, torch, T, AutoModelForCausalLM, attnprobe, TINY_CONFIGS, INTERFACE_FAMILIES
    import pandas as pd
    import torch
    import transformers as T
    from transformers import AutoModelForCausalLM

    import attnprobe

    if _FAST_LANE:
        _refuse_bundled_weights()
    # Under pytest-xdist (`make test` runs one worker per core) each worker computes with one thread,
    # and so do the attnprobe processes tests start: two workers of two threads each on two cores thrash.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    TINY_CONFIGS = _tiny_configs()
    INTERFACE_FAMILIES = [name for name in TINY_CONFIGS if name != "gpt_neo"]


def _refuse_bundled_weights() -> None:
    """The fast lane (ATTNPROBE_FAST=1, `make test-fast`) loads no bundled model: any load of a
    GGUF file or of the dequantised bundled weights fails the test that asked for it (mark it slow)."""
    from_pretrained = AutoModelForCausalLM.from_pretrained
    cache = str(attnprobe.model.bundled.cache_dir().resolve())

    def refuse(source, *args, **kwargs):
        if kwargs.get("gguf_file") or str(Path(source).resolve()).startswith(cache):
            raise RuntimeError(f"the fast lane loads no bundled model ({source}); mark this test slow")
        return from_pretrained(source, *args, **kwargs)

    AutoModelForCausalLM.from_pretrained = refuse


# examples per hypothesis fuzzer: 1,000 in `make test` (its time budget), 100 in the fast lane (the
# quick check while working); more with, e.g., ATTNPROBE_FUZZ_EXAMPLES=20000 make test
_FAST_LANE = os.environ.get("ATTNPROBE_FAST") == "1"
FUZZ_EXAMPLES = int(os.environ.get("ATTNPROBE_FUZZ_EXAMPLES", "100" if _FAST_LANE else "1000"))


def _tiny_configs() -> dict:
    """Two-layer configs that exercise each family's quirks (GQA, partial rotary, windows,
    soft-capping...)."""
    small = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    return {
        "gpt2": T.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64),
        "gpt2_inverse_layer_scale": T.GPT2Config(
            n_embd=32,
            n_layer=2,
            n_head=4,
            vocab_size=VOCAB,
            n_positions=64,
            scale_attn_by_inverse_layer_idx=True,
        ),
        "gpt_neox": T.GPTNeoXConfig(**small, rotary_pct=0.5, max_position_embeddings=64),
        "opt": T.OPTConfig(
            hidden_size=32,
            num_hidden_layers=2,
            ffn_dim=64,
            num_attention_heads=4,
            word_embed_proj_dim=32,
            vocab_size=VOCAB,
            max_position_embeddings=64,
        ),
        "llama": T.LlamaConfig(
            **small,
            num_key_value_heads=2,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
        "mistral": T.MistralConfig(**small, num_key_value_heads=2, sliding_window=4),
        "qwen2": T.Qwen2Config(**small, num_key_value_heads=2),
        "qwen3": T.Qwen3Config(**small, num_key_value_heads=2, head_dim=8),
        "gemma2": T.Gemma2Config(
            **small,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=4,
            attn_logit_softcapping=5.0,
            query_pre_attn_scalar=16,
        ),
        "gemma3": T.Gemma3TextConfig(
            **small,
            num_key_value_heads=1,
            head_dim=8,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "phi": T.PhiConfig(**small, partial_rotary_factor=0.5, qk_layernorm=True),
        "gpt_neo": T.GPTNeoConfig(  # does not route through AttentionInterface: eager fallback
            vocab_size=VOCAB,
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            window_size=4,
            max_position_embeddings=64,
        ),
    }


def build_tiny(
    name: str,
    attn_implementation: str = "attnprobe",
    dtype=None,
    seed: int = 0,
    vocab_size: int = VOCAB,
):
    """A random-initialised model (float32 unless `dtype`); a large init range gives peaked attention so
    mistakes show."""
    dtype = dtype or torch.float32
    config = copy.deepcopy(TINY_CONFIGS[name])
    config.vocab_size = vocab_size
    config.initializer_range = 0.3
    config.bos_token_id = config.eos_token_id = config.pad_token_id = 0
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    if attn_implementation == "attnprobe":
        attnprobe.attention.capture.enable(model)
    else:
        model.set_attn_implementation(attn_implementation)
    return model


def planted_covariate(model, n: int, seed: int, site, direction: int = 0, m: int = 200):
    """Random sequences of 3 to 8 tokens and a covariate planted in the model's own activations:
    `site(bank)` (N, D) of each sequence, along its principal direction `direction` (scaled to unit
    SD) plus noise of SD 0.3; the first `m` sequences with their last token 7 or 9 as control prompts
    labelled +1 / -1, in halves of pairs. Returns (bank, covariate, control, sign, half)."""
    import numpy as np
    import torch

    from attnprobe.intervene.engine import record

    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    sequences = [
        torch.randint(1, vocab, (int(t),), generator=g) for t in torch.randint(3, 9, (n,), generator=g)
    ]
    bank = record(model, sequences)
    z = site(bank).double()
    w = torch.linalg.svd(z - z.mean(0), full_matrices=False).Vh[direction]
    noise = 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    x = ((z - z.mean(0)) @ w / (z @ w).std() + noise).numpy()
    labelled = [torch.cat([s[:-1], torch.tensor([7 if i % 2 else 9])]) for i, s in enumerate(sequences[:m])]
    sign, half = np.where(np.arange(m) % 2, 1.0, -1.0), (np.arange(m) // 2) % 2
    return bank, x, record(model, labelled), sign, half


def eager_twin(model):
    """The same weights with transformers' own eager attention (the reference for captured weights)."""
    twin = AutoModelForCausalLM.from_config(copy.deepcopy(model.config)).to(model.dtype).eval()
    twin.load_state_dict(model.state_dict())
    twin.set_attn_implementation("eager")
    return twin


def padded_batch(lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids (B, T) with right padding (pad id 0) and the matching 0/1 mask."""
    generator = torch.Generator().manual_seed(seed)
    T_ = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), T_), generator=generator)
    mask = torch.zeros(len(lengths), T_, dtype=torch.long)
    for b, length in enumerate(lengths):
        mask[b, :length] = 1
        ids[b, length:] = 0
    return ids, mask


@pytest.fixture(scope="session")
def smollm():
    """The bundled SmolLM2-135M (dequantised once, then loaded from the safetensors cache)."""
    return attnprobe.load_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm_tokenizer():
    """The bundled model's tokenizer alone (no weights are loaded)."""
    return attnprobe.model.load_tokenizer("smollm2-135m")[0]


# one server per test process, with attnprobe's commands and the libraries they load imported once
# (each forked command then starts in 0.1 s, not the 5 s of a fresh interpreter's imports); the
# registries of plug-ins are not read there, so a command still finds those on its own path
FORKS = multiprocessing.get_context("forkserver")
FORKS.set_forkserver_preload(
    ["attnprobe.cli", "torch", "transformers", "transformers.models.llama.modeling_llama", "pandas"]
    + ["attnprobe.run.execute", "attnprobe.edits.sweep.command"]
)


def run_cli_logged(args: list[str], log: str, path: tuple[str, ...] = ()) -> None:
    """In a forked process: `attnprobe ARGS` from the CLI's first line, as `python -m attnprobe` runs
    it, its stdout and stderr written to the file `log`; `path`: folders put first on sys.path (as
    PYTHONPATH would)."""
    from attnprobe.cli import main

    sys.path[:0] = path
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    main(args, prog_name="attnprobe")


def forked_cli(args, log, path=()) -> multiprocessing.Process:
    """`attnprobe ARGS` in a process of its own, started (forked from a server that imported attnprobe
    once: without the interpreter's 5-6 s of imports a process; signals reach it as they would a
    terminal's). Its exit code is `exitcode` once joined; what it printed, the file `log`."""
    process = FORKS.Process(
        target=run_cli_logged, args=([str(a) for a in args], str(log), tuple(str(p) for p in path))
    )
    process.start()
    return process


def made_once(tmp_path_factory, name: str, make) -> Path:
    """The directory `name`, made once for the whole test session: under pytest-xdist the first
    worker to ask makes it (`make(folder)`) holding a lock while the others wait, then all read it
    (tests copy it before changing anything)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's base directory, the workers' common parent
    folder, made = root / name, root / f"{name}.made"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            made.touch()
    return folder


@pytest.fixture(scope="session")
def tiny_llama_dir(smollm_tokenizer, tmp_path_factory):
    """A tiny random Llama (2 layers x 2 heads) saved with the bundled tokenizer, so real suites run
    through the real CLI in seconds."""

    def make(folder):
        config = T.LlamaConfig(
            vocab_size=len(smollm_tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
        )
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        smollm_tokenizer.save_pretrained(folder)

    return made_once(tmp_path_factory, "tiny-llama", make)


def save_tiny_with_tokenizer(folder, tokenizer):
    """A tiny eager Llama saved with `tokenizer` (every token has a row): a local checkpoint directory."""
    model = build_tiny(
        "llama", attn_implementation="eager", vocab_size=len(tokenizer)
    )  # every token has a row
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


CHROMIUM = shutil.which("chromium")


def chromium(*args, url):
    """Headless Chromium with networking off; returns (stdout, stderr)."""
    profile = tempfile.mkdtemp()
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--proxy-server=127.0.0.1:9",
        "--enable-logging=stderr",
        "--v=0",
        f"--user-data-dir={profile}",
        *args,
        url,
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    shutil.rmtree(profile, ignore_errors=True)
    return result.stdout, result.stderr


TABLE = (
    "occupation\tbls_pct_female\tsector\ninspector\t6.4\tpublic\nmachinist\t6.7\tprivate\n"
    "nurse\t88.5\tpublic\npainter\t5.7\tprivate\ncashier\t71\tprivate\n"
)


def suite_file(tmp_path, where, extra=""):
    (tmp_path / "jobs.tsv").write_text(TABLE)
    path = tmp_path / "suite.yaml"
    path.write_text(
        textwrap.dedent(f"""\
        name: where
        contrast: pronoun
        slots:
          occupation: {{table: jobs.tsv, column: occupation}}
          pronoun:
            forms: [nom]
            values: [{{label: female, nom: she}}, {{label: male, nom: he}}]
        templates:
          - id: said
            text: "The {{occupation}} said that {{pronoun.nom}} left."
            where: "{where}"
        next_token:
          - {{cut: pronoun, candidates: pronoun}}
        """)
        + textwrap.dedent(extra)
    )
    return path


EFFECTS = """\
    head_effects:
      cut: pronoun
      positive: {positive}
      negative: male
      counterfactual: {{occupation: woman}}
    """


def no_weights(monkeypatch):
    """Make any weights load in the run fail the test: errors must come before the weights."""

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the configuration error")

    monkeypatch.setattr(attnprobe.run, "load_model", refuse)


EFFECT_SUITE = """\
name: fx
slots:
  occupation: {values: [nurse, engineer, teacher, doctor, lawyer, farmer, baker, pilot, chef, judge]}
  pronoun: {values: [{label: female, value: she}, {label: male, value: he}]}
contrast: pronoun
templates:
  - {id: said, text: "The {occupation} said that {pronoun} left."}
attention: [{source: pronoun, targets: occupation}]
next_token: [{cut: pronoun, candidates: pronoun}]
head_effects: {cut: pronoun, positive: female, negative: male, counterfactual: {occupation: woman}}
"""


def transformers_tokenizer(folder):
    from attnprobe.model import load_tokenizer

    return load_tokenizer(str(folder))[0]


def run_shipped(name: str, model_dir, tmp_path):
    """`attnprobe run probes/<name>.yaml` (its data copied beside it) on `model_dir` into tmp_path/o,
    through the real CLI; returns the Run."""
    from click.testing import CliRunner

    from attnprobe.cli import main

    shutil.copytree(f"probes/{name}", tmp_path / name)
    shutil.copy(f"probes/{name}.yaml", tmp_path / f"{name}.yaml")
    out = tmp_path / "o"
    result = CliRunner().invoke(
        main, ["run", str(tmp_path / f"{name}.yaml"), "--model", str(model_dir), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    return attnprobe.Run(out)


def one_line_error(result, *phrases):
    """Exit 2, no traceback, and exactly one error line, the last (progress lines such as
    'dequantising ...' or 'statistics: ...' may precede it), holding every phrase."""
    assert (
        result.exit_code == 2
        and isinstance(result.exception, SystemExit)
        and "Traceback" not in result.output
    ), result.output
    lines = result.output.strip().splitlines()
    assert [line for line in lines if line.startswith("attnprobe: error:")] == lines[-1:], result.output
    assert all(p in lines[-1] for p in phrases), result.output


OCCUPATIONS = [
    ("nurse", 88), ("secretary", 93), ("librarian", 79), ("cashier", 71), ("teacher", 70), ("baker", 60),
    ("lawyer", 37), ("chef", 22), ("pilot", 9), ("plumber", 2), ("carpenter", 3), ("mechanic", 2),
]  # fmt: skip


def _small_control(source: Path, target: Path, pairs_per_set: int = 6) -> None:
    """The shipped control file cut to its first pairs of each set (every frame of them): the same
    layout at 60 prompts instead of 160, as the tiny-model tests need no more."""
    header, *rows = source.read_text().splitlines()
    kept, seen = [header], {}
    for row in rows:
        pair, group = row.split("\t")[2:4]
        if pair in seen.setdefault(group, []) or len(seen[group]) < pairs_per_set:
            seen[group] += [pair] if pair not in seen[group] else []
            kept.append(row)
    target.write_text("\n".join(kept) + "\n")


def edit_suite(tmp_path):
    """A small pronoun suite with a covariate, a control block and head effects: what `attnprobe edit`
    needs, on 12 occupations x 2 templates."""
    rows = "".join(f"{o}\t{p}\n" for o, p in OCCUPATIONS)
    (tmp_path / "jobs.tsv").write_text("occupation\tbls_pct_female\n" + rows)
    _small_control(Path("probes/edits/definitional.tsv"), tmp_path / "definitional.tsv")
    path = tmp_path / "e.yaml"
    path.write_text(
        textwrap.dedent("""\
        name: e
        contrast: pronoun
        slots:
          occupation: {table: jobs.tsv, column: occupation}
          pronoun: {values: [{label: female, value: she}, {label: male, value: he}]}
        templates:
          - {id: said, text: "The {occupation} said that {pronoun} left."}
          - {id: told, text: "The {occupation} told us that {pronoun} was tired."}
        attention: [{source: pronoun, targets: occupation}]
        next_token: [{cut: pronoun, candidates: pronoun}]
        analysis:
          contrast: pronoun
          positive: female
          negative: male
          clusters: [occupation, template]
          covariate: occupation.bls_pct_female
        control:
          file: definitional.tsv
          words: {female: " she", male: " he"}
          pair: pair
          set: set
          fit: nouns
          phrase: phrase
        head_effects:
          cut: pronoun
          positive: female
          negative: male
          counterfactual: {occupation: [woman, man, person]}
        """)
    )
    return path


EDIT_SWEEP = [
    "--kinds",
    "zero,mean,scale,project",
    "--k",
    "1,2",
    "--draws",
    "3",
    "--texts",
    "8",  # of the 64 openings: the tiny model's full vocabulary makes each text's KL dear
    "--stream",
    "--stream-layers",
    "--mlp",
    "--trace",
    "--paths",
    "--sequential",
]
# the sweep the resume and interruption tests repeat: paths resume through the same phase code as the
# stream (the shared swept run keeps them)
EDIT_SWEEP_NO_PATHS = [a for a in EDIT_SWEEP if a != "--paths"]


def unswept_copy(run, tmp_path):
    """A copy of a swept run without its sweep."""
    shutil.copytree(run, tmp_path / "run", ignore=shutil.ignore_patterns("edits*", "edit_frontier*"))
    return tmp_path / "run"


def same_edit_tables(a, b):
    """The edit tables of two run directories are equal to the bit (but the wall-time column)."""
    read = lambda run, name: pd.read_parquet(run / f"{name}.parquet").drop(columns="seconds", errors="ignore")
    for name in ("edits", "edits_draws", "edits_items"):
        pd.testing.assert_frame_equal(read(a, name), read(b, name), check_exact=True, obj=name)


@pytest.fixture(scope="session")
def swept_run(tiny_llama_dir, tmp_path_factory):
    """(directory, suite, run) of the edit suite run on the tiny Llama and swept with EDIT_SWEEP, once
    for every test that reads a sweep (copy the run before changing it)."""
    from click.testing import CliRunner

    from attnprobe.cli import main

    def make(tmp):
        suite, out = edit_suite(tmp), tmp / "run"
        args = ["run", str(suite), "--model", str(tiny_llama_dir), "--out", str(out), "--no-report"]
        assert CliRunner().invoke(main, args).exit_code == 0
        result = CliRunner().invoke(main, ["edit", str(out), *EDIT_SWEEP])
        assert result.exit_code == 0, result.output

    tmp = made_once(tmp_path_factory, "swept", make)
    suite, out = tmp / "e.yaml", tmp / "run"  # as edit_suite writes them
    return tmp, suite, out


@pytest.fixture(scope="session")
def edited_run(swept_run):
    """The swept run's directory: the edit suite's run on the tiny Llama and its uninterrupted sweep
    (the reference tables of the resume and interruption tests; copy it before changing it)."""
    return swept_run[2]
