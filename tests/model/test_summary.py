"""The end of a run: probes/minimal.yaml through the real CLI on a tiny random Llama; its closing
table is short and narrow, and summary.json holds the numbers of the tables it summarises. The
report's small pieces that once misled (shares of a total effect near 0, raw per-value templates,
cut titles, a per-layer line that ran back) each checked on the piece itself."""

import json
import math
import os
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import pytest
from click.testing import CliRunner

from attnprobe.cli import main
from attnprobe.measures.head_effects.section import word_name
from attnprobe.measures.sections import split_levels, strongest_head
from attnprobe.plotting import Figures, figure
from attnprobe.plotting.plots import head_heatmap, layer_profile
from attnprobe.report import share_text, with_contents
from attnprobe.report.summary import WIDTH, summary_lines

MINIMAL = Path(__file__).resolve().parents[2] / "probes" / "minimal.yaml"


@pytest.fixture(scope="module")
def minimal_run(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("minimal") / "run"
    args = ["run", str(MINIMAL), "--model", str(tiny_llama_dir), "--out", str(out), "--no-progress"]
    result = CliRunner().invoke(main, args)  # stdout and stderr apart (click 8.2)
    assert result.exit_code == 0, result.output + result.stderr
    return out, result.stdout


def test_the_run_ends_with_a_short_table(minimal_run):
    out, stdout = minimal_run
    lines = stdout.strip().splitlines()
    assert 3 <= len(lines) <= 12 and max(map(len, lines)) <= WIDTH, lines
    assert lines[0].startswith("run") and "240 prompts" in lines[0]
    assert lines[-1] == f"report    {out / 'report.html'}"
    assert any(line.startswith("in words") and "the odds of female over male x" in line for line in lines)


def test_summary_json_holds_the_tables_numbers(minimal_run):
    out, stdout = minimal_run
    s = json.loads((out / "summary.json").read_text())
    assert s["summary_version"] == 1 and s["n_prompts"] == 240 and s["contrast"] == ["female", "male"]
    behavior = pd.read_parquet(out / "behavior.parquet").query("scope == 'all'").iloc[0]
    b = s["behaviour"]
    assert b["slope_per10"] == behavior["slope_per10"] and b["slope_p"] == behavior["slope_p"]
    assert b["slope_per10_ci"] == [behavior["slope_per10_ci_low"], behavior["slope_per10_ci_high"]]
    # the BLS shares' 10th and 90th percentiles round to 10 and 90: the odds over 8 tens of points
    assert (b["odds_from"], b["odds_to"]) == (10, 90)
    assert b["odds_ratio"] == pytest.approx(math.exp(8 * behavior["slope_per10"]), rel=1e-12)
    heads, _ = split_levels(pd.read_parquet(out / "head_stats.parquet"))
    (entry,) = s["heads"]
    assert entry["n_heads"] == len(heads) == 4  # 2 layers x 2 heads
    assert entry["n_passing"] == int((heads["interaction_q"] < 0.05).sum())
    top = strongest_head(heads, covariate=True)
    assert (entry["strongest"] is None) == (top is None)
    if top is not None:
        assert entry["strongest"]["value"] == top["interaction_per10"]
    # the test the heads pass is said once, in words, above the heads it is said of
    lines = stdout.splitlines()
    entry_row = f"heads     {entry['source']} -> {entry['target']}: {entry['n_passing']} of 4"
    at = next(i for i, line in enumerate(lines) if line.startswith(entry_row))
    header = "heads whose female - male attention follows occupation.bls_pct_female, q < 0.05 (BH):"
    assert lines[at - 1] == " " * 10 + header


def test_strongest_head_by_the_stated_rule():
    heads = pd.DataFrame(
        {
            "layer": [0, 1, 2],
            "head": [0, 1, 2],
            "interaction_q": [0.01, 0.2, 0.04],
            "interaction_per10": [0.02, -0.9, -0.05],  # the largest |slope| does not pass
        }
    )
    assert (strongest_head(heads, True)["layer"], strongest_head(heads, True)["head"]) == (2, 2)
    assert strongest_head(heads.assign(interaction_q=0.5), True) is None


def test_summary_lines_fit_whatever_the_names():
    s = {
        "suite": "s" * 80,
        "model": "m" * 80,
        "n_prompts": 10,
        "contrast": ["a" * 40, "b" * 40],
        "alpha": 0.05,
        "behaviour": None,
        "heads": [
            {"source": "x", "target": f"t{i}", "n_heads": 4, "n_passing": 0, "strongest": None}
            for i in range(20)
        ],
        "report": "r.html",
    }
    lines = summary_lines(s)
    assert len(lines) <= 12 and max(map(len, lines)) <= WIDTH and lines[-1] == "report    r.html"


def test_shares_beyond_a_thousand_percent_or_infinite_are_not_shown():
    assert share_text(0.824, 0) == "82%" and share_text(-0.05, 1, False) == "-5.0"
    assert share_text(10.0) == "1000%"  # the bound itself is shown
    for value in (10.01, -492494.599, math.inf, -math.inf, math.nan, None):
        assert share_text(value) == "n/a"


def test_a_per_value_counterfactual_is_named_in_words():
    assert word_name("{occupation.anti_stereotype}") == "each occupation's anti-stereotype"
    assert word_name("woman") == "woman"


def test_titles_wrap_instead_of_being_cut():
    heads = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "target": "t", "v": [1, 2, 3, 4.0]})
    title = "occupation -> each occupation's anti-stereotype: head output patched in (attribution)"
    fig = head_heatmap(heads, "t", "v", None, title=title, label="v")
    shown = fig.axes[0].get_title()
    assert shown.replace("\n", " ") == title and max(map(len, shown.split("\n"))) < len(title)
    plt.close(fig)


