"""Benchmarks of attnprobe on this machine: one process, the same prompts, medians of repeats.

    python benchmarks/run.py [--prompts 320] [--repeats 5] [--out benchmarks/results]

Measured, on the shipped gender suite and the bundled smollm2-135m:
  eager_loop     one prompt at a time, eager attention, output_attentions=True (what tutorials do)
  sdpa_floor     batched SDPA forward of the whole prompts, no capture, logits for the last position only
                 (also on only the tokens a run forwards: up to the last token a measure reads)
  capture_rows   batched forward of those tokens through attnprobe's function, recording the pronoun
                 rows of all layers
  run_end_to_end attnprobe.run_suite: capture, aggregation, writing chunks and tables
                 (statistics and report rendering timed separately; head effects off, timed below)
  bfloat16       run_end_to_end with the model in bfloat16 (softmax and recorded weights in float32),
                 and its agreement with float32: max |d weight|, Spearman of head effect rankings
  bfloat16_rows  max |d weight| of the raw recorded rows: bfloat16 model, and float32 model under autocast
  head_effects   (also --only head_effects) seconds per item of head effects: the one-item reference
                 patching every head and layer exactly, against the suite's scheme in batches
                 (attribution for all, the suite's 10 heads exact) and every head exact in batches
  scoring        (--only scoring) the referent-choice phase against the prompt phase on a
                 1,584-sentence coreference suite, and against round 2's way of scoring; the
                 likelihood and multiple-choice phases against their suites' prompt phases
  memory         peak resident memory of `attnprobe run` at 1x and 10x prompts (separate processes)
  load           load_model("smollm2-135m"): cold (empty cache, GGUF dequantised) and cached
  sharing        (--only sharing) the full gender suite: attnprobe end to end with prefix sharing
                 (float32 and bfloat16) and without (batch 32, the path before sharing), against the
                 plain forward of the forwarded tokens, the forward of the packed tries (each shared
                 token once), and the matmul peak measured in the same run; on the first --peer-prompts
                 prompts also TransformerLens run_with_cache (patterns only) and an nnsight trace
                 saving every layer's attention pattern, where installed (pip install -e '.[bench]')
The throughput figures (eager_loop to bfloat16) are timed in turn within every repeat, so a slow
spell of a shared machine hits all alike; ratios are between figures of this one run.
Writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

import attnprobe
from attnprobe.forward.packing import pad_right
from attnprobe.run.plan import encode_prompts, select_prompts
from attnprobe.suite import load_suite

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "probes" / "gender.yaml"


def interleaved(fns: list, repeats: int, warm_up: bool = True) -> list[float]:
    """Median seconds of each function, timed in turn within every repeat (after one warm-up round,
    unless the functions are long enough to need none)."""
    times = [[] for _ in fns]
    for repeat in range(repeats + warm_up):
        for fn, spent in zip(fns, times):
            start = time.perf_counter()
            fn()
            if repeat or not warm_up:
                spent.append(time.perf_counter() - start)
    return [statistics.median(spent) for spent in times]


def batches_of(encoded, batch_size: int, pad_id: int, forwarded: bool) -> list:
    """Length-sorted padded batches of whole prompts or of the tokens a run forwards
    (run.plan.forward_length)."""
    length = (lambda e: e.n_forward) if forwarded else (lambda e: len(e.ids))
    ordered = sorted(encoded, key=length)
    out = []
    for start in range(0, len(ordered), batch_size):
        batch = ordered[start : start + batch_size]
        ids, mask = pad_right([e.ids[: length(e)] for e in batch], pad_id)
        rows = torch.tensor([[e.spans["pronoun"][0]] for e in batch])
        out.append((ids, mask, rows))
    return out


def gender_prompts(tokenizer, n_prompts: int):
    """The suite and about `n_prompts` of its prompts, encoded as `attnprobe run --limit` selects them."""
    suite = load_suite(SUITE)
    return suite, encode_prompts(suite, select_prompts(suite.prompts, n_prompts), tokenizer, None)


def bench_throughput(pm, pm_bf16, encoded, repeats: int, scratch: Path, batch_size: int = 32) -> dict:
    """(a), (b), (b'), row capture, (c) and (d), timed in turn within every repeat (after one warm-up
    round): a slow spell of this shared machine hits all of them alike, so their ratios hold."""
    whole = batches_of(encoded, batch_size, pm.tokenizer.pad_token_id, forwarded=False)
    forwarded = batches_of(encoded, batch_size, pm.tokenizer.pad_token_id, forwarded=True)
    model = pm.model
    n = len(encoded)

    def attention(implementation: str) -> None:
        model.set_attn_implementation(implementation)

    @torch.inference_mode()
    def eager_loop():
        attention("eager")
        for e in encoded:
            model(input_ids=torch.tensor([e.ids]), output_attentions=True, use_cache=False)

    @torch.inference_mode()
    def sdpa_floor(batches):
        attention("sdpa")
        for ids, mask, _ in batches:
            model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)

    def capture_rows():
        attention("attnprobe")
        for ids, mask, rows in forwarded:
            attnprobe.run_with_capture(model, ids, mask, rows=rows, logit_positions=torch.tensor([0]))

    def run(probe_model, name):  # limit=n selects the same prompts; the last repeat's directory is kept
        attention("attnprobe")
        attnprobe.run_suite(
            SUITE,
            model=probe_model,
            out=scratch / name,
            limit=n,
            progress=False,
            log=lambda m: None,
            resume=False,
            skip=("head_effects",),
        )

    t_eager, t_floor, t_floor_forwarded, t_capture, t_run, t_bf16 = interleaved(
        [
            eager_loop,
            lambda: sdpa_floor(whole),
            lambda: sdpa_floor(forwarded),
            capture_rows,
            lambda: run(pm, "float32"),
            lambda: run(pm_bf16, "bfloat16"),
        ],
        repeats,
    )
    return {
        "n_prompts": n,
        "batch_size": batch_size,
        "tokens_per_prompt": sum(len(e.ids) for e in encoded) / n,
        "forwarded_tokens_per_prompt": sum(e.n_forward for e in encoded) / n,
        "eager_loop_prompts_per_s": n / t_eager,
        "sdpa_floor_prompts_per_s": n / t_floor,
        "sdpa_floor_forwarded_tokens_prompts_per_s": n / t_floor_forwarded,
        "capture_rows_prompts_per_s": n / t_capture,
        "capture_over_floor_forwarded_tokens": t_floor_forwarded / t_capture,
        "run_end_to_end_prompts_per_s": n / t_run,
        "run_over_eager_loop": t_eager / t_run,
        "run_over_floor": t_floor / t_run,
        "run_over_floor_forwarded_tokens": t_floor_forwarded / t_run,
        "bfloat16_prompts_per_s": n / t_bf16,
        "bfloat16_over_float32": t_run / t_bf16,
    }


def bench_agreement(scratch: Path) -> dict:
    """bfloat16 against float32 on the kept runs; statistics and report rendering timed."""
    from scipy.stats import spearmanr

    from attnprobe import stats
    from attnprobe.report import write_report

    start = time.perf_counter()
    write_report(scratch / "float32")
    report_seconds = time.perf_counter() - start
    a = pd.read_parquet(scratch / "float32" / "attention.parquet")
    b = pd.read_parquet(scratch / "bfloat16" / "attention.parquet")
    keys = ["prompt_id", "layer", "head", "source", "target"]
    joined = a.merge(b, on=keys, suffixes=("_32", "_16"))
    assert len(joined) == len(a) == len(b)
    heads32 = stats.head_stats(attnprobe.Run(scratch / "float32"), n_boot=200, n_perm=200)
    heads16 = stats.head_stats(attnprobe.Run(scratch / "bfloat16"), n_boot=200, n_perm=200)
    heads32, heads16 = heads32[heads32.scope == "all"], heads16[heads16.scope == "all"]
    rank = min(
        spearmanr(
            heads32[heads32.target == t]["difference"], heads16[heads16.target == t]["difference"]
        ).statistic
        for t in heads32["target"].unique()
    )
    return {
        "bfloat16_max_abs_dweight": float((joined["weight_32"] - joined["weight_16"]).abs().max()),
        "bfloat16_head_effect_spearman_min": float(rank),
        "statistics_and_report_s": report_seconds,
    }


def bench_bfloat16_rows(pm, pm_bf16, encoded, repeats: int) -> dict:
    """Where the bfloat16 error comes from: the recorded pronoun rows (every layer and head, before
    any aggregation) of a bfloat16 model, and of the float32 model under torch.autocast (matmuls in
    bfloat16, residual stream, norms and softmax in float32), against float32."""
    batches = batches_of(encoded, 32, pm.tokenizer.pad_token_id, forwarded=True)

    def rows(model, autocast=False):
        out = []
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            for ids, mask, r in batches:
                captured = attnprobe.run_with_capture(
                    model, ids, mask, rows=r, logit_positions=torch.tensor([0])
                )
                out.append(torch.stack([captured.weights[layer] for layer in sorted(captured.weights)]))
        return out

    def max_diff(a, b):
        return max((x - y).abs().max().item() for x, y in zip(a, b))

    reference, bf16, autocast = rows(pm), rows(pm_bf16), rows(pm, autocast=True)
    t32, t16, t_auto = interleaved(
        [lambda: rows(pm), lambda: rows(pm_bf16), lambda: rows(pm, autocast=True)], repeats
    )
    return {
        "bfloat16_weights_rows_max_abs_dweight": max_diff(reference, bf16),
        "bfloat16_weights_rows_speedup": t32 / t16,
        "autocast_rows_max_abs_dweight": max_diff(reference, autocast),
        "autocast_rows_speedup": t32 / t_auto,
    }


def bench_head_effects(pm, suite, encoded, n_reference: int = 3, n_items: int = 32, repeats: int = 2) -> dict:
    """Seconds per item of head effects, in one process on the gender suite's first items (x with
    its three x'): the reference, tests/reference_patching.effects with every head and layer patched exactly
    (what every item cost before, exact: all); the suite's scheme in batches (screen: attribution
    of every head and layer, all heads' patterns; then the suite's 10 heads exact, in and out and
    pattern, and a cross-fitted set), per item over a chunk of `n_items`; and every head and layer
    exact in batches (a held-out item). Also the largest difference between the batched and the
    reference exact effects of the suite's heads (float32)."""
    from dataclasses import replace

    from attnprobe.intervene.selection import head_mask, select
    from attnprobe.measures.head_effects import screen as phases

    sys.path.insert(0, str(ROOT / "tests"))  # the one-item reference lives with the tests
    from reference_patching import effects

    items = suite.head_effects.items(pm.tokenizer, encoded)[0][:n_items]
    L, H = pm.info.n_layers, pm.info.n_heads
    measure = suite.head_effects
    screened = phases.screen(pm, measure, items, set())
    selection = select(measure, items, screened["totals"], screened["items"], L, H)

    def scheme():
        tables = phases.screen(pm, measure, items, set())
        return tables, phases.selected(pm, items, selection)

    def every_head(item):
        return phases.screen(pm, replace(measure, exact="all"), [item], set())

    reference, worst = [], 0.0
    suite_heads = head_mask(selection.suite, L, H)
    _, chosen = scheme()
    for item in items[:n_reference]:
        start = time.perf_counter()
        for cf in item.counterfactuals:
            r = effects(
                pm,
                item.x,
                cf.x_cf,
                torch.arange(cf.at, len(item.x)),
                torch.arange(cf.at_cf, len(cf.x_cf)),
                list(item.positive),
                list(item.negative),
                torch.ones(L, H, dtype=torch.bool),
            )
            rows = chosen["items"][
                (chosen["items"]["item_id"] == item.item_id) & (chosen["items"]["counterfactual"] == cf.word)
            ]
            for column in ("output_in", "output_out", "pattern_in"):
                got, want = rows[column].to_numpy(), r[column][suite_heads].numpy()
                finite = ~pd.isna(want)
                worst = max(worst, float(abs(got[finite] - want[finite]).max(initial=0.0)))
        reference.append(time.perf_counter() - start)
    batched = [t / len(items) for t in interleaved([scheme], repeats, warm_up=False)]
    exact_all = interleaved([lambda: every_head(items[0])], repeats, warm_up=False)
    per_item_reference = statistics.median(reference)
    return {
        "n_reference_items": n_reference,
        "n_items": len(items),
        "exact_heads": measure.exact,
        "reference_all_heads_s_per_item": per_item_reference,
        "batched_scheme_s_per_item": batched[0],
        "batched_all_heads_s_per_item": exact_all[0],
        "saving_scheme_vs_reference": per_item_reference / batched[0],
        "saving_all_heads_batched_vs_reference": per_item_reference / exact_all[0],
        "suite_heads_max_abs_difference_float32": worst,
    }


