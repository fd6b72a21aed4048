"""What each head of an edit keeps of the covariate: at once against in order.

    python benchmarks/sequential_left.py RUN_DIR [--kind leace_mid] [--k 5]

RUN_DIR is a run swept with `attnprobe edit RUN_DIR --kinds KIND --k K --sequential`, which saved the
edit of the heads chosen on every item fitted at once (edits/KIND-kK) and in order (edits/KIND-seq-kK).
With each applied to the whole model, the items are recorded again and, per edited head, the
covariance of its output at the prediction (each item's last token) with the covariate is compared
with the clean model's: its component along the clean covariance and its norm, both as shares of the
clean covariance's norm. A LEACE fit leaves none where it is fitted; fitted at once, a head above an
edited one is fitted on outputs the edit below changes, so what it leaves shows here.
"""

import argparse
from pathlib import Path

import torch

from attnprobe.edits import edited, load_edit
from attnprobe.edits.estimate import last_outputs
from attnprobe.edits.sweep.options import run_and_suite
from attnprobe.intervene.engine import record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--kind", default="leace_mid")
    parser.add_argument("--k", type=int, default=5)
    args = parser.parse_args()
    _, reopened = run_and_suite(args.run)
    model = reopened.load_model("cpu")
    items = reopened.plan(model, args.run, lambda m: None).parts["head_effects"].items
    x = torch.as_tensor([i.covariate for i in items], dtype=torch.float64)
    xc, sequences = x - x.mean(), [i.x for i in items]
    cov = lambda z: (z.double() - z.double().mean(0)).T @ xc / len(x)  # (D,)
    edits = {
        name: load_edit(args.run / "edits" / f"{args.kind}{name}-k{args.k}.json") for name in ("", "-seq")
    }
    with torch.no_grad():
        outputs = {"clean": last_outputs(record(model.model, sequences))}
        for name, edit in edits.items():
            with edited(model, edit):
                outputs[name] = last_outputs(record(model.model, sequences))
    print(f"{args.run}: {args.kind} k = {args.k}, {len(items)} items")
    print("head   | clean |Cov| | at once: along, |left| | in order: along, |left|")
    for layer, head in edits[""].edit.heads:
        clean = cov(outputs["clean"][:, layer, head])
        row = [f"L{layer}H{head}".ljust(6), f"{clean.norm():.4f}".rjust(11)]
        for name in edits:
            left = cov(outputs[name][:, layer, head])
            row.append(
                f"{float(left @ clean) / clean.norm() ** 2:+.3f}, {left.norm() / clean.norm():.3f}".rjust(23)
            )
        print(" | ".join(row))


if __name__ == "__main__":
    main()
