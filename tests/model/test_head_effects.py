"""The head-effects measure end to end on tiny models: configuration errors before any weights load,
chunks that resume and shard, the suite's heads on every item, the pronoun-swap design, --limit."""

import re

import pandas as pd
import pytest
import torch
from conftest import EFFECT_SUITE, EFFECTS, TINY_CONFIGS, no_weights, suite_file
from transformers import AutoModelForCausalLM

import attnprobe
from attnprobe.errors import SuiteError
from attnprobe.suite import load_suite


@pytest.mark.parametrize(
    "positive, message",
    [
        ("feminine", "have no label 'feminine' or 'male' (labels: female, male)"),
    ],
)
def test_head_effects_configuration_errors_come_before_weights(tmp_path, monkeypatch, positive, message):
    no_weights(monkeypatch)
    suite = suite_file(tmp_path, "occupation != x", EFFECTS.format(positive=positive))
    with pytest.raises(SuiteError, match=re.escape(message)):
        attnprobe.run_suite(suite, out=tmp_path / "run", progress=False, log=lambda m: None)
    assert not (tmp_path / "run").exists()


def test_multi_token_candidate_is_refused_before_weights(tmp_path, monkeypatch):
    no_weights(monkeypatch)
    suite = suite_file(tmp_path, "occupation != x", EFFECTS.format(positive="female"))
    text = suite.read_text().replace("{label: female, nom: she}", "{label: female, nom: shezzqx}")
    suite.write_text(text)
    with pytest.raises(SuiteError, match="' shezzqx' is 4 tokens; head effects need single-token candidates"):
        attnprobe.run_suite(suite, out=tmp_path / "run", progress=False, log=lambda m: None)


def test_eager_only_family_is_refused_before_weights(tmp_path, monkeypatch, smollm_tokenizer):
    config = TINY_CONFIGS["gpt_neo"].__class__.from_dict(TINY_CONFIGS["gpt_neo"].to_dict())
    config.vocab_size = len(smollm_tokenizer)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "neo")
    smollm_tokenizer.save_pretrained(tmp_path / "neo")
    no_weights(monkeypatch)
    suite = suite_file(tmp_path, "occupation != x", EFFECTS.format(positive="female"))
    with pytest.raises(
        SuiteError, match="bypasses it \\(eager-only family\\); run it with --no-head-effects"
    ):
        attnprobe.run_suite(
            suite, model=str(tmp_path / "neo"), out=tmp_path / "run", progress=False, log=lambda m: None
        )


