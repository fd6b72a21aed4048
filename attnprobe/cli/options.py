"""Options several `attnprobe` commands share (cli/__init__.py, cli/probe.py)."""

from __future__ import annotations

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
        from transformers.utils import logging as hf_logging  # heavy: only once a command runs

        hf_logging.disable_progress_bar()  # our own progress bar is enough; keep CI logs readable
        if flags.get("verbose") or flags.get("quiet"):
            hf_logging.set_verbosity_info() if flags.get("verbose") else hf_logging.set_verbosity_error()
        return super().invoke(ctx)


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