# Eight frames written for this benchmark (WinoBias-shaped: type 1, the pronoun refers to the
# subject; type 2, to the object); {a} is the referent, {b} the other occupation.
FRAMES = (
    "{n} [The {a}] called the {b} because [{p}] wanted advice on the plan.",
    "{n} [The {a}] waited for the {b} because [{p}] had arrived early.",
    "{n} [The {a}] thanked the {b} after [{p}] finished the long report.",
    "{n} [The {a}] visited the {b} since [{p}] needed a signature.",
    "{n} The {b} praised [the {a}] because [{p}] had done careful work.",
    "{n} The {b} paid [the {a}] after [{p}] fixed the problem.",
    "{n} The {b} trusted [the {a}] because [{p}] was always honest.",
    "{n} The {b} helped [the {a}] when [{p}] asked for support.",
)
SCORING_SUITE = """\
name: coref-large
slots:
  occupation: {table: occupations-bls.tsv, column: occupation}
sentences:
%s
analysis:
  contrast: version
  positive: pro
  negative: anti
  clusters: [referent.occupation, template]
  referents: [referent, other]
  answer: referent
attention:
  - {source: pronoun, targets: [referent, other]}
referent_choice:
  prompt: " Here, '{pronoun}' refers to the"
"""


def large_coref_suite(folder: Path, pairs_per_frame: int = 99) -> Path:
    """A coreference suite of 8 frames x `pairs_per_frame` occupation pairs x pro/anti (1,584
    sentences by default) in `folder`: pro is the pronoun of the referent's majority gender (BLS)."""
    table = pd.read_csv(ROOT / "probes" / "occupations-bls.tsv", sep="\t", comment="#")
    female = dict(zip(table["occupation"], table["bls_pct_female"] > 50))
    names = sorted(female)
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :] if female[a] != female[b]]
    entries = []
    for f, frame in enumerate(FRAMES):
        chosen = pairs[f::8][:pairs_per_frame] + pairs[: max(0, pairs_per_frame - len(pairs[f::8]))]
        for version in ("pro", "anti"):
            lines = []
            for n, (a, b) in enumerate(chosen, start=1):
                pronoun = "she" if female[a] == (version == "pro") else "he"
                lines.append(frame.format(n=n, a=a, b=b, p=pronoun))
            (folder / f"f{f}-{version}.txt").write_text("\n".join(lines) + "\n")
        entries.append(
            f"  - {{id: f{f}, files: {{pro: f{f}-pro.txt, anti: f{f}-anti.txt}}, numbered: true, "
            "spans: [referent, pronoun], mark: {other: occupation}, lookup: {referent: occupation}}"
        )
    (folder / "occupations-bls.tsv").write_text((ROOT / "probes" / "occupations-bls.tsv").read_text())
    (folder / "coref.yaml").write_text(SCORING_SUITE % "\n".join(entries))
    return folder / "coref.yaml"


