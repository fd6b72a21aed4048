"""Saving a figure for the report: PNG and SVG under figures/, the PNG returned inline for the HTML."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import matplotlib.pyplot as plt


def figure(fig, directory: Path, name: str, alt: str) -> dict:
    directory.mkdir(exist_ok=True)
    fig.savefig(directory / f"{name}.svg")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    (directory / f"{name}.png").write_bytes(buffer.getvalue())
    plt.close(fig)
    return {"png": base64.b64encode(buffer.getvalue()).decode(), "alt": alt}
