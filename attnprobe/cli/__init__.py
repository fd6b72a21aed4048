"""The `attnprobe` command: thin click commands over library functions.

Every user mistake arrives as an AttnprobeError and leaves through the one handler on the group
(`Group.invoke`) as one line on stderr with the error's exit code (2; 130 for an interrupted run).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import click

from ..errors import AttnprobeError, RunError, RunInterrupted
from .options import (
    Command,
    data_root_option,
    device_option,
    dtype_option,
    model_option,
    pickle_option,
    remote_code_option,
)


class OneLineErrors(click.Group):
    """A click group whose commands turn an AttnprobeError, or a bad option of a command, into one
    line on stderr and an exit code."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except AttnprobeError as error:
            if isinstance(error, RunInterrupted):  # a further Ctrl-C while exiting changes nothing
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            click.echo(f"attnprobe: error: {error}", err=True)
            sys.exit(error.exit_code)
        except click.UsageError as error:
            command = (
                f" {error.ctx.info_name}" if error.ctx is not None and error.ctx.parent is not None else ""
            )
            message = " ".join(error.format_message().split()).rstrip(".")
            click.echo(f"attnprobe: error: {message}; see `attnprobe{command} --help`", err=True)
            sys.exit(error.exit_code)


EXAMPLES = {
    "models": "attnprobe models",
    "verify": "attnprobe verify --model gemma3-270m --long 600",
    "check": "attnprobe check probes/gender.yaml --model random:llama-3.1-8b --device cuda:0 "
    "--dtype bfloat16",
    "report": "attnprobe report reports/gender/smollm2-135m reports/gender/gemma3-270m",
    "merge": "attnprobe merge reports/gender/smollm2-135m shard-1 shard-2",
    "compare": "attnprobe compare reports/gender/smollm2-135m reports/gender/smollm2-135m-edited-leace-k1",
}


def subcommand(name: str):
    """A command of the group, its help ending with its example."""
    return main.command(name, cls=Command, epilog=f"Example: {EXAMPLES[name]}")


@click.group(
    cls=OneLineErrors,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Example: attnprobe run probes/gender.yaml (then open reports/gender/smollm2-135m/report.html). "
    "Each command's help: attnprobe COMMAND --help.",
)
@click.version_option(package_name="attnprobe")
@click.option("-q", "--quiet", is_flag=True, help="Only results and errors: no progress, log lines or notes.")
@click.option(
    "-v", "--verbose", is_flag=True, help="Also the log lines of transformers (loading, conversion)."
)
@click.pass_context
def main(ctx, quiet, verbose):
    """Extract, verify and probe attention in causal language models."""
    ctx.obj = {"quiet": quiet, "verbose": verbose}  # the subcommand (options.Command) applies them


@subcommand("models")
def models():
    """List the bundled model aliases, whether each is installed, and the shipped shapes
    (`--model random:NAME`)."""
    from ..model.bundled import bundled_status
    from ..model.shapes import shape_status

    for row in bundled_status():
        state = "installed" if row["installed"] else f"not installed ({row['install']})"
        click.echo(f"{row['alias']:<25} {state:<12}  {row['description']}")
    for name, about in shape_status():
        shape = f"{'random:' + name:<25} {'shape only':<12}"
        click.echo(f"{shape}  {about}; random weights, for time and memory (check, run)")


@subcommand("verify")
@model_option
@click.option(
    "--text", "texts", multiple=True, help="A text to check (repeatable); default: built-in probe sentences."
)
@dtype_option
@click.option(
    "--long",
    "long_tokens",
    type=click.IntRange(min=1),
    help="Also check a text of N tokens: up to 1,024 padded against the others, longer alone in blocks of "
    "query rows (memory stays O(rows x T)): sliding windows and long-context masks act (e.g. 600 for "
    "Gemma 3's 512-token window, 8000 past several).",
)
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False), help="Also write the per-layer table as JSON."
)
@device_option
@remote_code_option
@pickle_option
def verify(model_spec, texts, dtype, long_tokens, json_path, device, trust_remote_code, allow_pickle):
    """Recompute every attention layer from scratch and compare with the model.

    Exit 0 when every layer is within tolerance, 1 when any is not, 2 when the family has no
    from-scratch recomputation.
    """
    from ..verify import DEFAULT_TEXTS, format_table
    from ..verify.long import verify_spec

    if json_path:  # before the work: a path that cannot be written is refused at once
        _json_directory(Path(json_path))
    if any(not text.strip() for text in texts):
        raise click.BadParameter("a --text is empty; give a sentence to check", param_hint="--text")
    table = verify_spec(
        model_spec,
        list(texts) or DEFAULT_TEXTS,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        allow_pickle=allow_pickle,
        long_tokens=long_tokens,
        device=device,
    )
    click.echo(format_table(table))
    if json_path:
        _write_json(table, Path(json_path))
    sys.exit(0 if table["passed"].all() else 1)


