"""Suite input a user gets wrong or an attacker writes: typed `where`, names that would overwrite run
columns, hostile YAML, data files outside the suite, special files, quoting, spreadsheet exports,
expansion time."""

import re
from pathlib import Path

import pytest
from conftest import suite_file

from attnprobe.errors import SuiteError
from attnprobe.suite import load_suite


def occupations(suite):
    return sorted({p.slots["occupation"] for p in suite.prompts})


def test_numeric_where_compares_numbers_not_strings(tmp_path):
    # as strings, '9.42' > '50' and '6.4' > '50' were true: inspector, machinist and painter passed
    assert occupations(load_suite(suite_file(tmp_path, "occupation.bls_pct_female > 50"))) == [
        "cashier",
        "nurse",
    ]
    assert occupations(load_suite(suite_file(tmp_path, "occupation.bls_pct_female <= 6.7"))) == [
        "inspector",
        "machinist",
        "painter",
    ]
    assert occupations(load_suite(suite_file(tmp_path, "occupation.bls_pct_female == 71"))) == [
        "cashier"
    ]  # int cell vs literal
    assert occupations(load_suite(suite_file(tmp_path, "occupation.sector == public"))) == [
        "inspector",
        "nurse",
    ]


@pytest.mark.parametrize(
    "where, message",
    [
        (
            "occupation.nope > 50",
            "slot 'occupation' has no field 'nope' (for 'inspector'; fields: bls_pct_female, sector)",
        ),
        ("occupation.sector > 50", "'occupation.sector' is not a number for 'inspector'"),
        ("occupation.sector < public", "'public' is text; compare text with == or != only"),
    ],
)
def test_bad_where_is_a_file_line_error(tmp_path, where, message):
    with pytest.raises(SuiteError) as error:
        load_suite(suite_file(tmp_path, where))
    assert str(error.value).startswith(
        f"{tmp_path / 'suite.yaml'}:11: condition '{where}'"
    ) and message in str(error.value)


NAMES_SUITE = """\
name: {name}
slots:
  {slot}: [nurse, engineer]
  pronoun: {{values: [{{label: female, value: she{meta}}}, {{label: male, value: he}}]}}
contrast: pronoun
templates:
  - {{id: t, text: "The {{{slot}}} said that {{pronoun}} left."}}
next_token:
  - {{cut: pronoun, candidates: pronoun}}
{extra}"""


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"slot": "text"}, "slot name 'text' is reserved"),
        ({"slot": "prompt_id"}, "slot name 'prompt_id' is reserved"),
        ({"slot": "pronoun_2"}, "slot name 'pronoun_2' is reserved"),
        ({"slot": "job_tok_start"}, "slot name 'job_tok_start' is reserved"),
        ({"name": "'..'"}, "not only dots"),
        ({"extra": '  - {cut: pronoun, candidates: [" x"]}\n'}, "a second next_token measure at 'pronoun'"),
        (
            {"slot": "pronoun_text", "meta": ", text: x"},
            "metadata 'pronoun_text' would overwrite",
        ),  # pronoun.text vs slot
    ],
)
def test_names_that_would_overwrite_run_columns_are_refused(tmp_path, fields, message):
    """Issue 18: a slot, span or metadata name equal to a column the run writes used to overwrite it
    and join attention to the wrong prompts, with exit 0; now refused before anything runs."""
    (tmp_path / "s.yaml").write_text(
        NAMES_SUITE.format(**{"name": "s", "slot": "job", "meta": "", "extra": "", **fields})
    )
    with pytest.raises(SuiteError, match=re.escape(message)):
        load_suite(tmp_path / "s.yaml")
    (tmp_path / "ok.yaml").write_text(NAMES_SUITE.format(name="s", slot="job", meta="", extra=""))
    assert len(load_suite(tmp_path / "ok.yaml").prompts) == 4  # the same suite with ordinary names loads


