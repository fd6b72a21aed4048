"""`attnprobe run SUITE`: a probe suite through the run engine, ending with the key-findings table
(report.summary) or, without statistics, where the tables are."""

from __future__ import annotations

import os

import click

from ..defaults import DEFAULT_BATCH_SIZE, DEFAULT_CHUNK_SIZE
from .options import command, data_root_option, dtype_option, pickle_option, remote_code_option


class ShardType(click.ParamType):
    """K/N (1 <= K <= N), or 'auto': RANK and WORLD_SIZE as set by torchrun or accelerate launch."""

    name = "K/N|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        if value == "auto":
            try:
                return int(os.environ["RANK"]) + 1, int(os.environ["WORLD_SIZE"])
            except (KeyError, ValueError):
                self.fail(
                    "'auto' needs integer RANK and WORLD_SIZE (set by torchrun or accelerate launch); give "
                    "K/N instead",
                    param,
                    ctx,
                )
        try:
            k, n = (int(part) for part in str(value).split("/"))
        except ValueError:
            self.fail(f"{value!r}: write K/N, e.g. 1/4 (or 'auto' under torchrun)", param, ctx)
        if not 1 <= k <= n:
            self.fail(f"{value!r}: K/N needs 1 <= K <= N", param, ctx)
        return k, n


@command("attnprobe run probes/gender.yaml --limit 600 --no-head-effects")
@click.argument("suite", type=click.Path(dir_okay=False))
@click.option(
    "--model", "model_spec", default=None, help="Model spec; default: the suite's `model`, else smollm2-135m."
)
@click.option(
    "--out", type=click.Path(file_okay=False), help="Run directory; default reports/<suite>/<model>/."
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    help=f"Prompts per forward pass; default {DEFAULT_BATCH_SIZE} on a CPU, a whole chunk on a GPU "
    "(fewer where it would not fit; `check --device` prints it).",
)
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    help="Run only about N prompts (whole items, spread over templates).",
)
@dtype_option
@click.option(
    "--resume/--fresh", default=True, show_default=True, help="Continue a killed run, or start over."
)
@click.option(
    "--chunk-size",
    type=click.IntRange(min=1),
    default=DEFAULT_CHUNK_SIZE,
    show_default=True,
    help="Prompts per chunk written to disk.",
)
@click.option("--progress/--no-progress", default=None, help="Progress bar; default: on a terminal only.")
@click.option(
    "--report/--no-report",
    "with_report",
    default=True,
    show_default=True,
    help="Write statistics and report.html.",
)
@click.option(
    "--max-batch-tokens",
    type=click.IntRange(min=1),
    help="Cap padded tokens per batch (batch size x longest prompt).",
)
@click.option(
    "--shard",
    type=ShardType(),
    help="K/N: compute every N-th chunk starting at K (one process or GPU rank each); "
    "'auto' reads RANK and WORLD_SIZE as set by torchrun / accelerate launch. Join with `attnprobe merge`.",
)
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    help="torch device, e.g. cuda:0 (with --shard auto: cuda:LOCAL_RANK).",
)
@click.option(
    "--device-map",
    type=click.Choice(["auto"]),
    help="Spread a model too large for one device over all devices.",
)
@click.option(
    "--head-effects/--no-head-effects",
    default=True,
    show_default=True,
    help="Run the suite's head_effects measure (activation patching; minutes per 10 items on a CPU).",
)
@click.option(
    "--share-prefixes/--no-share-prefixes",
    default=True,
    show_default=True,
    help="Forward the tokens prompts share once (packed as a trie); the manifest says when the model does "
    "not allow it.",
)
@click.option(
    "--skip",
    "skipped",
    multiple=True,
    help="Leave out a declared measure with a phase of its own (repeatable): head_effects, "
    "direct_attribution, referent_choice, ...",
)
@click.option(
    "--edit",
    "edit_files",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="A saved edit (RUN_DIR/edits/NAME.json from `attnprobe edit`) applied to every forward pass; "
    "repeatable (applied in order). Default directory: reports/<suite>/<model>-edited-<names>/.",
)
@remote_code_option
@pickle_option
@data_root_option
def run(suite, model_spec, with_report, edit_files, skipped, **settings):
    """Run a probe suite (e.g. probes/gender.yaml) and write its tables to the run directory."""
    import time

    from ..suite import load_suite

    started = time.perf_counter()
    suite = load_suite(suite, data_roots=settings["data_roots"])  # before torch loads: its errors at once
    from ..notebook.api import run_suite
    from ..run import RunOptions

    shard, device = settings["shard"], settings["device"]
    if shard is not None and device.startswith("cuda") and ":" not in device:
        settings["device"] = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    quiet = click.get_current_context().obj.get("quiet")
    if quiet:
        settings.update(progress=False, log=lambda message: None)
    head_effects = () if settings.pop("head_effects") else ("head_effects",)
    settings["skip"] = tuple(dict.fromkeys((*head_effects, *skipped)))
    if edit_files:
        from ..edits.saved import load_edit

        settings["edits"] = tuple(load_edit(path) for path in edit_files)
    result = run_suite(suite, model_spec, RunOptions(**settings))
    timing = _timing(result, time.perf_counter() - started, quiet)
    if shard and _launched(shard):  # torchrun: rank 0 joins the shards once every rank is done
        joined = _join_ranks(result.directory.parent, shard)
        if joined is None:
            return
        result = joined
    elif shard or not with_report:  # no statistics: what was computed, and where, is the result
        for line in timing:
            click.echo(line)
        if shard:
            click.echo(
                f"shard {shard[0]} of {shard[1]} done; join all shards with: "
                "attnprobe merge OUT_DIR SHARD_DIR ..."
            )
        return
    if not with_report:
        click.echo(f"merged {shard[1]} shards -> {result.directory}")
        return
    _report(result.directory, timing, quiet, settings["progress"])