def test_the_layer_profile_draws_each_attention_entry_once_through_the_layers():
    # two entries share a target (at the pronoun, and before it): grouped by target alone, one line
    # ran from the last layer back to the first
    rows = [
        {"scope": "all", "source": source, "target": "occupation", "layer": layer, "n": layer}
        for source in ("pronoun", "before_pronoun")
        for layer in range(3)
    ]
    fig = layer_profile(pd.DataFrame(rows), {"n": "heads"}, "where in depth")
    lines = fig.axes[0].get_lines()
    assert len(lines) == 2
    for line in lines:
        assert list(line.get_xdata()) == [0, 1, 2]
    plt.close(fig)


def test_contents_link_every_section():
    html = with_contents("<h1>t</h1><!-- toc --><h2>run</h2><p>x</p><h3>heads <b>a</b></h3>")
    assert '<nav class="toc" aria-label="contents">' in html
    assert '<h2 id="s1">run</h2>' in html and '<h3 id="s2">heads <b>a</b></h3>' in html
    assert '<a href="#s2">heads a</a>' in html


def test_the_notebook_run_opens_every_table_and_one_heads_matrix(minimal_run, tiny_llama_dir, tmp_path):
    from attnprobe import Run
    from attnprobe.errors import AnalysisError

    out, _ = minimal_run
    run = Run(out)
    assert run.held_out.equals(pd.read_parquet(out / "held_out.parquet"))  # every table by its name
    assert "held_out" in dir(run) and "summary" in dir(run)
    with pytest.raises(AttributeError, match="no attribute 'no_such_table'"):
        assert run.no_such_table is None  # never reached: the lookup raises
    assert run.export("head_stats", tmp_path / "h.parquet").is_file()
    assert pd.read_parquet(tmp_path / "h.parquet").equals(run.head_stats)
    with pytest.raises(AnalysisError, match="no table 'nope' in this run; tables: behavior, "):
        run.export("nope", tmp_path / "x.csv")
    fig = run.plot_heads("occupation")
    assert fig.axes and fig.number not in plt.get_fignums()  # returned, not also left for pyplot to show
    # one head's whole matrix, recomputed: its pronoun rows give back the recorded attention weight
    prompts = run.prompts.set_index("prompt_id")
    attention = pd.read_parquet(out / "attention.parquet")
    for prompt_id, layer, head in ((0, 1, 0), (7, 0, 1)):
        matrix = run.attention_matrix(prompt_id, layer, head, model=str(tiny_llama_dir))
        p = prompts.loc[prompt_id]
        assert matrix.shape == (p["n_tokens"], p["n_tokens"])
        assert abs(matrix.to_numpy().sum(axis=1) - 1).max() < 1e-5  # softmax rows
        source = slice(p["pronoun_tok_start"], p["pronoun_tok_end"])
        target = slice(p["occupation_tok_start"], p["occupation_tok_end"])
        recomputed = matrix.to_numpy()[source, target].sum(axis=1).mean()
        row = attention.query(
            "prompt_id == @prompt_id and layer == @layer and head == @head and target == 'occupation'"
        )
        # float32, a packed batch in the run against one prompt here: rounding only
        assert abs(recomputed - row["weight"].iloc[0]) < 1e-5
    with pytest.raises(AnalysisError, match="L9H0 is outside the model's 2 layers x 2 heads"):
        run.attention_matrix(0, 9, 0, model=str(tiny_llama_dir))


def test_a_section_written_against_the_figure_folder_path_still_saves(tmp_path):
    """Measure.section gets a plotting.Figures; a plug-in written when it got the folder's path
    (`figure(fig, figures_dir, ...)`, `figures_dir / name`) works unchanged."""
    figures = Figures(tmp_path / "figures", {"d_z": 2.0})
    saved = figure(plt.figure(), figures, "plain", "a plain figure")
    assert (figures / "plain.png").is_file() and (tmp_path / "figures" / "plain.svg").is_file()
    assert os.fspath(figures) == str(tmp_path / "figures") and saved["alt"] == "a plain figure"
    assert figures.save(plt.figure(), "again", "again")["png"] and figures.limits == {"d_z": 2.0}
