"""Fuzzing the suite loader and expander: any input loads or raises SuiteError, in one line, fast."""

import functools
import re
import string
import textwrap

import pytest
import yaml
from conftest import FUZZ_EXAMPLES
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from attnprobe.suite import RESERVED_COLUMNS, SuiteError, key_table, load_suite

# every key any block may hold (the one table load_suite checks against), and a few slot words
KEYS = sorted({key for keys in key_table().values() for key in keys} | {"label", "nom", "acc"})
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


@settings(
    max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
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


LONG = " word" * 2100  # past the tiny model's context of 2,048


@pytest.mark.parametrize(
    "suite, old, new, what",
    [
        (
            "winogender-style.yaml",
            "prompt: \" Here, '{pronoun}' refers to the\"",
            f"prompt: \"{LONG} '{{pronoun}}' refers to the\"",
            "the referent_choice question",
        ),
        (
            "choices.yaml",
            '{prompt: " Answer:"}',
            f'{{prompt: "{LONG} Answer:"}}',
            "the question and its options",
        ),
    ],
)
def test_a_scored_continuation_past_the_context_is_refused_before_weights_load(
    tiny_llama_dir, tmp_path, suite, old, new, what
):
    """Issue 32: a referent-choice question that pushed prompts past the model's context was a
    traceback in the middle of the run; now `check` (and `run`, before loading weights) says which
    prompt and what to shorten."""
    import shutil

    from click.testing import CliRunner

    from attnprobe.cli import main

    shutil.copytree("probes", tmp_path / "probes")
    path = tmp_path / "probes" / suite
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new))
    result = CliRunner().invoke(main, ["check", str(path), "--model", str(tiny_llama_dir)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert f"with {what}" in result.output and "more than the model's context of 2,048" in result.output


@functools.cache
def _cached_tokenizer(spec, trust_remote_code=False):
    """The real load_tokenizer, read once per spec: the fuzzer plans a thousand suites."""
    from attnprobe.model import load_tokenizer

    return load_tokenizer(spec, trust_remote_code=trust_remote_code)


# Round-2 formats together (issue 32): paired numbered files (counts and numbers that may not match,
# a blank first line), declared and optional spans (reserved or non-ASCII names among them), `mark`,
# the analysis block, referent choice and head effects, each drawn from valid and broken variants.
# Property: `check` (load_suite, plan_run with the bundled tokenizer, describe) ends in a suite or in
# one `file:line:` line, never a traceback; a suite that loads pairs line n of pro with line n of anti.
PAIR_SENTENCE = st.tuples(
    st.sampled_from(["nurse", "mechanic", "carpenter", "baker", "x"]),
    st.sampled_from(["hired the baker because", "met the nurse as", "called", ""]),
    st.sampled_from(["[he]"] * 8 + ["[she]"] * 8 + ["he", "[he] lost [his]", "[she] [her] [it] [x]"]),
).map(lambda t: f"The [{t[0]}] {t[1]} {t[2]} left.")
# a valid suite of each shape, then up to two faults (a part replaced by a broken or degenerate one)
VALID = {
    "spans": st.sampled_from(
        ["spans: [referent, pronoun]", "spans: [referent, pronoun]\n    optional_spans: [pronoun_2]"]
    ),
    "mark": st.just("mark: {other: occupation}"),
    "analysis": st.sampled_from(
        [
            "analysis: {contrast: version, positive: pro, negative: anti, referents: [referent, other], "
            "answer: referent}",
            "analysis: {contrast: version, positive: pro, negative: anti, referents: [referent, other], "
            "answer: referent, clusters: [template]}",
        ]
    ),
    "attention": st.sampled_from(
        [
            "attention: [{source: pronoun, targets: [referent, other]}]",
            "attention: [{source: pronoun, targets: [referent]}]",
        ]
    ),
    "referent_choice": st.sampled_from(["", "referent_choice: {prompt: \" '{pronoun}' is the\"}"]),
    "head_effects": st.just(""),
}
FAULTS = [
    ("spans", "spans: [referent]"),
    ("spans", "spans: [text, pronoun]"),
    ("spans", "spans: [referent, referent]"),
    ("spans", "spans: [référent, pronoun]"),
    ("spans", "spans: [referent, pronoun]\n    optional_spans: pronoun_2"),
    ("mark", ""),
    ("mark", "mark: {other: nosuch}"),
    ("mark", "mark: {pronoun: occupation}"),
    ("analysis", ""),
    ("analysis", "analysis: {contrast: version, positive: pro, negative: nosuch}"),
    ("analysis", "analysis: {contrast: version, positive: pro, negative: anti, groups: {all: [f1]}}"),
    ("analysis", "analysis: {contrast: version, positive: pro, negative: anti, held_out: 0}"),
    ("analysis", "analysis: {contrast: version, positive: pro, negative: anti, covariate: referent.x}"),
    ("attention", "attention: [{source: pronoun_2, targets: [referent]}]"),
    ("referent_choice", "referent_choice: {prompt: \" '{nosuch}' is the\"}"),
    ("head_effects", "head_effects: {counterfactual: pair, max_items: 4}"),
    (
        "head_effects",
        "head_effects: {cut: pronoun, positive: pro, negative: anti, counterfactual: {referent: woman}}",
    ),
]


@settings(
    max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sentences=st.lists(PAIR_SENTENCE, min_size=1, max_size=3),
    numbers=st.sampled_from(["same"] * 4 + ["offset", "fewer", "repeated", "blank first line", "unnumbered"]),
    valid=st.fixed_dictionaries(VALID),
    faults=st.lists(st.sampled_from(FAULTS), max_size=2),
)
def test_fuzzed_round_two_formats(tmp_path, monkeypatch, sentences, numbers, valid, faults):
    from attnprobe.run import RunOptions, plan_run
    from attnprobe.run import plan as plan_module
    from attnprobe.run.describe import describe

    monkeypatch.setattr(plan_module, "load_tokenizer", _cached_tokenizer)
    parts = {**valid, **dict(faults)}
    pro = [f"{n + 1} {s}" for n, s in enumerate(sentences)]
    anti = [line.replace("[he]", "[X]").replace("[she]", "[he]").replace("[X]", "[she]") for line in pro]
    numbered = numbers != "unnumbered"
    if numbers == "offset":
        anti = [f"{int(a.split(' ', 1)[0]) + 1} {a.split(' ', 1)[1]}" for a in anti]
    elif numbers == "fewer":
        anti = anti[:-1]
    elif numbers == "repeated":
        anti = anti[:1] + anti
    elif numbers == "unnumbered":
        pro, anti = [p.split(" ", 1)[1] for p in pro], [a.split(" ", 1)[1] for a in anti]
    elif numbers == "blank first line":
        anti = [""] + anti
    (tmp_path / "pro.txt").write_text("\n".join(pro) + "\n")
    (tmp_path / "anti.txt").write_text("\n".join(anti) + "\n")
    (tmp_path / "jobs.tsv").write_text("occupation\tbls_pct_female\nnurse\t88\nmechanic\t1\nbaker\t60\n")
    entry = "\n    ".join(p for p in (parts["spans"], parts["mark"]) if p)
    text = (
        "name: fuzz\nslots:\n  occupation: {table: jobs.tsv}\nsentences:\n  - id: f1\n"
        f"    files: {{pro: pro.txt, anti: anti.txt}}\n    numbered: {str(numbered).lower()}\n    {entry}\n"
        + "".join(
            f"{parts[key]}\n"
            for key in ("analysis", "attention", "referent_choice", "head_effects")
            if parts[key]
        )
    )
    suite = check(tmp_path / "x.yaml", text)
    if suite is None:
        event("refused by load_suite: " + _refusal(tmp_path / "x.yaml"))  # see --hypothesis-show-statistics
        return
    try:
        plan = plan_run(suite, "smollm2-135m", RunOptions(out=str(tmp_path / "out")))
        describe(plan)
    except SuiteError as error:
        assert re.match(rf"{re.escape(str(tmp_path))}/[^:/]+(:\d+)?: \S", str(error)), str(error)
        assert "\n" not in str(error)
        event("refused by plan_run")
        return
    event("planned")
    by_version = {}
    for prompt in suite.prompts:  # pairing never shifts: line n of pro with line n of anti
        by_version.setdefault(prompt.item_id, {})[prompt.meta["version"]] = prompt.text
    for pair in by_version.values():
        if len(pair) == 2:
            assert pair["pro"].replace("she", "he") == pair["anti"].replace("she", "he")


def _refusal(path) -> str:
    try:
        load_suite(path)
    except SuiteError as error:
        return re.sub(r"'[^']*'|\d+", "_", str(error).split(": ", 1)[1])[:60]
    return "?"
