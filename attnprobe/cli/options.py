"""Options several `attnprobe` commands share (cli/__init__.py, cli/probe.py)."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

import click

from ..defaults import DEFAULT_MODEL, DTYPE_NAMES


def _verbosity(ctx, param, value):
    """-q / -v given after a subcommand's name: recorded where the group's own flags are."""
    if value:
        ctx.ensure_object(dict)[param.name] = True


class Command(click.Command):
    """A subcommand of `attnprobe`: takes -q/-v after its name too, and sets up transformers'
    logging when it runs, never for --help (so help needs no heavy import)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.params += [
            click.Option(flags, is_flag=True, expose_value=False, callback=_verbosity, help=text)
            for flags, text in (
                (["-q", "--quiet"], "Only results and errors (as `attnprobe -q`)."),
                (["-v", "--verbose"], "Also transformers' log lines (as `attnprobe -v`)."),
            )
        ]

    def invoke(self, ctx):
        flags = ctx.ensure_object(dict)
        if flags.get("quiet") and flags.get("verbose"):
            raise click.UsageError("-q and -v contradict each other; give one")
        level = "info" if flags.get("verbose") else "error" if flags.get("quiet") else None
        with transformers_logging(level):
            return super().invoke(ctx)


@contextmanager
def transformers_logging(level: str | None):
    """transformers' log level (None: its default) and no progress bars of its own (ours is enough;
    CI logs stay readable) for one command. Set directly where transformers is loaded already, else
    through the environment variables it reads when first imported: a command refused before it
    needs a model (a suite's error) does not wait 0.7 s for that import."""
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if level:
            hf_logging.set_verbosity_info() if level == "info" else hf_logging.set_verbosity_error()
        yield
        return
    wanted = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", **({"TRANSFORMERS_VERBOSITY": level} if level else {})}
    saved = {key: os.environ.get(key) for key in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:  # a later command in this process (a notebook, a test) sets its own
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)


def command(example: str, **kwargs):
    """A subcommand whose help ends with an example."""
    return click.command(cls=Command, epilog=f"Example: {example}", **kwargs)


model_option = click.option(
    "--model",
    "model_spec",
    default=DEFAULT_MODEL,
    show_default=True,
    help="Bundled alias, .gguf path, local checkpoint directory or hub id.",
)
dtype_option = click.option(
    "--dtype", type=click.Choice(list(DTYPE_NAMES)), default="float32", show_default=True
)
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
device_option = click.option(
    "--device", default="cpu", show_default=True, help="torch device to run on, e.g. cuda:0."
)
