"""`attnprobe edit RUN_DIR`: the head-edit sweep (attnprobe.edits), a command of cli/__init__.py's group."""

from __future__ import annotations

from pathlib import Path

import click

from ..defaults import (
    DEFAULT_EDIT_COUNTS,
    DEFAULT_EDIT_K,
    DEFAULT_EDIT_KINDS,
    EDIT_KIND_NAMES,
    MAX_EDIT_COUNTS,
    MIN_EDIT_COUNTS,
)
from .options import command, device_option


def _int_list(ctx, param, value):
    if value is None:
        return None
    try:
        return tuple(int(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r}: whole numbers separated by commas, e.g. 1,2,5,10,20") from None


def _count(name: str, help: str):
    """The option of one of the sweep's counts, its bounds and default from defaults.py."""
    bounds = click.IntRange(MIN_EDIT_COUNTS[name], MAX_EDIT_COUNTS[name])
    return click.option(
        f"--{name}", type=bounds, default=DEFAULT_EDIT_COUNTS[name], show_default=True, help=help
    )


@command("attnprobe edit reports/gender/smollm2-135m --kinds zero,leace --k 1,5")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
@click.option(
    "--kinds",
    default=",".join(DEFAULT_EDIT_KINDS),
    show_default=True,
    help=f"Head edit kinds, comma-separated: {', '.join(EDIT_KIND_NAMES)}.",
)
@click.option(
    "--k",
    "ks",
    default=",".join(map(str, DEFAULT_EDIT_K)),
    show_default=True,
    callback=_int_list,
    help="Numbers of heads.",
)
@click.option(
    "--heads", help="Edit these heads on every item instead of the run's ranking, e.g. L26H2,L25H2."
)
@click.option(
    "--sequential/--no-sequential",
    default=False,
    show_default=True,
    help="Also fit each kind's heads in order, each layer's on the model with the heads below it edited "
    "(kind KIND-seq, for the kinds with fitted parameters; no random sets).",
)
@_count(
    "draws",
    "Random head sets per k.",
)
@click.option("--factor", type=float, default=0.5, show_default=True, help="Factor of the scale edit.")
@click.option(
    "--reference",
    help="Counterfactual word of the reference set; default the suite's last literal one (person).",
)
@click.option(
    "--cost-text",
    "text_file",
    type=click.Path(),
    help="Also report the log-loss change on this text file (--text in verify is a sentence).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@_count(
    "alone",
    "The top heads each zeroed alone on every item and control prompt (edits_heads.csv); 0: none.",
)
@_count(
    "texts",
    "Texts the model writes from the shipped openings that KL is measured on (fewer: faster, wider CI).",
)
@_count(
    "placebo",
    "Refit each covariate-fitted kind on this many permutations of the covariate across units "
    "(edits_placebo.csv; 199 gives p a floor of 0.005).",
)
@click.option(
    "--stream/--no-stream",
    default=False,
    show_default=True,
    help="Also erase the covariate from the residual stream entering each layer (edits_stream.csv).",
)
@click.option(
    "--mlp/--no-mlp",
    default=False,
    show_default=True,
    help="Also edit each layer's MLP output (zero, mean, project, leace), fitted at the prediction "
    "and at the slot's last token (mlp-MODE-slot); edits_mlp.csv.",
)
@click.option(
    "--mlp-modes",
    default=None,
    metavar="MODES",
    help="The modes --mlp measures, comma-separated (implies --mlp): zero, mean, project, leace, "
    "leace_mid, or a plug-in's (attnprobe.site_modes); default zero,mean,project,leace.",
)
@click.option(
    "--stream-layers/--no-stream-layers",
    default=False,
    show_default=True,
    help="Also erase the covariate from the stream entering several consecutive layers at once, each "
    "eraser fitted on the model erased below it (--mlp-layers' windows; kind stream-layers); "
    "edits_stream.csv.",
)
@click.option(
    "--stream-layer-modes",
    default=None,
    metavar="MODES",
    help="The modes --stream-layers measures, comma-separated (implies --stream-layers): leace, "
    "leace_mid, project, dual, ... (any of --mlp-modes'); default leace (kind stream-layers; another "
    "mode is kind stream-layers-MODE).",
)
@click.option(
    "--mlp-layers/--no-mlp-layers",
    default=False,
    show_default=True,
    help="Also edit the MLP outputs of several consecutive layers at once, each fitted on the model "
    "edited below it (DAMA's design: its layer counts scaled to the model's depth; project, "
    "dual (2DAMA's keep rule) and leace_mid, fitted at the slot: mlp-layers-MODE-slot); edits_mlp.csv.",
)
@click.option(
    "--mlp-layer-modes",
    default=None,
    metavar="MODES",
    help="The modes --mlp-layers measures, comma-separated (implies --mlp-layers): any of --mlp-modes' "
    "(zero, mean, project, leace, leace_mid, dual, or a plug-in's); default project,dual,leace_mid.",
)
@click.option(
    "--mlp-ranks",
    default=None,
    metavar="RANKS",
    callback=_int_list,
    help="The directions per layer --mlp-layers' project and dual remove, comma-separated, 1 to 64 "
    "(implies --mlp-layers; default 1; rank R > 1 is kind mlp-layers-MODE-rR-slot).",
)
@click.option(
    "--trace/--no-trace",
    default=False,
    show_default=True,
    help="Also patch the residual stream from the reference counterfactual per layer at the occupation, "
    "the tokens between and the prediction (tracing.csv).",
)
@click.option(
    "--paths/--no-paths",
    default=False,
    show_default=True,
    help="Also path-patch the top 5 heads: their value input from the occupation against their pattern, "
    "and the senders into their value (paths.csv, paths_edges.csv).",
)
@click.option(
    "--circuits/--no-circuits",
    default=False,
    show_default=True,
    help="Also find circuits of heads and MLPs by attribution (EAP, EAP-IG) and judge each size by exact "
    "patching on held-out items (circuits.csv, circuit_parts.csv or circuit_edges.parquet, "
    "circuit_agreement.csv).",
)
@click.option(
    "--circuit-grain",
    type=click.Choice(["parts", "edges"]),
    default="parts",
    show_default=True,
    help="What --circuits chooses: parts (heads and MLPs) or edges (a part's write into one query, key, "
    "value, MLP input or the logits, at the occupation, between or at the last position).",
)
@click.option(
    "--also",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="Another suite (repeatable) each chosen edit is applied to: its bias measures before and after, "
    "paired (edits_transfer.csv; runs under RUN_DIR/also/).",
)
@click.option(
    "--also-k",
    "also_ks",
    default="1,5",
    show_default=True,
    callback=_int_list,
    help="The numbers of heads whose edits --also applies.",
)
@device_option
def edit(run_dir, kinds, text_file, also, also_ks, device, **settings):
    """Edit the heads RUN_DIR found (by default k = 1, 5; against random heads of the same layers)
    and write edits.csv: the stereotype gradient removed, definitional pronouns kept, and the KL cost."""
    from ..edits import EditOptions, run_edits
    from ..edits.sweep.options import IMPLIES

    kinds = tuple(k.strip() for k in kinds.split(",") if k.strip())
    for name, flag in IMPLIES.items():  # a list given asks for its edits; none: the options' default
        if settings[name] is None:
            del settings[name]
            continue
        if isinstance(settings[name], str):  # the modes' names (the ranks are numbers already)
            settings[name] = tuple(m.strip() for m in settings[name].split(",") if m.strip())
        settings[flag] = True
    options = EditOptions(kinds=kinds, text=text_file, **settings)  # the other options by their names
    quiet = click.get_current_context().obj.get("quiet")
    log = (lambda message: None) if quiet else (lambda message: click.echo(message, err=True))
    table = run_edits(run_dir, options, log=log, also=also, also_ks=also_ks, device=device)
    from ..report.edit_sweep import edit_frontier_figure, goal_figure  # the report draws both

    edit_frontier_figure(Path(run_dir), Path(run_dir) / "figures")
    goal_figure(Path(run_dir), Path(run_dir) / "figures")
    log(f"edit: figures/edit_frontier.png and edit_goal.png in {run_dir}")
    columns = [
        "kind",
        "k",
        "gradient_before",
        "gradient_after",
        "gradient_removed",
        "random_p",
        "definitional_accuracy_after",
        "kl",
    ]
    click.echo(table[columns].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
