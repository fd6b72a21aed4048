"""A few sentences without a suite: ap.probe agrees with a suite run; token helpers."""

import re

import pandas as pd
import pytest

import attnprobe as ap
from attnprobe.errors import AttnprobeError, SuiteError

pytestmark = pytest.mark.slow

SENTENCES = [
    "The [occupation: nurse] said that [pronoun: she] would call back.",
    "The [occupation: mechanic] said that [pronoun: he] was late.",
]


def test_probe_equals_the_suite_attention_measure(tiny_llama_dir, tmp_path):
    (tmp_path / "s.txt").write_text("\n".join(SENTENCES) + "\n")
    (tmp_path / "s.yaml").write_text(
        "name: s\nsentences:\n  - {id: b, file: s.txt}\n"
        "attention:\n  - {source: pronoun, targets: [occupation]}\n"
    )
    pm = ap.load_model(str(tiny_llama_dir))
    run = ap.run_suite(tmp_path / "s.yaml", model=pm, out=tmp_path / "run", progress=False)
    expected = run.attention.set_index(["prompt_id", "layer", "head"])["weight"]
    table = ap.probe(pm, SENTENCES)
    assert set(table["source"]) == {"pronoun"} and set(table["span"]) == {"", "occupation", "pronoun"}
    summed = (
        table[table["span"] == "occupation"].groupby(["sentence", "layer", "head"])["weight"].sum()
    )  # sum over target tokens
    pd.testing.assert_series_equal(
        summed.rename_axis(["prompt_id", "layer", "head"]).astype("float32"),
        expected.astype("float32"),
        check_names=False,
        check_index_type=False,
        atol=1e-6,
        rtol=0,
    )
    rows = table.groupby(["sentence", "layer", "head"])["weight"].sum()
    assert (rows - 1).abs().max() < 1e-5  # each source token's attention sums to 1 over the tokens
    first = table[(table["sentence"] == 0) & (table["layer"] == 0) & (table["head"] == 0)]
    assert first["token"].tolist() == ap.str_tokens(pm, first["text"].iloc[0])


def test_token_helpers_and_unnamed_brackets(smollm):
    text = "The nurse said that she would call back."
    tokens = ap.str_tokens(smollm, text)
    start, end = ap.span_tokens(smollm, text, "nurse")
    assert "".join(tokens[start:end]).strip() == "nurse"
    assert ap.span_tokens(smollm, text, (20, 23)) == ap.span_tokens(smollm, text, "she")
    with pytest.raises(SuiteError, match="'doctor' does not occur"):
        ap.span_tokens(smollm, text, "doctor")
    table = ap.probe(smollm, ["The [nurse] said that [she]"])
    assert set(table["source"]) == {"span2"} and set(table["span"]) >= {"span1", "span2"}
    assert len(table) == 30 * 9 * len(ap.str_tokens(smollm, "The nurse said that she"))
    with pytest.raises(SuiteError, match="sentence 1: no span 'pronoun' \\(spans: span1, span2\\)"):
        ap.probe(smollm, ["The [nurse] said that [she]"], source="pronoun")


def test_quiet_run_prints_only_results(tiny_llama_dir, tmp_path):
    from click.testing import CliRunner

    from attnprobe.cli import main

    (tmp_path / "s.txt").write_text(
        "[occupation: Nurses] said that [pronoun: they] left.\n" + SENTENCES[1] + "\n"
    )
    (tmp_path / "s.yaml").write_text(
        "name: s\nsentences:\n  - {id: b, file: s.txt}\n"
        "attention:\n  - {source: pronoun, targets: [occupation]}\n"
    )
    args = ["run", str(tmp_path / "s.yaml"), "--model", str(tiny_llama_dir)]
    loud = CliRunner().invoke(
        main, args + ["--out", str(tmp_path / "a")]
    )  # not a terminal: a log line per phase and chunk
    quiet = CliRunner().invoke(main, ["-q", *args, "--no-report", "--out", str(tmp_path / "b")])
    assert loud.exit_code == quiet.exit_code == 0, quiet.output
    for phase in (
        f"loading {tiny_llama_dir} (float32)",
        "loading: weights hashed (2 of 2 steps",
        "attnprobe run: chunk 1 of 1 done, 2 of 2 prompts",
        "note: ",
        "statistics and report ...",
        "statistics: attention (1 of 8 steps",
        "statistics: referent_choice (3 of 8",
        "statistics: multiple_choice (5 of 8",
        "statistics: held_out (8 of 8",
        "report: figures of ",
        "report: written ",
        "statistics and report in ",
    ):
        assert phase in loud.output, (phase, loud.output)
    assert (
        "note: " not in quiet.output and "loading" not in quiet.output
    )  # the sink note on a target at token 0
    assert quiet.output.strip().splitlines()[-1].startswith("2 prompts on")
    both = CliRunner().invoke(main, ["-q", "-v", *args, "--no-report", "--out", str(tmp_path / "c")])
    assert both.exit_code == 2 and "-q and -v contradict each other" in both.output


@pytest.mark.parametrize(
    "sentences, batch_size, message",
    [
        ([], 8, "no sentences given"),
        ([None], 8, "sentence 1 is NoneType, not text"),
        (123, 8, "sentences is int; pass text or a list of texts"),
        ({"a": 1}, 8, "sentences is dict"),
        (["The [nurse] said that [she]"], 0, "batch_size must be a whole number of at least 1, got 0"),
        (["The [nurse] said " + "very " * 2100 + "that [she]"], 8, "more than the model's context of 2,048"),
    ],
)
def test_bad_notebook_input_is_one_line_not_a_traceback(tiny_llama_dir, sentences, batch_size, message):
    with pytest.raises(AttnprobeError, match=re.escape(message)):
        ap.probe(str(tiny_llama_dir), sentences, batch_size=batch_size)


@pytest.mark.parametrize(
    "view, options, message",
    [
        ("head_view", {"layer": 7}, "layer=7: give layer indices 0-1 (this model has 2 layers of 2 heads)"),
        ("head_view", {"heads": [0, 5]}, "heads=[0, 5]: give head indices 0-1"),
        ("head_view", {"include_layers": "all"}, "include_layers='all'"),
        ("model_view", {"include_heads": [-1]}, "include_heads=[-1]"),
        ("attention_view", {"start": (0, 9)}, "start_head=9: give head indices 0-1"),
        ("attention_view", {"start": 3}, "start=3: give (layer, head)"),
    ],
)
def test_views_refuse_layers_and_heads_outside_the_model_in_one_line(tiny_llama_dir, view, options, message):
    """Issue 40: out-of-range or mistyped layers and heads were bertviz's IndexError; now one line."""
    text = "The nurse said that [she] left." if view == "attention_view" else "The nurse said that she left."
    with pytest.raises(AttnprobeError, match=re.escape(message)):
        getattr(ap, view)(str(tiny_llama_dir), text, **options)
