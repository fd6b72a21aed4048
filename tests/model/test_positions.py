"""Attention read where the prediction is made: `at: before` reads the query row of the token just
before a span (the position a next-token prediction of it comes from), checked against plain
transformers eager attention, and analysed as a level (both prompts of an item share that prefix)."""

import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM

import attnprobe
from attnprobe.report import write_report

SUITE = """\
name: positions
contrast: pronoun
slots:
  occupation:
    values: [{value: nurse, bls: 88}, {value: engineer, bls: 16}, {value: teacher, bls: 73},
             {value: mechanic, bls: 2}, {value: baker, bls: 60}, {value: lawyer, bls: 40}]
  pronoun:
    forms: [nom]
    values: [{label: female, nom: she}, {label: male, nom: he}]
templates:
  - {id: said, text: "The {occupation} said that {pronoun.nom} left."}
  - {id: stayed, text: "The {occupation} stayed late because {pronoun.nom} was busy."}
attention:
  - {source: pronoun, at: before, targets: [occupation]}
  - {source: pronoun, targets: [occupation]}
next_token:
  - {cut: pronoun, candidates: pronoun}
analysis: {contrast: pronoun, positive: female, negative: male, covariate: occupation.bls}
"""


@pytest.fixture(scope="module")
def run(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("positions")
    (folder / "s.yaml").write_text(SUITE)
    return attnprobe.run_suite(
        folder / "s.yaml", model=str(tiny_llama_dir), out=folder / "out", progress=False
    )


def test_before_reads_the_row_of_the_token_before_the_span(run, tiny_llama_dir):
    prompts, attention = run.prompts, run.attention
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager")
    tokenizer = attnprobe.model.load_tokenizer(str(tiny_llama_dir))[0]
    before = attention[attention["source"] == "before_pronoun"]
    for row in prompts.head(4).itertuples():
        ids = tokenizer(row.text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            weights = model(input_ids=ids, output_attentions=True).attentions
        query = int(row.pronoun_tok_start) - 1
        keys = slice(int(row.occupation_tok_start), int(row.occupation_tok_end))
        for layer in range(2):
            for head in range(2):
                expected = weights[layer][0, head, query, keys].sum().item()
                got = before[
                    (before.prompt_id == row.prompt_id) & (before.layer == layer) & (before["head"] == head)
                ]["weight"]
                assert got.item() == pytest.approx(expected, abs=1e-5)


def test_before_is_a_level_beside_the_pronoun_difference(run):
    html = write_report(run.directory).read_text()
    heads = pd.read_csv(run.directory / "head_stats.csv")
    before, at = heads[heads.source == "before_pronoun"], heads[heads.source == "pronoun"]
    assert before["level"].notna().all() and before["difference"].isna().all()
    assert before["level_per10"].notna().all() and before["level_test"].str.contains("occupation").all()
    assert at["difference"].notna().all() and at["level"].isna().all()
    assert "at the token before the pronoun" in html and 'alt="layer x head slope of the attention' in html


@pytest.mark.parametrize("dtype, level", [("bfloat16", True), ("float32", False)])
def test_a_value_read_twice_within_the_formats_rounding_stays_a_level(run, tmp_path, dtype, level):
    """On a GPU in bfloat16 the two prompts of an item may read their shared prefix in passes of other
    shapes, which round differently: the token before the pronoun differed by up to a few eps between
    them (Llama 3.1 8B shape, full gender suite, H200). Within 8 eps of the format it stays one level
    read twice; the same gap in a float32 run is a paired difference."""
    import json
    import shutil

    from attnprobe.report import load_tables
    from attnprobe.run.files.reader import RunFiles

    shutil.copytree(run.directory, tmp_path / "run")
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    (tmp_path / "run" / "manifest.json").write_text(json.dumps({**manifest, "dtype": dtype}))
    attention = pd.read_parquet(tmp_path / "run" / "attention.parquet")
    male = run.prompts.loc[run.prompts["pronoun_label"] == "male", "prompt_id"]
    moved = (attention["source"] == "before_pronoun") & attention["prompt_id"].isin(male)
    assert moved.sum() == len(male) * 2 * 2  # the male prompts' reads, every layer and head
    shift = 0.02 * ((attention.index[moved] % 3) - 1)  # up to 2.6 bfloat16 eps
    attention.loc[moved, "weight"] = (attention.loc[moved, "weight"] + shift).astype("float32")
    attention.to_parquet(tmp_path / "run" / "attention.parquet", index=False)
    heads = load_tables(RunFiles(tmp_path / "run"), refresh=True, write=False)["head_stats"]
    before = heads[heads.source == "before_pronoun"]
    is_level = "level" in before and before["level"].notna().all()
    assert is_level == level and ("difference" not in before or before["difference"].isna().all()) == level


def test_the_head_effects_section_draws_one_source_where_two_read_the_slot(tiny_llama_dir, tmp_path):
    """The head-effects section's attention heatmap (source -> the patched slot) drew every paired row
    of the slot: where the token before the pronoun counted as a paired difference beside the pronoun
    itself (the H200's bfloat16 run), two rows per head failed the report. Planted here in float32 with
    a gap in the before-pronoun reads: the report is written and the heatmap names its source."""
    import json

    from attnprobe.report import write_report

    suite = SUITE + "head_effects: {cut: pronoun, positive: female, negative: male, "
    suite += "counterfactual: {occupation: [person]}}\n"
    (tmp_path / "s.yaml").write_text(suite)
    run = attnprobe.run_suite(
        tmp_path / "s.yaml", model=str(tiny_llama_dir), out=tmp_path / "out", progress=False
    )
    attention = pd.read_parquet(run.directory / "attention.parquet")
    male = run.prompts.loc[run.prompts["pronoun_label"] == "male", "prompt_id"]
    moved = (attention["source"] == "before_pronoun") & attention["prompt_id"].isin(male)
    attention.loc[moved, "weight"] = (attention.loc[moved, "weight"] + 0.02).astype("float32")
    attention.to_parquet(run.directory / "attention.parquet", index=False)
    html = write_report(run.directory).read_text()
    heads = pd.read_csv(run.directory / "head_stats.csv")
    assert set(heads.loc[heads["difference"].notna(), "source"]) == {"pronoun", "before_pronoun"}
    assert 'alt="attention difference, pronoun -&gt; occupation"' in html
    assert json.loads((run.directory / "manifest.json").read_text())["dtype"] == "float32"