def _json_directory(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunError(
            f"--json {path}: cannot create {path.parent} ({exc.strerror or exc}); choose a writable path"
        ) from None


def _write_json(table, path: Path) -> None:
    try:
        table.to_json(path, orient="records", indent=1)
    except OSError as exc:
        raise RunError(
            f"--json {path}: cannot write ({exc.strerror or exc}); choose a writable path"
        ) from None


@subcommand("check")
@click.argument("suite", type=click.Path(dir_okay=False))
@click.option(
    "--model",
    "model_spec",
    default=None,
    help="Tokenizer to count tokens with; default: the suite's `model`.",
)
@click.option("--limit", type=click.IntRange(min=1), help="As `run --limit`.")
@dtype_option
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    help="Estimate memory and time on this device (cuda:0 on a machine without a GPU: an 80 GB H100).",
)
@remote_code_option
@data_root_option
def check(suite, model_spec, limit, dtype, device, trust_remote_code, data_roots):
    """Validate a suite and say what a run would do (prompts, items, analysis, measures, tokens,
    memory and time on --device) without loading any model weights."""
    from ..suite import load_suite

    loaded = load_suite(suite, data_roots=data_roots)  # before torch loads: a suite's error at once
    from ..run import RunOptions, plan_run
    from ..run.describe import describe
    from ..run.resources import footprint_lines

    device = _estimated_device(device)
    options = RunOptions(
        limit=limit, dtype=dtype, device=device, trust_remote_code=trust_remote_code, data_roots=data_roots
    )
    plan = plan_run(loaded, model_spec, options)  # batches as a run on `device` plans them
    for line in describe(plan, device) + footprint_lines(plan, device) + _circuit_lines(plan, device):
        click.echo(line)


def _circuit_lines(plan, device: str) -> list[str]:
    """On a CPU, what `edit --circuits` would run after this run: pairs of each item with its reference
    version and with another occupation (at most)."""
    from ..model.footprint import Shape

    shape, effects = Shape.of(plan.config), plan.parts.get("head_effects")
    if device != "cpu" or shape is None or not effects or not effects.items:
        return []
    from ..analyses.circuits.search import estimate_lines

    tokens = sum(len(i.x) for i in effects.items) / len(effects.items)
    gflop = tokens * shape.flops_per_token() / 1e9  # a prompt's forward pass
    return estimate_lines((shape.L, shape.H, shape.Hkv), 2 * len(effects.items), gflop)


def _estimated_device(device: str) -> str:
    """A device string torch parses (a GPU need not be present: its memory is then assumed)."""
    import torch

    try:
        torch.device(device)
    except (RuntimeError, TypeError):
        raise click.BadParameter(f"'{device}' is not a torch device; use cpu, cuda or cuda:N") from None
    return device


def _phases() -> bool | None:
    """Progress of the statistics and report phases: off with -q, else a bar on a terminal and
    log lines elsewhere."""
    return False if click.get_current_context().obj.get("quiet") else None


@subcommand("report")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(file_okay=False, exists=True))
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    help="HTML file; default RUN_DIR/report.html, or reports/compare.html for several runs.",
)
def report(run_dirs, out):
    """Write statistics (CSV), figures and report.html for one run, or several side by side."""
    from ..report import write_report

    click.echo(f"report: {write_report(list(run_dirs), out, progress=_phases())}")


@subcommand("merge")
@click.argument("out", type=click.Path(file_okay=False))
@click.argument("shard_dirs", nargs=-1, required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--report/--no-report", "with_report", default=True, show_default=True)
def merge(out, shard_dirs, with_report):
    """Join the directories of a sharded run into OUT, identical to an unsharded run."""
    from ..notebook.api import merge_shards

    result = merge_shards(list(shard_dirs), out)
    click.echo(f"merged {len(shard_dirs)} shards, {result.manifest.n_prompts} prompts -> {result.directory}")
    if with_report:
        from ..report import write_report

        click.echo(f"report: {write_report(result.directory, progress=_phases())}")


@subcommand("compare")
@click.argument("run_a", type=click.Path(file_okay=False, exists=True))
@click.argument("run_b", type=click.Path(file_okay=False, exists=True))
@click.option("--out", type=click.Path(file_okay=False), help="Directory; default reports/compare/<A>--<B>/.")
def compare(run_a, run_b, out):
    """Paired statistics B - A of two runs of the same prompts (original and edited, two checkpoints)."""
    from ..report.comparison import headline, write_comparison

    path, tables = write_comparison(run_a, run_b, out)
    for line in headline(tables):
        click.echo(line)
    click.echo(f"compare: {path}")


from .edit import edit  # noqa: E402 (registered after the group exists)
from .probe import probe  # noqa: E402
from .run import run  # noqa: E402

main.add_command(edit)
main.add_command(probe)
main.add_command(run)