def test_sentence_columns_that_would_overwrite_run_columns_are_refused(tmp_path):
    (tmp_path / "s.tsv").write_text("text\tprompt_id\n[The nurse] said [she] left.\t7\n")
    (tmp_path / "s.yaml").write_text(
        "name: s\nsentences:\n  - {id: b, file: s.tsv, spans: [occupation, pronoun]}\n"
        "attention:\n  - {source: pronoun, targets: occupation}\n"
    )
    with pytest.raises(SuiteError, match=r"s\.tsv:2: column 'prompt_id' is a column every run writes"):
        load_suite(tmp_path / "s.yaml")


def _load_error(path: Path, text: str) -> str:
    path.write_text(text)
    with pytest.raises(SuiteError) as error:
        load_suite(path)
    return str(error.value)


def test_hostile_yaml_is_refused_quickly(tmp_path):
    """Issue 18: a 700-byte alias bomb ran for minutes; deep nesting gave a RecursionError traceback."""
    import time

    bomb = (
        "a: &a [x, x, x, x, x, x, x, x, x]\n"
        + "".join(
            f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
            f"*{chr(97 + i)}, "
            f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
            for i in range(8)
        )
        + "name: s\ndescription: *i\n"
    )
    started = time.perf_counter()
    message = _load_error(tmp_path / "bomb.yaml", bomb)
    assert time.perf_counter() - started < 1.0 and len(bomb) < 800
    assert "an alias bomb?" in message and message.startswith(f"{tmp_path / 'bomb.yaml'}:")
    assert "nested too deeply" in _load_error(
        tmp_path / "deep.yaml", "name: s\ndescription: " + "[" * 5000 + "]" * 5000 + "\n"
    )
    assert "`description` must be" in _load_error(
        tmp_path / "d.yaml", "name: s\ndescription: [a, b]\ntemplates: []\n"
    )


def test_data_files_stay_under_the_suite_directory(tmp_path):
    """Issue 18: a data path could read any file (/proc/self/environ was printed in the error)."""
    (tmp_path / "suite").mkdir()
    (tmp_path / "secret.tsv").write_text("occupation\nnurse\n")
    for relative in ("../secret.tsv", "/proc/self/environ"):
        message = _load_error(
            tmp_path / "suite" / "s.yaml",
            f"name: s\nslots:\n  occupation: {{table: '{relative}'}}\n"
            "templates:\n  - {id: t, text: 'The {occupation} left.'}\n",
        )
        assert (
            "lies outside the suite's directory" in message
            and "nurse" not in message
            and "PATH=" not in message
        )
    suite = tmp_path / "suite" / "s.yaml"  # now naming /proc/self/environ: outside every allowed root
    with pytest.raises(
        SuiteError, match="lies outside the suite's directory .* or allow its directory with --data-root"
    ):
        load_suite(suite, data_roots=[tmp_path])
    suite.write_text(
        "name: s\nslots:\n  occupation: {table: '../secret.tsv'}\ntemplates:\n  - {id: t, text: 'The "
        "{occupation} left.'}\n"
    )
    assert [p.text for p in load_suite(suite, data_roots=[tmp_path]).prompts] == ["The nurse left."]
    from click.testing import CliRunner

    from attnprobe.cli import main

    refused = CliRunner().invoke(main, ["check", str(suite)])
    assert refused.exit_code == 2 and "--data-root" in refused.output
    allowed = CliRunner().invoke(main, ["check", str(suite), "--data-root", str(tmp_path)])
    assert allowed.exit_code == 0 and "1 prompts" in allowed.output, allowed.output


