"""Regression tests for bugs named in issue 14: each failed before the layout split."""

import json
import re
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import TINY_CONFIGS
from transformers import AutoModelForCausalLM

import attnprobe
from attnprobe.errors import RunError, SuiteError
from attnprobe.run import model_name, storage
from attnprobe.suite import load_suite

TABLE = (
    "occupation\tbls_pct_female\tsector\ninspector\t6.4\tpublic\nmachinist\t6.7\tprivate\n"
    "nurse\t88.5\tpublic\npainter\t5.7\tprivate\ncashier\t71\tprivate\n"
)


def suite_file(tmp_path, where, extra=""):
    (tmp_path / "jobs.tsv").write_text(TABLE)
    path = tmp_path / "suite.yaml"
    path.write_text(
        textwrap.dedent(f"""\
        name: where
        contrast: pronoun
        slots:
          occupation: {{table: jobs.tsv, column: occupation}}
          pronoun:
            forms: [nom]
            values: [{{label: female, nom: she}}, {{label: male, nom: he}}]
        templates:
          - id: said
            text: "The {{occupation}} said that {{pronoun.nom}} left."
            where: "{where}"
        next_token:
          - {{cut: pronoun, candidates: pronoun}}
        """)
        + textwrap.dedent(extra)
    )
    return path


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


OLD_RUN = {"fingerprint": "old", "settings": {}, "versions": {}, "suite": {"name": "gender"}}


def test_fresh_removes_every_artefact_of_the_old_run_and_nothing_else(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps(OLD_RUN))
    for name in (
        "prompts.csv",
        "head_effects_items.parquet",
        "head_effects_totals.csv",
        "head_stats.csv",
        "report.html",
    ):
        (tmp_path / name).write_text("old")
    (tmp_path / "chunks").mkdir()
    (tmp_path / "figures").mkdir()
    for name in (
        "00000.done",
        "00000.attention.parquet",
        "effects-00003.items.parquet",
        "selected-00000.done",
        ".00001.done.tmp",
    ):
        (tmp_path / "chunks" / name).write_text("{}")
    (tmp_path / "figures" / "difference_occupation.png").write_text("png")
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "chunks" / "my-notes.txt").write_text("mine too")  # another tool's file among the chunks
    kept = []
    assert (
        storage.prepare_directory(tmp_path, "new", resume=False, suite_name="gender", log=kept.append) is None
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chunks", "notes.txt"]
    assert [p.name for p in (tmp_path / "chunks").iterdir()] == ["my-notes.txt"]
    assert kept == [f"--fresh kept 1 files attnprobe did not write in {tmp_path}: chunks/my-notes.txt"]


def test_fresh_refuses_another_tools_manifest_and_another_suites_run(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"name": "someone else's"}))
    (tmp_path / "prompts.csv").write_text("theirs")
    with pytest.raises(RunError, match="was not written by attnprobe; nothing was deleted"):
        storage.prepare_directory(tmp_path, "new", resume=False, suite_name="gender")
    assert (tmp_path / "prompts.csv").read_text() == "theirs"
    (tmp_path / "manifest.json").write_text(json.dumps(OLD_RUN))
    with pytest.raises(
        RunError,
        match=f"{tmp_path} holds a run of suite 'gender', not 'coref'; --fresh replaces only a run "
        "of the same suite: choose another --out \\(nothing was deleted\\)",
    ):
        storage.prepare_directory(tmp_path, "new", resume=False, suite_name="coref")
    assert (tmp_path / "prompts.csv").read_text() == "theirs"


def test_output_name_of_a_local_checkpoint(tmp_path, monkeypatch):
    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    assert model_name("./ckpt") == "ckpt" and model_name("ckpt/") == "ckpt"  # was '._ckpt'
    assert model_name("org/model") == "org_model" and model_name("/x/SmolLM2.Q4.gguf") == "SmolLM2.Q4"


EFFECTS = """\
    head_effects:
      cut: pronoun
      positive: {positive}
      negative: male
      counterfactual: {{occupation: woman}}
    """


