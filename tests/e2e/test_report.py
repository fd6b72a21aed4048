"""The report: CSV tables, figures, self-contained HTML that renders in a real browser, escaping."""

import base64
import io
import json
import re

import matplotlib.image as mpimg
import pandas as pd
import pytest
from click.testing import CliRunner
from conftest import CHROMIUM, chromium

import attnprobe
from attnprobe.cli import main
from attnprobe.report import write_report

SKIP = ("head_effects", "direct_attribution")  # the phases of their own these runs do not read

pytestmark = pytest.mark.slow
HEAD_COLUMNS = [
    "scope",
    "source",
    "target",
    "layer",
    "head",
    "n_items",
    "n_cells",
    "clusters",
    "n_clusters",
    "mean_female",
    "mean_male",
    "difference",
    "difference_ci_low",
    "difference_ci_high",
    "d_z",
    "difference_p",
    "difference_q",
    "difference_templates_same_sign",
    "difference_df",
    "difference_test",
    "difference_power_note",
    "interaction_per10",
    "interaction_per10_ci_low",
    "interaction_per10_ci_high",
    "interaction_r",
    "interaction_p",
    "interaction_q",
    "interaction_df",
    "interaction_df_is_clusters",
    "interaction_variance_floored",
    "interaction_i2_templates",
    "interaction_templates_same_sign",
    "interaction_r_half_a",
    "interaction_r_half_b",
    "held_out_splits",
    "held_out_splits_median_p",
    "held_out_splits_share_p05",
    "interaction_p05",
    "interaction_placebo_p05_mean",
    "interaction_placebo_p05_q95",
    "interaction_placebo_any_q05",
    "interaction_placebo_draws",
    "interaction_test",
    "interaction_power_note",
    # the token before the pronoun: no paired difference (both prompts share the prefix), a level
    "level",
    "level_ci_low",
    "level_ci_high",
    "level_per10",
    "level_per10_ci_low",
    "level_per10_ci_high",
    "level_p",
    "level_q",
    "level_test",
    "level_p05",
    "level_placebo_p05_mean",
    "level_placebo_p05_q95",
    "level_placebo_any_q05",
    "level_placebo_draws",
]


@pytest.fixture(scope="module")
def reported(smollm, tmp_path_factory):
    out = tmp_path_factory.mktemp("gender")
    run = attnprobe.run_suite(
        "probes/gender.yaml",
        model=smollm,
        out=out,
        limit=150,
        progress=False,
        skip=SKIP,
    )
    return run, write_report(out)


def test_tables_and_figures_are_written(reported):
    run, path = reported
    heads = pd.read_csv(run.directory / "head_stats.csv")
    # scopes: all and both groups for the occupation, from the pronoun and from the token before it;
    # all and two-entity for the participant
    assert list(heads.columns) == HEAD_COLUMNS and len(heads) == (3 + 3 + 2) * 30 * 9
    level = heads["level"].notna()
    assert (level == (heads["source"] == "before_pronoun")).all() and heads.loc[
        level, "difference"
    ].isna().all()
    paired = heads[~level]
    assert (
        paired["interaction_q"].between(0, 1).all()
        and (paired["difference_ci_low"] <= paired["difference"] + 1e-12).all()
        and heads.loc[level, "level_q"].between(0, 1).all()
    )
    assert set(heads["clusters"]) == {"occupation x template"}
    behavior = pd.read_csv(run.directory / "behavior.csv")
    # 150 prompts leave fewer than 5 items per template: the templates share one row, with a note
    assert list(behavior["scope"]) == [
        "all",
        "single-entity",
        "two-entity",
        "14 templates with < 5 items each",
    ]
    folded = behavior.set_index("scope").iloc[3]
    assert folded["kind"] == "folded" and "folded into this row" in folded["power_note"]
    assert set(folded["comparison"].split(" | ")) >= {"she vs he", "her vs him+his"}
    links = re.findall(r'<a href="([^"#][^"]*)">', path.read_text())  # files; #sN: the contents
    assert {"head_stats.csv", "head_stats.parquet", "attention.parquet", "prompts.csv"} <= set(links)
    assert all((path.parent / link).is_file() for link in links)  # every table link opens a file
    assert len(pd.read_csv(run.directory / "layer_stats.csv")) == 8 * 30
    for name in (
        "interaction_occupation",
        "difference_participant",
        "layer_profile",
        "behavior_vs_covariate",
        "behavior_by_template",
    ):
        assert (run.directory / "figures" / f"{name}.png").stat().st_size > 5000
        assert (run.directory / "figures" / f"{name}.svg").read_text().lstrip().startswith("<?xml")