def test_a_loop_of_symbolic_links_is_one_line(tmp_path):
    """Issue 32: a data file or --data-root that is a loop of links was a traceback (RuntimeError)."""
    (tmp_path / "a.tsv").symlink_to(tmp_path / "b.tsv")
    (tmp_path / "b.tsv").symlink_to(tmp_path / "a.tsv")
    suite = tmp_path / "s.yaml"
    suite.write_text(
        "name: s\nslots:\n  occupation: {table: a.tsv}\n"
        "templates:\n  - {id: t, text: 'The {occupation} left.'}\n"
    )
    assert "data file 'a.tsv' is a loop of symbolic links" in _load_error(suite, suite.read_text())
    (tmp_path / "root").symlink_to(tmp_path / "root")
    with pytest.raises(
        SuiteError, match="data root .*root' is a loop of symbolic links; give a real directory"
    ):
        load_suite(suite, data_roots=[tmp_path / "root"])
    from click.testing import CliRunner

    from attnprobe.cli import main

    refused = CliRunner().invoke(main, ["check", str(suite)])
    assert refused.exit_code == 2 and "loop of symbolic links" in refused.output
    assert len(refused.output.strip().splitlines()) == 1


def test_special_and_oversized_data_files_are_refused_before_reading(tmp_path):
    import os
    import time

    def suite(table):
        return (
            f"name: s\nslots:\n  occupation: {{table: '{table}'}}\n"
            "templates:\n  - {id: t, text: 'The {occupation} left.'}\n"
        )

    os.mkfifo(tmp_path / "fifo.tsv")  # reading a FIFO would wait forever for a writer
    (tmp_path / "folder.tsv").mkdir()
    for name in ("fifo.tsv", "folder.tsv"):
        started = time.perf_counter()
        message = _load_error(tmp_path / "s.yaml", suite(name))
        assert f"data file '{name}' is not a regular file" in message and time.perf_counter() - started < 1
    message = _load_error(
        tmp_path / "s.yaml", suite("x").replace("'x'", '"bad\\nname.tsv"')
    )  # a line break in the name
    assert "data file 'bad\\nname.tsv' not found" in message and "\n" not in message
    lines = tmp_path / "many.tsv"
    lines.write_text("text\n" + "[She] left.\n" * 1_200)
    started = time.perf_counter()
    message = _load_error(
        tmp_path / "m.yaml",
        "name: s\nmax_prompts: 1000\nsentences:\n  - {id: b, file: many.tsv, spans: [pronoun]}\n",
    )
    assert message.startswith(
        f"{tmp_path / 'm.yaml'}:4: data file 'many.tsv' has at least 1,201 lines, more than "
        "max_prompts = 1,000"
    )
    assert "raise `max_prompts:`" in message
    lines.write_text("text\r" + "[She] left.\r" * 1_200, newline="")  # old-Mac line ends count too
    message = _load_error(
        tmp_path / "m.yaml",
        "name: s\nmax_prompts: 1000\nsentences:\n  - {id: b, file: many.tsv, spans: [pronoun]}\n",
    )
    assert "has at least 1,201 lines, more than max_prompts = 1,000" in message
    big = tmp_path / "big.yaml"
    big.write_text("name: s\ndescription: '" + "x" * (2**20) + "'\n")
    started = time.perf_counter()
    with pytest.raises(
        SuiteError, match=r"big.yaml:1: the suite file has 1.0 MB, more than 1 MB of YAML; move long lists"
    ):
        load_suite(big)
    assert time.perf_counter() - started < 0.1


def test_sentence_files_keep_quotes_and_span_names_are_names(tmp_path):
    (tmp_path / "s.tsv").write_text('text\n"Hi," said [the nurse], and [she] left.\n')
    (tmp_path / "s.yaml").write_text(
        "name: s\nsentences:\n  - {id: b, file: s.tsv, spans: [occupation, pronoun]}\n"
    )
    prompt = load_suite(tmp_path / "s.yaml").prompts[0]
    assert (
        prompt.text == '"Hi," said the nurse, and she left.'
        and prompt.text[slice(*prompt.spans["pronoun"])] == "she"
    )
    (tmp_path / "t.yaml").write_text("name: s\nsentences:\n  - {id: b, file: s.tsv, spans: [a/b, '=c']}\n")
    with pytest.raises(SuiteError, match=r"span name 'a/b' must be letters, digits and '_'"):
        load_suite(tmp_path / "t.yaml")