def test_head_effects_are_chunked_resumable_and_shardable(tiny_llama_dir, tmp_path, monkeypatch):
    """Head effects are stored in chunks of items like the rest: a lost chunk is recomputed alone;
    two shards merged give exactly the unsharded first phase, and running the merged directory
    again adds the selected-heads phase, equal to the unsharded run's."""
    monkeypatch.setattr(attnprobe.measures.head_effects, "EFFECT_CHUNK_ITEMS", 4)
    EFFECT_CHUNK_ITEMS = 4

    suite = tmp_path / "fx.yaml"
    suite.write_text(EFFECT_SUITE)
    quiet = {"model": str(tiny_llama_dir), "progress": False, "log": lambda m: None}
    whole = attnprobe.run_suite(suite, out=tmp_path / "whole", **quiet)
    items = pd.read_parquet(whole.directory / "head_effects_items.parquet")
    totals = pd.read_parquet(whole.directory / "head_effects_totals.parquet")
    n_items = whole.manifest.entry("head_effects")["n_items"]
    assert n_items > EFFECT_CHUNK_ITEMS and whole.manifest.entry("n_effect_chunks") == -(
        -n_items // EFFECT_CHUNK_ITEMS
    )

    chunks = whole.directory / "chunks"
    kept = (chunks / "effects-00000.items.parquet").stat().st_mtime_ns
    (chunks / "effects-00001.done").unlink()  # as if killed while chunk 1 was being written
    again = attnprobe.run_suite(suite, out=tmp_path / "whole", **quiet)
    assert (chunks / "effects-00000.items.parquet").stat().st_mtime_ns == kept  # not recomputed
    pd.testing.assert_frame_equal(pd.read_parquet(again.directory / "head_effects_items.parquet"), items)

    for k in (1, 2):
        attnprobe.run_suite(suite, out=tmp_path / "sharded", shard=(k, 2), **quiet)
    merged = attnprobe.merge_shards(
        [tmp_path / "sharded" / f"shard-{k}-of-2" for k in (1, 2)], tmp_path / "merged"
    )
    pd.testing.assert_frame_equal(pd.read_parquet(merged.directory / "head_effects_items.parquet"), items)
    assert merged.manifest.entry("head_effects")["n_items"] == n_items and merged.has("head_effects")
    assert "crossfit_in" not in pd.read_parquet(
        merged.directory / "head_effects_totals.parquet"
    )  # needs every item
    completed = attnprobe.run_suite(suite, out=tmp_path / "merged", **quiet)
    pd.testing.assert_frame_equal(
        pd.read_parquet(completed.directory / "head_effects_totals.parquet"), totals
    )
    assert (
        completed.manifest.entry("head_effects")["crossfit_heads"]
        == whole.manifest.entry("head_effects")["crossfit_heads"]
    )


def test_exact_k_patches_the_same_suite_heads_on_every_item(tiny_llama_dir, tmp_path):
    suite = tmp_path / "fx.yaml"
    suite.write_text(
        EFFECT_SUITE.replace(
            "counterfactual: {occupation: woman}",
            "counterfactual: {occupation: [woman, man]}, exact: 2, select: 1",
        )
    )
    messages = []
    run = attnprobe.run_suite(
        suite, out=tmp_path / "k", model=str(tiny_llama_dir), progress=False, log=messages.append
    )
    # a fresh run resumes nothing: the held-out items' chunks come first, then the others'
    assert not [m for m in messages if m.startswith("resuming")], messages
    items = pd.read_parquet(run.directory / "head_effects_items.parquet")
    totals = pd.read_parquet(run.directory / "head_effects_totals.parquet")
    held = set(totals.loc[totals["held_out"], "item_id"])
    assert (
        len(held) == run.manifest.entry("head_effects")["held_out"] == 5
    )  # 8 by default, at most half of the 10 items
    on_held = items[items["item_id"].isin(held)]
    assert on_held[["output_in", "output_out", "pattern_in"]].notna().all().all()  # every head exact there
    patched = items[items["output_in"].notna() & ~items["item_id"].isin(held)]
    heads = set(map(tuple, patched[["layer", "head"]].to_numpy()))
    grid = run.manifest.model.n_layers * run.manifest.model.n_heads
    assert len(heads) == 2 and len(patched) == 2 * (
        run.manifest.entry("head_effects")["n_pairs"] - len(on_held) // grid
    )  # the same 2 heads
    assert (
        patched[["output_out", "pattern_in"]].notna().all().all()
        and items["attribution_output"].notna().all()
    )
    assert run.manifest.entry("head_effects")["exact_heads"] == " ".join(
        f"L{l}H{h}" for l, h in sorted(heads)
    )
    stats = attnprobe.Run(run.directory).head_effects
    tested = stats.groupby("counterfactual")["output_in_p"].count()  # the heads patched on every item
    assert tested.eq(2).all()