def test_html_is_self_contained(reported):
    _, path = reported
    html = path.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)  # nothing fetched from a network
    assert "<link" not in html
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert (
        len(images) == 8
    )  # interaction and difference for two targets, the level before the pronoun, the layer profile,
    # two behaviour figures
    for data in images:
        pixels = mpimg.imread(io.BytesIO(base64.b64decode(data)), format="png")
        assert pixels.shape[0] > 200 and pixels.shape[1] > 200
    assert "Across " in html and "Methods and caveats" in html
    headline = re.search(r'<p class="headline">([^<]*)', html).group(1)
    assert (  # behaviour in log-odds per 10 points, then the interaction heads, then the lexical difference
        headline.index("per 10 occupation.bls_pct_female points (95% CI")
        < headline.index("cluster-robust by occupation x template")
        < headline.index("changes with")
        < headline.index("token difference, not bias")
    )
    assert "random heads of the same layers" in headline  # the held-out claim carries its null


@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium not installed: `apt-get install -y chromium` (make test installs it)"
)
def test_report_renders_in_chromium_without_network(reported, tmp_path):
    _, path = reported
    dom, log = chromium("--dump-dom", "--virtual-time-budget=5000", url=path.as_uri())
    assert "Uncaught" not in log and "ERROR:CONSOLE" not in log, log[-2000:]
    view = dom[dom.index('class="attention-view"') :]
    # drawn: the first prompt with the strongest head's target, beside its other variant and their difference,
    # the pronoun marked on both sides of each panel
    assert (
        view.count("<line") > 20
        and view.count('class="view-panel"') == 3
        and view.count('class="tok source"') == 6
    )
    assert (
        dom.count("<option") >= 30 + 2 + 1 and view.count('class="swatch"') == 9
    )  # layer, view and prompt pickers, head swatches
    shot = tmp_path / "shot.png"
    chromium(f"--screenshot={shot}", "--window-size=1200,2600", url=path.as_uri())
    pixels = mpimg.imread(shot)
    assert pixels.shape[:2] == (2600, 1200)
    assert (pixels[..., :3] < 0.9).any(axis=2).mean() > 0.05  # plenty drawn, not a blank page


def test_cli_report_compares_runs(reported, smollm, tmp_path):
    run, _ = reported
    other = attnprobe.run_suite(
        "probes/gender.yaml",
        model=smollm,
        out=tmp_path / "other",
        limit=30,
        progress=False,
        skip=SKIP,
    )
    out = tmp_path / "compare.html"
    result = CliRunner().invoke(main, ["report", str(run.directory), str(other.directory), "--out", str(out)])
    assert result.exit_code == 0, result.output
    html = out.read_text()
    assert "Models side by side" in html and html.count("<section>") == 2
    table = html[html.index("Models side by side") : html.index("<section>")]
    assert (
        "interaction heads: occupation" in table
        and "difference heads: participant" in table
        and table.count("<td>r = ") == 2
    )
    spec = run.manifest.model.spec
    labels = [f"{spec} ({run.directory.name})", f"{spec} (other)"]  # one model twice: told apart by directory
    assert all(f'<td class="text">{label}</td>' in table for label in labels), table
    differences = sorted(p.name for p in (tmp_path / "compare_figures").glob("*.png"))
    assert len(differences) == 2 and all(
        name.startswith("difference_") for name in differences
    )  # one per target
    assert table.count('alt="per-head interaction_r of') == 2


