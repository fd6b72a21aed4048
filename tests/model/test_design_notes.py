"""What the declared design lets a run conclude, said where a user reads: a cluster dimension with
fewer than five levels gets a note in `check`, the manifest, the report's notes and its headline."""

import json

from click.testing import CliRunner

from attnprobe.cli import main

SUITE = """\
name: two-files
sentences:
  - id: first
    files: {pro: pro1.txt, anti: anti1.txt}
    spans: [referent, pronoun]
  - id: second
    files: {pro: pro2.txt, anti: anti2.txt}
    spans: [referent, pronoun]
analysis: {contrast: version, positive: pro, negative: anti, clusters: [template]}
attention: [{source: pronoun, targets: [referent]}]
"""
PRO = [
    "[The developer] argued with the designer because [he] did not like the design.\n"
    "[The nurse] thanked the mechanic because [she] was tired.\n",
    "[The hairdresser] called the carpenter because [she] needed a shelf.\n"
    "[The driver] waved at the clerk because [he] was leaving.\n",
]


def test_a_two_level_cluster_dimension_is_noted_in_check_manifest_and_report(tmp_path, tiny_llama_dir):
    for i, text in enumerate(PRO, 1):
        (tmp_path / f"pro{i}.txt").write_text(text)
        (tmp_path / f"anti{i}.txt").write_text(
            text.replace("[he]", "[x]").replace("[she]", "[he]").replace("[x]", "[she]")
        )
    (tmp_path / "s.yaml").write_text(SUITE)
    note = "cluster dimension template has 2 levels: intervals clustered by it use t with 1 df"
    check = CliRunner().invoke(main, ["check", str(tmp_path / "s.yaml"), "--model", str(tiny_llama_dir)])
    assert check.exit_code == 0 and note in check.output, check.output
    out = tmp_path / "out"
    run = CliRunner().invoke(
        main,
        ["run", str(tmp_path / "s.yaml"), "--model", str(tiny_llama_dir), "--out", str(out), "--no-progress"],
    )
    assert run.exit_code == 0, run.output
    assert any(note in n for n in json.loads((out / "manifest.json").read_text())["notes"])
    html = (out / "report.html").read_text()
    headline = html[html.index('class="headline"') :].split("</p>")[0]
    assert "template has 2 levels" in headline and note in html
