"""attnprobe: attention extraction, from-scratch verification and bias probing for causal LMs.

The public names below load on first use (PEP 562), so that `attnprobe --help` and `import
attnprobe` start at once: the first `ap.NAME` imports torch and transformers, registers attnprobe's
attention function with transformers' `AttentionInterface` and the model methods (`pm.capture`,
`pm.edited`, ...), and binds every public name.
"""

from .version import __version__ as __version__

# public name -> the module that defines it
_WHERE = {
    "EditOptions": "edits",
    "edited": "edits",
    "load_edit": "edits",
    **dict.fromkeys(
        (
            "AnalysisError",
            "AttnprobeError",
            "CaptureError",
            "ModelSpecError",
            "RunError",
            "RunInterrupted",
            "SuiteError",
            "UnsupportedFamily",
        ),
        "errors",
    ),
    "Captured": "attention.capture",
    "encode": "attention.capture",
    "run_with_capture": "attention.capture",
    "HeadSet": "heads",
    "DEFAULT_MODEL": "model",
    "ModelInfo": "model",
    "ProbeModel": "model",
    "load_model": "model",
    "probe": "notebook.adhoc",
    "span_tokens": "notebook.adhoc",
    "str_tokens": "notebook.adhoc",
    "Run": "notebook.api",
    "merge_shards": "notebook.api",
    "run_suite": "notebook.api",
    "linear_readout": "notebook.linear_readout",
    "attention_view": "notebook.views",
    "head_view": "notebook.views",
    "model_view": "notebook.views",
    "compare_runs": "report.comparison",
    "Suite": "suite",
    "load_suite": "suite",
    "verify": "verify",
}
_MODULES = ("capture", "edits")  # subpackages that are public names themselves (ap.edits.Zero)

__all__ = sorted([*_WHERE, *_MODULES, "__version__"])


def _load() -> None:
    """Import the public names into the package and register what they need, once."""
    from importlib import import_module

    model = import_module(".model", __name__)
    capture = import_module(".attention.capture", __name__)  # registers the attention function

    names = {name: getattr(import_module(f".{where}", __name__), name) for name, where in _WHERE.items()}
    globals().update(names, capture=capture, edits=import_module(".edits", __name__))
    model.register(  # pm.capture(texts), pm.edited(edit), pm.probe(sentences), pm.verify(), ...
        capture=capture.capture_texts,
        edited=names["edited"],
        probe=names["probe"],
        str_tokens=names["str_tokens"],
        span_tokens=names["span_tokens"],
        verify=names["verify"],
        head_view=names["head_view"],
        model_view=names["model_view"],
    )


def __getattr__(name: str):
    if name in _WHERE or name in _MODULES:
        _load()
        return globals()[name]
    from importlib import import_module
    from importlib.util import find_spec

    if not name.startswith("_") and find_spec(f"{__name__}.{name}") is not None:  # ap.model, ap.stats
        return import_module(f".{name}", __name__)
    raise AttributeError(f"module 'attnprobe' has no attribute '{name}'")


def __dir__():
    return sorted({*globals(), *__all__})