def test_notebook_api(reported, smollm):
    run, _ = reported
    assert {"interaction_r", "difference_q"} <= set(run.head_stats.columns) and run.behavior["scope"].iloc[
        0
    ] == "all"
    assert set(run.behavior_by_unit["scope"]) >= {"all"} and {"label", "mean", "n"} <= set(
        run.condition_means.columns
    )
    assert run.head_effects is None and run.head_effects_summary is None  # this run skipped head effects
    fig = run.plot_heads("participant")
    assert fig.axes[0].get_title().startswith("pronoun -> participant: interaction")
    fig = run.plot_heads("occupation")  # two sources reach the occupation: the pronoun's paired rows
    assert fig.axes[0].get_title().startswith("pronoun -> occupation: interaction")
    fig = run.plot_heads("occupation", statistic="level")  # the token before the pronoun
    assert fig.axes[0].get_title().startswith("before_pronoun -> occupation: level")
    with pytest.raises(attnprobe.AnalysisError, match="no level for source 'pronoun' in this run"):
        run.plot_heads("occupation", statistic="level", source="pronoun")
    with pytest.raises(attnprobe.AnalysisError, match="no attention target 'nobody' in this run; targets: "):
        run.plot_heads("nobody")  # used to return an empty figure
    with pytest.raises(attnprobe.AnalysisError, match="'r' is not in this run's head_stats; use interaction"):
        run.plot_heads("participant", statistic="r")
    assert run._repr_html_().startswith("<div><b>attnprobe run</b> gender on smollm2-135m: 150 prompts")
    html = attnprobe.head_view(smollm, "The nurse said that she", html_action="return")
    assert '" nurse"' in html.data or "nurse" in html.data
    with pytest.raises(attnprobe.AttnprobeError, match="one text at a time"):
        attnprobe.head_view(smollm, ["a", "b"])
    first = run.prompts.iloc[0]  # a run's prompt by id, on the run's own model
    page = attnprobe.model_view(run, int(first.prompt_id), include_layers=[0], html_action="return")
    assert f'" {first.text.split()[1]}"' in page.data  # its occupation, a token of the view
    with pytest.raises(attnprobe.AttnprobeError, match="has no prompt 999999"):
        attnprobe.head_view(run, 999999)


def test_bertviz_views_take_options_and_say_when_offline(smollm, tmp_path):
    import json as json_module
    import re as re_module

    head = attnprobe.head_view(
        smollm, "The nurse said that she", layer=3, heads=[1, 2], include_layers=[3, 4], html_action="return"
    )
    params = json_module.loads(
        re_module.search(r"const params = (.*?); // HACK", head.data, re_module.S).group(1)
    )
    assert (params["layer"], params["heads"], params["include_layers"]) == (3, [1, 2], [3, 4])
    grid = attnprobe.model_view(
        "smollm2-135m",
        "The nurse said that she",
        include_layers=[0],
        include_heads=[0, 8],
        html_action="return",
    )
    params = json_module.loads(
        re_module.search(r"const params = (.*?); // HACK", grid.data, re_module.S).group(1)
    )
    assert (params["include_layers"], params["include_heads"]) == ([0], [0, 8])
    for html in (head, grid):
        assert html.data.count("bertviz could not load its scripts") == 1
    if CHROMIUM:  # no network: require.js never arrives, and the note shows instead of a blank widget
        page = tmp_path / "view.html"
        page.write_text(f"<html><body>{head.data}</body></html>")
        dom, _ = chromium("--dump-dom", "--virtual-time-budget=8000", url=page.as_uri())
        note = re_module.search(r'<div id="bertviz-[0-9a-f]+-offline" style="([^"]*)"', dom)
        assert note and "display: block" in note.group(1), dom[-1500:]