def _no_weights(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the configuration error")

    monkeypatch.setattr(attnprobe.run, "load_model", refuse)


@pytest.mark.parametrize(
    "positive, message",
    [
        ("feminine", "have no label 'feminine' or 'male' (labels: female, male)"),
    ],
)
def test_head_effects_configuration_errors_come_before_weights(tmp_path, monkeypatch, positive, message):
    _no_weights(monkeypatch)
    suite = suite_file(tmp_path, "occupation != x", EFFECTS.format(positive=positive))
    with pytest.raises(SuiteError, match=re.escape(message)):
        attnprobe.run_suite(suite, out=tmp_path / "run", progress=False, log=lambda m: None)
    assert not (tmp_path / "run").exists()


def test_multi_token_candidate_is_refused_before_weights(tmp_path, monkeypatch):
    _no_weights(monkeypatch)
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
    _no_weights(monkeypatch)
    suite = suite_file(tmp_path, "occupation != x", EFFECTS.format(positive="female"))
    with pytest.raises(
        SuiteError, match="bypasses it \\(eager-only family\\); run it with --no-head-effects"
    ):
        attnprobe.run_suite(
            suite, model=str(tmp_path / "neo"), out=tmp_path / "run", progress=False, log=lambda m: None
        )


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--shard", "3/2"],
            "Invalid value for '--shard': '3/2': K/N needs 1 <= K <= N; see `attnprobe run --help`",
        ),
        (["--shard", "x"], "Invalid value for '--shard': 'x': write K/N, e.g. 1/4"),
        (["--batch-size", "0"], "Invalid value for '--batch-size'"),
    ],
)
def test_bad_options_are_one_line_before_anything_runs(tmp_path, args, message):
    from click.testing import CliRunner

    from attnprobe.cli import main

    result = CliRunner().invoke(main, ["run", "probes/gender.yaml", "--out", str(tmp_path / "o"), *args])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert (
        result.output.startswith("attnprobe: error: ")
        and message in result.output
        and not (tmp_path / "o").exists()
    )


EFFECT_SUITE = """\
name: fx
slots:
  occupation: {values: [nurse, engineer, teacher, doctor, lawyer, farmer, baker, pilot, chef, judge]}
  pronoun: {values: [{label: female, value: she}, {label: male, value: he}]}
contrast: pronoun
templates:
  - {id: said, text: "The {occupation} said that {pronoun} left."}
attention: [{source: pronoun, targets: occupation}]
next_token: [{cut: pronoun, candidates: pronoun}]
head_effects: {cut: pronoun, positive: female, negative: male, counterfactual: {occupation: woman}}
"""


def test_head_effects_are_chunked_resumable_and_shardable(tiny_llama_dir, tmp_path, monkeypatch):
    """Head effects are stored in chunks of items like the rest: a lost chunk is recomputed alone;
    two shards merged give exactly the unsharded first phase, and running the merged directory
    again adds the selected-heads phase, equal to the unsharded run's."""
    monkeypatch.setattr(attnprobe.run.plan, "EFFECT_CHUNK_ITEMS", 4)
    EFFECT_CHUNK_ITEMS = 4

    suite = tmp_path / "fx.yaml"
    suite.write_text(EFFECT_SUITE)
    quiet = {"model": str(tiny_llama_dir), "progress": False, "log": lambda m: None}
    whole = attnprobe.run_suite(suite, out=tmp_path / "whole", **quiet)
    items = pd.read_parquet(whole.directory / "head_effects_items.parquet")
    totals = pd.read_parquet(whole.directory / "head_effects_totals.parquet")
    n_items = whole.manifest["head_effects"]["n_items"]
    assert n_items > EFFECT_CHUNK_ITEMS and whole.manifest["n_effect_chunks"] == -(
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
    assert merged.manifest["head_effects"]["n_items"] == n_items and merged.has_head_effects
    assert "crossfit_in" not in pd.read_parquet(
        merged.directory / "head_effects_totals.parquet"
    )  # needs every item
    completed = attnprobe.run_suite(suite, out=tmp_path / "merged", **quiet)
    pd.testing.assert_frame_equal(
        pd.read_parquet(completed.directory / "head_effects_totals.parquet"), totals
    )
    assert (
        completed.manifest["head_effects"]["crossfit_heads"]
        == whole.manifest["head_effects"]["crossfit_heads"]
    )


def test_exact_k_patches_the_same_suite_heads_on_every_item(tiny_llama_dir, tmp_path):
    suite = tmp_path / "fx.yaml"
    suite.write_text(
        EFFECT_SUITE.replace(
            "counterfactual: {occupation: woman}",
            "counterfactual: {occupation: [woman, man]}, exact: 2, select: 1",
        )
    )
    run = attnprobe.run_suite(
        suite, out=tmp_path / "k", model=str(tiny_llama_dir), progress=False, log=lambda m: None
    )
    items = pd.read_parquet(run.directory / "head_effects_items.parquet")
    totals = pd.read_parquet(run.directory / "head_effects_totals.parquet")
    held = set(totals.loc[totals["held_out"], "item_id"])
    assert (
        len(held) == run.manifest["head_effects"]["held_out"] == 5
    )  # 8 by default, at most half of the 10 items
    on_held = items[items["item_id"].isin(held)]
    assert on_held[["output_in", "output_out", "pattern_in"]].notna().all().all()  # every head exact there
    patched = items[items["output_in"].notna() & ~items["item_id"].isin(held)]
    heads = set(map(tuple, patched[["layer", "head"]].to_numpy()))
    grid = run.manifest["model"]["n_layers"] * run.manifest["model"]["n_heads"]
    assert len(heads) == 2 and len(patched) == 2 * (
        run.manifest["head_effects"]["n_pairs"] - len(on_held) // grid
    )  # the same 2 heads
    assert (
        patched[["output_out", "pattern_in"]].notna().all().all()
        and items["attribution_output"].notna().all()
    )
    assert run.manifest["head_effects"]["exact_heads"] == " ".join(f"L{l}H{h}" for l, h in sorted(heads))
    stats = attnprobe.Run(run.directory).head_effects
    assert stats.groupby("counterfactual")["p"].count().eq(2).all()  # tested: the heads patched on every item


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


def test_a_run_off_a_terminal_logs_each_chunk(tiny_llama_dir, tmp_path):
    """Issue 17: with stderr not a terminal (notebooks, nohup, SLURM, CI) a run used to print nothing
    for minutes; now one line per finished chunk of prompts and of head-effects items."""
    from click.testing import CliRunner

    from attnprobe.cli import main

    (tmp_path / "fx.yaml").write_text(EFFECT_SUITE)
    result = CliRunner().invoke(
        main,
        [
            "run",
            str(tmp_path / "fx.yaml"),
            "--model",
            str(tiny_llama_dir),
            "--out",
            str(tmp_path / "out"),
            "--chunk-size",
            "8",
            "--batch-size",
            "4",
        ],
    )
    assert result.exit_code == 0, result.output
    assert re.search(
        r"attnprobe run: chunk 1 of 3 done, 8 of 20 prompts, \d+ s, about \d+ s left", result.output
    )
    assert "attnprobe run: chunk 3 of 3 done, 20 of 20 prompts" in result.output
    assert re.search(r"head effects: chunk 1 of 1 done, 10 of 10 items", result.output)
    assert re.search(r"selected heads: chunk 1 of 1 done, 10 of 10 items", result.output)


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
        f"{tmp_path / 'm.yaml'}:4: data file 'many.tsv' has 1,201 lines, more than max_prompts = 1,000"
    )
    assert "raise `max_prompts:`" in message
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


