"""Published benchmark files read by their format, not their layout (issues 40 and 41): CSV parsed
as a whole file (quoted line breaks, commas and quotes in cells, CRLF, BOM), StereoSet keyed by
example id (one line equals indented), BBQ's nested fields type-checked; every refusal one line
naming the file and the line where the record starts."""

import csv
import io
import json
import string

import pandas as pd
import pytest
from conftest import FUZZ_EXAMPLES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnprobe
from attnprobe.errors import SuiteError
from attnprobe.report import write_report
from attnprobe.suite import load_suite
from attnprobe.suite.files.rows import delimited_rows

HEADER = ["", "sent_more", "sent_less", "stereo_antistereo", "bias_type", "annotations"]
# Rows as CrowS-Pairs publishes them (written for attnprobe): the third holds a quoted line break
# inside a cell, as row 1293 of crows_pairs_anonymized.csv does; others hold commas and quotes.
CROWS = [
    ["0", "She was a nurse, gentle and kind.", "He was a nurse, gentle and kind.", "stereo", "gender", "[]"],
    ["1", 'The old man said "no" again.', 'The young man said "no" again.', "stereo", "age", "[['age']]"],
    [
        "2",
        "Bob was denied because he was poor\n.",
        "Bob was denied because he was rich\n.",
        "stereo",
        "socioeconomic",
        "",
    ],
    [
        "3",
        "Poor people steal, everyone knows.",
        "Rich people steal, everyone knows.",
        "antistereo",
        "socioeconomic",
        "",
    ],
]


def _write_crows(path, rows=CROWS, newline="\n", bom=False):
    buffer = io.StringIO(newline="")
    csv.writer(buffer, lineterminator=newline).writerows([HEADER, *rows])
    path.write_bytes((("\ufeff" if bom else "") + buffer.getvalue()).encode())


def _crows_suite(tmp_path):
    (tmp_path / "s.yaml").write_text(
        "name: crows\nfirst_token: bos\nsentences:\n"
        "  - {id: crows, file: crows.csv, columns: {sent_more: more, sent_less: less}}\n"
        "analysis: {contrast: version, positive: more, negative: less, clusters: [item]}\n"
        "likelihood: {by: bias_type}\n"
    )
    return tmp_path / "s.yaml"


@pytest.mark.parametrize("newline, bom", [("\n", False), ("\r\n", True)])
def test_a_crows_pairs_csv_with_quoted_line_breaks_reads_cell_for_cell(tmp_path, newline, bom):
    _write_crows(tmp_path / "crows.csv", newline=newline, bom=bom)
    suite = load_suite(_crows_suite(tmp_path))
    assert len(suite.prompts) == 8 and len({p.item_id for p in suite.prompts}) == 4
    texts = {(p.meta["bias_type"], p.meta["version"]): p.text for p in suite.prompts}
    assert texts[("age", "more")] == 'The old man said "no" again.'
    assert texts[("gender", "less")] == "He was a nurse, gentle and kind."
    # the quoted line break stays inside the sentence; the row is numbered by its first line
    broken = [p for p in suite.prompts if p.meta["version"] == "more" and "Bob" in p.text][0]
    assert broken.text == "Bob was denied because he was poor\n." and broken.origin.endswith("crows.csv:4")
    after = [p for p in suite.prompts if p.text.startswith("Poor")][0]
    assert after.origin.endswith("crows.csv:7")  # lines 4-6 hold the record with two line breaks


def test_a_published_format_named_reads_as_its_columns_spelled_out(tmp_path):
    """`columns: crows_pairs` (suite.files.formats.FORMATS) is the mapping a user would spell out; a name
    that is no published format of that key is one line listing those that are."""
    _write_crows(tmp_path / "crows.csv")
    spelled = load_suite(_crows_suite(tmp_path)).prompts
    path = _crows_suite(tmp_path)
    path.write_text(path.read_text().replace("{sent_more: more, sent_less: less}", "crows_pairs"))
    named = load_suite(path).prompts
    assert [(p.text, p.meta, p.spans) for p in named] == [(p.text, p.meta, p.spans) for p in spelled]
    path.write_text(path.read_text().replace("crows_pairs", "bbq"))  # a format of `choices`, not `columns`
    with pytest.raises(SuiteError, match=r"s.yaml:4: .*published format: stereoset, crows_pairs$"):
        load_suite(path)


