"""attnprobe run: the tidy outputs, their numbers against eager attention, resume after SIGKILL."""

import os
import signal
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from conftest import forked_cli
from transformers import AutoModelForCausalLM, LlamaConfig

import attnprobe
from attnprobe.cli import main
from attnprobe.errors import RunError
from attnprobe.model import from_pretrained_objects
from attnprobe.suite import SuiteError

SKIP = ("head_effects", "direct_attribution")  # the phases of their own these runs do not read

GENDER = "probes/gender.yaml"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_run(smollm, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    return attnprobe.run_suite(
        GENDER,
        model=smollm,
        out=out,
        limit=90,
        batch_size=8,
        chunk_size=32,
        progress=False,
        skip=SKIP,
    )


def test_outputs_follow_the_contract(small_run, smollm):
    prompts, attention, logprobs = small_run.prompts, small_run.attention, small_run.logprobs
    assert len(prompts) == 90 and prompts["template_id"].nunique() == 14  # spread over every template
    assert list(attention.columns) == ["prompt_id", "layer", "head", "source", "target", "weight"]
    assert list(logprobs.columns) == ["prompt_id", "cut", "candidate", "candidate_label", "logprob"]
    L, H = smollm.info.n_layers, smollm.info.n_heads
    two_entity = prompts["participant"].notna()
    # pronoun -> occupation and the token before the pronoun -> occupation always, participant where present
    expected_rows = L * H * (2 * len(prompts) + two_entity.sum())
    assert len(attention) == expected_rows
    assert attention.groupby(["prompt_id", "source", "target"]).size().eq(L * H).all()
    assert set(attention["source"]) == {"pronoun", "before_pronoun"}
    assert set(logprobs["candidate_label"]) == {"female", "male", "neutral"}
    # three candidates per prompt; five where " her" is both acc and poss (her vs him + his, them + their)
    ambiguous = prompts["template_id"].isin(["left_keys", "thanked_praised", "thanked_gift"])
    assert len(logprobs) == 3 * len(prompts) + 2 * ambiguous.sum()
    for row in prompts.itertuples():
        assert row.text[row.pronoun_char_start : row.pronoun_char_end].lower() in {
            "she",
            "he",
            "they",
            "her",
            "him",
            "his",
            "them",
            "their",
        }
    m = small_run.manifest
    assert m.status == "complete" and m.model.weights_sha256 == smollm.info.source_sha256
    assert m.suite.sha256 and m.versions["torch"] == torch.__version__ and m.dtype == "float32"


def test_weights_equal_eager_attention_of_each_prompt_alone(small_run, smollm):
    """Spot check: recompute the documented aggregation from HF eager output_attentions."""
    prompts = small_run.prompts.set_index("prompt_id")
    attention = small_run.attention.set_index(
        ["prompt_id", "source", "target", "layer", "head"]
    ).sort_index()["weight"]
    sample = list(prompts.index[::9])
    smollm.model.set_attn_implementation("eager")
    try:
        worst = 0.0
        for pid in sample:
            row = prompts.loc[pid]
            ids = smollm.tokenizer(row.text, return_tensors="pt")["input_ids"]
            assert ids.shape[1] == row.n_tokens
            with torch.no_grad():
                eager = torch.stack(smollm.model(input_ids=ids, output_attentions=True).attentions)[
                    :, 0
                ]  # (L, H, T, T)
            before = slice(row.pronoun_tok_start - 1, row.pronoun_tok_start)  # the position predicting it
            for source, src, target in (
                ("pronoun", slice(row.pronoun_tok_start, row.pronoun_tok_end), "occupation"),
                ("pronoun", slice(row.pronoun_tok_start, row.pronoun_tok_end), "participant"),
                ("before_pronoun", before, "occupation"),
            ):
                if pd.isna(row[f"{target}_tok_start"]):
                    continue
                tgt = slice(int(row[f"{target}_tok_start"]), int(row[f"{target}_tok_end"]))
                expected = (
                    eager[:, :, src, tgt].sum(-1).mean(-1)
                )  # sum over target tokens, mean over source tokens
                got = torch.tensor(attention.loc[(pid, source, target)].to_numpy()).view_as(expected)
                worst = max(worst, (got - expected).abs().max().item())
        assert worst <= 1e-5
    finally:
        smollm.model.set_attn_implementation("attnprobe")


def test_logprobs_equal_a_direct_forward(small_run, smollm):
    prompts = small_run.prompts.set_index("prompt_id")
    for pid, group in list(small_run.logprobs.groupby("prompt_id"))[:5]:
        row = prompts.loc[pid]
        ids = smollm.tokenizer(row.text, return_tensors="pt")["input_ids"][:, : row.pronoun_tok_start]
        with torch.no_grad():
            logp = torch.log_softmax(smollm.model(input_ids=ids).logits[0, -1], -1)
        for candidate, value in zip(group["candidate"], group["logprob"]):
            token = smollm.tokenizer(candidate, add_special_tokens=False)["input_ids"]
            assert len(token) == 1 and abs(logp[token[0]].item() - value) <= 1e-5


def test_multi_token_candidates_sum_their_tokens(smollm, tmp_path):
    suite = tmp_path / "s.yaml"
    suite.write_text(
        textwrap.dedent("""\
        name: multi
        slots:
          job: [nurse]
        templates:
          - {id: a, text: "The {job} said that she left."}
        next_token:
          - {cut: job, candidates: [" nurse", " pharmacologist"]}
        """)
    )
    run = attnprobe.run_suite(suite, model=smollm, out=tmp_path / "out", progress=False)
    value = run.logprobs.set_index("candidate")["logprob"]
    tokens = smollm.tokenizer(" pharmacologist", add_special_tokens=False)["input_ids"]
    assert len(tokens) > 1
    prefix = smollm.tokenizer("The", return_tensors="pt")["input_ids"]
    ids = torch.cat([prefix, torch.tensor([tokens])], dim=1)
    with torch.no_grad():
        logp = torch.log_softmax(smollm.model(input_ids=ids).logits[0], -1)
    expected = sum(logp[prefix.shape[1] - 1 + i, t].item() for i, t in enumerate(tokens))
    assert abs(value[" pharmacologist"] - expected) <= 1e-4


def test_prompt_longer_than_context_is_refused_before_running(smollm, tmp_path):
    config = LlamaConfig(
        vocab_size=len(smollm.tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=6,
    )
    tiny = from_pretrained_objects(AutoModelForCausalLM.from_config(config), smollm.tokenizer, "tiny")
    with pytest.raises(
        SuiteError, match=r"gender.yaml:\d+: prompt \d+ has \d+ tokens, more than the model's context of 6"
    ):
        attnprobe.run_suite(
            GENDER,
            model=tiny,
            out=tmp_path / "x",
            limit=3,
            progress=False,
            skip=SKIP,
        )
    assert not (tmp_path / "x").exists()  # nothing written, nothing run


def test_candidate_that_tokenises_to_nothing(tmp_path):
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[PAD]": 1, "the": 2, "nurse": 3, "said": 4, "she": 5}
    core = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    core.normalizer = normalizers.Replace("~", "")  # a tokenizer that drops '~' entirely
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]")
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(
            vocab_size=6, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        )
    )
    suite = tmp_path / "s.yaml"
    suite.write_text(
        'name: t\nslots:\n  job: [nurse]\ntemplates:\n  - {id: a, text: "the {job} said she"}\n'
        'next_token:\n  - {cut: job, candidates: [" she", " ~"]}\n'
    )
    with pytest.raises(SuiteError, match=r"s.yaml:7: candidate ' ~' tokenises to nothing"):
        attnprobe.run_suite(
            suite, model=from_pretrained_objects(model, tokenizer, "w"), out=tmp_path / "o", progress=False
        )


