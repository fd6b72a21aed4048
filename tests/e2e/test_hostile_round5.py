"""Round 5's hostile inputs that were tracebacks (issue 55): each now one line and exit 2."""

import json

import pytest
import torch
import transformers as T
from click.testing import CliRunner
from conftest import FUZZ_EXAMPLES, one_line_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from attnprobe.cli import main

MINIMAL = "probes/minimal.yaml"


@pytest.fixture(scope="module")
def finished_run(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "r"
    result = CliRunner().invoke(main, ["run", MINIMAL, "--model", str(tiny_llama_dir), "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_compare_of_a_damaged_manifest_or_into_an_impossible_out_is_one_line(finished_run, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    result = CliRunner().invoke(
        main, ["compare", str(finished_run), str(finished_run), "--out", str(blocked / "c")]
    )
    one_line_error(result, "--out", "cannot create it", "choose a writable directory")
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    manifest = json.loads((finished_run / "manifest.json").read_text())
    del manifest["suite"]["sha256"]
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["compare", str(finished_run), str(damaged)])
    one_line_error(result, "manifest.json: suite.sha256 is missing or not a str", "--fresh")


def test_compare_and_a_writer_of_one_of_its_runs_exclude_each_other(finished_run, tiny_llama_dir, tmp_path):
    """run --fresh while compare read gave a compare.json naming the old model beside the new model's
    numbers: compare reads under a shared lock that a writer's exclusive lock excludes."""
    from attnprobe.store import exclusive, shared

    with exclusive(finished_run):  # a run --fresh or an edit writing it
        result = CliRunner().invoke(
            main, ["compare", str(finished_run), str(finished_run), "--out", str(tmp_path / "c")]
        )
    one_line_error(result, "is being written by another attnprobe command", "read it again")
    assert not (tmp_path / "c").exists()
    with shared(finished_run):  # a compare reading it
        args = ["run", MINIMAL, "--model", str(tiny_llama_dir), "--out", str(finished_run), "--fresh"]
        result = CliRunner().invoke(main, args)
    one_line_error(result, "another attnprobe command (a run, an edit or a compare) is using")
    assert (finished_run / "manifest.json").exists()  # nothing removed
    result = CliRunner().invoke(
        main, ["compare", str(finished_run), str(finished_run), "--out", str(tmp_path / "c")]
    )
    assert result.exit_code == 0 and json.loads((tmp_path / "c" / "compare.json").read_text())["a"]["model"]


def test_probe_out_under_a_file_is_one_line(tiny_llama_dir, tmp_path):
    (tmp_path / "doc.txt").write_text("The nurse said that [she] was late.\n")
    (tmp_path / "a-file").write_text("")
    args = ["probe", str(tmp_path / "doc.txt"), "--model", str(tiny_llama_dir)]
    result = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "a-file" / "x.csv")])
    one_line_error(result, "--out", "cannot create its directory")


@pytest.mark.parametrize("tokens", [100, 10**12])
def test_verify_long_beyond_the_context_is_refused_before_any_text_is_built(
    smollm_tokenizer, tmp_path, tokens
):
    """A GPT-2 of 64 positions: --long 100 was an IndexError, --long 10**12 a MemoryError."""
    config = T.GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=64, vocab_size=len(smollm_tokenizer))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gpt2")
    smollm_tokenizer.save_pretrained(tmp_path / "gpt2")
    result = CliRunner().invoke(main, ["verify", "--model", str(tmp_path / "gpt2"), "--long", str(tokens)])
    one_line_error(result, f"--long {tokens:,} is more than the model's context of 64 tokens")


def test_one_attention_pair_declared_twice_is_a_file_line_error(tmp_path):
    """Two entries with one source and target (other aggregations) wrote two rows per key that later
    tables averaged (issue 55)."""
    from attnprobe.errors import SuiteError
    from attnprobe.suite import load_suite

    suite = (
        open(MINIMAL)
        .read()
        .replace(
            "  - {source: pronoun, targets: [occupation]}",
            "  - {source: pronoun, targets: [occupation]}\n"
            "  - {source: pronoun, targets: occupation, source_agg: last}",
        )
    )
    (tmp_path / "s.yaml").write_text(suite)
    (tmp_path / "occupations-bls.tsv").write_text(open("probes/occupations-bls.tsv").read())
    with pytest.raises(SuiteError, match=r"s.yaml:\d+: .*attention pronoun -> occupation is declared twice"):
        load_suite(tmp_path / "s.yaml")


def test_edited_with_a_string_or_an_unfitted_edit_is_one_error(tiny_llama_dir):
    import attnprobe as ap
    from attnprobe.errors import AttnprobeError

    pm = ap.load_model(str(tiny_llama_dir))
    with pytest.raises(AttnprobeError, match="'zero' is not an edit; give an edit of attnprobe.edits"):
        with ap.edited(pm, "zero"):
            pass
    with pytest.raises(AttnprobeError, match="the mean edit lacks means; fit it"):
        with ap.edited(pm, ap.edits.Mean(heads=((0, 0),))):
            pass


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(ks=5), "ks 5: give a list of whole numbers"),
        (dict(kinds="zero"), "kinds 'zero': give a list of kind names"),
        (dict(draws=10**9), "--draws 1000000000: give a whole number from 0 to 10,000"),
        (dict(alone=-1), "--alone -1: give a whole number from 0 to 1,000"),
        (dict(ks=(1, True)), "give a list of whole numbers"),
    ],
)
def test_edit_options_of_the_wrong_type_or_size_are_refused_before_any_work(options, message):
    """Run.edit(ks=5) was a TypeError after 20-40 s of recording; --draws 10**9 ran without a word."""
    from attnprobe.edits import EditOptions
    from attnprobe.errors import AttnprobeError

    with pytest.raises(AttnprobeError, match=message):
        EditOptions(**options)


