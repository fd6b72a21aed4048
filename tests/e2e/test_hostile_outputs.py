"""Outputs are safe to open: spreadsheets see text, browsers see text."""

import re
import textwrap

import pandas as pd
import pytest
from conftest import CHROMIUM, chromium

import attnprobe
from attnprobe.report import write_report
from attnprobe.store import neutralise, write_csv


def test_formula_cells_are_neutralised(tmp_path):
    table = pd.DataFrame(
        {
            "text": ['=HYPERLINK("http://x")', "+1", "-cmd", "@SUM(A1)", "\tx", "plain", "a=b"],
            "logprob": [-1.5, -2.0, 0.5, -0.1, 1.0, 2.0, 3.0],
        }
    )
    write_csv(table, tmp_path / "t.csv")
    back = pd.read_csv(tmp_path / "t.csv")
    assert back["text"].tolist()[:5] == ['\'=HYPERLINK("http://x")', "'+1", "'-cmd", "'@SUM(A1)", "'\tx"]
    assert back["text"].tolist()[5:] == ["plain", "a=b"]
    assert back["logprob"].tolist() == table["logprob"].tolist()  # numbers stay numbers
    assert neutralise(-3) == -3 and neutralise(None) is None
    write_csv(pd.DataFrame({"=cmd|' /C calc'!A0": ["x"], "note": ["y"]}), tmp_path / "h.csv")
    assert (tmp_path / "h.csv").read_text().splitlines()[0] == "'=cmd|' /C calc'!A0,note"  # header cells too


@pytest.mark.slow
def test_hostile_suite_text_in_every_output(smollm, tmp_path):
    suite = tmp_path / "xss.yaml"
    suite.write_text(
        textwrap.dedent("""\
        name: xss
        contrast: pronoun
        slots:
          occupation: [nurse, "<b onmouseover=alert(2)>chef</b>", "=cmd|' /C calc'!A0"]
          pronoun:
            forms: [nom]
            values:
              - {label: female, nom: she}
              - {label: male, nom: he}
        templates:
          - {id: "<i>t</i>", text: "<script>alert(1)</script> The {occupation} said that {pronoun.nom} left."}
          - {id: "u", text: "-2+3 {occupation} said that {pronoun.nom} left."}
        attention:
          - {source: pronoun, targets: occupation}
        next_token:
          - {cut: pronoun, candidates: pronoun}
        """)
    )
    attnprobe.run_suite(suite, model=smollm, out=tmp_path / "run", progress=False)
    html = write_report(tmp_path / "run").read_text()
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<b onmouseover" not in html and "<i>t</i>" not in html
    assert html.count("<script") == 3  # the examples JSON block, the view and the table code, nothing else
    assert not re.search(r"<[^>]*\son\w+\s*=", html)  # no inline event handlers at all
    prompts = pd.read_csv(tmp_path / "run" / "prompts.csv")
    assert not prompts["text"].str.startswith(("=", "+", "-", "@")).any()
    assert "'-2+3 nurse said that she left." in set(prompts["text"])
    assert "'=cmd|' /C calc'!A0" in set(prompts["occupation"])
    if CHROMIUM:
        dom, log = chromium(
            "--dump-dom", "--virtual-time-budget=3000", url=(tmp_path / "run" / "report.html").as_uri()
        )
        assert dom.count("<script") == 3 and "<b onmouseover" not in dom and "Uncaught" not in log
