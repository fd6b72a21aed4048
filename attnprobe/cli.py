"""The `attnprobe` command: thin click commands over library functions.

Every user mistake arrives as an AttnprobeError and leaves through the one handler on the group
(`Group.invoke`) as one line on stderr with the error's exit code (2; 130 for an interrupted run).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import click

from .errors import AttnprobeError, RunError, RunInterrupted
from .models import DEFAULT_MODEL, DTYPES
from .run.plan import DEFAULT_BATCH_SIZE


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
            command = f" {error.ctx.info_name}" if error.ctx is not None and error.ctx.parent is not None else ""
            message = " ".join(error.format_message().split()).rstrip(".")
            click.echo(f"attnprobe: error: {message}; see `attnprobe{command} --help`", err=True)
            sys.exit(error.exit_code)


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
                self.fail("'auto' needs integer RANK and WORLD_SIZE (set by torchrun or accelerate launch); give K/N instead",
                          param, ctx)
        try:
            k, n = (int(part) for part in str(value).split("/"))
        except ValueError:
            self.fail(f"{value!r}: write K/N, e.g. 1/4 (or 'auto' under torchrun)", param, ctx)
        if not 1 <= k <= n:
            self.fail(f"{value!r}: K/N needs 1 <= K <= N", param, ctx)
        return k, n


model_option = click.option("--model", "model_spec", default=DEFAULT_MODEL, show_default=True,
                            help="Bundled alias, .gguf path, local checkpoint directory or hub id.")
dtype_option = click.option("--dtype", type=click.Choice(list(DTYPES)), default="float32", show_default=True)
remote_code_option = click.option("--trust-remote-code", is_flag=True, help="Allow a hub model's own Python code to run.")
data_root_option = click.option("--data-root", "data_roots", multiple=True, type=click.Path(file_okay=False, exists=True),
                                help="Also read the suite's data files from this directory (repeatable); by default only "
                                     "the suite's own directory and below.")
pickle_option = click.option("--allow-pickle", is_flag=True, help="Allow pickled weights (*.bin), which can run code when loaded.")


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="attnprobe")
@click.option("-q", "--quiet", is_flag=True, help="Only results and errors: no progress, log lines or notes.")
@click.option("-v", "--verbose", is_flag=True, help="Also the log lines of transformers (loading, conversion).")
@click.pass_context
def main(ctx, quiet, verbose):
    """Extract, verify and probe attention in causal language models."""
    from transformers.utils import logging as hf_logging

    if quiet and verbose:
        raise click.UsageError("-q and -v contradict each other; give one")
    hf_logging.disable_progress_bar()  # our own progress bar is enough; keep CI logs readable
    if verbose or quiet:
        hf_logging.set_verbosity_info() if verbose else hf_logging.set_verbosity_error()
    ctx.obj = {"quiet": quiet}


@main.command()
def models():
    """List the bundled model aliases and whether each is installed."""
    from .models import bundled_status

    for row in bundled_status():
        state = "installed" if row["installed"] else f"not installed ({row['install']})"
        click.echo(f"{row['alias']:<14} {state:<12}  {row['description']}")


@main.command()
@model_option
@click.option("--text", "texts", multiple=True, help="A text to check (repeatable); default: built-in probe sentences.")
@dtype_option
@click.option("--long", "long_tokens", type=click.IntRange(min=1), help="Also check a text of about N tokens, padded "
              "against the others: sliding windows and long-context masks act (e.g. 600 for Gemma 3's 512-token window).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the per-layer table as JSON.")
@remote_code_option
@pickle_option
def verify(model_spec, texts, dtype, long_tokens, json_path, trust_remote_code, allow_pickle):
    """Recompute every attention layer from scratch and compare with the model.

    Exit 0 when every layer is within tolerance, 1 when any is not, 2 when the family has no
    from-scratch recomputation.
    """
    from .verify import DEFAULT_TEXTS, format_table, verify_spec

    if json_path:  # before the work: a path that cannot be written is refused at once
        _json_directory(Path(json_path))
    table = verify_spec(model_spec, list(texts) or DEFAULT_TEXTS, dtype=dtype, trust_remote_code=trust_remote_code,
                        allow_pickle=allow_pickle, long_tokens=long_tokens)
    click.echo(format_table(table))
    if json_path:
        _write_json(table, Path(json_path))
    sys.exit(0 if table["passed"].all() else 1)


def _json_directory(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunError(f"--json {path}: cannot create {path.parent} ({exc.strerror or exc}); choose a writable path") from None


def _write_json(table, path: Path) -> None:
    try:
        table.to_json(path, orient="records", indent=1)
    except OSError as exc:
        raise RunError(f"--json {path}: cannot write ({exc.strerror or exc}); choose a writable path") from None


# The prompts' speed for `check`, measured by `make demo` (SmolLM2-135M, float32, 2 idle CPU cores,
# 2026-11-23, prefixes shared); head effects: HeadEffectsMeasure.estimate_seconds.
REFERENCE = {"prompts_per_s": 190.0, "model": "smollm2-135m"}


@main.command()
@click.argument("suite", type=click.Path(dir_okay=False))
@click.option("--model", "model_spec", default=None, help="Tokenizer to count tokens with; default: the suite's `model`.")
@click.option("--limit", type=click.IntRange(min=1), help="As `run --limit`.")
@remote_code_option
@data_root_option
def check(suite, model_spec, limit, trust_remote_code, data_roots):
    """Validate a suite and say what a run would do (prompts, items, analysis, measures, tokens,
    a time estimate) without loading any model weights."""
    from .models import DEFAULT_MODEL, load_tokenizer
    from .run.plan import encode_prompts, plan_batches, select_prompts, sharing_summary, sink_notes
    from .sharing import prefix_sharing_blocker
    from .suite import load_suite

    loaded = load_suite(suite, data_roots=data_roots)
    spec = model_spec or loaded.model or DEFAULT_MODEL
    tokenizer, max_positions, config = load_tokenizer(spec, trust_remote_code=trust_remote_code)
    prompts = select_prompts(loaded.prompts, limit)
    encoded = encode_prompts(loaded, prompts, tokenizer, max_positions)
    a = loaded.analysis
    click.echo(f"suite {loaded.name} ({loaded.path}): {len({p.template_id for p in prompts})} templates or sentence sets, "
               f"{len(prompts)} prompts, {len({p.item_id for p in prompts})} items")
    if a.paired:
        covariate = f"; covariate {a.name(a.covariate)} across {a.name(a.unit)}s" if a.covariate else "; no covariate"
        click.echo(f"analysis: {a.positive} - {a.negative} by {a.name(a.contrast)}; clusters {a.cluster_text}{covariate}"
                   + "".join(f"; group {g} ({len(ids)})" for g, ids in a.groups.items()))
    else:
        click.echo(f"analysis: no two labels compared (labels: {', '.join(a.labels) or 'none'}): descriptive tables only")
    for m in loaded.attention:
        click.echo(f"attention: {m.source} -> {', '.join(m.targets)} ({m.source_agg} over source, {m.target_agg} over target)")
    for m in loaded.next_token:
        click.echo(f"next_token: at {m.cut}, candidates {m.candidates if isinstance(m.candidates, str) else list(m.candidates)}")
    effects_items, pair_seconds = [], 0.0
    if loaded.head_effects is not None:
        effects_items, dropped = loaded.head_effects.for_prompts(len(encoded), len(loaded.prompts)).items(tokenizer, encoded)
        pairs = sum(len(i["counterfactuals"]) for i in effects_items)
        reasons = sorted({d["reason"] for d in dropped})
        design = "a pronoun swap" if loaded.head_effects.design == "pair" else f"{loaded.head_effects.slot} replaced"
        exact, held = loaded.head_effects.exact, loaded.head_effects.held_out_ids(effects_items)
        click.echo(f"head_effects ({design}): {len(effects_items)} items x {len(loaded.head_effects.replacements)} counterfactuals = "
                   f"{pairs} pairs ({len(dropped)} dropped{': ' + '; '.join(reasons[:2]) if reasons else ''}), exact patching of "
                   + ("every head" if exact == "all" else f"{exact} heads on every item and of every head on {len(held)} held-out items"))
        pair_seconds = loaded.head_effects.estimate_seconds(effects_items)
    for line in loaded.skipped:
        click.echo(f"skipped: {line}")
    for line in [*loaded.notes, *sink_notes(loaded, encoded)]:
        click.echo(f"note: {line}")
    n = max(1, len(encoded))
    blocker = prefix_sharing_blocker(config, max((e.n_forward for e in encoded), default=0))
    shared = sharing_summary([plan_batches(encoded, DEFAULT_BATCH_SIZE, share_prefixes=blocker is None)], encoded, blocker)
    sharing = f"{shared['tokens_forwarded'] / n:.2f} with shared prefixes once" if blocker is None else f"prefixes not shared: {blocker}"
    click.echo(f"tokens ({spec} tokenizer): {shared['tokens_without_sharing'] / n:.2f} forwarded per prompt ({sharing}), "
               f"longest prompt {max((len(e.ids) for e in encoded), default=0)}")
    minutes = len(prompts) / REFERENCE["prompts_per_s"] / 60 + pair_seconds / 60
    click.echo(f"estimate: about {minutes:.1f} min for {REFERENCE['model']} on 2 CPU cores (prompts at "
               f"{REFERENCE['prompts_per_s']:.0f}/s, head effects {pair_seconds / 60:.1f} min); "
               "larger models take longer in proportion to their size")


@main.command()
@click.argument("suite", type=click.Path(dir_okay=False))
@click.option("--model", "model_spec", default=None, help="Model spec; default: the suite's `model`, else smollm2-135m.")
@click.option("--out", type=click.Path(file_okay=False), help="Run directory; default reports/<suite>/<model>/.")
@click.option("--batch-size", type=click.IntRange(min=1), default=DEFAULT_BATCH_SIZE, show_default=True, help="Prompts per forward pass.")
@click.option("--limit", type=click.IntRange(min=1), help="Run only about N prompts (whole items, spread over templates).")
@dtype_option
@click.option("--resume/--fresh", default=True, show_default=True, help="Continue a killed run, or start over.")
@click.option("--chunk-size", type=click.IntRange(min=1), default=512, show_default=True, help="Prompts per chunk written to disk.")
@click.option("--progress/--no-progress", default=None, help="Progress bar; default: on a terminal only.")
@click.option("--report/--no-report", "with_report", default=True, show_default=True, help="Write statistics and report.html.")
@click.option("--max-batch-tokens", type=click.IntRange(min=1), help="Cap padded tokens per batch (batch size x longest prompt).")
@click.option("--shard", type=ShardType(), help="K/N: compute every N-th chunk starting at K (one process or GPU rank each); "
              "'auto' reads RANK and WORLD_SIZE as set by torchrun / accelerate launch. Join with `attnprobe merge`.")
@click.option("--device", default="cpu", show_default=True, help="torch device, e.g. cuda:0 (with --shard auto: cuda:LOCAL_RANK).")
@click.option("--device-map", type=click.Choice(["auto"]), help="Spread a model too large for one device over all devices.")
@click.option("--head-effects/--no-head-effects", default=True, show_default=True,
              help="Run the suite's head_effects measure (activation patching; minutes per 10 items on a CPU).")
@click.option("--share-prefixes/--no-share-prefixes", default=True, show_default=True,
              help="Forward the tokens prompts share once (packed as a trie); the manifest says when the model does not allow it.")
@remote_code_option
@pickle_option
@data_root_option
def run(suite, model_spec, out, batch_size, limit, dtype, resume, chunk_size, progress, with_report, max_batch_tokens,
        shard, device, device_map, head_effects, share_prefixes, trust_remote_code, allow_pickle, data_roots):
    """Run a probe suite (e.g. probes/gender.yaml) and write its tables to the run directory."""
    import time

    from .api import run_suite

    started = time.perf_counter()
    if shard is not None and device.startswith("cuda") and ":" not in device:
        device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    quiet = click.get_current_context().obj.get("quiet")
    result = run_suite(suite, model=model_spec, out=out, batch_size=batch_size, limit=limit, dtype=dtype,
                       resume=resume, chunk_size=chunk_size, progress=False if quiet else progress,
                       log=(lambda message: None) if quiet else None, trust_remote_code=trust_remote_code,
                       max_batch_tokens=max_batch_tokens, shard=shard, device=device, device_map=device_map,
                       head_effects=head_effects, allow_pickle=allow_pickle, data_roots=data_roots, share_prefixes=share_prefixes)
    seconds = time.perf_counter() - started
    manifest = result.manifest
    for line in [] if quiet else [f"skipped: {s}" for s in manifest["skipped"]] + [f"note: {n}" for n in manifest.get("notes", [])]:
        click.echo(line, err=True)
    n = manifest["n_prompts"]
    effects = manifest.get("head_effects")
    prompt_seconds = seconds - (effects["seconds"] if effects else 0.0)
    click.echo(f"{n} prompts on {manifest['model']['spec']} in {prompt_seconds:.1f} s ({n / prompt_seconds:.1f} prompts/s, "
               f"including model load) -> {result.directory}")
    if effects:
        click.echo(f"head effects: {effects['n_items']} items, {effects.get('n_pairs', effects['n_items'])} (item, counterfactual) pairs "
                   f"in {effects['seconds']:.1f} s ({len(effects['dropped'])} dropped, listed in manifest.json)")
    if shard:
        click.echo(f"shard {shard[0]} of {shard[1]} done; join all shards with: attnprobe merge OUT_DIR SHARD_DIR ...")
        return
    if with_report:
        from .report import headline, load_tables, write_report

        started = time.perf_counter()
        if not quiet:
            click.echo("statistics and report ...", err=True)
        path = write_report(result.directory, progress=False if quiet else progress)
        click.echo(f"report ({time.perf_counter() - started:.1f} s): {path}")
        click.echo(headline(result, load_tables(result)))


def _phases() -> bool | None:
    """Progress of the statistics and report phases: off with -q, else a bar on a terminal and
    log lines elsewhere."""
    return False if click.get_current_context().obj.get("quiet") else None


@main.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--out", type=click.Path(dir_okay=False), help="HTML file; default RUN_DIR/report.html, or reports/compare.html for several runs.")
def report(run_dirs, out):
    """Write statistics (CSV), figures and report.html for one run, or several side by side."""
    from .report import write_report

    click.echo(f"report: {write_report(list(run_dirs), out, progress=_phases())}")


@main.command()
@click.argument("out", type=click.Path(file_okay=False))
@click.argument("shard_dirs", nargs=-1, required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--report/--no-report", "with_report", default=True, show_default=True)
def merge(out, shard_dirs, with_report):
    """Join the directories of a sharded run into OUT, identical to an unsharded run."""
    from .api import merge_shards

    result = merge_shards(list(shard_dirs), out)
    click.echo(f"merged {len(shard_dirs)} shards, {result.manifest['n_prompts']} prompts -> {result.directory}")
    if with_report:
        from .report import write_report

        click.echo(f"report: {write_report(result.directory, progress=_phases())}")
