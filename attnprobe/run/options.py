"""How a run is run: every option of `attnprobe run` as one frozen object.

The CLI, `attnprobe.run_suite` and tests build a `RunOptions`; `plan_run` reads it, and the fields
that change what a run computes feed its fingerprint and the manifest's settings (`settings`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..defaults import DEFAULT_CHUNK_SIZE
from ..errors import RunError


def log_to_stderr(message: str) -> None:
    print(message, file=sys.stderr)


@dataclass(frozen=True)
class RunOptions:
    out: str | Path | None = None  # run directory; default reports/<suite>/<model>/
    batch_size: int | None = None  # prompts per forward pass; None: DEFAULT_BATCH_SIZE, a chunk on a GPU
    limit: int | None = None  # about this many prompts, whole items spread over templates
    dtype: str = "float32"
    resume: bool = True  # continue a killed run; False starts over (--fresh)
    chunk_size: int = DEFAULT_CHUNK_SIZE
    max_batch_tokens: int | None = None  # cap on padded tokens per batch
    shard: tuple[int, int] | None = None  # (k, n): compute chunks k-1, k-1+n, ...
    device: str = "cpu"
    device_map: str | None = None
    skip: tuple[str, ...] = ()  # declared measures this run leaves out (those with phases of their own)
    share_prefixes: bool = True  # forward the prompts' shared token prefixes once
    trust_remote_code: bool = False
    allow_pickle: bool = False
    data_roots: tuple = ()  # directories besides the suite's own its data files may come from
    progress: bool | None = None  # None: a bar on a terminal, log lines elsewhere; False: silent
    edits: tuple = field(
        default=(), compare=False
    )  # saved edits (edits.saved.SavedEdit) applied to the model, in order
    log: Callable[[str], None] = field(default=log_to_stderr, compare=False)

    def __post_init__(self):
        if (self.batch_size is not None and self.batch_size < 1) or self.chunk_size < 1:
            raise RunError("batch size and chunk size must be at least 1")
        if self.shard is not None and not (len(self.shard) == 2 and 1 <= self.shard[0] <= self.shard[1]):
            raise RunError(f"shard must be K/N with 1 <= K <= N, got {self.shard}")

    def owns(self, k: int) -> bool:
        """Whether this process computes chunk k (every chunk unless sharded)."""
        return self.shard is None or k % self.shard[1] == self.shard[0] - 1
