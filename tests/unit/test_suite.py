"""Suite loading: expansion, spans, and one test per validation error (message checked)."""

import re
import textwrap

import pytest

from attnprobe.suite import SuiteError, load_suite, token_spans

GOOD = """\
name: tiny
contrast: pronoun
slots:
  occupation: {values: [nurse, engineer]}
  other: [guest, visitor]
  pronoun:
    forms: [nom, acc]
    values:
      - {label: female, nom: she, acc: her}
      - {label: male, nom: he, acc: him}
templates:
  - {id: one, text: "The {occupation} said that {pronoun.nom} left."}
  - {id: two, text: "The {occupation} met the {other}. {Pronoun.nom} smiled.", where: "occupation != other"}
  - {id: braces, text: "The {{literal}} {occupation} saw {pronoun.acc}."}
attention:
  - {source: pronoun, targets: [occupation, other]}
next_token:
  - {cut: pronoun, candidates: pronoun}
"""


def write(tmp_path, text, name="suite.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_expansion_spans_and_candidates(tmp_path):
    suite = load_suite(write(tmp_path, GOOD))
    assert len(suite.prompts) == 2 * 2 + 2 * 2 * 2 + 2 * 2
    first = suite.prompts[0]
    assert first.text == "The nurse said that she left."
    assert (
        first.text[slice(*first.spans["occupation"])] == "nurse"
        and first.text[slice(*first.spans["pronoun"])] == "she"
    )
    assert first.candidates["pronoun"] == ((" she", "female"), (" he", "male"))
    assert first.item_id == suite.prompts[1].item_id != suite.prompts[2].item_id  # only the pronoun differs
    capital = next(p for p in suite.prompts if p.template_id == "two")
    assert capital.text == "The nurse met the guest. She smiled."
    assert capital.candidates["pronoun"] == ((" She", "female"), (" He", "male"))
    braces = next(p for p in suite.prompts if p.template_id == "braces")
    assert (
        braces.text == "The {literal} nurse saw her."
        and braces.text[slice(*braces.spans["occupation"])] == "nurse"
    )
    assert braces.candidates["pronoun"] == (
        (" her", "female"),
        (" him", "male"),
    )  # accusative form at this cut
    assert any("attention pronoun -> other: not measured" in s and "one, braces" in s for s in suite.skipped)


def test_table_slot_metadata_and_explicit_sentences(tmp_path):
    (tmp_path / "jobs.tsv").write_text("# provenance line\njob\tpct\nnurse\t90.0\nbaker\t60\n")
    (tmp_path / "sents.tsv").write_text(
        "text\tsource\n[The developer] argued with the designer because [he] was late.\tx\n"
    )
    suite = load_suite(
        write(
            tmp_path,
            """\
        name: t
        slots:
          job: {table: jobs.tsv}
        templates:
          - {id: a, text: "The {job} waited."}
        sentences:
          - {id: bench, file: sents.tsv, spans: [occupation, pronoun]}
        attention:
          - {source: pronoun, targets: occupation}
        """,
        )
    )
    assert [p.meta["job_pct"] for p in suite.prompts[:2]] == [90.0, 60]
    marked = suite.prompts[-1]
    assert marked.text == "The developer argued with the designer because he was late."
    assert marked.text[slice(*marked.spans["occupation"])] == "The developer"
    assert marked.text[slice(*marked.spans["pronoun"])] == "he" and marked.meta == {"source": "x"}


ERRORS = [
    # (suite text, expected line, expected message part)
    (
        GOOD.replace("{occupation} said", "{job} said"),
        12,
        "unknown slot '{job}'; defined slots: occupation, other, pronoun",
    ),
    (
        GOOD.replace("other: [guest, visitor]", "other: []"),
        5,
        "slot 'other' has no values; give at least one",
    ),
    (GOOD.replace("id: two", "id: one"), 13, "duplicate template id 'one' (first at line 12)"),
    (
        GOOD.replace("targets: [occupation, other]", "targets: [occupation, boss]"),
        15,
        "span 'boss' does not occur in any template",
    ),
    (GOOD.replace("candidates: pronoun}", 'candidates: [" she", ""]}'), 18, "candidate 2 is empty"),
    (GOOD.replace("contrast: pronoun", "contrast: pronoun\nmodle: gpt2"), 3, "unknown key 'modle'"),
    (
        GOOD.replace("{pronoun.nom} left", "{pronoun} left"),
        12,
        "slot 'pronoun' has forms (nom, acc): write {pronoun.nom}",
    ),
    (GOOD.replace("{pronoun.nom} left", "{pronoun.gen} left"), 12, "slot 'pronoun' has no form 'gen'"),
    (GOOD.replace("saw {pronoun.acc}", "saw {pronoun.acc"), 14, "is not a slot reference"),
    (
        GOOD.replace('where: "occupation != other"', 'where: "occupation ~ other"'),
        13,
        "cannot read condition",
    ),
    (GOOD.replace("templates:", "templates: 3\nx:"), 12, "unknown key 'x'; allowed: analysis, attention"),
    (GOOD.replace("  - {id: one,", "  - {id: [one,"), 12, "invalid YAML (expected ',' or ']', but got '}')"),
    (GOOD.replace("name: tiny", "name: a/b"), 1, "name 'a/b' must be letters"),
    (GOOD.replace("nom: she, acc: her}", "nom: she}"), 9, "value 1 of slot 'pronoun' lacks form 'acc'"),
    (GOOD.replace("other: [guest, visitor]", "other: [guest, guest]"), 5, "lists 'guest' twice"),
    (
        GOOD.replace("occupation: {values: [nurse, engineer]}", "occupation: {table: missing.tsv}"),
        4,
        "data file 'missing.tsv' not found",
    ),
]


@pytest.mark.parametrize("text,line,message", ERRORS)
def test_validation_error_names_file_line_and_fix(tmp_path, text, line, message):
    path = write(tmp_path, text)
    with pytest.raises(SuiteError) as error:
        load_suite(path)
    assert str(error.value).startswith(f"{path}:{line}: "), str(error.value)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_expansion_limit_is_checked_before_expanding(tmp_path):
    many = GOOD.replace("contrast: pronoun", "contrast: pronoun\nmax_prompts: 10")
    with pytest.raises(SuiteError, match=r"more than 10 prompts \(before filters\)"):
        load_suite(write(tmp_path, many))


def test_explicit_sentence_errors(tmp_path):
    (tmp_path / "s.tsv").write_text("text\n[one] and [two]\n[only one here\n")
    suite = """\
        name: t
        sentences:
          - {id: s, file: s.tsv, spans: [a, b]}
        """
    with pytest.raises(SuiteError, match=r"s.tsv:3: unbalanced or nested brackets"):
        load_suite(write(tmp_path, suite))
    (tmp_path / "s.tsv").write_text("text\n[one] and two\n")
    with pytest.raises(
        SuiteError, match=r"s.tsv:2: 1 unnamed bracketed span\(s\) but `spans:` names 2 \(a, b\)"
    ):
        load_suite(write(tmp_path, suite))


def test_table_row_errors_name_the_table_line(tmp_path):
    (tmp_path / "jobs.tsv").write_text("job\tpct\nnurse\t90\tx\n")
    with pytest.raises(SuiteError, match=r"jobs.tsv:2: 3 cells but the header has 2"):
        load_suite(
            write(
                tmp_path,
                "name: t\nslots:\n  job: {table: jobs.tsv}\ntemplates:\n  - {id: a, text: '{job}'}\n",
            )
        )


def test_unsafe_yaml_is_refused(tmp_path):
    path = write(tmp_path, "name: !!python/object/apply:os.system ['echo hacked']\n")
    with pytest.raises(SuiteError, match="invalid YAML"):
        load_suite(path)


def test_token_spans_from_offsets():
    offsets = [(0, 0), (0, 3), (3, 9), (9, 14)]  # a special token first, then "The", " nurse", " said"
    assert token_spans(offsets, {"occupation": (4, 9), "both": (2, 11), "none": (20, 22)}) == {
        "occupation": (2, 3),
        "both": (1, 4),
        "none": (-1, -1),
    }


def test_shipped_gender_suite():
    suite = load_suite("probes/gender.yaml")
    assert len(suite.templates) >= 12
    assert len({p.meta["occupation_bls_pct_female"] for p in suite.prompts}) > 40
    labels = {p.meta["pronoun_label"] for p in suite.prompts}
    assert labels == {"female", "male", "neutral"}
    items = {p.item_id for p in suite.prompts}
    assert len(items) >= 2000  # paired items per pronoun contrast, far above the 30 a head test needs


def test_ambiguous_forms_are_summed_or_excluded(tmp_path):
    """ " her" is accusative and possessive: by default every label gets its words of both cases
    (her vs him + his); with `ambiguous: exclude` those prompts get no candidates and are listed."""
    text = textwrap.dedent("""\
        name: amb
        slots:
          occupation: [nurse, engineer]
          pronoun:
            forms: [nom, acc, poss]
            values:
              - {label: female, nom: she, acc: her, poss: her}
              - {label: male, nom: he, acc: him, poss: his}
        contrast: pronoun
        templates:
          - {id: nom, text: "The {occupation} said that {pronoun.nom} left."}
          - {id: acc, text: "We thanked the {occupation} and praised {pronoun.acc} warmly."}
        next_token:
          - {cut: pronoun, candidates: pronoun%s}
        """)
    (tmp_path / "sum.yaml").write_text(text % "")
    summed = load_suite(tmp_path / "sum.yaml")
    by_template = {p.template_id: p.candidates["pronoun"] for p in summed.prompts}
    assert by_template["nom"] == ((" she", "female"), (" he", "male"))
    assert by_template["acc"] == ((" her", "female"), (" him", "male"), (" his", "male"))
    assert (
        summed.notes[0]
        == (
            "next_token at 'pronoun': a form is both acc and poss; scored against the sum of each "
            "label's words (1 template(s): acc)"
        )
        and not summed.skipped
    )
    assert summed.notes[1].startswith("cluster dimension occupation has 2 levels")  # 2 occupations
    (tmp_path / "exclude.yaml").write_text(text % ", ambiguous: exclude")
    excluded = load_suite(tmp_path / "exclude.yaml")
    assert all("pronoun" not in p.candidates for p in excluded.prompts if p.template_id == "acc")
    assert excluded.skipped == (
        "next_token at 'pronoun': a form is both acc and poss; excluded (1 template(s): acc)",
    )


BENCHMARK = """\
name: bench
slots:
  occupation: {values: [developer, designer, nurse, mechanic]}
sentences:
  - id: type1
    files: {pro: t1-pro.txt, anti: t1-anti.txt}
    numbered: true
    spans: [referent, pronoun]
    mark: {other: occupation}
analysis: {contrast: version, positive: pro, negative: anti}
attention: [{source: pronoun, targets: [referent, other]}]
"""


def test_numbered_benchmark_files_pair_by_line_with_named_and_marked_spans(tmp_path):
    """Published benchmarks' shape: numbered lines, [bracketed] spans, pro and anti files whose line n
    is one item; the unbracketed second occupation is marked from the occupation slot's words."""
    (tmp_path / "t1-pro.txt").write_text(
        "1 [The developer] argued with the designer because [he] did not like the design.\n"
        "2 The nurse thanked [the mechanic] because [he] came quickly.\n"
    )
    (tmp_path / "t1-anti.txt").write_text(
        "1 [The developer] argued with the designer because [she] did not like the design.\n"
        "2 The nurse thanked [the mechanic] because [she] came quickly.\n"
    )
    suite = load_suite(write(tmp_path, BENCHMARK))
    assert len(suite.prompts) == 4 and {p.item_id for p in suite.prompts} == {"type1|1", "type1|2"}
    first = suite.prompts[0]
    assert (
        first.text == "The developer argued with the designer because he did not like the design."
    )  # no number, no brackets
    assert first.meta["version"] == "pro" and first.meta["line"] == 1
    assert {k: first.text[a:b] for k, (a, b) in first.spans.items()} == {
        "referent": "The developer",
        "pronoun": "he",
        "other": "designer",
    }
    second = suite.prompts[1]
    assert (
        second.text[slice(*second.spans["other"])] == "nurse"
    )  # before the referent: the first free occurrence
    assert suite.analysis.labels == ("pro", "anti")


def test_named_inline_spans_may_vary_by_line(tmp_path):
    (tmp_path / "s.txt").write_text(
        "[occupation: The developer] said [pronoun: he] was late.\n"
        "[pronoun: She] told [occupation: the nurse] that [pronoun: she] was late.\n"
        "# a comment\n"
        "Nothing marked but [the clerk] here.\n"
    )
    suite = load_suite(
        write(tmp_path, "name: t\nsentences:\n  - {id: s, file: s.txt, spans: [occupation]}\n")
    )
    spans = [{k: p.text[a:b] for k, (a, b) in p.spans.items()} for p in suite.prompts]
    assert spans == [
        {"occupation": "The developer", "pronoun": "he"},
        {"pronoun": "She", "occupation": "the nurse", "pronoun_2": "she"},
        {"occupation": "the clerk"},
    ]
    (tmp_path / "bad.txt").write_text("[a] and [b]\n")
    with pytest.raises(
        SuiteError, match=r"bad.txt:1: 2 unnamed bracketed span\(s\) but the entry lists no `spans:`"
    ):
        load_suite(write(tmp_path, "name: t\nsentences:\n  - {id: s, file: bad.txt}\n"))
    (tmp_path / "n.txt").write_text("1 [a: x] fine\nnot numbered\n")
    with pytest.raises(SuiteError, match=r"n.txt:2: the line does not match the entry's line format"):
        load_suite(write(tmp_path, "name: t\nsentences:\n  - {id: s, file: n.txt, numbered: true}\n"))


def test_templates_with_their_own_values_and_meta_expand_without_the_product():
    suite = load_suite("probes/winogender-style.yaml")
    assert len(suite.prompts) == 24 * 3 and len({p.item_id for p in suite.prompts}) == 24
    nurse = [p for p in suite.prompts if p.template_id == "nurse_p"]
    assert {p.slots["occupation"] for p in nurse} == {"nurse"} and {
        p.slots["participant"] for p in nurse
    } == {"patient"}
    assert all(
        p.meta["answer"] == "participant" and p.meta["occupation_bls_pct_female"] == 89.58 for p in nurse
    )
    assert suite.analysis.groups["answer=occupation"] == tuple(
        t.id for t in suite.templates if t.id.endswith("_o")
    )


def test_template_values_errors(tmp_path):
    base = GOOD.replace(
        '- {id: one, text: "The {occupation} said that {pronoun.nom} left."}',
        '- {id: one, text: "The {occupation} said that {pronoun.nom} left.", VALUES}',
    )
    for values, message in (
        ("values: {pronoun: [xyz]}", "'xyz' is not a value of slot 'pronoun'"),
        ("values: {nope: [a]}", "values for 'nope', which this template does not use"),
        ("meta: {prompt_id: 3}", "metadata 'prompt_id' would overwrite a column"),
    ):
        with pytest.raises(SuiteError, match=re.escape(message)):
            load_suite(write(tmp_path, base.replace("VALUES", values)))


def test_a_mark_that_finds_no_word_in_some_lines_is_noted(tmp_path):
    """Round-3 attack: `mark:` finding nothing in a line left the span out silently."""
    (tmp_path / "t1-pro.txt").write_text(
        "1 [The developer] argued with the designer because [he] did not like the design.\n"
        "2 The cook thanked [the mechanic] because [he] came quickly.\n"
    )
    (tmp_path / "t1-anti.txt").write_text(
        "1 [The developer] argued with the designer because [she] did not like the design.\n"
        "2 The cook thanked [the mechanic] because [she] came quickly.\n"
    )
    suite = load_suite(write(tmp_path, BENCHMARK))
    path = tmp_path / "t1-pro.txt"
    assert (
        f"sentences 'type1': `mark: other` found no word in 2 of 4 lines (first: {path}:2); those prompts "
        "have no span 'other' and drop out of measures that need it"
    ) in suite.notes
    assert sum("other" in p.spans for p in suite.prompts) == 2  # line 1 of each file
