"""check_edit_kind: one head-edit kind, and check_site_mode: one mode of the per-layer edits, through
what `attnprobe edit` and `run --edit` ask of them."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np


def edit_inputs(model, suite, reference: str | None = None, seed: int = 0, texts: int = 8):
    """The recorded inputs `attnprobe edit` fits kinds on (edits.inputs.Inputs), for `suite` (a Suite
    with head effects, a covariate and a control) on `model` (a loaded ProbeModel); `texts`: the
    generated texts of the cost (8 of the 64: the check needs texts, not a tight interval)."""
    from ..edits.inputs import Texts, record_inputs
    from ..run import RunOptions, plan_run

    effects = plan_run(suite, model, RunOptions(progress=False, log=lambda m: None)).parts["head_effects"]
    word = reference or suite.head_effects.replacements[-1]
    labels = (effects.measure.positive, effects.measure.negative)
    return record_inputs(model, effects.items, word, suite.control, labels, Texts(seed, texts))


def check_edit_kind(kind, model, inputs) -> None:
    """Check the HeadEdit subclass `kind` on `model` (a tiny ProbeModel) and `inputs` (edit_inputs):
    it fits on the inputs, replaces a head's output with one of its shape, edits nothing on no heads,
    saves and loads to the same edit, and gives the same values in one packed pass as one item at a
    time. AssertionError naming the part that fails."""
    import torch

    from ..edits import edited
    from ..edits.sweep.options import EditOptions

    L, H, D = model.info.n_layers, model.info.n_heads, model.info.head_dim
    edit = _part(kind, "fit", lambda: kind.fit(inputs, np.arange(4), EditOptions()))
    assert isinstance(edit, kind), f"{kind.kind}: fit gave {type(edit).__name__}, not a {kind.__name__}"
    edit = edit.on(((L - 1, 0),))
    z = torch.randn(2, H, 3, D, generator=torch.Generator().manual_seed(0))
    for layer in range(L):
        out = _part(kind, "replacement", lambda layer=layer: edit.replacement(layer, z))
        assert isinstance(out, torch.Tensor) and out.shape == z.shape and out.dtype == z.dtype, (
            f"{kind.kind}: replacement gave {getattr(out, 'shape', out)} for head outputs {tuple(z.shape)}"
        )
    ids = _probe_ids(model)
    logits = lambda: model.model(input_ids=ids).logits
    with torch.no_grad():
        clean = logits()
        with edited(model, edit.on(())):
            assert torch.equal(logits(), clean), f"{kind.kind}: an edit of no heads changed the logits"
        with edited(model, edit):
            changed = logits()
    _round_trip(kind, edit, model, changed, logits)
    if not kind.DRAWN:  # a drawn kind's values depend on the pass's shape (seeded per shape)
        _packed(kind, edit, model, inputs)


def _label(kind) -> str:
    """A head kind's name (kind.kind) or a site mode's (kind.mode)."""
    return getattr(kind, "kind", None) or kind.mode


def _part(kind, name: str, call):
    """call(), an exception raised as the AssertionError naming the kind (or mode) and the part."""
    try:
        return call()
    except Exception as exc:
        raise AssertionError(f"{_label(kind)}: {name} raised {type(exc).__name__}: {exc}") from exc


def _round_trip(kind, edit, model, changed, logits) -> None:
    """Saved (edits.saved) and loaded back, the edit gives the same logits (its tensors as float32)."""
    import torch

    from ..edits import edited, load_edit, save_edit

    label = _label(kind)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / label
        _part(kind, "save", lambda: save_edit(edit, path, model, {"check": "attnprobe.testing"}))
        loaded = _part(kind, "load", lambda: load_edit(path))
    assert type(loaded.edit) is type(edit), f"{label}: loaded back as {type(loaded.edit).__name__}"
    with torch.no_grad(), edited(model, loaded):
        again = logits()
    assert torch.allclose(again, changed, atol=1e-5), (
        f"{label}: the saved and loaded edit changes the logits by {(again - changed).abs().max():.3g}"
    )


def _packed(kind, edit, model, inputs) -> None:
    """edits.passes.edited_behaviour of every item in one call equals one call per item."""
    import torch

    from ..edits.passes import Variants, edited_behaviour

    n, (L, H) = min(4, len(inputs.items)), (model.info.n_layers, model.info.n_heads)
    mask = edit.mask(L, H)
    pos, neg = inputs.labels[:n, 0], inputs.labels[:n, 1]
    together = edited_behaviour(
        model, Variants(inputs.bank, edit, torch.arange(n), mask.expand(n, L, H)), pos, neg
    )
    alone = torch.cat(
        [
            edited_behaviour(
                model,
                Variants(inputs.bank, edit, torch.tensor([i]), mask[None]),
                pos[i : i + 1],
                neg[i : i + 1],
            )
            for i in range(n)
        ]
    )
    assert torch.allclose(together, alone, atol=1e-6), (
        f"{kind.kind}: packed passes differ from separate ones by {(together - alone).abs().max():.3g}"
    )


def check_site_mode(name: str, model, inputs) -> None:
    """Check the registered site mode `name` (edits.layers.modes) on `model` (a tiny ProbeModel) and
    `inputs` (edit_inputs): fitted at every layer's MLP output, it gives three finite vectors of the
    model's width; its edit keeps a vector's shape (and, where it replaces, gives every vector the same
    output) and leaves the logits finite; it saves and loads to the same edit. AssertionError naming
    the part that fails."""
    import torch

    from ..edits import edited
    from ..edits.layers.mlp import Recorded
    from ..edits.layers.modes import SITE_MODES

    mode, E = SITE_MODES[name], model.model.config.get_text_config().hidden_size
    fit, ids = Recorded(model.model, inputs).fit(name), _probe_ids(model)
    h = torch.randn(2, 3, E, generator=torch.Generator().manual_seed(0))
    for layer in range(model.info.n_layers):
        edit = _part(mode, "fit", lambda layer=layer: fit(inputs, layer, np.arange(4)))
        out = _part(mode, "erase", lambda edit=edit: edit.erase(h))
        assert out.shape == h.shape, f"{name}: erase gave {tuple(out.shape)} for vectors {tuple(h.shape)}"
        if mode.replaces:
            assert torch.allclose(out, out[:1, :1].expand_as(out)), f"{name}: replaces, but not by one vector"
        with torch.no_grad(), edited(model, edit):
            changed = model.model(input_ids=ids).logits
        assert torch.isfinite(changed).all(), (
            f"{name}: the edit of layer {layer} gave logits that are not finite"
        )
    _round_trip(mode, edit, model, changed, lambda: model.model(input_ids=ids).logits)


def _probe_ids(model):
    import torch

    return torch.tensor([model.tokenizer("The nurse said that the doctor left")["input_ids"]])