def bench_scoring(repeats: int) -> dict:
    """The referent-choice phase against the prompt phase on a 1,584-sentence coreference suite
    (SmolLM2, one process, medians): both phases as a run computes them (attnprobe.run.phases), and
    the referent choice as round 2 scored it (each sentence + question + candidate forwarded whole,
    full-vocabulary logits at every position, batches of 16) on the first 256 prompts."""
    from attnprobe.forward.packing import pad_right
    from attnprobe.run import RunOptions, plan_run
    from attnprobe.run.phases import prompts_phase, referent_choice_phase
    from attnprobe.schema.spans import candidate_words

    pm = attnprobe.load_model("smollm2-135m")
    with tempfile.TemporaryDirectory() as scratch:
        suite = load_suite(large_coref_suite(Path(scratch)))
        options = RunOptions(skip=("head_effects",), log=lambda m: None, progress=False)
        plan = plan_run(suite, pm, options)

    def whole(phase):
        return lambda: [phase.compute(k, lambda n: None) for k in phase.mine]

    prompts, choice = prompts_phase(pm, plan, options), referent_choice_phase(pm, plan, options)
    measure, referents = suite.referent_choice, suite.analysis.referents

    @torch.no_grad()
    def round_two(encoded):
        sequences = []
        for e in encoded:
            prefix = list(e.ids) + pm.tokenizer.encode(measure.question(e.prompt), add_special_tokens=False)
            for r in referents:
                sequences.append(
                    prefix + pm.tokenizer.encode(candidate_words(e.prompt, r), add_special_tokens=False)
                )
        for start in range(0, len(sequences), 16):
            ids, mask = pad_right(sequences[start : start + 16], pm.tokenizer.pad_token_id)
            pm.model(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)

    times = interleaved([whole(prompts), whole(choice)], repeats)
    old = (
        interleaved([lambda: round_two(plan.encoded[:256])], max(1, repeats // 2))[0]
        * len(plan.encoded)
        / 256
    )
    return {
        "n_sentences": len(plan.encoded),
        "prompt_phase_s": times[0],
        "referent_choice_s": times[1],
        "ratio_choice_to_prompts": times[1] / times[0],
        "round_two_referent_choice_s_estimated": old,
        "speedup_vs_round_two": old / times[1],
    }


def bench_scored_shapes(repeats: int) -> dict:
    """The likelihood and multiple-choice phases against the prompt phase of their own suites, at
    benchmark size: the shipped pairs (32) and questions (24) each made unique 50 and 66 times over
    ("Story n: ...", "In case n, ..."): 3,200 sentences and 1,584 questions (SmolLM2, medians)."""
    import json as json_module
    import shutil

    from attnprobe.run import RunOptions, plan_run
    from attnprobe.run.phases import likelihood_phase, multiple_choice_phase, prompts_phase

    pm, out = attnprobe.load_model("smollm2-135m"), {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        shutil.copy(ROOT / "probes" / "pairs.yaml", folder / "pairs.yaml")
        shutil.copy(ROOT / "probes" / "choices.yaml", folder / "choices.yaml")
        (folder / "pairs").mkdir()
        (folder / "choices").mkdir()
        pairs = pd.read_csv(ROOT / "probes" / "pairs" / "pairs.csv")
        copies = []
        for n in range(50):
            copy = pairs.copy()
            for column in ("sent_more", "sent_less"):
                copy[column] = f"Story {n + 1}: " + copy[column]
            copies.append(copy)
        pd.concat(copies).to_csv(folder / "pairs" / "pairs.csv", index=False)
        rows = [json_module.loads(line) for line in (ROOT / "probes" / "choices" / "choices.jsonl").open()]
        lines = [
            json_module.dumps(
                dict(r, context=f"In case {n + 1}, {r['context'][0].lower()}{r['context'][1:]}")
            )
            for n in range(66)
            for r in rows
        ]
        (folder / "choices" / "choices.jsonl").write_text("\n".join(lines) + "\n")
        options = RunOptions(skip=("head_effects",), log=lambda m: None, progress=False)
        for name, phase_of in (("pairs", likelihood_phase), ("choices", multiple_choice_phase)):
            plan = plan_run(load_suite(folder / f"{name}.yaml"), pm, options)
            phases = (prompts_phase(pm, plan, options), phase_of(pm, plan, options))
            runs = [lambda p=p: [p.compute(k, lambda n: None) for k in p.mine] for p in phases]
            times = interleaved(runs, repeats, warm_up=False)  # minutes each: no warm-up round
            out[name] = {
                "n_prompts": len(plan.encoded),
                "prompt_phase_s": times[0],
                "scored_phase_s": times[1],
                "ratio": times[1] / times[0],
            }
    return out


def matmul_peak(repeats: int = 5) -> float:
    """GFLOP/s of a large float32 matmul (2048^3) on this machine now: the compute ceiling."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return 2 * 2048**3 / 1e9 / interleaved([lambda: a @ b], repeats)[0]


def flop_per_token(pm) -> float:
    """2 x the parameters a token passes through (all but the embedding), in GFLOP."""
    embedding = pm.model.get_input_embeddings().weight.numel()
    return 2 * (sum(p.numel() for p in pm.model.parameters()) - embedding) / 1e9


def bench_sharing(pm, pm_bf16, encoded, repeats: int, scratch: Path, peers: list) -> dict:
    """The run with prefix sharing against the run without it and against both floors, on the same
    prompts (all of the suite by default), timed in turn in every repeat; then the peers."""
    from attnprobe.forward.packing import pack_trie, packed_inputs
    from attnprobe.run.plan import DEFAULT_BATCH_SIZE, plan_batches, sharing_summary

    model, pad = pm.model, pm.tokenizer.pad_token_id
    n = len(encoded)
    forwarded = batches_of(encoded, 32, pad, forwarded=True)
    batches = plan_batches(encoded, DEFAULT_BATCH_SIZE, share_prefixes=True)
    packed = [
        packed_inputs([pack_trie([encoded[i].forward_ids for i in pack]) for pack in batch.packs], pad)
        for batch in batches
    ]
    unique = sharing_summary([batches], encoded, None)["tokens_forwarded"] / n

    @torch.inference_mode()
    def floor_forwarded():
        model.set_attn_implementation("sdpa")
        for ids, mask, _ in forwarded:
            model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)
        model.set_attn_implementation("attnprobe")

    @torch.inference_mode()
    def floor_packed():
        model.set_attn_implementation("sdpa")
        for ids, pos, mask in packed:
            model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=1)
        model.set_attn_implementation("attnprobe")

    def run(probe_model, name, **options):
        attnprobe.run_suite(
            SUITE,
            model=probe_model,
            out=scratch / name,
            limit=n,
            progress=False,
            log=lambda m: None,
            resume=False,
            skip=("head_effects",),
            **options,
        )

    peak_before = matmul_peak()
    (
        floor_packed(),
        run(pm, "warm-up", share_prefixes=False, batch_size=32),
    )  # a short warm-up: the rounds take minutes
    t_floor, t_packed, t_shared, t_plain, t_bf16 = interleaved(
        [
            floor_forwarded,
            floor_packed,
            lambda: run(pm, "shared"),
            lambda: run(pm, "plain", share_prefixes=False, batch_size=32),
            lambda: run(pm_bf16, "shared_bf16"),
        ],
        repeats,
        warm_up=False,
    )
    peak = (peak_before + matmul_peak()) / 2
    gflop = flop_per_token(pm)
    forwarded_tokens = sum(e.n_forward for e in encoded) / n
    share = lambda seconds: n * forwarded_tokens * gflop / seconds / peak  # noqa: E731 (useful work: the forwarded tokens)
    results = {
        "n_prompts": n,
        "forwarded_tokens_per_prompt": forwarded_tokens,
        "unique_tokens_per_prompt": unique,
        "gflop_per_token": gflop,
        "matmul_peak_gflop_s": peak,
        "compute_floor_forwarded_prompts_per_s": peak / (forwarded_tokens * gflop),
        "compute_floor_unique_prompts_per_s": peak / (unique * gflop),
        "plain_forward_prompts_per_s": n / t_floor,
        "plain_forward_share_of_peak": share(t_floor),
        "packed_forward_prompts_per_s": n / t_packed,
        "packed_forward_share_of_peak": share(t_packed),
        "run_shared_prompts_per_s": n / t_shared,
        "run_shared_share_of_peak": share(t_shared),
        "run_plain_prompts_per_s": n / t_plain,
        "run_plain_share_of_peak": share(t_plain),
        "run_shared_bfloat16_prompts_per_s": n / t_bf16,
        "run_shared_over_run_plain": t_plain / t_shared,
        "run_shared_over_plain_forward": t_floor / t_shared,
    }
    print(json.dumps(results), flush=True)  # kept in the log should the peers fail
    results.update(bench_peers(pm, peers, repeats, scratch))
    return results


def bench_peers(pm, encoded, repeats: int, scratch: Path) -> dict:
    """attnprobe end to end against TransformerLens and nnsight recording every layer's attention
    pattern of the same prompts (their forwarded tokens, batches of 32), where they are installed.
    Both run the model with eager attention, as they need to; each gets its own copy of the model."""
    import copy

    n, batches = len(encoded), batches_of(encoded, 32, pm.tokenizer.pad_token_id, forwarded=True)
    fns, names = (
        [
            lambda: attnprobe.run_suite(
                SUITE,
                model=pm,
                out=scratch / "peers",
                limit=n,
                progress=False,
                log=lambda m: None,
                resume=False,
                skip=("head_effects",),
            )
        ],
        ["attnprobe"],
    )
    try:
        from transformer_lens.model_bridge import TransformerBridge

        twin = copy.deepcopy(pm.model)
        bridge = TransformerBridge.boot_transformers(
            "HuggingFaceTB/SmolLM2-135M", hf_model=twin, tokenizer=pm.tokenizer
        )

        @torch.inference_mode()
        def lens():
            for ids, mask, _ in batches:
                bridge.run_with_cache(
                    ids, attention_mask=mask, names_filter=lambda name: name.endswith("hook_pattern")
                )

        fns.append(lens), names.append("transformer_lens")
    except ImportError:
        pass
    try:
        from nnsight import LanguageModel

        twin = copy.deepcopy(pm.model)
        twin.set_attn_implementation(
            "eager"
        )  # nnsight reads the pattern a module returns, which only eager computes
        traced = LanguageModel(twin, tokenizer=pm.tokenizer)

        @torch.inference_mode()
        def trace():
            for ids, mask, _ in batches:
                saved = []
                with traced.trace({"input_ids": ids, "attention_mask": mask}):
                    for layer in traced.model.layers:
                        saved.append(layer.self_attn.output[1].save())  # (B, H, T, T) under eager attention

        fns.append(trace), names.append("nnsight")
    except ImportError:
        pass
    seconds = dict(zip(names, interleaved(fns, repeats)))
    out = {"peers_n_prompts": n, **{f"peers_{name}_prompts_per_s": n / t for name, t in seconds.items()}}
    out.update(
        {
            f"peers_attnprobe_over_{name}": t / seconds["attnprobe"]
            for name, t in seconds.items()
            if name != "attnprobe"
        }
    )
    return out


def bench_memory() -> dict:
    one, ten = peak_memory_of_run(300), peak_memory_of_run(3000)
    return {"peak_rss_mib_300_prompts": one, "peak_rss_mib_3000_prompts": ten, "growth": ten / one - 1}


def peak_memory_of_run(limit: int) -> float:
    """Peak RSS (MiB) of a fresh process that loads the model and runs `limit` prompts.

    Read from VmHWM in /proc/self/status: getrusage's ru_maxrss survives fork and exec on Linux and
    would report this (parent) process's peak instead."""
    code = (
        "import tempfile, attnprobe\n"
        f"pm = attnprobe.load_model('smollm2-135m')\n"
        "with tempfile.TemporaryDirectory() as out:\n"
        f"    attnprobe.run_suite({str(SUITE)!r}, model=pm, out=out, limit={limit}, progress=False, "
        'log=lambda m: None, skip=("head_effects",))\n'
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
        "print(int(hwm.split()[1]) / 1024)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(result.stdout.strip().splitlines()[-1])


def load_time(cache: str | None, repeats: int) -> float:
    env = dict(os.environ)
    code = (
        "import time, attnprobe\nt = time.perf_counter()\n"
        "attnprobe.load_model('smollm2-135m')\nprint(time.perf_counter() - t)\n"
    )
    times = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as fresh:
            env["ATTNPROBE_CACHE"] = cache or fresh
            out = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
            )
            times.append(float(out.stdout.strip().splitlines()[-1]))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=320)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument(
        "--only",
        choices=["memory", "sharing", "head_effects", "scoring"],
        help="Run one section (results merged into the existing JSON).",
    )
    parser.add_argument(
        "--sharing-prompts", type=int, default=None, help="Prompts of the sharing section (default: all)."
    )
    parser.add_argument("--peer-prompts", type=int, default=320, help="Prompts on which the peers are timed.")
    args = parser.parse_args()

    results = {
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    }
    if args.only:
        previous = (
            json.loads((args.out / "results.json").read_text())
            if (args.out / "results.json").is_file()
            else {}
        )
        previous["memory"] = bench_memory() if args.only == "memory" else previous.get("memory")
        if args.only == "sharing":
            previous["sharing"] = sharing_section(args)
        if args.only == "scoring":
            previous["scoring"] = bench_scoring(args.repeats)
            shapes = bench_scored_shapes(args.repeats)
            previous["scoring_pairs"], previous["scoring_choices"] = shapes["pairs"], shapes["choices"]
        if args.only == "head_effects":
            pm = attnprobe.load_model("smollm2-135m")
            suite, encoded = gender_prompts(pm.tokenizer, 10**9)
            previous["head_effects"] = bench_head_effects(pm, suite, encoded, repeats=args.repeats)
        return write({k: v for k, v in previous.items() if v is not None}, args.out)
    pm = attnprobe.load_model("smollm2-135m")
    pm_bf16 = attnprobe.load_model("smollm2-135m", dtype="bfloat16")
    suite, encoded = gender_prompts(pm.tokenizer, args.prompts)
    with tempfile.TemporaryDirectory() as scratch:
        results["throughput"] = bench_throughput(pm, pm_bf16, encoded, args.repeats, Path(scratch))
        results["agreement"] = bench_agreement(Path(scratch))
    results["bfloat16_rows"] = bench_bfloat16_rows(pm, pm_bf16, encoded, args.repeats)
    results["head_effects"] = bench_head_effects(pm, suite, encoded)
    results["memory"] = bench_memory()
    from attnprobe.model.bundled import cache_dir

    results["load"] = {"cold_s": load_time(None, 1), "cached_s": load_time(str(cache_dir()), args.repeats)}
    results["sharing"] = sharing_section(args)
    write(results, args.out)


def sharing_section(args) -> dict:
    pm = attnprobe.load_model("smollm2-135m")
    pm_bf16 = attnprobe.load_model("smollm2-135m", dtype="bfloat16")
    _, encoded = gender_prompts(pm.tokenizer, args.sharing_prompts or 10**9)
    _, peers = gender_prompts(
        pm.tokenizer, args.peer_prompts
    )  # the prompts `--limit` selects, as the run does
    with tempfile.TemporaryDirectory() as scratch:
        return bench_sharing(pm, pm_bf16, encoded, args.repeats, Path(scratch), peers)


def write(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lines = ["| measure | value |", "|---|---|"]
    for section, values in results.items():
        for key, value in values.items():
            lines.append(
                f"| {section}.{key} | {value:.3f} |"
                if isinstance(value, float)
                else f"| {section}.{key} | {value} |"
            )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
