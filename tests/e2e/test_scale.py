"""Sharded runs in separate processes merge into exactly the single-process result; token budgets."""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from attnprobe.cli import main
from attnprobe.run.plan import Encoded, plan_batches, plan_chunks, plan_sha256
from attnprobe.suite import Prompt

REPO = Path(__file__).resolve().parents[2]


def test_token_budget_batches():
    encoded = [
        Encoded(Prompt(i, str(i), "t", "x", {}, {}, {}), tuple(range(n + 5)), {}, n)
        for i, n in enumerate([3, 9, 4, 9, 10, 2])
    ]
    batches = plan_batches(encoded, batch_size=4, max_batch_tokens=20)
    lengths = [[len(encoded[i].forward_ids) for i in b] for b in batches]
    assert lengths == [
        [2, 3, 4],
        [9, 9],
        [10],
    ]  # sorted by forwarded length; each batch's size x longest <= 20
    assert all(len(b) * max(l) <= 20 for b, l in zip(batches, lengths))
    assert [sum(len(b) for b in chunk) for chunk in plan_chunks(batches, 4)] == [5, 1]


def test_the_fingerprint_holds_the_batch_plan():
    """A run resumes (or a shard merges) only with one that forwarded the same tokens in the same batches."""

    def encoded(n_forward):
        return [
            Encoded(Prompt(i, str(i), "t", "x", {}, {}, {}), tuple(range(9)), {}, n)
            for i, n in enumerate(n_forward)
        ]

    a, b = encoded([3, 5, 4]), encoded([3, 6, 4])
    chunks = plan_chunks(plan_batches(a, batch_size=2), 2)
    assert plan_sha256(chunks, a) == plan_sha256(chunks, encoded([3, 5, 4]))
    assert plan_sha256(chunks, a) != plan_sha256(chunks, b)  # same prompts, another forwarded length
    assert plan_sha256(chunks, a) != plan_sha256(plan_chunks(plan_batches(a, batch_size=3), 2), a)


ARGS = [
    "run",
    str(REPO / "probes" / "gender.yaml"),
    "--limit",
    "120",
    "--batch-size",
    "8",
    "--chunk-size",
    "16",
    "--no-report",
    "--no-head-effects",
    "--skip",
    "direct_attribution",
]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The unsharded run the sharded ones must reproduce (in this process: one thread, as theirs)."""
    out = tmp_path_factory.mktemp("whole")
    result = CliRunner().invoke(main, [*ARGS, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def assert_same_run(a: Path, b: Path) -> None:
    for name in ("prompts.csv", "logprobs.csv"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    pd.testing.assert_frame_equal(
        pd.read_parquet(a / "attention.parquet"), pd.read_parquet(b / "attention.parquet"), check_exact=True
    )


@pytest.mark.slow
def test_torchrun_ranks_take_their_shards_and_the_shards_merge_to_the_single_process_run(whole, tmp_path):
    """The documented multi-GPU launch, on 2 CPU processes at once: torchrun sets RANK/WORLD_SIZE,
    --shard auto reads them, rank 0 merges; the shards merged again by `attnprobe merge` (in the
    other order) give the single-process run too, and one shard alone is refused."""
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "attnprobe",
    ]
    result = subprocess.run(
        [*launch, *ARGS, "--shard", "auto", "--out", str(tmp_path / "ranks")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    shards = sorted(str(p) for p in (tmp_path / "ranks").glob("shard-*-of-2"))
    assert len(shards) == 2
    # once both ranks were done (a gloo barrier), rank 0 merged them into --out: the unsharded run
    assert "merged 2 shards" in result.stdout
    assert_same_run(whole, tmp_path / "ranks")
    s1, s2 = (tmp_path / "ranks" / f"shard-{k}-of-2" for k in (1, 2))
    assert not (s1 / "attention.parquet").exists()  # a shard holds chunks only
    result = CliRunner().invoke(main, ["merge", str(tmp_path / "merged"), str(s2), str(s1), "--no-report"])
    assert result.exit_code == 0, result.output
    assert_same_run(whole, tmp_path / "merged")
    incomplete = CliRunner().invoke(main, ["merge", str(tmp_path / "m2"), str(s1)])
    assert incomplete.exit_code == 2 and "shards [1] of 2 given" in incomplete.output
    merged = CliRunner().invoke(main, ["merge", str(tmp_path / "merged"), *shards, "--no-report"])
    assert merged.exit_code == 0, merged.output
    assert_same_run(whole, tmp_path / "merged")