def test_spreadsheet_exports_read_as_written(tmp_path):
    """A byte-order mark before the header, CRLF line ends, and U+2028 inside a sentence (one line to
    an editor, two to str.splitlines) keep their lines, columns and line numbers."""
    (tmp_path / "s.tsv").write_bytes(
        "\ufefftext\tnote\r\n[She] left\u2028early.\tx\r\n[He] stayed.\ty\r\n".encode()
    )
    (tmp_path / "s.yaml").write_text("name: s\nsentences:\n  - {id: b, file: s.tsv, spans: [pronoun]}\n")
    prompts = load_suite(tmp_path / "s.yaml").prompts
    assert [p.text for p in prompts] == ["She left\u2028early.", "He stayed."]
    assert [p.meta["note"] for p in prompts] == ["x", "y"] and prompts[1].origin.endswith("s.tsv:3")


def test_a_template_repeating_one_slot_expands_in_linear_time(tmp_path):
    """Issue 18: 20,000 occurrences of one slot were quadratic (a search for a free span name)."""
    import time

    (tmp_path / "s.yaml").write_text(
        "name: s\nslots:\n  x: [a]\ntemplates:\n  - {id: t, text: '" + "{x} " * 20_000 + "'}\n"
    )
    started = time.perf_counter()
    prompt = load_suite(tmp_path / "s.yaml").prompts[0]
    assert time.perf_counter() - started < 2.0
    assert (
        prompt.spans["x"] == (0, 1)
        and prompt.spans["x_2"] == (2, 3)
        and prompt.spans["x_20000"] == (39998, 39999)
    )


PAIRED = """\
name: paired
sentences:
  - {{id: t1, files: {{pro: pro.txt, anti: anti.txt}}, spans: [referent, pronoun]{numbered}}}
analysis: {{contrast: version, positive: pro, negative: anti}}
attention: [{{source: pronoun, targets: [referent]}}]
"""
LINES = [
    "[The developer] argued with the designer because [he] did not like the design.",
    "The nurse thanked [the mechanic] because [he] came quickly.",
    "[The hairdresser] called the carpenter because [she] needed a shelf.",
    "[The driver] waved at the clerk because [he] was leaving.",
]


def _paired(tmp_path, pro, anti, numbered=""):
    (tmp_path / "pro.txt").write_text(pro)
    (tmp_path / "anti.txt").write_text(anti)
    (tmp_path / "s.yaml").write_text(PAIRED.format(numbered=numbered))
    return tmp_path / "s.yaml"


def _swap(line):
    return line.replace("[he]", "[x]").replace("[she]", "[he]").replace("[x]", "[she]")


def test_paired_files_of_different_lengths_are_refused_naming_both(tmp_path):
    pro = "\n".join(LINES) + "\n"
    anti = "\n".join(_swap(x) for x in LINES[:3]) + "\n"
    with pytest.raises(
        SuiteError,
        match=r"pro\.txt:4: sentence 4 has no counterpart in anti\.txt "
        r"\(nearest there: sentence 3 on line 3; 4 pro and 3 anti",
    ):
        load_suite(_paired(tmp_path, pro, anti))


def test_numbered_files_offset_by_one_are_refused(tmp_path):
    pro = "".join(f"{n} {x}\n" for n, x in enumerate(LINES, start=1))
    anti = "".join(f"{n} {_swap(x)}\n" for n, x in enumerate(LINES, start=2))
    with pytest.raises(
        SuiteError,
        match=r"pro\.txt:1: sentence 1 has no counterpart in anti\.txt "
        r"\(nearest there: sentence 2 on line 1;",
    ):
        load_suite(_paired(tmp_path, pro, anti, ", numbered: true"))
    twice = "".join(f"{min(n, 3)} {_swap(x)}\n" for n, x in enumerate(LINES, start=1))
    with pytest.raises(SuiteError, match=r"anti\.txt:4: sentence number 3 appears twice"):
        load_suite(_paired(tmp_path, pro, twice, ", numbered: true"))