def test_pronoun_swap_needs_paired_versions_and_a_question(tmp_path):
    (tmp_path / "pro.txt").write_text("1 The [nurse] hired the mechanic because [she] was busy.\n")
    (tmp_path / "anti.txt").write_text("1 The [nurse] hired the mechanic because [he] was busy.\n")
    head = (
        "name: s\nslots: {occupation: [nurse, mechanic]}\nsentences:\n  - {id: f1, files: {pro: pro.txt, "
        "anti: anti.txt}, "
        "numbered: true, spans: [referent, pronoun], mark: {other: occupation}}\n"
        "analysis: {contrast: version, positive: pro, negative: anti, referents: [referent, other], answer: "
        "referent}\n"
        "attention:\n  - {source: pronoun, targets: [referent, other]}\n"
    )
    (tmp_path / "s.yaml").write_text(head + "head_effects: {counterfactual: pair}\n")
    with pytest.raises(
        SuiteError, match=r"s.yaml:\d+: counterfactual: pair .* needs .* a `referent_choice:` question"
    ):
        load_suite(tmp_path / "s.yaml")
    (tmp_path / "s.yaml").write_text(
        head + "referent_choice: {prompt: \" '{pronoun}' is the\"}\n"
        "head_effects: {counterfactual: pair, templates: [f2]}\n"
    )
    with pytest.raises(SuiteError, match="unknown template id 'f2'"):
        load_suite(tmp_path / "s.yaml")
    (tmp_path / "s.yaml").write_text(
        head + "referent_choice: {prompt: \" '{pronoun}' is the\"}\n"
        "head_effects: {counterfactual: pair, templates: [f1], exact: 3}\n"
    )
    measure = load_suite(tmp_path / "s.yaml").head_effects
    assert (measure.design, measure.positive, measure.negative, measure.replacements, measure.exact) == (
        "pair",
        "pro",
        "anti",
        ("anti",),
        3,
    )


def test_limit_scales_the_head_effects_items_and_the_run_says_how_many(tiny_llama_dir, tmp_path, monkeypatch):
    """--limit 10 of 20 prompts halves max_items (8 -> 4); before the phase the run logs the item
    count, and after the first chunk the time per item and what is left."""
    monkeypatch.setattr(attnprobe.measures.head_effects, "EFFECT_CHUNK_ITEMS", 4)
    suite = tmp_path / "fx.yaml"
    suite.write_text(
        EFFECT_SUITE.replace(
            "counterfactual: {occupation: woman}}", "counterfactual: {occupation: woman}, max_items: 8}"
        )
    )
    lines = []
    run = attnprobe.run_suite(
        suite, model=str(tiny_llama_dir), out=tmp_path / "run", limit=10, progress=False, log=lines.append
    )
    assert run.manifest.n_prompts == 10 and run.manifest.entry("head_effects")["n_items"] == 4
    assert any(
        re.fullmatch(
            r"head effects: 4 items \(4 counterfactual pairs\) in 1 chunk; about \d+\.\d min on 2 CPU cores, "
            r"the time per item is known after the first chunk",
            line,
        )
        for line in lines
    )
    full = attnprobe.run_suite(
        suite, model=str(tiny_llama_dir), out=tmp_path / "full", progress=False, log=lines.append
    )
    assert full.manifest.entry("head_effects")["n_items"] == 8
    assert any(
        line.startswith("head effects: ")
        and " s per item, about " in line
        and "for the other 4 items" in line
        for line in lines
    )


