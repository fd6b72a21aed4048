"""The scored phases against their token floor, and `check`'s estimate of a whole benchmark.

    python benchmarks/scored_phases.py [--model smollm2-135m] [--questions 5000] [--whole 50000]
                                       [--sentences 3200] [--repeats 3] [--out benchmarks/results]

1. Floor. The likelihood phase (CrowS-shaped sentences: the 32 shipped pairs in numbered openings,
   `--sentences` in all) and the multiple-choice phase (BBQ-shaped: the 24 shipped questions in
   numbered openings, `--questions`) as `attnprobe run` computes them, timed alone (medians). Their
   floor: the tokens they must forward (the trie nodes of their packed sequences, `plan.parts[phase].tokens`,
   what `check` prints) x 2 x the parameters a token passes through besides the embeddings, plus
   2 x hidden x vocabulary for every position whose logits are read, at the float32 matmul peak
   measured in the same run (attention's T^2 terms left out: under 2% at these lengths).
2. Estimate. `check`'s estimate for a `--whole`-question suite of the same shape (plan only, no
   weights) against the measured multiple-choice phase of `--questions` scaled by tokens forwarded
   and by questions.

Writes scored_phases-<model>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def crows_suite(folder: Path, sentences: int) -> Path:
    pairs = pd.read_csv(REPO / "probes" / "pairs" / "pairs.csv")
    copies = []
    for n in range(max(1, sentences // (2 * len(pairs)))):
        copy = pairs.copy()
        for column in ("sent_more", "sent_less"):
            copy[column] = f"Story {n + 1}: " + copy[column]
        copies.append(copy)
    pd.concat(copies).to_csv(folder / "pairs.csv", index=False)
    (folder / "pairs.yaml").write_text(
        "name: pairs\nfirst_token: bos\nsentences:\n"
        "  - {id: pairs, file: pairs.csv, columns: {sent_more: more, sent_less: less}}\n"
        "analysis: {contrast: version, positive: more, negative: less, clusters: [item]}\nlikelihood: {}\n"
    )
    return folder / "pairs.yaml"


def bbq_suite(folder: Path, questions: int, name: str) -> Path:
    rows = [json.loads(line) for line in open(REPO / "probes" / "choices" / "choices.jsonl")]
    lines = [
        json.dumps(
            dict(
                r,
                example_id=k,
                context=f"In case {k // len(rows) + 1}, {r['context'][0].lower()}{r['context'][1:]}",
            )
        )
        for k, r in ((k, rows[k % len(rows)]) for k in range(questions))
    ]
    (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    (folder / f"{name}.yaml").write_text(
        f"name: {name}\nfirst_token: bos\nsentences: [{{id: bbq, file: {name}.jsonl, choices: bbq}}]\n"
        "analysis: {clusters: [question_index]}\nmultiple_choice: {}\n"
    )
    return folder / f"{name}.yaml"


def matmul_peak(repeats: int = 5) -> float:
    """GFLOP/s of a 2048^3 float32 matmul now (median): the compute ceiling."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * 2048**3 / 1e9 / statistics.median(times[1:])


def floor_seconds(pm, tokens: int, scored: int, peak: float) -> float:
    """Linear layers at every forwarded token, the lm head at every scored position."""
    model = pm.model
    embedding = model.get_input_embeddings().weight
    body = sum(p.numel() for p in model.parameters()) - embedding.numel()
    return (2 * body * tokens + 2 * embedding.numel() * scored) / 1e9 / peak


def time_phase(pm, suite_path: Path, phase_name: str, repeats: int) -> dict:
    from attnprobe.measures import multiple_choice
    from attnprobe.run import RunOptions, plan_run
    from attnprobe.run.phases import likelihood_phase, multiple_choice_phase
    from attnprobe.suite import load_suite

    options = RunOptions(skip=("head_effects",), log=lambda m: None, progress=False)
    plan = plan_run(load_suite(suite_path), pm, options)
    phase = (likelihood_phase if phase_name == "likelihood" else multiple_choice_phase)(pm, plan, options)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for k in phase.mine:
            phase.compute(k, lambda n: None)
        times.append(time.perf_counter() - t0)
    # positions whose logits are read: every scored token's predecessor; the options of one question
    # share the position that predicts their first tokens
    if phase_name == "likelihood":
        scored = sum(len(e.ids) - 1 for e in plan.encoded)
    else:
        tails = [
            multiple_choice.sequences(plan.suite.multiple_choice, e, pm.tokenizer)[1] for e in plan.encoded
        ]
        scored = sum(1 + sum(len(tail) - 1 for _, tail in t.values()) for t in tails)
    return {
        "prompts": len(plan.encoded),
        "tokens_forwarded": plan.parts[phase_name].tokens,
        "seconds": statistics.median(times),
        "rounds": times,
        "estimate_seconds": _estimate(plan, phase_name),
        "scored_positions": scored,
    }


def _estimate(plan, phase: str) -> float:
    """`check`'s estimate of one scored phase, in seconds."""
    return next(seconds for name, seconds, _ in plan.estimate_seconds() if name == phase)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--questions", type=int, default=5000)
    parser.add_argument("--whole", type=int, default=50000)
    parser.add_argument("--sentences", type=int, default=3200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    import attnprobe
    from attnprobe.forward.estimates import model_parameters
    from attnprobe.run import RunOptions, plan_run
    from attnprobe.suite import load_suite

    pm = attnprobe.load_model(args.model)
    result = {"model": args.model, "date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()  # the whole benchmark's plan: no weights are needed for it
        whole = plan_run(
            load_suite(bbq_suite(folder, args.whole, "whole")), args.model, RunOptions(log=lambda m: None)
        )
        result["check_seconds_whole"] = time.perf_counter() - t0
        peak_before = matmul_peak()
        result["likelihood"] = time_phase(pm, crows_suite(folder, args.sentences), "likelihood", args.repeats)
        result["multiple_choice"] = time_phase(
            pm, bbq_suite(folder, args.questions, "part"), "multiple_choice", args.repeats
        )
        peak = (peak_before + matmul_peak()) / 2
    scale = model_parameters(pm.model) / 106e6  # the estimate's size scaling (estimates.REFERENCE_PARAMETERS)
    for name in ("likelihood", "multiple_choice"):
        r = result[name]
        r["floor_seconds"] = floor_seconds(pm, r["tokens_forwarded"], r["scored_positions"], peak)
        r["over_floor"] = r["seconds"] / r["floor_seconds"]
        r["tokens_per_second"] = r["tokens_forwarded"] / r["seconds"]
    part = result["multiple_choice"]
    estimate = _estimate(whole, "multiple_choice") * scale
    scaled_by_tokens = part["seconds"] * whole.parts["multiple_choice"].tokens / part["tokens_forwarded"]
    result["whole"] = {
        "questions": args.whole,
        "tokens_forwarded": whole.parts["multiple_choice"].tokens,
        "check_estimate_seconds": estimate,
        "measured_part_scaled_by_questions": part["seconds"] * args.whole / args.questions,
        "measured_part_scaled_by_tokens": scaled_by_tokens,
        "estimate_over_scaled": estimate / (part["seconds"] * args.whole / args.questions),
    }
    result["matmul_peak_gflop_s"] = peak
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"scored_phases-{args.model}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