def test_tables_round_trip_as_computed(tiny_llama_dir, tmp_path):
    """Issue 17: tables came back from CSV with spreadsheet quote prefixes ('-...) and dtypes that
    depended on the cache. Parquet is now what readers read; the CSV stays a safe export."""
    from attnprobe.run import plan
    from attnprobe.suite import load_suite as load

    (tmp_path / "s.yaml").write_text(
        "name: s\nslots:\n  x: ['-minus', '=sum(1)', plain]\n"
        "  p: {values: [{label: a, value: she}, {label: b, value: he}]}\ncontrast: p\n"
        "templates:\n  - {id: t, text: 'The {x} said that {p} left.'}\n"
        "attention: [{source: p, targets: x}]\n"
    )
    run = attnprobe.run_suite(
        tmp_path / "s.yaml",
        model=str(tiny_llama_dir),
        out=tmp_path / "out",
        progress=False,
        log=lambda m: None,
    )
    suite = load(tmp_path / "s.yaml")
    tokenizer = transformers_tokenizer(tiny_llama_dir)
    expected = storage.prompts_table(plan.encode_prompts(suite, list(suite.prompts), tokenizer, 10_000))
    pd.testing.assert_frame_equal(attnprobe.Run(run.directory).prompts, expected)
    assert "'-minus" in (run.directory / "prompts.csv").read_text()  # the spreadsheet export is neutralised
    first = attnprobe.Run(run.directory).condition_means  # computed
    attnprobe.Run(run.directory).report()
    pd.testing.assert_frame_equal(
        attnprobe.Run(run.directory).condition_means, first
    )  # from the cache, same dtypes


def transformers_tokenizer(folder):
    from attnprobe.models import load_tokenizer

    return load_tokenizer(str(folder))[0]


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
    monkeypatch.setattr(attnprobe.run.plan, "EFFECT_CHUNK_ITEMS", 4)
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
    assert run.manifest["n_prompts"] == 10 and run.manifest["head_effects"]["n_items"] == 4
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
    assert full.manifest["head_effects"]["n_items"] == 8
    assert any(
        line.startswith("head effects: ")
        and " s per item, about " in line
        and "for the other 4 items" in line
        for line in lines
    )
