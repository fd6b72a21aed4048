"""Sharded runs in separate processes merge into exactly the single-process result; token budgets."""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from attnprobe.cli import main
from attnprobe.runner import Encoded, plan_batches, plan_chunks
from attnprobe.suite import Prompt

REPO = Path(__file__).resolve().parents[1]


def test_token_budget_batches():
    encoded = [Encoded(Prompt(i, str(i), "t", "x", {}, {}, {}), tuple(range(n + 5)), {}, n) for i, n in enumerate([3, 9, 4, 9, 10, 2])]
    batches = plan_batches(encoded, batch_size=4, max_batch_tokens=20)
    lengths = [[len(encoded[i].forward_ids) for i in b] for b in batches]
    assert lengths == [[2, 3, 4], [9, 9], [10]]  # sorted by forwarded length; each batch's size x longest <= 20
    assert all(len(b) * max(l) <= 20 for b, l in zip(batches, lengths))
    assert [sum(len(b) for b in chunk) for chunk in plan_chunks(batches, 4)] == [5, 1]


@pytest.mark.slow
def test_two_process_sharded_run_merges_to_the_single_process_run(tmp_path):
    args = ["run", str(REPO / "probes" / "gender.yaml"), "--limit", "120", "--batch-size", "8", "--chunk-size", "16", "--no-report", "--no-head-effects"]
    whole = subprocess.run([sys.executable, "-m", "attnprobe", *args, "--out", str(tmp_path / "whole")], capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr
    shards = [subprocess.Popen([sys.executable, "-m", "attnprobe", *args, "--shard", f"{k}/2", "--out", str(tmp_path / "shards")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in (1, 2)]
    for process in shards:  # both run at once, as two ranks would
        _, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr
    s1, s2 = tmp_path / "shards" / "shard-1-of-2", tmp_path / "shards" / "shard-2-of-2"
    assert not (s1 / "attention.parquet").exists()  # a shard holds chunks only
    result = CliRunner().invoke(main, ["merge", str(tmp_path / "merged"), str(s2), str(s1), "--no-report"])
    assert result.exit_code == 0, result.output
    for name in ("prompts.csv", "logprobs.csv"):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "merged" / name).read_bytes()
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "whole" / "attention.parquet"),
                                  pd.read_parquet(tmp_path / "merged" / "attention.parquet"), check_exact=True)
    incomplete = CliRunner().invoke(main, ["merge", str(tmp_path / "m2"), str(s1)])
    assert incomplete.exit_code == 2 and "shards [1] of 2 given" in incomplete.output