def test_sigkill_then_resume_gives_identical_outputs(tmp_path):
    repo = Path(__file__).resolve().parents[2]
    args = [
        "run",
        str(repo / GENDER),
        "--limit",
        "80",
        "--batch-size",
        "4",
        "--chunk-size",
        "8",
        "--no-head-effects",
        "--skip",
        "direct_attribution",
        "--no-report",  # the run's own files are compared
    ]
    reference = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "whole")])  # uninterrupted: here
    assert reference.exit_code == 0, reference.output

    killed = forked_cli([*args, "--out", tmp_path / "killed"], tmp_path / "killed.log")
    chunks = tmp_path / "killed" / "chunks"
    deadline = time.time() + 300
    while len(list(chunks.glob("*.done"))) < 4 and time.time() < deadline and killed.is_alive():
        time.sleep(0.05)
    assert killed.is_alive(), "the run finished before it could be killed; make it longer"
    os.kill(killed.pid, signal.SIGKILL)
    killed.join()
    done_before = len(list(chunks.glob("*.done")))
    assert 4 <= done_before < 10 and not (tmp_path / "killed" / "attention.parquet").exists()

    resumed = forked_cli([*args, "--out", tmp_path / "killed"], tmp_path / "resumed.log")
    resumed.join(timeout=600)
    stderr = (tmp_path / "resumed.log").read_text()
    assert resumed.exitcode == 0, stderr
    assert f"resuming {tmp_path / 'killed'}: {done_before} of 10 chunks already complete" in stderr
    for name in ("prompts.csv", "logprobs.csv"):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "killed" / name).read_bytes()
    whole = pd.read_parquet(tmp_path / "whole" / "attention.parquet")
    again = pd.read_parquet(tmp_path / "killed" / "attention.parquet")
    pd.testing.assert_frame_equal(whole, again, check_exact=True)


