"""Any suite runs end to end: other labels, no covariate, nothing declared, paired sentence files.

Each runs the real CLI (`attnprobe run`, which writes the report) on a tiny random Llama saved
with the bundled tokenizer, and reads the tables and report it wrote.
"""

import re

import pandas as pd
import pytest
import torch
from click.testing import CliRunner

import attnprobe
from attnprobe.cli import main

pytestmark = pytest.mark.slow

SIZES = """\
name: sizes
slots:
  animal:
    values: [{value: dog, weight: 30}, {value: cat, weight: 4}, {value: horse, weight: 500},
             {value: mouse, weight: 0.02}, {value: bird, weight: 0.1}, {value: sheep, weight: 80}]
  size: {values: [{value: large, label: big}, {value: tiny, label: small}%s]}
contrast: size
templates:
  - {id: saw, text: "I saw a {size} {animal} near the house, and it ran."}
  - {id: found, text: "We found a {size} {animal} in the garden, and it slept."}
%s
attention:
  - {source: animal, targets: [size]}
next_token:
  - {cut: size, candidates: size}
"""


def run_cli(suite_path, model_dir, out):
    result = CliRunner().invoke(
        main, ["run", str(suite_path), "--model", str(model_dir), "--out", str(out), "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    html = (out / "report.html").read_text()
    return html, re.search(r'<p class="headline">([^<]*)', html).group(1)


def test_labels_other_than_female_male_with_a_covariate(tiny_llama_dir, tmp_path):
    suite = tmp_path / "sizes.yaml"
    suite.write_text(SIZES % ("", "analysis: {covariate: animal.weight}"))
    html, headline = run_cli(suite, tiny_llama_dir, tmp_path / "out")
    heads = pd.read_csv(tmp_path / "out" / "head_stats.csv")
    assert {"mean_big", "mean_small", "interaction_r"} <= set(heads.columns) and len(heads) == 2 * 2
    assert set(heads["clusters"]) == {"animal x template"} and set(heads["n_clusters"]) == {"6 x 2"}
    assert "log p(big) - log p(small)" in headline and "animal.weight" in headline and "not bias" in headline
    behavior = pd.read_csv(tmp_path / "out" / "behavior.csv")
    assert set(behavior["comparison"]) == {"large vs tiny"} and behavior["n_units"].iloc[0] == 6
    text = re.sub(r"data:image/png;base64,[^\"]+", "", html).lower()  # words, not the images' base64
    assert "female" not in text and "bls" not in text and "occupation" not in text


def test_a_suite_without_a_covariate(tiny_llama_dir, tmp_path):
    suite = tmp_path / "sizes.yaml"
    suite.write_text(SIZES % ("", ""))
    _, headline = run_cli(suite, tiny_llama_dir, tmp_path / "out")
    heads = pd.read_csv(tmp_path / "out" / "head_stats.csv")
    assert "interaction_r" not in heads and heads["difference_p"].notna().all()
    assert "mean log p(big) - log p(small)" in headline and "the paired difference" in headline


def test_three_labels_and_nothing_declared_is_descriptive(tiny_llama_dir, tmp_path):
    suite = tmp_path / "sizes.yaml"
    suite.write_text(SIZES % (", {value: medium, label: middle}", ""))
    _, headline = run_cli(suite, tiny_llama_dir, tmp_path / "out")
    assert "compares no two labels (contrast labels: big, small, middle)" in headline
    assert pd.read_csv(tmp_path / "out" / "head_stats.csv").empty
    assert len(pd.read_csv(tmp_path / "out" / "condition_means.csv")) == 4 * 3 * 6  # heads x labels x animals


def test_paired_sentence_suite(tiny_llama_dir, tmp_path):
    """The shipped pro/anti coreference suite in a benchmark's shape (numbered lines, one file per
    version, the second occupation marked from the slot's words), compared by `version`."""
    html, headline = run_cli("probes/coref.yaml", tiny_llama_dir, tmp_path / "out")
    heads = pd.read_csv(tmp_path / "out" / "head_stats.csv")
    pooled = heads[heads["scope"] == "all"]
    assert set(heads["target"]) == {"referent", "other"} and set(pooled["n_items"]) == {128}
    assert set(heads.loc[heads["scope"] == "type2", "n_items"]) == {64}  # the declared group
    assert set(pooled["clusters"]) == {"referent.occupation x template"} and set(pooled["n_clusters"]) == {
        "16 x 8"
    }
    assert "log p(pro) - log p(anti)" in headline
    # referent accuracy, recomputed by hand: every cell holds one item and frames have equal sizes,
    # so the design's weighted mean is the plain mean over prompts
    accuracy = pd.read_csv(tmp_path / "out" / "referent_accuracy.csv").set_index(["layer", "head"])
    attention = pd.read_parquet(tmp_path / "out" / "attention.parquet")
    prompts = pd.read_parquet(tmp_path / "out" / "prompts.parquet").set_index("prompt_id")
    one = attention[(attention["layer"] == 1) & (attention["head"] == 0)].pivot(
        index="prompt_id", columns="target", values="weight"
    )
    correct = (one["referent"] > one["other"]).astype(float)
    for label in ("pro", "anti"):
        assert (
            abs(
                accuracy.loc[(1, 0), f"accuracy_{label}"]
                - correct[prompts.loc[one.index, "version"] == label].mean()
            )
            <= 1e-12
        )
    assert (
        abs(
            accuracy.loc[(1, 0), "gap"]
            - (accuracy.loc[(1, 0), "accuracy_pro"] - accuracy.loc[(1, 0), "accuracy_anti"])
        )
        <= 1e-12
    )
    assert "Referent accuracy" in html
    behavior = pd.read_csv(tmp_path / "out" / "behavior.csv").set_index("scope")
    assert set(behavior.loc["all", "comparison"].split(" | ")) == {"he vs she", "she vs he"}
    # the pronoun swap (head_effects counterfactual: pair), recomputed by hand for one item
    totals = pd.read_parquet(tmp_path / "out" / "head_effects_totals.parquet").set_index("item_id")
    assert len(totals) == 32 and set(totals["counterfactual"]) == {"anti"} and "A pronoun swap" in html
    item = totals.index[0]
    pm = attnprobe.load_model(str(tiny_llama_dir))
    ys = {}
    for version in ("pro", "anti"):
        p = prompts[(prompts["item_id"] == item) & (prompts["version"] == version)].iloc[0]
        words = {
            r: p["text"][p[f"{r}_char_start"] : p[f"{r}_char_end"]].removeprefix("The ").removeprefix("the ")
            for r in ("referent", "other")
        }
        question = f" Here, '{p['text'][p['pronoun_char_start'] : p['pronoun_char_end']]}' refers to the"
        ids = pm.tokenizer.encode(p["text"] + question, add_special_tokens=False)
        with torch.no_grad():
            last = pm.model(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
        first = {r: pm.tokenizer.encode(" " + w, add_special_tokens=False)[0] for r, w in words.items()}
        ys[version] = float(last[first["referent"]] - last[first["other"]])
    assert abs(totals.loc[item, "y"] - ys["pro"]) < 1e-4 and abs(totals.loc[item, "y_cf"] - ys["anti"]) < 1e-4
    assert abs(totals.loc[item, "te"] - (ys["anti"] - ys["pro"])) < 1e-4
    # every head's output patched in from x' gives y(x') exactly: the swapped words reach the end only
    # through heads
    assert (totals["all_heads_in"] - totals["te"]).abs().max() < 1e-4


def test_analysis_errors_are_one_line_before_the_model(tmp_path):
    cases = [
        (
            "analysis: {covariate: animal.height}",
            "'animal.height' is not a slot, slot.field or sentence column",
        ),
        ("analysis: {positive: big, negative: huge}", "label 'huge' is not a label of the contrast 'size'"),
        ("analysis: {clusters: [animal, template, item]}", "names one or two units"),
        ("analysis: {groups: {g: [nope]}}", "group 'g' names unknown template(s) nope"),
        (
            "analysis: {covariate: animal, positive: big, negative: small}",
            "covariate 'animal' must be numeric",
        ),
    ]
    for declaration, message in cases:
        suite = tmp_path / "bad.yaml"
        suite.write_text(SIZES % ("", declaration))
        result = CliRunner().invoke(
            main, ["run", str(suite), "--model", "/nonexistent/model", "--out", str(tmp_path / "o")]
        )
        assert result.exit_code == 2 and message in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1 and f"{suite}:" in result.output


@pytest.mark.parametrize(
    "measures",
    [
        "attention:\n  - {source: animal, targets: [size]}\n",  # no next_token
        # no attention; candidates not labelled by the contrast
        'next_token:\n  - {cut: animal, candidates: [" dog", " cat"]}\n',
    ],
)
def test_suites_with_one_kind_of_measure_report(tiny_llama_dir, tmp_path, measures):
    suite = tmp_path / "one.yaml"
    suite.write_text(
        "name: one\nslots:\n  animal: [dog, cat, horse, mouse]\n"
        "  size: {values: [{value: large, label: big}, {value: tiny, label: small}]}\n"
        'contrast: size\ntemplates:\n  - {id: saw, text: "I saw a {size} {animal} near the house."}\n'
        + measures
    )
    run_cli(suite, tiny_llama_dir, tmp_path / "out")
    again = CliRunner().invoke(main, ["report", str(tmp_path / "out")])  # from the cached tables
    assert again.exit_code == 0 and "Traceback" not in again.output, again.output


def test_check_says_what_a_run_would_do_without_weights(monkeypatch):
    import attnprobe.model

    def no_weights(*args, **kwargs):
        raise AssertionError("check must not load model weights")

    monkeypatch.setattr(attnprobe.model, "load_model", no_weights)
    result = CliRunner().invoke(main, ["check", "probes/gender.yaml"])
    assert result.exit_code == 0, result.output
    assert "6840 prompts, 2280 items" in result.output and "female - male by pronoun" in result.output
    assert "head_effects (occupation replaced): 480 items" in result.output and re.search(
        r"estimate: about \d+\.\d min", result.output
    )
    assert (
        "7.72 forwarded per prompt (2.09 with shared prefixes once)" in result.output
    )  # 52,794 and 14,263 tokens
    bad = CliRunner().invoke(main, ["check", "probes/nope.yaml"])
    assert (
        bad.exit_code == 2
        and len(bad.output.strip().splitlines()) == 1
        and "suite file not found" in bad.output
    )


SINK = """\
name: sink
first_token: FIRST
slots:
  occupation: [Nurses, Engineers, Teachers, Farmers]
  pronoun: {values: [{label: female, value: she}, {label: male, value: he}]}
contrast: pronoun
templates:
  - {id: lead, text: "{occupation} said that {pronoun} was late."}
  - {id: inner, text: "The {occupation} said that {pronoun} was late."}
attention:
  - {source: pronoun, targets: occupation}
"""


def test_a_target_on_the_first_token_warns_and_the_declared_treatment_applies(tiny_llama_dir, tmp_path):
    """SmolLM2's tokenizer adds no BOS token: a span at the start of the text sits on position 0,
    where attention piles up (a sink). keep: a note in check, the manifest and the report; bos:
    the tokenizer's BOS is prepended and spans move by one; exclude: token 0 leaves every span."""
    import json

    path = tmp_path / "sink.yaml"
    path.write_text(SINK.replace("FIRST", "keep"))
    checked = CliRunner().invoke(main, ["check", str(path), "--model", str(tiny_llama_dir)])
    assert "note: attention target 'occupation' sits on the first token in 8 prompt(s)" in checked.output
    html, _ = run_cli(path, tiny_llama_dir, tmp_path / "keep")
    assert "sits on the first token" in html
    assert any(
        "sits on the first token" in n
        for n in json.loads((tmp_path / "keep" / "manifest.json").read_text())["notes"]
    )

    path.write_text(SINK.replace("FIRST", "bos"))
    run_cli(path, tiny_llama_dir, tmp_path / "bos")
    prompts = pd.read_parquet(tmp_path / "bos" / "prompts.parquet")
    assert prompts["occupation_tok_start"].min() == 1
    manifest = json.loads((tmp_path / "bos" / "manifest.json").read_text())
    assert not any("first token" in n for n in manifest["notes"])

    path.write_text(SINK.replace("FIRST", "exclude"))
    run_cli(path, tiny_llama_dir, tmp_path / "exclude")
    attention = pd.read_parquet(tmp_path / "exclude" / "attention.parquet")
    prompts = pd.read_parquet(tmp_path / "exclude" / "prompts.parquet").set_index("prompt_id")
    lead = prompts.index[prompts["template_id"] == "lead"]
    dropped = lead[prompts.loc[lead, "occupation_tok_end"].isna()]  # one-token occupations at the start
    kept = lead[prompts.loc[lead, "occupation_tok_end"].notna()]  # longer ones lose token 0 only
    assert len(dropped) and not attention["prompt_id"].isin(dropped).any()
    assert (prompts.loc[kept, "occupation_tok_start"] == 1).all()
    inner = prompts.index[prompts["template_id"] == "inner"]
    assert set(inner) <= set(attention["prompt_id"])
    notes = json.loads((tmp_path / "exclude" / "manifest.json").read_text())["notes"]
    said = [n for n in notes if n.startswith("first_token: exclude leaves span 'occupation' no token")]
    assert len(said) == 1 and f"in {len(dropped)} prompt(s)" in said[0]  # the dropped prompts are said


def test_referent_accuracy_reads_the_answer_from_a_column(tiny_llama_dir, tmp_path):
    """The Winogender-shaped suite: the correct referent is the template's `answer` (occupation or
    participant); accuracy per head is recomputed by hand for one head."""
    html, _ = run_cli("probes/winogender-style.yaml", tiny_llama_dir, tmp_path / "out")
    accuracy = pd.read_csv(tmp_path / "out" / "referent_accuracy.csv").set_index(["layer", "head"])
    attention = pd.read_parquet(tmp_path / "out" / "attention.parquet")
    prompts = pd.read_parquet(tmp_path / "out" / "prompts.parquet").set_index("prompt_id")
    one = attention[(attention["layer"] == 0) & (attention["head"] == 1)].pivot(
        index="prompt_id", columns="target", values="weight"
    )
    answer = prompts.loc[one.index, "answer"]
    chosen = one["occupation"].where(answer == "occupation", one["participant"])
    other = one["participant"].where(answer == "occupation", one["occupation"])
    correct = (chosen > other).astype(float) + 0.5 * (chosen == other)
    # one item per template and 24 templates weighted equally: the weighted mean is the plain mean
    assert abs(accuracy.loc[(0, 1), "accuracy"] - correct.mean()) <= 1e-12
    assert set(pd.read_csv(tmp_path / "out" / "head_stats.csv")["scope"]) >= {
        "answer=occupation",
        "answer=participant",
    }
    # the model's own choice: each referent's words after the question, scored by hand with the model
    pm = attnprobe.load_model(str(tiny_llama_dir))
    scores = pd.read_parquet(tmp_path / "out" / "referent_choice.parquet")
    text = prompts.loc[0, "text"]
    pronoun = text[prompts.loc[0, "pronoun_char_start"] : prompts.loc[0, "pronoun_char_end"]]
    question = f" Here, '{pronoun}' refers to the"
    for referent in ("occupation", "participant"):
        words = " " + text[prompts.loc[0, f"{referent}_char_start"] : prompts.loc[0, f"{referent}_char_end"]]
        prefix = pm.tokenizer.encode(text + question, add_special_tokens=False)
        tail = pm.tokenizer.encode(words, add_special_tokens=False)
        with torch.no_grad():
            logp = pm.model(torch.tensor([prefix + tail])).logits[0].log_softmax(-1)
        by_hand = sum(float(logp[len(prefix) - 1 + t, token]) for t, token in enumerate(tail))
        row = scores[(scores["prompt_id"] == 0) & (scores["referent"] == referent)].iloc[0]
        assert row["candidate"] == words and abs(row["logprob"] - by_hand) < 1e-4
    wide = scores.pivot(index="prompt_id", columns="referent", values="logprob")
    answer = prompts.loc[wide.index, "answer"]
    chosen = wide["occupation"].where(answer == "occupation", wide["participant"])
    other = wide["participant"].where(answer == "occupation", wide["occupation"])
    correct = (chosen > other).astype(float) + 0.5 * (chosen == other)
    per_item = correct.groupby(prompts.loc[wide.index, "item_id"]).mean()  # the pronouns of one item averaged
    choice = pd.read_parquet(tmp_path / "out" / "referent_choice_accuracy.parquet").set_index("scope")
    assert list(choice.index) == [
        "all",
        "answer=occupation",
        "answer=participant",
    ]  # all, then the declared groups
    assert abs(choice.loc["all", "accuracy"] - per_item.mean()) <= 1e-12
    of_occupation = per_item[
        prompts.drop_duplicates("item_id").set_index("item_id").loc[per_item.index, "answer"] == "occupation"
    ]
    assert abs(choice.loc["answer=occupation", "accuracy"] - of_occupation.mean()) <= 1e-12
    assert "Asked to continue each sentence with" in html