def test_a_crows_pairs_csv_with_quoted_line_breaks_runs_end_to_end(tiny_llama_dir, tmp_path):
    _write_crows(tmp_path / "crows.csv")
    run = attnprobe.run_suite(
        _crows_suite(tmp_path), model=str(tiny_llama_dir), out=tmp_path / "o", progress=False
    )
    assert len(run.likelihood) == 8 and run.likelihood["logprob"].notna().all()
    assert "Sentence preference" in write_report(run.directory).read_text()
    table = pd.read_csv(tmp_path / "o" / "sentence_preference.csv")
    assert set(table.loc[table["by"] == "bias_type", "value"]) == {"gender", "age", "socioeconomic"}


@pytest.mark.parametrize(
    "text, message",
    [
        (
            'sent_more,sent_less,bias_type\n"A b c.","A d c.",x\n"An open quote,A e c.,y\nmore,text,z\n',
            r"crows.csv:3: a quote opened in the row starting on this line is never closed",
        ),
        (  # a stray quote inside a quoted cell: pandas reads 'He said hi" to me."', another sentence
            'sent_more,sent_less,bias_type\n"A b c.","A d c.",x\n"He said "hi" to me.","A e.",y\n',
            r"crows.csv:3: a quote ends a quoted cell before its end .* double each quote",
        ),
        (
            "sent_more,sent_less,sent_more\nA b c.,A d c.,x\n",
            r"crows.csv:1: the header names column 'sent_more' twice",
        ),
        (
            'sent_more,sent_less,bias_type\n"A\nb c.","A d c.",x\n"A b","A c"\n',
            r"crows.csv:4: 2 cells but the header has 3",
        ),
    ],
)
def test_a_damaged_csv_is_one_line_naming_where_the_record_starts(tmp_path, text, message):
    (tmp_path / "crows.csv").write_text(text)
    with pytest.raises(SuiteError, match=message):
        load_suite(_crows_suite(tmp_path))


CELL = st.text(alphabet=string.ascii_letters + ' ,"\n\r\t#-é', max_size=12)


@settings(
    max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    width=st.integers(1, 5),
    data=st.data(),
    newline=st.sampled_from(["\n", "\r\n"]),
)
def test_fuzzed_csv_written_by_the_csv_module_reads_back_cell_for_cell(tmp_path, width, data, newline):
    """Random valid CSV (quoted line breaks, commas and quotes inside cells) written by Python's csv
    module reads back cell for cell; rows the reader skips by rule (blank, or a first cell starting
    with '#') are left out of what is written."""
    header = [f"c{k}" for k in range(width)]
    row = st.lists(CELL, min_size=width, max_size=width).filter(
        lambda r: any(c.strip() for c in r) and not r[0].startswith("#")
    )
    rows = data.draw(st.lists(row, max_size=6))
    if newline == "\n":  # the writer quotes only the terminator's characters: a bare CR would end a row
        rows = [[c.replace("\r", "") for c in r] for r in rows]
        rows = [r for r in rows if any(c.strip() for c in r) and not r[0].startswith("#")]
    buffer = io.StringIO(newline="")
    csv.writer(buffer, lineterminator=newline).writerows([header, *rows])
    path = tmp_path / "f.csv"
    read = delimited_rows(path, buffer.getvalue(), needed=())
    assert [list(record.values()) for _, record in read] == rows
    starts = [n for n, _ in read]
    assert starts == sorted(starts) and all(n >= 2 for n in starts)


def _stereoset_file(path, examples, indent):
    doc = {"version": "1.0-test", "data": {"intersentence": [], "intrasentence": examples}}
    path.write_text(json.dumps(doc, indent=indent))


def _stereoset_example(k, context, words):
    labels = ("stereotype", "anti-stereotype", "unrelated")
    return {
        "id": f"{k:032x}",
        "target": "nurse",
        "bias_type": "profession",
        "context": context,
        "sentences": [
            {"sentence": context.replace("BLANK", w), "id": f"s{k}{i}", "labels": [], "gold_label": g}
            for i, (g, w) in enumerate(zip(labels, words))
        ],
    }