def test_resume_with_other_settings_is_refused_and_fresh_replaces(smollm, tmp_path):
    attnprobe.run_suite(
        GENDER,
        model=smollm,
        out=tmp_path,
        limit=6,
        progress=False,
        skip=SKIP,
    )
    with pytest.raises(RunError, match="holds a run with other settings .* rerun with --fresh"):
        attnprobe.run_suite(
            GENDER,
            model=smollm,
            out=tmp_path,
            limit=9,
            progress=False,
            skip=SKIP,
        )
    run = attnprobe.run_suite(
        GENDER,
        model=smollm,
        out=tmp_path,
        limit=9,
        resume=False,
        progress=False,
        skip=SKIP,
    )
    assert len(run.prompts) == 9


def test_cli_run_reports_and_bad_suite_is_one_line(tmp_path):
    runner = CliRunner()
    result = runner.invoke(
        main,
        [
            "run",
            GENDER,
            "--limit",
            "12",
            "--out",
            str(tmp_path / "o"),
            "--no-progress",
            "--no-head-effects",
            "--skip",
            "direct_attribution",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "12 prompts on smollm2-135m" in result.output and "prompts/s" in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntemplates:\n  - {id: a, text: 'The {job}.'}\n")
    result = runner.invoke(main, ["run", str(bad)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output.strip() == f"attnprobe: error: {bad}:3: unknown slot '{{job}}'; defined slots: none"


def test_forward_stops_after_the_last_token_a_measure_reads(smollm, tmp_path):
    """Causal models: tokens after the last span read and the last cut change no result, so they are not
    forwarded."""
    from attnprobe.run.plan import encode_prompts
    from attnprobe.suite import load_suite

    suite = tmp_path / "s.yaml"
    suite.write_text(
        textwrap.dedent("""\
        name: cut
        slots:
          job: [nurse, carpenter]
          pronoun: [she, he]
        templates:
          - {id: a, text: "The {job} said that {pronoun} would leave early today."}
        attention:
          - {source: pronoun, targets: [job]}
          - {source: job, targets: [pronoun]}
        """)
    )
    loaded = load_suite(suite)
    for e in encode_prompts(loaded, list(loaded.prompts), smollm.tokenizer, None):
        assert e.n_forward == e.spans["pronoun"][1] < len(e.ids)
    run = attnprobe.run_suite(suite, model=smollm, out=tmp_path / "out", progress=False)
    weights = run.attention.groupby(["source", "target"])["weight"]
    assert weights.max()[("job", "pronoun")] == 0.0  # a query never sees a later key
    assert weights.min()[("pronoun", "job")] > 0.0
    gender = load_suite(GENDER)
    e = encode_prompts(gender, list(gender.prompts[:1]), smollm.tokenizer, None)[0]
    assert e.n_forward == e.spans["pronoun"][1]  # gender: up to the pronoun (its row); the cut is before it
