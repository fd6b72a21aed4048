"""`attnprobe probe TEXT_FILE`: attention from one bracketed span of a text (a sentence or a
document up to the model's context) to every token, as adhoc.probe computes it."""

from __future__ import annotations

from pathlib import Path

import click

from .options import command, device_option, model_option, pickle_option, remote_code_option

MAX_BYTES = 16 * 2**20  # a text longer than any context (1M tokens is about 4 MB of English)


@command("attnprobe probe doc.txt --source occupation   (doc.txt: 'The [occupation: nurse] said ...')")
@click.argument("text_file", type=click.Path(dir_okay=False, exists=True))
@model_option
@click.option("--source", help="The bracketed span to read from; default the last one.")
@click.option("--out", type=click.Path(dir_okay=False), help="Write every layer, head and token to this CSV.")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True, help="Rows to print.")
@device_option
@remote_code_option
@pickle_option
def probe(text_file, model_spec, source, out, top, device, trust_remote_code, allow_pickle):
    """Attention from a [bracketed] span of TEXT_FILE to every token, per layer and head.

    Texts longer than 1,024 tokens are read in chunks, recording only the span's rows: memory
    O(layers x heads x span x tokens), estimated (and refused if it would not fit) before the run.
    A regular file of at most 16 MiB.
    """
    from ..errors import SuiteError
    from ..suite.files.sentences import parse_marked

    path = Path(text_file)
    if not path.is_file():  # a FIFO would block, /dev/zero would fill the memory
        raise SuiteError(f"{path}: not a regular file; give a text file")
    if path.stat().st_size > MAX_BYTES:
        raise SuiteError(
            f"{path}: {path.stat().st_size:,} bytes, more than {MAX_BYTES:,} (no model's context holds that "
            "much text); give a shorter text"
        )
    try:
        marked = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise SuiteError(f"{path}: not UTF-8 text (byte {error.start}); save it as UTF-8") from None
    spans = parse_marked(marked, str(path))[1]  # refuses a malformed bracket before the model loads
    if not spans:
        raise SuiteError(f"{path}: mark the source span with [brackets], e.g. '... said that [it] was late'")
    if out:
        try:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SuiteError(
                f"--out {out}: cannot create its directory ({exc.strerror or exc}); choose another"
            ) from None
    from ..forward.longdoc import CHUNK_TOKENS, layer_masks, memory_estimate  # torch: after the text's checks
    from ..model import load_model
    from ..notebook.adhoc import probe as probe_text

    pm = load_model(model_spec, device=device, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
    n = len(pm.tokenizer(parse_marked(marked, str(path))[0])["input_ids"])
    if n > CHUNK_TOKENS:
        rows = 8  # a span is a few tokens; the estimate is stated for 8
        click.echo(
            f"{path}: {n:,} tokens, read in chunks of {CHUNK_TOKENS:,}; about "
            f"{memory_estimate(pm, n, rows) / 2**30:.2f} GiB besides the model for a span of up to {rows} "
            f"tokens over {len(layer_masks(pm))} layers",
            err=True,
        )
    table = probe_text(pm, [marked], source=source, batch_size=1)
    if out:
        table.to_csv(out, index=False)
        click.echo(f"wrote {len(table):,} rows to {out}", err=True)
    strongest = table[table["position"] > 0].nlargest(top, "weight")  # position 0 is the usual sink
    columns = ["layer", "head", "position", "token", "span", "weight"]
    click.echo(f"from '{table['source'].iloc[0]}': the {top} largest weights (position 0 left out)")
    click.echo(strongest[columns].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