def _timing(result, seconds: float, quiet: bool) -> list[str]:
    """What the run skipped and noted (on stderr unless quiet), and the lines saying how long it took."""
    from ..measures.head_effects import EffectsRecord

    manifest = result.manifest
    for line in (
        [] if quiet else [f"skipped: {s}" for s in manifest.skipped] + [f"note: {n}" for n in manifest.notes]
    ):
        click.echo(line, err=True)
    n = manifest.n_prompts
    effects = EffectsRecord.of(manifest)
    prompt_seconds = seconds - (effects.seconds if effects else 0.0)
    timing = [
        f"{n} prompts on {manifest.model.spec} in {prompt_seconds:.1f} s "
        f"({n / prompt_seconds:.1f} prompts/s, including model load) -> {result.directory}"
    ]
    if effects:
        timing.append(
            f"head effects: {effects.n_items} items, {effects.n_pairs} "
            f"(item, counterfactual) pairs in {effects.seconds:.1f} s ({len(effects.dropped)} "
            "dropped, listed in manifest.json)"
        )
    return timing


def _report(directory, timing: list[str], quiet: bool, progress) -> None:
    """Statistics and the report, then the run's result: a short table (the full prose is in the report)."""
    import json
    import time

    from ..report import write_report
    from ..report.summary import summary_lines

    started = time.perf_counter()
    if not quiet:
        for line in timing:
            click.echo(line, err=True)
        click.echo("statistics and report ...", err=True)
    write_report(directory, progress=progress)
    if not quiet:
        click.echo(f"statistics and report in {time.perf_counter() - started:.1f} s", err=True)
    summary = json.loads((directory / "summary.json").read_text())
    for line in summary_lines(summary):
        click.echo(line)


def _launched(shard) -> bool:
    """This process is rank shard[0] - 1 of a torchrun / accelerate launch (`--shard auto`)."""
    env = os.environ
    return (
        "MASTER_ADDR" in env
        and env.get("WORLD_SIZE") == str(shard[1])
        and env.get("RANK") == str(shard[0] - 1)
        and shard[1] > 1
    )


def _join_ranks(out, shard):
    """Wait for every rank (a gloo barrier: CPU only, beside whatever GPUs the ranks use), then on rank 0
    merge the shard directories into `out`; returns the merged run on rank 0, None elsewhere."""
    from datetime import timedelta

    import torch.distributed as dist

    from ..notebook.api import merge_shards

    dist.init_process_group("gloo", timeout=timedelta(days=7))  # a shard may run for days
    try:
        dist.barrier()
        merged = None
        if dist.get_rank() == 0:
            shards = [out / f"shard-{k}-of-{shard[1]}" for k in range(1, shard[1] + 1)]
            merged = merge_shards(shards, out)
        dist.barrier()  # the other ranks end once the merged run is written
        return merged
    finally:
        dist.destroy_process_group()
