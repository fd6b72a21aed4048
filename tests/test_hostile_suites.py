"""Fuzzing the suite loader and expander: any input loads or raises SuiteError, in one line, fast."""

import re
import string
import textwrap

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnprobe.suite import RESERVED_COLUMNS, SuiteError, load_suite

KEYS = [
    "name",
    "description",
    "model",
    "contrast",
    "slots",
    "templates",
    "sentences",
    "attention",
    "next_token",
    "max_prompts",
    "values",
    "table",
    "column",
    "forms",
    "id",
    "text",
    "where",
    "source",
    "targets",
    "cut",
    "candidates",
    "file",
    "spans",
    "source_agg",
    "target_agg",
    "label",
    "nom",
    "acc",
]
SLOT_TEXT = st.text(alphabet=string.ascii_letters + " {}.[]|!=<>'\"-_\n\t\u202e\u0301😀", max_size=40)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**7), st.floats(allow_nan=True), SLOT_TEXT)
NODES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(KEYS), SLOT_TEXT), children, max_size=5),
    ),
    max_leaves=25,
)


def template_suite(slot_values, template_text, where, max_prompts):
    """A structurally plausible suite with fuzzed contents: reaches expansion, spans and measures."""
    return {
        "name": "fuzz",
        "contrast": "p",
        "max_prompts": max_prompts,
        "slots": {
            "a": {"values": slot_values},
            "p": {"forms": ["nom"], "values": [{"label": "f", "nom": "she"}, {"label": "m", "nom": "he"}]},
        },
        "templates": [{"id": "t", "text": template_text, "where": where}],
        "attention": [{"source": "p", "targets": ["a"]}],
        "next_token": [{"cut": "p", "candidates": "p"}],
    }


def check(path, text):
    path.write_text(text, encoding="utf-8")
    try:
        suite = load_suite(path)
    except SuiteError as error:
        message = str(error)
        # file:line: message, where the file is the suite or one of its data files
        assert (
            re.match(rf"{re.escape(str(path.parent))}/[^:/]+(:\d+)?: \S", message) and "\n" not in message
        ), message
        return None
    for prompt in suite.prompts:  # spans always point at their slot's text
        for start, end in prompt.spans.values():
            assert 0 <= start <= end <= len(prompt.text)
    return suite


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=NODES)
def test_arbitrary_yaml_documents(tmp_path, doc):
    check(tmp_path / "s.yaml", yaml.safe_dump(doc, allow_unicode=True))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.text(max_size=300))
def test_arbitrary_text(tmp_path, raw):
    check(tmp_path / "s.yaml", raw)


@settings(max_examples=700, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    values=st.lists(SCALARS, max_size=6),
    text=SLOT_TEXT.map(lambda t: t + " {p.nom}"),
    where=st.one_of(st.just([]), st.lists(SLOT_TEXT, max_size=2)),
    max_prompts=st.integers(1, 50),
)
def test_fuzzed_templates_and_slots(tmp_path, values, text, where, max_prompts):
    suite = check(
        tmp_path / "s.yaml",
        yaml.safe_dump(template_suite(values, text, where, max_prompts), allow_unicode=True),
    )
    if suite is not None:
        assert len(suite.prompts) <= max_prompts


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(table=st.text(alphabet=string.printable + "é😀", max_size=200))
def test_fuzzed_table_files(tmp_path, table):
    (tmp_path / "t.tsv").write_text(table, encoding="utf-8")
    check(
        tmp_path / "s.yaml",
        "name: x\nslots:\n  a: {table: t.tsv}\ntemplates:\n  - {id: t, text: 'The {a}.'}\n",
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sentences=st.lists(st.text(alphabet="ab []\t|", max_size=20), max_size=4))
def test_fuzzed_sentence_files(tmp_path, sentences):
    (tmp_path / "s.tsv").write_text("text\n" + "\n".join(sentences) + "\n", encoding="utf-8")
    check(tmp_path / "x.yaml", "name: x\nsentences:\n  - {id: s, file: s.tsv, spans: [a, b]}\n")


