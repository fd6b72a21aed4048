"""Saving a figure for the report: PNG and SVG under figures/, the PNG returned inline for the HTML."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import matplotlib.pyplot as plt

from ..errors import RunError
from ..run.files.fresh import own_directory
from ..store import check_inside


def figure(fig, directory: Path, name: str, alt: str) -> dict:
    """Save `fig` as figures/NAME.svg and .png; a full disk or a read-only directory is one line (the
    run's own files are untouched: figures are written after them)."""
    buffer = io.BytesIO()
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