def test_a_blank_first_line_does_not_shift_the_pairs(tmp_path):
    """Unnumbered files pair the n-th sentences: a blank line used to shift every pair after it."""
    pro = "\n".join(LINES) + "\n"
    anti = "\n# a comment\n" + "\n".join(_swap(x) for x in LINES) + "\n"
    suite = load_suite(_paired(tmp_path, pro, anti))
    by_item = {}
    for p in suite.prompts:
        by_item.setdefault(p.item_id, {})[p.meta["version"]] = p.text
    assert len(by_item) == 4
    for versions in by_item.values():  # the two versions of an item are the same sentence
        assert versions["pro"].replace(" she ", " he ") == versions["anti"].replace(" she ", " he ")


@pytest.mark.parametrize("name", ["text", "template_id", "item_id", "n_tokens", "prompt_id", "who_tok_end"])
def test_span_names_that_are_run_columns_are_refused(tmp_path, name):
    """A span named `text` overwrote the prompt's text column with the span's words, silently."""
    (tmp_path / "s.txt").write_text(f"[The nurse] said that [{name}: she] left.\n")
    (tmp_path / "s.yaml").write_text(
        "name: s\nsentences:\n  - {id: b, file: s.txt, spans: [occupation]}\n"
        "attention:\n  - {source: occupation, targets: occupation}\n"
    )
    with pytest.raises(SuiteError, match=rf"s\.txt:1: span name '{name}' is reserved"):
        load_suite(tmp_path / "s.yaml")


def test_metadata_named_like_a_span_column_is_refused(tmp_path):
    """Slot metadata `x_char_start` becomes column pronoun_x_char_start: a span's own column name."""
    (tmp_path / "s.yaml").write_text(
        NAMES_SUITE.format(name="s", slot="job", meta=", x_char_start: 3", extra="")
    )
    with pytest.raises(SuiteError, match=r"metadata 'pronoun_x_char_start' would overwrite"):
        load_suite(tmp_path / "s.yaml")


@pytest.mark.parametrize("group", ["all", "t"])
def test_a_group_named_like_a_scope_is_refused(tmp_path, group):
    """A group named `all` silently replaced the pooled scope's rows in every table."""
    extra = f"analysis: {{contrast: pronoun, groups: {{{group}: [t]}}}}\n"
    (tmp_path / "s.yaml").write_text(NAMES_SUITE.format(name="s", slot="job", meta="", extra=extra))
    with pytest.raises(SuiteError, match=f"group name '{group}' is taken"):
        load_suite(tmp_path / "s.yaml")


def test_a_catastrophic_line_pattern_is_one_line_in_seconds(tmp_path):
    """`(a|aa)+` nested in a failing match backtracks exponentially: it used to hang on a 34-character
    line; now each line has a time budget."""
    import time

    (tmp_path / "s.txt").write_text("a" * 40 + "!\n")
    (tmp_path / "s.yaml").write_text(
        "name: s\nsentences:\n  - id: b\n    file: s.txt\n    pattern: '(?P<text>(a|aa)+)b'\n"
        "    spans: []\nattention: []\n"
    )
    start = time.perf_counter()
    with pytest.raises(SuiteError, match=r"s\.txt:1: the entry's `pattern` took over 1 s on this line"):
        load_suite(tmp_path / "s.yaml")
    assert time.perf_counter() - start < 5


SMALL = """\
name: s
contrast: pronoun
slots:
  occupation: {values: [nurse, pilot]}
  pronoun: {values: [{label: female, value: she}, {label: male, value: he}]}
templates:
  - {id: a, text: "The {occupation} said that {pronoun} left."}
next_token: [{cut: pronoun, candidates: pronoun}]
"""


@pytest.mark.parametrize(
    "extra, message",
    [
        ("? [a, b]\n: 1\n", "s.yaml:9: invalid YAML (a key is a list or a mapping; keys are plain names)"),
        (
            "head_effects: {cut: pronoun, counterfactual: {[occupation]: woman}}\n",
            "s.yaml:9: invalid YAML (a key is a list or a mapping",
        ),
        ("name: t\n", "s.yaml:9: invalid YAML (key 'name' is given twice (lines 1 and 9); keep one)"),
    ],
)
def test_unhashable_and_repeated_keys_are_one_line(tmp_path, extra, message):
    """Round-3 attack: an unhashable key was a traceback; a repeated key silently kept the last value."""
    assert message in _load_error(tmp_path / "s.yaml", SMALL + extra)