EXAMPLES = [
    _stereoset_example(1, "The nurse was BLANK.", ["gentle", "rough", "purple"]),
    _stereoset_example(2, "An engineer is BLANK.", ["logical", "emotional", "wet"]),
    _stereoset_example(3, "My grandfather is BLANK.", ["stubborn", "flexible", "round"]),
]


def _stereoset_suite(tmp_path, examples, indent):
    _stereoset_file(tmp_path / "dev.json", examples, indent)
    (tmp_path / "s.yaml").write_text(
        "name: stereoset\nfirst_token: bos\nsentences:\n  - {id: intra, file: dev.json, columns: stereoset}\n"
        "analysis: {contrast: version, positive: stereotype, negative: anti-stereotype, clusters: [item]}\n"
        "likelihood: {}\n"
    )
    return load_suite(tmp_path / "s.yaml")


def test_stereoset_on_one_line_reads_as_the_same_file_indented(tmp_path):
    """StereoSet's dev.json is written by json.dump on one line: items are keyed by the example's
    id, so the one-line file gives the same prompts and items as the indented one."""
    one_line = _stereoset_suite(tmp_path, EXAMPLES, None)
    assert (tmp_path / "dev.json").read_text().count("\n") == 0
    indented = _stereoset_suite(tmp_path, EXAMPLES, 2)
    fields = lambda s: [(p.item_id, p.text, p.meta["version"], p.spans) for p in s.prompts]
    assert fields(one_line) == fields(indented)
    assert len({p.item_id for p in one_line.prompts}) == 3 and len(one_line.prompts) == 9


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d[1].update(id=d[0]["id"]), r"dev.json:1: example 2 repeats id '0+1' of example 1"),
        (lambda d: d[2].pop("id"), r"dev.json:1: example 3 has no `id`"),
    ],
)
def test_a_missing_or_repeated_stereoset_id_is_one_error_naming_it(tmp_path, change, message):
    examples = json.loads(json.dumps(EXAMPLES))
    change(examples)
    with pytest.raises(SuiteError, match=message):
        _stereoset_suite(tmp_path, examples, None)


def test_bbq_nested_fields_of_the_wrong_type_are_one_line(tmp_path):
    rows = [json.loads(line) for line in open("probes/choices/choices.jsonl")][:3]
    rows[1]["answer_info"] = [["grandfather", "old"], ["grandson", "nonOld"]]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "s.yaml").write_text(
        "name: q\nsentences: [{id: q, file: q.jsonl, choices: bbq}]\nmultiple_choice: {}\n"
    )
    with pytest.raises(SuiteError, match=r"q.jsonl:2 \(example_id \d+\): answer_info must map ans0..ans2"):
        load_suite(tmp_path / "s.yaml")
    rows[1] = dict(rows[0], additional_metadata={"stereotyped_groups": "old"})
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SuiteError, match=r"q.jsonl:2 .*stereotyped_groups must be a list"):
        load_suite(tmp_path / "s.yaml")


WORD = st.text(alphabet=string.ascii_letters, min_size=1, max_size=8)
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


def _loads_or_refuses(tmp_path, name):
    """The suite loads, or a SuiteError names the data file: never another exception."""
    try:
        return load_suite(tmp_path / "s.yaml")
    except SuiteError as error:
        assert name in str(error) or "s.yaml" in str(error), str(error)
        return None