def test_cross_fitting_chooses_each_quarter_its_heads_on_the_other_units_and_templates():
    """4 occupations x 2 templates: items fall into quarters (unit half x template half); in quarter q
    head q has the largest attribution, so the set each quarter is tested with is the opposite
    quarter's head, never its own (round 2 split occupations only, so a template's own heads were
    tested on it)."""
    import torch

    from attnprobe.intervene.items import PatchItem
    from attnprobe.intervene.selection import folds, opposite, select
    from attnprobe.measures.head_effects.designs import SlotSwap

    bls = {"a": 10.0, "b": 40.0, "c": 60.0, "d": 90.0}
    items = [
        PatchItem(f"{t}|{u}", t, u, u, bls[u], torch.tensor([1, 2]), (), (3,), (4,))
        for t in ("t1", "t2")
        for u in bls
    ]
    fold = folds(items)
    assert sorted(set(fold.values())) == [0, 1, 2, 3] and {opposite(f, 2) for f in range(4)} == {0, 1, 2, 3}
    assert all(opposite(f, 2) // 2 != f // 2 and opposite(f, 2) % 2 != f % 2 for f in range(4))
    rows = [
        {
            "item_id": i.item_id,
            "counterfactual": "woman",
            "layer": 0,
            "head": h,
            "attribution_output": 1.0 if h == fold[i.item_id] else 0.0,
        }
        for i in items
        for h in range(4)
    ]
    totals = pd.DataFrame({"item_id": [i.item_id for i in items], "counterfactual": "woman", "te": 1.0})
    measure = SlotSwap("occupation", ("woman",), "female", "male", select=1, exact=2, cut="pronoun")
    selection = select(measure, items, totals, pd.DataFrame(rows), 1, 4)
    for i in items:
        assert selection.crossfit_for(i, "woman") == (opposite(fold[i.item_id], 2),)


def test_a_truncated_head_effects_table_is_rebuilt_by_the_rerun_the_error_names(tiny_llama_dir, tmp_path):
    """The report's error says a rerun rebuilds a damaged table from the chunks; for the head-effect
    tables every rerun used to keep the truncated file (it existed) and fail the same way."""
    from click.testing import CliRunner

    from attnprobe.cli import main

    (tmp_path / "fx.yaml").write_text(EFFECT_SUITE)
    command = ["run", str(tmp_path / "fx.yaml"), "--model", str(tiny_llama_dir), "--out", str(tmp_path / "o")]
    assert CliRunner().invoke(main, command).exit_code == 0
    table = tmp_path / "o" / "head_effects_items.parquet"
    before = pd.read_parquet(table)
    table.write_bytes(table.read_bytes()[:1000])
    report = CliRunner().invoke(main, ["report", str(tmp_path / "o")])
    assert report.exit_code == 2 and "rerun the same `attnprobe run` command" in report.output
    again = CliRunner().invoke(main, command)
    assert again.exit_code == 0, again.output
    pd.testing.assert_frame_equal(pd.read_parquet(table), before)


def test_a_per_value_counterfactual_takes_each_items_own_partner(tiny_llama_dir, tmp_path):
    """`{occupation.partner}`: each occupation replaced by its own value of the table's column (Vig
    et al.'s per-occupation anti-stereotypical swap), one direction beside the literal words; x' is
    the prompt with that word, and TE is y(x') - y(x) as for any word."""
    (tmp_path / "jobs.tsv").write_text(
        "occupation\tpct\tpartner\nnurse\t90\tplumber\nplumber\t2\tnurse\nbaker\t60\t\nchef\t20\tbaker\n"
    )
    suite = tmp_path / "p.yaml"
    suite.write_text(
        EFFECT_SUITE.replace(
            "{values: [nurse, engineer, teacher, doctor, lawyer, farmer, baker, pilot, chef, judge]}",
            "{table: jobs.tsv, column: occupation}",
        ).replace(
            "counterfactual: {occupation: woman}",
            'counterfactual: {occupation: [woman, "{occupation.partner}"]}',
        )
    )
    run = attnprobe.run_suite(
        suite, model=str(tiny_llama_dir), out=tmp_path / "run", progress=False, log=lambda m: None
    )
    totals = run.head_effect_totals
    per_value = totals[totals["counterfactual"] == "{occupation.partner}"].set_index("occupation")
    assert set(per_value.index) == {"nurse", "plumber", "chef"}  # baker has no partner: dropped, said why
    dropped = run.manifest.entry("head_effects")["dropped"]
    assert any(
        "baker" in d["item_id"] and "has no value of {occupation.partner}" in d["reason"] for d in dropped
    )
    model = attnprobe.load_model(str(tiny_llama_dir))
    she, he = (model.tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in (" she", " he"))
    for occupation, partner in (("nurse", "plumber"), ("chef", "baker")):
        ids = model.tokenizer(f"The {partner} said that", return_tensors="pt")["input_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(model.model(input_ids=ids).logits[0, -1], -1)
        assert abs(per_value.loc[occupation, "y_cf"] - (logp[she] - logp[he]).item()) < 1e-4
    bad = suite.read_text().replace("{occupation.partner}", "{occupation.rival}")
    suite.write_text(bad)
    with pytest.raises(SuiteError, match=r"\{occupation.rival\} names no column of slot 'occupation'"):
        load_suite(suite)


def test_a_counterfactual_slot_after_the_cut_is_refused_before_weights(tmp_path, monkeypatch):
    """Issue 32: with the slot after the cut every pair was dropped and the run ended in a traceback
    after the prompts; mixed templates keep the items that qualify and say what was dropped."""
    no_weights(monkeypatch)
    after = EFFECT_SUITE.replace(
        "The {occupation} said that {pronoun} left.", "Then {pronoun} met the {occupation}."
    )
    (tmp_path / "after.yaml").write_text(after)
    with pytest.raises(
        SuiteError,
        match=r"after.yaml:\d+: head_effects have no item to patch \(10 dropped: the occupation comes after "
        r"the cut\); change the templates or the counterfactual, or run with --no-head-effects",
    ):
        attnprobe.run_suite(tmp_path / "after.yaml", out=tmp_path / "run", progress=False, log=lambda m: None)
    assert not (tmp_path / "run").exists()
    mixed = EFFECT_SUITE.replace(
        '  - {id: said, text: "The {occupation} said that {pronoun} left."}',
        '  - {id: said, text: "The {occupation} said that {pronoun} left."}\n'
        '  - {id: met, text: "Then {pronoun} met the {occupation}."}',
    )
    (tmp_path / "mixed.yaml").write_text(mixed)
    from attnprobe.run.options import RunOptions
    from attnprobe.run.plan import plan_run

    plan = plan_run(load_suite(tmp_path / "mixed.yaml"), "smollm2-135m", RunOptions())
    effects = plan.parts["head_effects"]
    assert len(effects.items) == 10 and {d.reason for d in effects.dropped} == {
        "the occupation comes after the cut"
    }


def test_every_head_patching_is_charged_by_the_passes_it_reruns():
    """head_effect_seconds: the held-out items' every-head patching scales with the passes it takes
    at the model's layers and heads, the rest with the pairs; all of it with the parameters."""
    from types import SimpleNamespace

    from attnprobe.forward.estimates import (
        PAIR_SECONDS,
        REFERENCE_HEADS,
        REFERENCE_PARAMETERS,
        REFERENCE_TOKENS,
        exact_passes,
        head_effect_seconds,
    )

    measure = SimpleNamespace(exact=10, held_out_ids=lambda items: {0})
    items = [SimpleNamespace(item_id=i, counterfactuals=[1, 2], x=[0] * 7) for i in range(4)]
    reference = head_effect_seconds(measure, items)
    held = 2 * 7 / REFERENCE_TOKENS * PAIR_SECONDS["every_head"]  # item 0's two pairs
    for layers, heads in ((32, 32), (16, 32), (34, 8)):
        wider = head_effect_seconds(measure, items, heads=(layers, heads))
        ratio = exact_passes(layers, heads) / exact_passes(*REFERENCE_HEADS)
        assert wider - reference == pytest.approx(held * (ratio - 1))
    # SmolLM2's 30 layers of 9 heads: 31 patched variants a layer rerun over 15.5 layers, 3 whole passes
    assert exact_passes(30, 9) == 31 * 15.5 + 3
    doubled = head_effect_seconds(measure, items, parameters=2 * REFERENCE_PARAMETERS)
    assert doubled == pytest.approx(2 * reference)