def test_probe_refuses_a_fifo_and_a_text_larger_than_any_context(tiny_llama_dir, tmp_path):
    import os

    os.mkfifo(tmp_path / "fifo")
    result = CliRunner().invoke(main, ["probe", str(tmp_path / "fifo"), "--model", str(tiny_llama_dir)])
    one_line_error(result, "not a regular file")
    big = tmp_path / "big.txt"
    with big.open("wb") as fh:  # sparse: no disk is written
        fh.truncate(17 * 2**20)
    result = CliRunner().invoke(main, ["probe", str(big), "--model", str(tiny_llama_dir)])
    one_line_error(result, "more than 16,777,216", "give a shorter text")


def test_a_csv_cell_past_the_field_limit_is_a_file_line_error(tmp_path):
    from attnprobe.errors import SuiteError
    from attnprobe.suite.files.rows import delimited_rows

    text = "text\nok\n" + "x" * 200_000 + "\n"
    with pytest.raises(SuiteError, match=r"big.csv:3: field larger than field limit"):
        delimited_rows(tmp_path / "big.csv", text)


def test_json_nested_too_deep_is_a_file_line_error(tmp_path):
    from attnprobe.errors import SuiteError
    from attnprobe.suite.files.formats import stereoset_rows
    from attnprobe.suite.files.rows import jsonl_rows

    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(SuiteError, match=r"q.jsonl:2: JSON nested too deep"):
        jsonl_rows(tmp_path / "q.jsonl", '{"text": "ok"}\n' + deep + "\n")
    with pytest.raises(SuiteError, match=r"dev.json:1: JSON nested too deep"):
        stereoset_rows(tmp_path / "dev.json", deep)


def test_a_header_of_too_many_columns_or_a_jsonl_line_too_long_is_refused_at_once(tmp_path):
    import time

    from attnprobe.errors import SuiteError
    from attnprobe.suite.files.rows import delimited_rows, jsonl_rows

    started = time.perf_counter()
    with pytest.raises(SuiteError, match=r"wide.csv:1: the header has 1,000,000 columns, more than 1,000"):
        delimited_rows(tmp_path / "wide.csv", ",".join(f"c{i}" for i in range(10**6)) + "\ntext\n")
    with pytest.raises(SuiteError, match=r"long.jsonl:1: a line of 3,000,012 characters"):
        jsonl_rows(tmp_path / "long.jsonl", '{"text": "' + "x" * 3_000_000 + '"}\n')
    assert time.perf_counter() - started < 10


def test_resuming_after_the_weights_under_the_same_path_changed_is_refused(smollm_tokenizer, tmp_path):
    """The old tables were kept and the manifest's hash rewritten (issue 55): now one line, and the
    first run's files stay as they were."""
    from conftest import save_tiny_with_tokenizer

    model = tmp_path / "model"
    save_tiny_with_tokenizer(model, smollm_tokenizer)
    args = [
        "run",
        MINIMAL,
        "--model",
        str(model),
        "--limit",
        "20",
        "--out",
        str(tmp_path / "r"),
        "--no-report",
    ]
    assert CliRunner().invoke(main, args).exit_code == 0
    manifest = (tmp_path / "r" / "manifest.json").read_text()
    torch.manual_seed(1)
    replaced = AutoModelForCausalLM.from_pretrained(model)
    with torch.no_grad():
        for weight in replaced.parameters():
            weight.add_(0.01)
    replaced.save_pretrained(model)
    one_line_error(CliRunner().invoke(main, args), "weights of", "changed since this run began", "--fresh")
    assert (tmp_path / "r" / "manifest.json").read_text() == manifest


NOTEBOOK_CALLS = {"export": 2, "attention_matrix": 3, "plot_heads": 3, "attention_view": 1, "compare": 1}
ANY_ARGUMENT = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner),
    max_leaves=4,
)


@settings(
    max_examples=FUZZ_EXAMPLES // 4,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(call=st.sampled_from(sorted(NOTEBOOK_CALLS)), args=st.lists(ANY_ARGUMENT, min_size=3, max_size=3))
def test_fuzzed_notebook_calls_return_or_raise_one_error(finished_run, tiny_pm, tmp_path, call, args):
    """Run's methods given any values (250 examples in `make test`): a result, or one AttnprobeError
    naming the argument; never another exception (issue 55)."""
    import matplotlib.pyplot as plt

    import attnprobe as ap
    from attnprobe.errors import AttnprobeError

    run = ap.Run(finished_run)
    args = args[: NOTEBOOK_CALLS[call]]  # as many as the method takes
    if call == "export" and len(args) > 1:
        args[1] = tmp_path / str(args[1])[:20].replace("/", "_")
    keywords = {"model": tiny_pm} if call == "attention_matrix" else {}
    if call == "attention_view":
        keywords = {"html_action": "return"}
    try:
        getattr(run, call)(*args, **keywords)
    except AttnprobeError:
        pass
    finally:
        plt.close("all")


@pytest.fixture(scope="module")
def tiny_pm(tiny_llama_dir):
    import attnprobe as ap

    return ap.load_model(str(tiny_llama_dir))