def test_merge_keys_may_still_be_overridden(tmp_path):
    (tmp_path / "s.yaml").write_text(
        SMALL.replace("  pronoun:", "  base: &b {values: [x]}\n  other: {<<: *b, values: [y]}\n  pronoun:")
    )
    suite = load_suite(tmp_path / "s.yaml")  # an explicit key overriding a merged one is not a repeat
    assert [v.forms["value"] for v in suite.slots["other"].values] == ["y"]


def test_a_long_delimiter_and_an_overlong_path_are_one_line(tmp_path):
    (tmp_path / "t.tsv").write_text("occupation;x\nnurse;1\npilot;2\n")
    text = SMALL.replace("{values: [nurse, pilot]}", '{table: t.tsv, column: occupation, delimiter: ";;"}')
    assert "s.yaml:4: delimiter is one character (e.g. ';' or '|'), got ';;'" in _load_error(
        tmp_path / "s.yaml", text
    )
    with pytest.raises(SuiteError, match="cannot be read .File name too long.; give a shorter path"):
        load_suite(tmp_path / ("a" * 251 + ".yaml"))


def test_a_constant_covariate_gets_a_note(tmp_path):
    """Round-3 attack: a one-valued covariate ran with exit 0 and empty interaction columns, no word why."""
    (tmp_path / "c.tsv").write_text("occupation\tpct\nnurse\t50\npilot\t50\nchef\t50\n")
    text = SMALL.replace("{values: [nurse, pilot]}", "{table: c.tsv, column: occupation}")
    analysis = "analysis: {contrast: pronoun, positive: female, negative: male, covariate: occupation.pct}\n"
    (tmp_path / "s.yaml").write_text(text + analysis)
    notes = [n for n in load_suite(tmp_path / "s.yaml").notes if "covariate" in n]
    assert notes == [
        "covariate occupation.pct takes 1 distinct value(s) (50) over the prompts: no slope across it can "
        "be estimated, so the interaction and gradient statistics stay empty; declare a covariate that "
        "varies, or remove it"
    ]
    (tmp_path / "c.tsv").write_text("occupation\tpct\nnurse\t50\npilot\t5\nchef\t50\n")
    assert not [n for n in load_suite(tmp_path / "s.yaml").notes if "covariate" in n]
    # a template's own value that the table does not list has no covariate: said, not silently dropped
    own = text.replace(
        '  - {id: a, text: "The {occupation} said that {pronoun} left."}',
        '  - {id: a, text: "The {occupation} said that {pronoun} left."}\n'
        '  - {id: b, text: "The {occupation} left.  {pronoun} waved.", values: {occupation: [astronaut]}}',
    )
    (tmp_path / "s.yaml").write_text(own + analysis)
    notes = [n for n in load_suite(tmp_path / "s.yaml").notes if "covariate" in n]
    assert notes == [
        "2 prompts have no value of covariate occupation.pct (templates b), e.g. a template's own values "
        "that the slot's table does not list: they are left out of the covariate statistics; add them "
        "to the table"
    ]


def test_held_out_zero_with_exact_k_gets_a_note(tmp_path):
    effects = (
        "head_effects: {cut: pronoun, positive: female, negative: male, counterfactual: {occupation: woman}"
    )
    (tmp_path / "s.yaml").write_text(SMALL + effects + ", exact: 3, held_out: 0}\n")
    assert any("held_out: 0 leaves no item" in n for n in load_suite(tmp_path / "s.yaml").notes)
    (tmp_path / "s.yaml").write_text(SMALL + effects + ", exact: 3}\n")
    assert not any("held_out: 0" in n for n in load_suite(tmp_path / "s.yaml").notes)


