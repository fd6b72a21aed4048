"""Options several `attnprobe` commands share (cli/__init__.py, cli/probe.py)."""

from __future__ import annotations

import click

from ..model import DEFAULT_MODEL, DTYPES

model_option = click.option(
    "--model",
    "model_spec",
    default=DEFAULT_MODEL,
    show_default=True,
    help="Bundled alias, .gguf path, local checkpoint directory or hub id.",
)
dtype_option = click.option("--dtype", type=click.Choice(list(DTYPES)), default="float32", show_default=True)
remote_code_option = click.option(
    "--trust-remote-code", is_flag=True, help="Allow a hub model's own Python code to run."
)
data_root_option = click.option(
    "--data-root",
    "data_roots",
    multiple=True,
    type=click.Path(file_okay=False, exists=True),
    help="Also read the suite's data files from this directory (repeatable); by default only "
    "the suite's own directory and below.",
)
pickle_option = click.option(
    "--allow-pickle", is_flag=True, help="Allow pickled weights (*.bin), which can run code when loaded."
)