# Sentence files as people export them: colliding column names, quotes, CRLF, a BOM, U+2028 (a line
# separator to Python's str.splitlines, not to csv), named and unnamed spans, numbered lines.
COLUMNS = st.sampled_from(
    [
        "prompt_id",
        "item_id",
        "n_tokens",
        "a_char_start",
        "a",
        "b",
        "version",
        "pair",
        "note",
        "=cmd",
        "x y",
        "",
        "text",
    ]
)
WORDS = st.text(alphabet="ab \"'-.:\u2028\u0085é😀=", max_size=8)  # a cell without the delimiter
SENTENCE = st.lists(
    st.one_of(
        WORDS,
        WORDS,
        WORDS,
        WORDS.map(lambda w: f"[{w}]"),
        WORDS.map(lambda w: f"[b: {w}]"),
        st.sampled_from(["[", "]", ",", "\t", ",", "\t"]),
    ),
    min_size=1,
    max_size=5,
).map("".join)
NEWLINE = st.sampled_from(["\n", "\r\n", "\n", "\r\n", "\r", "\u2028"])


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    columns=st.lists(COLUMNS, max_size=3),
    rows=st.lists(
        st.tuples(st.integers(0, 99), SENTENCE, st.lists(WORDS, max_size=3)), min_size=1, max_size=4
    ),
    newline=NEWLINE,
    bom=st.booleans(),
    suffix=st.sampled_from([".tsv", ".csv", ".txt"]),
    entry=st.sampled_from(
        [
            "spans: [a]",
            "spans: [a, c]",
            "numbered: true",
            "pattern: '(?P<key>\\d+)[.] (?P<text>.*)'",
            "pair: pair",
            "column: v",
        ]
    ),
)
def test_fuzzed_exported_sentence_files(tmp_path, columns, rows, newline, bom, suffix, entry):
    delimiter = "," if suffix == ".csv" else "\t"
    suffix = ".txt" if "numbered" in entry or "pattern" in entry else suffix
    if suffix == ".txt":  # plain lines, numbered or not
        lines = [f"{n}. {text}" if "numbered" in entry or "pattern" in entry else text for n, text, _ in rows]
    else:
        lines = [delimiter.join(["text", *columns])] + [
            delimiter.join([text, *(cells + [""] * 3)[: len(columns)]]) for _, text, cells in rows
        ]
    (tmp_path / f"s{suffix}").write_bytes(
        (("\ufeff" if bom else "") + newline.join(lines) + newline).encode("utf-8")
    )
    suite = check(tmp_path / "x.yaml", f"name: x\nsentences:\n  - {{id: s, file: s{suffix}, {entry}}}\n")
    for prompt in suite.prompts if suite else ():
        span_columns = {
            f"{n}{end}"
            for n in prompt.spans
            for end in ("_char_start", "_char_end", "_tok_start", "_tok_end")
        }
        written = [*RESERVED_COLUMNS, *prompt.slots, *prompt.meta, *span_columns]
        assert len(written) == len(set(written)), written  # no column of prompts.csv is written twice
        assert "\ufeff" not in prompt.text and not any(c.startswith("\ufeff") for c in prompt.meta)


# Data paths as a careless or hostile suite writes them: climbing out, absolute, home, special files.
SECRET = "SECRET-VALUE-42"
DATA_PATH = st.one_of(
    st.sampled_from(
        [
            "../secret.tsv",
            "/proc/self/environ",
            "/dev/zero",
            "/dev/stdin",
            "~/.bashrc",
            "fifo.tsv",
            "link.tsv",
            "dir",
            "ok.tsv",
            "./ok.tsv",
            "sub/../ok.tsv",
            "sub/../../secret.tsv",
            "",
            ".",
            "ok.tsv\n",
        ]
    ),
    st.text(alphabet="./~\\%:*?-_ab😀\x01", min_size=1, max_size=24),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(relative=DATA_PATH)
def test_fuzzed_data_paths(tmp_path, relative):
    import os

    root = tmp_path / "suite"
    if not root.is_dir():
        root.mkdir()
        (root / "sub").mkdir()
        (root / "dir").mkdir()
        (root / "ok.tsv").write_text("a\nnurse\n")
        (tmp_path / "secret.tsv").write_text(f"a\n{SECRET}\n")
        os.mkfifo(root / "fifo.tsv")
        (root / "link.tsv").symlink_to(tmp_path / "secret.tsv")
    text = yaml.safe_dump(
        {"name": "x", "slots": {"a": {"table": relative}}, "templates": [{"id": "t", "text": "The {a}."}]}
    )
    suite = check(root / "x.yaml", text)
    if suite is not None:  # only the file inside the suite's directory can load
        assert [p.text for p in suite.prompts] == ["The nurse."]
    else:
        with pytest.raises(SuiteError) as error:
            load_suite(root / "x.yaml")
        assert SECRET not in str(error.value) and "PATH=" not in str(error.value)


def test_expansion_bound_refuses_huge_suites_quickly(tmp_path):
    import time

    values = ", ".join(f"w{i}" for i in range(200))
    text = textwrap.dedent(f"""\
        name: big
        slots:
          a: [{values}]
          b: [{values}]
          c: [{values}]
        templates:
          - {{id: t, text: "{{a}} {{b}} {{c}}"}}
        """)
    path = tmp_path / "s.yaml"
    path.write_text(text)
    start = time.perf_counter()
    with pytest.raises(SuiteError, match=r"s.yaml:6: the suite would expand to more than 1,000,000 prompts"):
        load_suite(path)  # 200^3 = 8,000,000 prompts
    assert time.perf_counter() - start < 5  # refused before expanding anything
