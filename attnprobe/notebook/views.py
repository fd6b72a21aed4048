"""Attention views for notebooks: attnprobe's own offline view (the report's, `attention_view`) and
bertviz's head and model views, fed by attnprobe's capture.

bertviz draws with require.js and d3 from a CDN. Each view carries a one-line note, hidden while
bertviz draws, that shows itself when those scripts did not load (a notebook without network),
so the user reads why instead of looking at a blank widget.
"""

from __future__ import annotations

import re
from html import escape

from ..attention.capture import run_with_capture
from ..errors import AttnprobeError
from .adhoc import model_of

MAX_TOKENS = 256  # bertviz's views become unreadable (and slow) beyond a few hundred tokens
OFFLINE_NOTE = (
    "bertviz could not load its scripts (require.js and d3 from cdnjs.cloudflare.com), so this view stays "
    "empty without a network connection; attnprobe's HTML report has an attention view that works offline."
)
# Shown after a few seconds unless bertviz has drawn into its root div (or require.js never arrived).
_NOTE = """<div id="{root}-offline" style="display:none;color:#a00;font:13px sans-serif">{note}</div>
<script>setTimeout(function () {{
  var root = document.getElementById("{root}");
  if (typeof require === "undefined" || !(root && root.querySelector("svg")))
    document.getElementById("{root}-offline").style.display = "block";
}}, {wait_ms});</script>"""


def _inputs(model, text):
    """(per-layer attention (1, H, T, T), tokens) of one text. `model`: a ProbeModel, a spec, or a
    run (its model; `text` may then be a prompt id of the run)."""
    from ..run.files.reader import RunFiles

    if isinstance(model, RunFiles):
        run, model = model, model.manifest.model.spec
        if isinstance(text, int):
            by_id = run.prompts.set_index("prompt_id")["text"]
            if text not in by_id.index:
                raise AttnprobeError(
                    f"run {run.directory} has no prompt {text}; its prompt ids are in run.prompts.prompt_id"
                )
            text = by_id[text]
    if not isinstance(text, str):
        raise AttnprobeError(
            "bertviz shows one text at a time (it has no batch view); pass a single string, "
            "e.g. run.prompts.text[0], or with a run a prompt id"
        )
    pm = model_of(model)
    enc = pm.tokenizer(text, return_tensors="pt")
    n_tokens = enc["input_ids"].shape[1]
    if n_tokens > MAX_TOKENS:
        raise AttnprobeError(
            f"text has {n_tokens} tokens; bertviz is readable up to {MAX_TOKENS}: shorten the text"
        )
    captured = run_with_capture(pm, enc["input_ids"], enc["attention_mask"])
    attention = tuple(captured.weights[layer][:1] for layer in sorted(captured.weights))
    tokens = [pm.tokenizer.decode([i]) for i in enc["input_ids"][0].tolist()]
    assert all(a.shape[-1] == len(tokens) for a in attention)  # bertviz's most common failure, checked early
    return attention, tokens


def _with_note(html, html_action: str, wait_ms: int):
    """bertviz's HTML plus the offline note; displayed (`view`) or returned (`return`)."""
    from IPython.display import HTML, display

    root = re.search(r'id="(bertviz-[0-9a-f]+)"', html.data).group(1)  # bertviz's root div for this view
    page = HTML(html.data + _NOTE.format(root=root, note=escape(OFFLINE_NOTE), wait_ms=wait_ms))
    if html_action == "return":
        return page
    if html_action != "view":
        raise AttnprobeError(f"html_action is 'view' or 'return', not {html_action!r}")
    display(page)
    return None


def _check_indices(n_layers: int, n_heads: int, **given) -> None:
    """The views' layer and head options (an index or a list of indices) lie in the model: one line
    naming the option and the range otherwise, not bertviz's IndexError."""
    for name, value in given.items():
        if value is None:
            continue
        n = n_layers if "layer" in name else n_heads
        values = [value] if isinstance(value, int) and not isinstance(value, bool) else value
        ok = isinstance(values, (list, tuple)) and all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n for v in values
        )
        if not ok:
            raise AttnprobeError(
                f"{name}={value!r}: give {'layer' if 'layer' in name else 'head'} indices 0-{n - 1} "
                f"(this model has {n_layers} layers of {n_heads} heads)"
            )