@settings(
    max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    words=st.lists(st.tuples(WORD, WORD, WORD), min_size=1, max_size=4, unique_by=lambda t: t[0]),
    indent=st.sampled_from([None, 1, 2]),
    damage=st.one_of(
        st.none(), st.tuples(st.integers(0, 3), st.sampled_from(["id", "sentences", "target"]), ANY_JSON)
    ),
)
def test_fuzzed_stereoset_json_reads_the_same_in_any_layout_or_is_one_error(tmp_path, words, indent, damage):
    """Random StereoSet-shaped files (1,000 examples): written on one line or indented they give the
    same prompts; a field replaced by any JSON value is read or refused as a SuiteError naming the file."""
    examples = [
        _stereoset_example(k, f"The {a} person was BLANK.", [a + "x", b + "y", c + "z"])
        for k, (a, b, c) in enumerate(words, start=1)
    ]
    if damage is None:
        one = _stereoset_suite(tmp_path, examples, None)
        again = _stereoset_suite(tmp_path, examples, indent)
        assert [(p.item_id, p.text) for p in one.prompts] == [(p.item_id, p.text) for p in again.prompts]
        assert len(one.prompts) == 3 * len(examples)
        return
    k, field, value = damage
    examples[k % len(examples)][field] = value
    _stereoset_file(tmp_path / "dev.json", examples, indent)
    (tmp_path / "s.yaml").write_text(
        "name: stereoset\nsentences:\n  - {id: intra, file: dev.json, columns: stereoset}\nlikelihood: {}\n"
    )
    _loads_or_refuses(tmp_path, "dev.json")


BBQ_FIELDS = [
    "context",
    "question",
    "ans0",
    "label",
    "answer_info",
    "additional_metadata",
    "question_polarity",
]


@settings(
    max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    picks=st.lists(st.integers(0, 23), min_size=1, max_size=5),
    damage=st.one_of(st.none(), st.tuples(st.integers(0, 4), st.sampled_from(BBQ_FIELDS), ANY_JSON)),
)
def test_fuzzed_bbq_jsonl_is_read_or_one_error(tmp_path, picks, damage):
    """Random BBQ-shaped files (1,000 examples) from the shipped questions, one field replaced by any
    JSON value: read, or refused as a SuiteError naming the file (never a traceback)."""
    rows = [json.loads(line) for line in open("probes/choices/choices.jsonl")]
    chosen = [dict(rows[i], example_id=n) for n, i in enumerate(picks)]
    if damage is not None:
        k, field, value = damage
        chosen[k % len(chosen)][field] = value
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chosen))
    (tmp_path / "s.yaml").write_text(
        "name: q\nsentences: [{id: q, file: q.jsonl, choices: bbq}]\nmultiple_choice: {}\n"
    )
    suite = _loads_or_refuses(tmp_path, "q.jsonl")
    if damage is None:
        assert suite is not None and len(suite.prompts) == len(picks)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r: r.pop("answer_info"), r"q.jsonl:2 .*no answer_info; .*keep them in the row"),
        (lambda r: r.pop("additional_metadata"), r"q.jsonl:2 .*no additional_metadata"),
        (lambda r: r["answer_info"].pop("ans1"), r"q.jsonl:2 .*answer_info must map ans0..ans2"),
        (
            lambda r: r.pop("question_polarity"),
            r"q.jsonl:2 .*question_polarity is None; BBQ's values are neg and",
        ),
        (
            lambda r: r.update(context_condition="ambiguous"),
            r"context_condition is 'ambiguous'.*ambig and disambig",
        ),
        (lambda r: r.update(ans2=r["ans0"]), r"q.jsonl:2 .*two options read .*distinct answers"),
    ],
)
def test_bbq_rows_that_would_change_the_numbers_silently_are_one_error(tmp_path, change, message):
    """A row without answer_info would count as never biased, an unknown spelling of the condition
    would form a third scope, identical options would give the tie to the first (issue 55)."""
    rows = [json.loads(line) for line in open("probes/choices/choices.jsonl")][:3]
    change(rows[1])
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "s.yaml").write_text(
        "name: q\nsentences: [{id: q, file: q.jsonl, choices: bbq}]\nmultiple_choice: {}\n"
    )
    with pytest.raises(SuiteError, match=message):
        load_suite(tmp_path / "s.yaml")


def test_bbq_values_in_another_case_are_read_as_bbq_spells_them(tmp_path):
    rows = [json.loads(line) for line in open("probes/choices/choices.jsonl")][:3]
    rows[0].update(question_polarity="NEG", context_condition="Ambig")
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "s.yaml").write_text(
        "name: q\nsentences: [{id: q, file: q.jsonl, choices: bbq}]\nmultiple_choice: {}\n"
    )
    first = load_suite(tmp_path / "s.yaml").prompts[0]
    assert (first.meta["polarity"], first.meta["condition"]) == ("neg", "ambig")
