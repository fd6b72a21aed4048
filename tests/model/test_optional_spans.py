"""Benchmarks as distributed: lines that carry a varying number of unnamed [bracketed] spans (a
second pronoun in some lines), declared as optional trailing names (`optional_spans: [pronoun_2]`)."""

import pandas as pd
import pytest
from click.testing import CliRunner

from attnprobe.cli import main
from attnprobe.errors import SuiteError
from attnprobe.suite import load_suite

SUITE = """\
name: optional
slots:
  occupation: {values: [developer, designer, nurse, mechanic, hairdresser, carpenter]}
sentences:
  - id: t1
    files: {pro: pro.txt, anti: anti.txt}
    numbered: true
    spans: [referent, pronoun]
    optional_spans: [pronoun_2]
    mark: {other: occupation}
analysis: {contrast: version, positive: pro, negative: anti}
attention: [{source: pronoun, targets: [referent, other]}]
"""
PRO = (
    "1 [The developer] argued with the designer because [he] did not like the design.\n"
    "2 The nurse thanked [the mechanic] because [he] came quickly.\n"
    "3 [The hairdresser] called the carpenter because [she] needed to cut [her] hair.\n"
)


def write(tmp_path, pro=PRO, suite=SUITE):
    (tmp_path / "pro.txt").write_text(pro)
    (tmp_path / "anti.txt").write_text(
        pro.replace("[he]", "[x]").replace("[she]", "[he]").replace("[x]", "[she]")
    )
    (tmp_path / "s.yaml").write_text(suite)
    return tmp_path / "s.yaml"


def test_lines_with_two_and_three_brackets_read_with_an_optional_span(tmp_path):
    suite = load_suite(write(tmp_path))
    spans = [
        {k: p.text[a:b] for k, (a, b) in p.spans.items() if k != "other"}
        for p in suite.prompts
        if p.meta["version"] == "pro"
    ]
    assert spans == [
        {"referent": "The developer", "pronoun": "he"},
        {"referent": "the mechanic", "pronoun": "he"},
        {"referent": "The hairdresser", "pronoun": "she", "pronoun_2": "her"},
    ]
    assert (
        "sentences 't1': 4 lines with 2, 2 lines with 3 unnamed [bracketed] spans (optional: pronoun_2)"
        in suite.notes
    )


@pytest.mark.parametrize(
    "line, count",
    [("4 [The nurse] met [the] carpenter as [he] left [his] car.\n", 4), ("4 Only [the nurse] here.\n", 1)],
)
def test_a_line_with_more_or_fewer_spans_than_allowed_is_one_error_naming_file_and_line(
    tmp_path, line, count
):
    with pytest.raises(
        SuiteError, match=rf"pro.txt:4: {count} unnamed bracketed span\(s\) but `spans:` names 2 to 3"
    ):
        load_suite(write(tmp_path, PRO + line))


def test_optional_spans_are_names(tmp_path):
    with pytest.raises(SuiteError, match=r"s.yaml:\d+: `optional_spans` lists the names of unnamed spans"):
        load_suite(
            write(tmp_path, suite=SUITE.replace("optional_spans: [pronoun_2]", "optional_spans: pronoun_2"))
        )


def test_check_reports_the_counts_and_run_keeps_the_optional_span(tmp_path, tiny_llama_dir):
    path = write(tmp_path)
    check = CliRunner().invoke(main, ["check", str(path), "--model", str(tiny_llama_dir)])
    assert check.exit_code == 0, check.output
    assert "note: sentences 't1': 4 lines with 2, 2 lines with 3 unnamed [bracketed] spans" in check.output
    run = CliRunner().invoke(
        main,
        ["run", str(path), "--model", str(tiny_llama_dir), "--out", str(tmp_path / "out"), "--no-progress"],
    )
    assert run.exit_code == 0, run.output
    prompts = pd.read_csv(tmp_path / "out" / "prompts.csv")
    assert prompts["pronoun_2_tok_start"].notna().sum() == 2  # the third item's two versions
    attention = pd.read_parquet(tmp_path / "out" / "attention.parquet")
    assert set(attention["prompt_id"]) == set(prompts["prompt_id"])  # every line was measured


def test_a_line_of_20000_repeated_inline_names_is_refused_at_once(tmp_path):
    """Issue 32: repeated inline names were renamed in quadratic time (20,000 took minutes)."""
    import time

    line = "1 The [referent: nurse] said [pronoun: she] " + " ".join("[s: w]" for _ in range(20_000)) + "\n"
    started = time.perf_counter()
    with pytest.raises(SuiteError, match=r"pro.txt:1: 20,002 bracketed spans, more than 64 in one sentence"):
        load_suite(write(tmp_path, line))
    assert time.perf_counter() - started < 5
    from attnprobe.suite.files.sentences import parse_marked

    started = time.perf_counter()  # below the cap, repeated names stay linear: s, s_2, s_3, ...
    spans = parse_marked(" ".join("[s: w]" for _ in range(64)), "line")[1]
    assert list(spans)[:3] == ["s", "s_2", "s_3"] and "s_64" in spans
    assert list(parse_marked("[s: a] [s_2: b] [s: c]", "line")[1]) == ["s", "s_2", "s_3"]