def head_view(
    model,
    text: str | int,
    layer: int | None = None,
    heads: list[int] | None = None,
    include_layers: list[int] | None = None,
    html_action: str = "view",
    wait_ms: int = 4000,
):
    """bertviz's head view of one text: the heads of one layer overlaid, toggled by clicking.
    `model`: a ProbeModel, a model spec, or a run (then `text` may be one of its prompt ids); `layer`,
    `heads`, `include_layers`: bertviz's options
    (which layer and heads to show first, which layers to offer)."""
    from bertviz import head_view as bertviz_head_view

    attention, tokens = _inputs(model, text)
    _check_indices(
        len(attention), attention[0].shape[1], layer=layer, heads=heads, include_layers=include_layers
    )
    html = bertviz_head_view(
        attention, tokens, layer=layer, heads=heads, include_layers=include_layers, html_action="return"
    )
    return _with_note(html, html_action, wait_ms)


def model_view(
    model,
    text: str | int,
    include_layers: list[int] | None = None,
    include_heads: list[int] | None = None,
    display_mode: str = "light",
    html_action: str = "view",
    wait_ms: int = 4000,
):
    """bertviz's model view of one text: a layers x heads grid of thumbnails, one per head."""
    from bertviz import model_view as bertviz_model_view

    attention, tokens = _inputs(model, text)
    n_layers, n_heads = len(attention), attention[0].shape[1]
    _check_indices(n_layers, n_heads, include_layers=include_layers, include_heads=include_heads)
    html = bertviz_model_view(
        attention,
        tokens,
        include_layers=include_layers,
        include_heads=include_heads,
        display_mode=display_mode,
        html_action="return",
    )
    return _with_note(html, html_action, wait_ms)


def attention_view(
    source, texts: list[str] | None = None, start: tuple[int, int] = (0, 0), html_action: str = "view"
):
    """The report's attention view (offline, no libraries) in a notebook: the heads of a layer
    overlaid (toggled by their swatches), a prompt beside a comparison prompt of the same length
    with their difference, weights on hover, and a layers x heads grid. `source` is a Run (its
    example prompts) or a model (spec or ProbeModel) with `texts`, whose last [bracketed] span is
    the source (red); `start` = (layer, head) shown first."""
    import json
    import uuid
    from importlib.resources import files

    from IPython.display import HTML, display

    if texts is None:
        from ..run.files.reader import RunFiles

        run = source if isinstance(source, RunFiles) else RunFiles(source)
        examples = json.loads((run.directory / "examples.json").read_text())
    else:
        examples = _examples(source, [texts] if isinstance(texts, str) else list(texts))
    if not (isinstance(start, (list, tuple)) and len(start) == 2):
        raise AttnprobeError(f"start={start!r}: give (layer, head), e.g. start=(26, 2)")
    shape = examples[0]["shape"] if examples else [0, 0]  # (L, H, rows, T) of the packed weights
    _check_indices(shape[0], shape[1], start_layer=start[0], start_head=start[1])
    view_id = f"attnprobe-view-{uuid.uuid4().hex}"
    # as Jinja's tojson: no <, > or & in the script block ("</script>" or "<!--<script>" in a text
    # would end it early or keep it open)
    data = json.dumps(examples).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    page = HTML(
        f'<script type="application/json" id="{view_id}-data">{data}</script>'
        f'<div class="attention-view" data-source="{view_id}-data" data-start="{start[0]},{start[1]}"></div>'
        f"<script>{files('attnprobe.report').joinpath('view.js').read_text()}</script>"
    )
    if html_action == "return":
        return page
    display(page)
    return None


def _examples(model, texts: list[str]) -> list[dict]:
    """The view's data for plain texts: every layer, head and row of each; the last bracketed span
    is the source (red). One item: texts of equal length are compared side by side."""
    from ..measures.attention import pack_weights
    from .adhoc import marked_attention

    examples = []
    for i, sentence in enumerate(marked_attention(model, texts)):
        spans = dict(sentence["spans"])
        shape, packed = pack_weights(sentence["weights"])
        examples.append(
            {
                "prompt_id": i,
                "item_id": 0,
                "text": sentence["text"],
                "label": "",
                "spans": spans,
                "shape": shape,
                "weights_u16_base64": packed,
                "tokens": sentence["tokens"],
            }
        )
    return examples