@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium not installed: `apt-get install -y chromium` (make test installs it)"
)
def test_report_tables_sort_and_filter_in_chromium(tmp_path):
    from importlib.resources import files

    rows = "".join(
        f"<tr><td>{v}</td><td>{name}</td></tr>"
        for v, name in [
            ("10", "L1H1"),
            ("2", "L2H2"),
            ("x", "L3H3"),
            ("1.5 [0, 3]", "L4H4"),
            ("-0.5%", "L5H5"),
            ("7", "L6H6"),
        ]
    )
    script = files("attnprobe.report").joinpath("tables.js").read_text()
    act = """<script>
      const th = document.querySelector("th"); th.click();
      const order = Array.from(document.querySelectorAll("tr")).slice(1).map(r => r.cells[1].textContent);
      th.click();
      const reverse = Array.from(document.querySelectorAll("tr")).slice(1).map(r => r.cells[1].textContent);
      const box = document.querySelector(".table-filter"); box.value = "l2h"; box.dispatchEvent(new Event("input"));
      const shown = Array.from(document.querySelectorAll("tr")).slice(1).filter(r => r.style.display !== "none").map(r => r.cells[1].textContent);
      document.body.setAttribute("data-result", JSON.stringify([order, reverse, shown]));
    </script>"""
    page = tmp_path / "t.html"
    page.write_text(
        f"<html><body><table><tr><th>value</th><th>head</th></tr>{rows}</table><script>{script}</script>{act}</body></html>"
    )
    dom, log = chromium("--dump-dom", "--virtual-time-budget=2000", url=page.as_uri())
    result = json.loads(re.search(r'data-result="([^"]*)"', dom).group(1).replace("&quot;", '"'))
    assert result[0] == ["L5H5", "L4H4", "L2H2", "L6H6", "L1H1", "L3H3"]  # numbers by value, then text
    assert result[1] == list(reversed(result[0])) and result[2] == ["L2H2"], (result, log[-500:])


def test_attention_view_in_a_notebook_draws_offline(reported, smollm, tmp_path):
    run, _ = reported
    for name, page in (
        ("run", run.attention_view(html_action="return")),
        (
            "texts",
            attnprobe.attention_view(
                smollm,
                ["The [nurse] said <!--<script> that [she]</script>"],
                start=(3, 1),
                html_action="return",
            ),
        ),
    ):
        assert page.data.count('class="attention-view"') == 1 and page.data.count("<script") == 2
        if CHROMIUM:
            path = tmp_path / f"{name}.html"
            path.write_text(f"<html><body>{page.data}{page.data}</body></html>")  # two views in one page
            dom, log = chromium("--dump-dom", "--virtual-time-budget=3000", url=path.as_uri())
            assert "Uncaught" not in log, log[-1500:]
            assert dom.count('aria-label="prompt"') == 2 and dom.count("<line") > 20  # each view set up once
            assert dom.count('class="tok source"') >= 2


VIEW_ACTIONS = """<script>
  const root = document.querySelector(".attention-view"), r = {};
  const lines = (panel) => Array.from(root.querySelectorAll(`[data-panel^='${panel}'] line`));
  const panels = () => root.querySelectorAll(".view-panel").length;
  const strokes = (panel) => lines(panel).map(l => l.getAttribute("stroke") + l.getAttribute("stroke-opacity")).join();
  const token = (i) => root.querySelector(`[data-panel^='A:'] text.tok[data-side=query][data-index='${i}']`);
  const choose = (label, value) => { const s = root.querySelector(`select[aria-label='${label}']`); s.value = value; s.dispatchEvent(new Event("change")); };
  r.panels = panels(); r.compare = root.querySelector("select[aria-label='compare with']").value;
  r.lines = lines("A:").length; r.colours = new Set(lines("A:").map(l => l.getAttribute("stroke"))).size;
  root.querySelector(".swatch[aria-pressed=false]").click();
  r.linesToggled = lines("A:").length; r.coloursToggled = new Set(lines("A:").map(l => l.getAttribute("stroke"))).size;
  token(4).dispatchEvent(new MouseEvent("mouseenter"));
  r.linesHover = lines("A:").length; r.weights = root.querySelectorAll("[data-panel^='A:'] text.weight").length;
  token(4).dispatchEvent(new MouseEvent("mouseleave"));
  r.linesLeft = lines("A:").length;
  const difference = strokes("A - B");
  choose("prompt", "1");
  r.switched = root.querySelector(".view-panel h5").textContent; r.differenceChanged = strokes("A - B") !== difference;
  choose("compare with", ""); r.panelsAlone = panels();
  choose("view", "grid"); r.thumbs = root.querySelectorAll(".thumb").length;
  root.querySelector(".thumb[data-layer='7'][data-head='2']").dispatchEvent(new MouseEvent("click", {bubbles: true}));
  r.opened = [root.querySelector("select[aria-label=layer]").value, root.querySelector(".swatch[aria-pressed=true]").textContent, panels()];
  document.body.setAttribute("data-result", JSON.stringify(r));
</script>"""


