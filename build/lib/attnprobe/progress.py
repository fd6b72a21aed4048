"""Progress of a phase (loading, prompts, head effects, statistics, report): a tqdm bar on a
terminal, a widget bar in a Jupyter notebook (a text bar without ipywidgets); anywhere else (nohup,
SLURM, CI, a redirected stderr) one log line per finished chunk or step with the count, the time and
an estimate of what is left; nothing with enabled=False.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time


def log_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def in_notebook() -> bool:
    """True inside a Jupyter kernel (IPython is imported there already; nothing is imported here)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython and hasattr(ipython, "get_ipython") else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def _bar_class(notebook: bool):
    """tqdm's widget bar in a notebook with ipywidgets (which it draws with), else the text bar."""
    if notebook and importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.notebook import tqdm

        return tqdm
    from tqdm import tqdm

    return tqdm


class Progress:
    """One phase's bar (`total` units, `initial` already done). `enabled`: None = a bar on a
    terminal or in a notebook, log lines elsewhere; True = a bar; False = silent."""

    def __init__(
        self,
        total: int,
        initial: int = 0,
        enabled: bool | None = None,
        log=log_to_stderr,
        unit: str = "prompt",
        desc: str = "attnprobe run",
    ):
        notebook = in_notebook()
        interactive = notebook or (sys.stderr.isatty() and not os.environ.get("CI"))
        self.bar = _bar_class(notebook)(
            total=total,
            initial=initial,
            disable=not (interactive if enabled is None else enabled),
            unit=unit,
            desc=desc,
            dynamic_ncols=True,
            smoothing=0.1,
        )
        self.lines = enabled is None and not interactive
        self.log, self.total, self.done, self.first, self.unit, self.desc = (
            log,
            total,
            initial,
            initial,
            unit,
            desc,
        )
        self.started = time.perf_counter()

    def update(self, n: int) -> None:
        self.bar.update(n)
        self.done += n

    def chunk_done(self, k: int, n_chunks: int) -> None:
        """Off a terminal: one line for a finished chunk, with the time left at the rate so far."""
        if not self.lines:
            return
        seconds = time.perf_counter() - self.started
        rate = (self.done - self.first) / seconds if seconds > 0 else 0.0
        left = (
            f", about {(self.total - self.done) / rate:.0f} s left"
            if rate > 0 and self.done < self.total
            else ""
        )
        self.log(
            f"{self.desc}: chunk {k + 1} of {n_chunks} done, {self.done} of {self.total} {self.unit}s, "
            f"{seconds:.0f} s{left}"
        )

    def step(self, name: str) -> None:
        """One unit of a phase made of named steps (statistics tables, report parts)."""
        self.update(1)
        if self.lines:
            self.log(
                f"{self.desc}: {name} ({self.done} of {self.total} {self.unit}s, "
                f"{time.perf_counter() - self.started:.0f} s)"
            )

    def close(self) -> None:
        self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
