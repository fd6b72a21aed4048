"""Saving a figure for the report: PNG and SVG under figures/, the PNG returned inline for the HTML."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np

from ..errors import RunError
from ..store import check_inside, own_directory


def figure(fig, directory, name: str, alt: str) -> dict:
    """Save `fig` as figures/NAME.svg and .png; a full disk or a read-only directory is one line (the
    run's own files are untouched: figures are written after them)."""
    import matplotlib.pyplot as plt  # not loaded where nothing is drawn (a run's summary, the CLI)

    buffer, directory = io.BytesIO(), Path(directory)
    try:
        fig.savefig(buffer, format="png", dpi=110)
        own_directory(directory)
        for suffix in ("svg", "png"):  # declared in a run directory, and reached without a link
            check_inside(directory / f"{name}.{suffix}")
        fig.savefig(directory / f"{name}.svg")
        (directory / f"{name}.png").write_bytes(buffer.getvalue())
    except OSError as exc:
        raise RunError(
            f"cannot write the figure {directory / name}.png ({exc.strerror or exc}); free disk space or "
            "make the directory writable, then run `attnprobe report` again (the run's results are kept)"
        ) from None
    finally:
        plt.close(fig)
    return {"png": base64.b64encode(buffer.getvalue()).decode(), "alt": alt}


class Figures:
    """Where one run's report figures go, and the colour ranges the runs of one report share
    (`limits`: statistic -> +-limit, so that equal colours mean equal values across runs). It reads
    as its directory (os.PathLike, and `figures / name`): a plug-in's section written against the
    figure folder's path, `figure(fig, figures_dir, name, alt)`, works unchanged."""

    def __init__(self, directory: Path, limits: dict | None = None):
        self.directory = Path(directory)
        self.limits = dict(limits or {})

    def save(self, fig, name: str, alt: str) -> dict:
        return figure(fig, self.directory, name, alt)

    def __fspath__(self) -> str:
        return str(self.directory)

    def __truediv__(self, name) -> Path:
        return self.directory / name


def file_name(text) -> str:
    """`text` as a file name: every character but letters and digits becomes an underscore."""
    return "".join(ch if ch.isalnum() else "_" for ch in str(text))


def largest_abs(values) -> float:
    """The largest finite |value| (1 when there is none): a symmetric colour range."""
    finite = np.abs(np.asarray(values, dtype=float))
    finite = finite[np.isfinite(finite)]
    return float(finite.max()) if finite.size and finite.max() > 0 else 1.0