@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium not installed: `apt-get install -y chromium` (make test installs it)"
)
def test_attention_view_toggles_hovers_and_compares_in_chromium(smollm, tmp_path):
    page = attnprobe.attention_view(
        smollm,
        ["The [nurse] said that [she]", "The [nurse] said that [he]"],
        start=(3, 1),
        html_action="return",
    )
    path = tmp_path / "view.html"
    path.write_text(f"<html><head></head><body>{page.data}{VIEW_ACTIONS}</body></html>")
    dom, log = chromium("--dump-dom", "--virtual-time-budget=3000", url=path.as_uri())
    assert "Uncaught" not in log and "net::ERR" not in log, log[-1500:]  # nothing fetched
    r = json.loads(re.search(r'data-result="([^"]*)"', dom).group(1).replace("&quot;", '"'))
    assert r["panels"] == 3 and r["compare"] == "1"  # she beside he, and she - he
    assert (
        r["colours"] == 1 and r["coloursToggled"] == 2 and r["linesToggled"] > r["lines"]
    )  # a second head, its own colour
    assert (
        0 < r["linesHover"] < r["linesToggled"] and r["weights"] == 2 * 5
    )  # 5 keys of the last token, 2 heads
    assert r["linesLeft"] == r["linesToggled"]
    assert (
        r["switched"].startswith("A: #1: The nurse said that he") and r["differenceChanged"]
    )  # he - she: the difference flips
    assert r["panelsAlone"] == 1 and r["thumbs"] == 30 * 9
    assert r["opened"] == ["7", "head 2", 1], r


def test_two_attention_entries_reaching_one_target_get_a_heatmap_each(tiny_llama_dir, tmp_path):
    """Issue 40: two sources attending to one target once crashed the heatmaps ("Index contains
    duplicate entries"); each (source, target) now has its own figure, in one run and compared."""
    (tmp_path / "jobs.tsv").write_text(
        "occupation\tbls_pct_female\n" + "".join(f"{o}\t{p}\n" for o, p in JOBS)
    )
    (tmp_path / "two.yaml").write_text(
        "name: two\ncontrast: pronoun\nslots:\n  occupation: {table: jobs.tsv, column: occupation}\n"
        "  act: {values: [left, was tired]}\n"
        "  pronoun: {values: [{label: female, value: she}, {label: male, value: he}]}\n"
        "templates:\n  - {id: t1, text: 'The {occupation} said that {pronoun} {act}.'}\n"
        "  - {id: t2, text: 'Yesterday the {occupation} told us that {pronoun} {act}.'}\n"
        "attention: [{source: pronoun, targets: occupation}, {source: act, targets: occupation}]\n"
        "analysis: {contrast: pronoun, positive: female, negative: male, clusters: [occupation, template],"
        " covariate: occupation.bls_pct_female}\n"
    )
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        result = CliRunner().invoke(
            main, ["run", str(tmp_path / "two.yaml"), "--model", str(tiny_llama_dir), "--out", str(out)]
        )
        assert result.exit_code == 0, result.output
        runs.append(out)
    figures = {p.stem for p in (runs[0] / "figures").glob("*.png")}
    for source in ("pronoun", "act"):
        assert (
            f"interaction_{source}____occupation" in figures
            and f"difference_{source}____occupation" in figures
        )
    html = (runs[0] / "report.html").read_text()
    assert "act -&gt; occupation" in html or "act -> occupation" in html
    compared = tmp_path / "compare.html"
    result = CliRunner().invoke(main, ["report", *map(str, runs), "--out", str(compared)])
    assert result.exit_code == 0, result.output
    assert compared.stat().st_size > 10_000


JOBS = [("nurse", 88), ("secretary", 93), ("teacher", 70), ("lawyer", 37), ("pilot", 9), ("plumber", 2)]