def test_values_that_leave_the_contrast_one_label_get_a_note(tmp_path):
    """Round-3 attack: `values:` keeping one pronoun ran with exit 0 and no paired statistics, no word why."""
    one = SMALL.replace(
        '"The {occupation} said that {pronoun} left."}',
        '"The {occupation} said that {pronoun} left.", values: {pronoun: [she]}}',
    )
    (tmp_path / "s.yaml").write_text(one)
    assert (
        "the contrast pronoun has one label over the prompts (female): no item has a pair, so no paired "
        "statistics are made; give the contrast slot two values (check `values:` of the templates)"
    ) in load_suite(tmp_path / "s.yaml").notes
    two = one.replace(
        "values: {pronoun: [she]}}",
        'values: {pronoun: [she]}}\n  - {id: b, text: "The {occupation} left and {pronoun} waved."}',
    )
    (tmp_path / "s.yaml").write_text(
        two + "analysis: {contrast: pronoun, positive: female, negative: male}\n"
    )
    assert (
        "template(s) a have no prompt labelled 'male' in pronoun: their items have no pair and drop out of "
        "the paired statistics; give the template both values"
    ) in load_suite(tmp_path / "s.yaml").notes


def test_degenerate_tables_values_and_labels_are_said(tmp_path):
    """Issue 32: a slot table with a repeated header column (the second silently won), template
    values the table lacks and next_token labels that never match the contrast ran with no word."""
    (tmp_path / "jobs.tsv").write_text("occupation\tpct\nnurse\t88\nbaker\t60\nmechanic\t1\n")
    head = (
        "name: h\nslots:\n  occupation: {table: jobs.tsv}\n"
        "  pronoun: {forms: [nom], values: [{label: female, nom: she}, {label: male, nom: he}]}\n"
        "  word: {values: [{label: f, value: she}, {label: m, value: he}]}\ncontrast: pronoun\n"
    )
    (tmp_path / "dup.tsv").write_text("occupation\toccupation\nnurse\tx\n")
    message = _load_error(
        tmp_path / "dup.yaml",
        head.replace("jobs.tsv", "dup.tsv")
        + "templates:\n  - {id: a, text: 'The {occupation} said that {pronoun.nom} left.'}\n",
    )
    assert message == (
        f"{tmp_path / 'dup.yaml'}:3: table dup.tsv names column 'occupation' twice in its header; rename "
        "one (the second would silently replace the first)"
    )
    (tmp_path / "s.yaml").write_text(
        head + "templates:\n"
        "  - {id: a, text: 'The {occupation} said that {pronoun.nom} came and {word} left.', "
        "values: {occupation: [plumber, nurse]}}\n"
        "next_token: [{cut: word, candidates: word}]\n"
    )
    notes = load_suite(tmp_path / "s.yaml").notes
    assert (
        "template 'a': values of 'occupation' not in its table (plumber) have none of its columns (pct); "
        "add them to the table if those are used" in notes
    )
    assert any(
        n.startswith(
            "next_token at 'word': the candidates' labels (f, m) do not include both compared labels"
        )
        for n in notes
    )


@pytest.mark.parametrize("block", [1, 2, 3, 7, 2**20])
def test_lines_are_counted_in_blocks_as_in_one_read(monkeypatch, block):
    """A data file's lines (LF, CRLF, CR) counted block by block equal one count of the whole file,
    a CRLF split across two blocks included; past the bound the read stops with no data."""
    import io

    from attnprobe.schema import yamllines

    monkeypatch.setattr(yamllines, "READ_BLOCK", block)
    data = b"a\r\nb\rc\n\r\n\r\rd\r\n"
    whole = data.count(b"\n") + data.count(b"\r") - data.count(b"\r\n")
    assert yamllines.counted_read(io.BytesIO(data), None) == (data, whole) and whole == 7
    assert yamllines.counted_read(io.BytesIO(data), 7) == (data, 7)
    stopped, counted = yamllines.counted_read(io.BytesIO(data), 3)
    assert stopped is None and counted > 3