def test_the_chosen_heads_interval_is_adjusted_for_the_choice():
    """The headline's strongest head is the largest of m slopes: its interval widens with m
    (Bonferroni, from the same standard error and df), equal to the plain one when m = 1."""
    from scipy.stats import t

    from attnprobe.report.headline import _chosen_interval, _not_absence

    se, df = 0.01, 5
    row = pd.Series(
        {"x": 0.03, "x_ci_low": 0.03 - t.ppf(0.975, df) * se, "x_ci_high": 0.03 + t.ppf(0.975, df) * se}
    )
    row["interaction_df"] = df
    assert _chosen_interval(row, "x", 1) == pytest.approx((row["x_ci_low"], row["x_ci_high"]))
    low, high = _chosen_interval(row, "x", 270)
    assert high - 0.03 == pytest.approx(t.ppf(1 - 0.025 / 270, df) * se) and low < row["x_ci_low"]
    assert "the smallest q is 0.12; not passing a test is not evidence" in _not_absence(
        pd.DataFrame({"interaction_q": [0.5, 0.12]}), "interaction"
    )
    placebo = {
        "p05": 24,
        "placebo_p05_mean": 6.3,
        "placebo_p05_q95": 17.0,
        "placebo_any_q05": 0.0,
        "placebo_draws": 40,
    }
    group = pd.DataFrame({"level_q": [0.5, 0.42], **{f"level_{k}": [v, v] for k, v in placebo.items()}})
    assert "24 heads at p < 0.05 against 6.3 on average (95th percentile 17)" in _not_absence(group, "level")


FIRST_SCREEN = """<script>
window.addEventListener("load", function () {
  const box = (selector) => { const el = document.querySelector(selector); return el ? el.getBoundingClientRect() : null; };
  const page = document.body.cloneNode(true);  // the suite's own templates are shown as written
  page.querySelectorAll("table.templates, script, style").forEach((el) => el.remove());
  const table = box("table.findings"), image = box("figure.main img"), text = page.textContent;
  const shares = (text.match(/-?[0-9][0-9,]*(\\.[0-9]+)?%/g) || []).map((s) => Math.abs(parseFloat(s.replace(/,/g, ""))));
  document.body.setAttribute("data-result", JSON.stringify({
    table: table && [table.bottom, table.right], image: image && [image.bottom, image.right, image.height],
    toc: document.querySelectorAll("nav.toc a").length, templates: (text.match(/[{][a-z_]+[.][a-z_]+[}]/g) || []).length,
    largest_share: Math.max(0, ...shares), infinite: (text.match(/inf%/g) || []).length}));
});
</script>"""


@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium not installed: `apt-get install -y chromium` (make test installs it)"
)
def test_report_opens_on_its_findings_in_chromium(reported, tmp_path):
    """At 1400 x 900 the key-findings table and the behaviour figure are on the first screen, a table
    of contents links the sections, and nothing misleads: no unfilled {slot.field} template, no share
    above 1,000% or infinite, one strongest head wherever one is named."""
    _, path = reported
    html = path.read_text()
    probe = path.with_name("first_screen.html")
    probe.write_text(html.replace("</body>", FIRST_SCREEN + "</body>"))
    dom, log = chromium(
        "--dump-dom", "--window-size=1400,900", "--virtual-time-budget=5000", url=probe.as_uri()
    )
    assert "Uncaught" not in log and "ERROR:CONSOLE" not in log, log[-2000:]
    r = json.loads(re.search(r'data-result="([^"]*)"', dom).group(1).replace("&quot;", '"'))
    assert r["table"] and r["table"][0] <= 900 and r["table"][1] <= 1400, r
    assert r["image"] and r["image"][0] <= 900 and r["image"][1] <= 1400 and r["image"][2] > 200, r
    assert r["toc"] >= 8 and r["templates"] == 0 and r["infinite"] == 0 and r["largest_share"] <= 1000, r
    named = set(re.findall(r"strongest (L\d+H\d+)", html)) | set(
        re.findall(r"most strongly (L\d+H\d+)", html)
    )
    top = re.search(r"<h3[^>]*>Top heads</h3>.*?<tr><td>(\d+)</td><td>(\d+)</td>", html, re.S)
    if top:  # the table's first row is the strongest head by the same rule
        named.add(f"L{top[1]}H{top[2]}")
    view = re.search(r'data-start="(\d+),(\d+),', html)  # the attention view starts at that head
    if named and view:
        named.add(f"L{view[1]}H{view[2]}")
    assert len(named) <= 1, named
