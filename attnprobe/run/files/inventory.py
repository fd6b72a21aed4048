"""Every file a command writes into a run directory, declared once: its name (a table's stem, a file,
or a pattern inside a folder), its format and the command that writes it.

`store.atomic_write` refuses, while a command writes into a run (`writing_into`), any file that is
not declared here or that a link would carry out of the run; `--fresh` removes exactly the declared
files (fresh.remove_run). A measure declares its own files on its class (ARTEFACTS, CHUNKS, TABLES:
attnprobe.measures); what the run itself, the report and `attnprobe edit` write is listed below, and
`edit --also`'s runs (also/SUITE/EDIT/) are runs of their own, declared as any run.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ... import store
from ...errors import RegistryError
from ...measures import MEASURES
from .layout import TABLES_KEY

TABLE, PARQUET, JSON, HTML, FIGURE, SAVED_EDIT, CHUNK, COPY = (
    "table (.csv and .parquet)",
    "parquet",
    "json",
    "html",
    "figure (.png and .svg)",
    "saved edit (.json and .safetensors)",
    "chunk",
    "copy",
)


@dataclass(frozen=True)
class Declared:
    """One file (or family of files) of a run directory. `pattern` matches the path relative to the
    run directory (with `/`); `writer` is the command that writes it."""

    pattern: str
    form: str
    writer: str
    what: str

    def matches(self, relative: str) -> bool:
        return re.fullmatch(self.pattern, relative) is not None


def _table(name: str, writer: str, what: str) -> Declared:
    return Declared(rf"{re.escape(name)}\.(csv|parquet)", TABLE, writer, what)


def _file(name: str, form: str, writer: str, what: str) -> Declared:
    return Declared(re.escape(name), form, writer, what)


# what `attnprobe edit` writes beside the run (its options in `writer`)
EDIT_TABLES = {
    "edits": "edit",
    "edits_draws": "edit",
    "edits_items": "edit",
    "edits_quarters": "edit",
    "edits_heads": "edit",
    "edits_goal": "edit",
    "edits_placebo": "edit --placebo",
    "edits_stream": "edit --stream",
    "edits_mlp": "edit --mlp",
    "edits_transfer": "edit --also",
    "tracing": "edit --trace",
    "paths": "edit --paths",
    "paths_parts": "edit --paths",
    "paths_edges": "edit --paths",
    "paths_circuit": "edit --paths",
    "readout": "edit --paths",
    "circuits": "edit --circuits",
    "circuit_parts": "edit --circuits",
    "circuit_agreement": "edit --circuits",
}
EDIT_VALUES = {  # the raw values the tables above are computed from (Parquet only)
    "tracing_items": "edit --trace",
    "paths_items": "edit --paths",
    "paths_screen": "edit --paths",
    "paths_edges_items": "edit --paths",
    "paths_circuit_items": "edit --paths",
    "readout_states": "edit --paths",
    "circuit_runs": "edit --circuits",
    "circuit_attribution": "edit --circuits",
    "circuit_edges": "edit --circuits",
}
SAVED_EDIT_NAME = r"[a-z][a-z0-9_-]*"  # KIND, KIND-kK, mlp-MODE-slot, each with -qF for a quarter's fit


def _run_files() -> list[Declared]:
    chunk_prefixes = "|".join(re.escape(prefix) for prefix in _chunk_prefixes() if prefix)
    return [
        _table("prompts", "run", "one row per prompt: ids, text, slots, metadata, spans"),
        _file("manifest.json", JSON, "run", "suite hash, model, weights hash, versions, settings, times"),
        _file(".lock", "lock", "run, edit, merge", "the directory's lock (held while a command writes)"),
        Declared(
            rf"chunks/(({chunk_prefixes}|edits-[\w.-]+-)?\d{{5}}\.(done|[a-z_]+\.parquet)"
            r"|edits-[0-9a-f]{16}-[a-z]+\.(parquet|done))",
            CHUNK,
            "run, edit",
            "finished chunks and their .done markers (edits-PART-: `edit`'s resumable parts)",
        ),
        Declared(r"suite/.+", COPY, "run", "the suite file and its data files as the run read them"),
    ]


def _measure_files() -> list[Declared]:
    """Each registered measure's files (its ARTEFACTS, written by the run) and statistics tables
    (TABLES, written by the report)."""
    own = [
        Declared(re.escape(name), PARQUET if name.endswith(".parquet") else "file", "run", kind.NAME)
        for kind in MEASURES.values()
        for name in kind.ARTEFACTS
    ]
    stats = [
        _table(name, "report", f"{kind.NAME} statistics")
        for kind in MEASURES.values()
        for name in kind.TABLES
    ]
    return own + stats


def _report_files() -> list[Declared]:
    return [
        _table("held_out", "report", "held-out checks of the head rankings"),
        _file("behavior_by_occupation.csv", "csv", "report", "behavior_by_unit under its first name"),
        _file(TABLES_KEY, JSON, "report", "which statistics version the cached tables were made with"),
        _file("summary.json", JSON, "report", "the key findings the report shows"),
        _file("report.html", HTML, "report", "the self-contained page"),
        Declared(r"figures/[\w-]+\.(png|svg)", FIGURE, "report", "the report's figures"),
    ]


def _edit_files() -> list[Declared]:
    tables = [_table(name, writer, "an edit table") for name, writer in EDIT_TABLES.items()]
    values = [_file(f"{name}.parquet", PARQUET, writer, "raw values") for name, writer in EDIT_VALUES.items()]
    saved = [
        Declared(rf"edits/{SAVED_EDIT_NAME}\.(json|safetensors)", SAVED_EDIT, "edit", "the chosen edits"),
        Declared(
            rf"edits/quarters/{SAVED_EDIT_NAME}-q\d\.(json|safetensors)",
            SAVED_EDIT,
            "edit",
            "each quarter's edit, fitted on the other quarters",
        ),
    ]
    return tables + values + saved


def _chunk_prefixes() -> set[str]:
    """Each phase's chunk file prefix (the prompts' chunks have none)."""
    return {prefix for kind in MEASURES.values() for prefix in kind.CHUNKS}


def declared() -> tuple[Declared, ...]:
    """Every file a run directory may hold, with the command that writes it. A measure (a plug-in)
    whose file is one the run, the report or `attnprobe edit` writes is refused (RegistryError)."""
    return _declared(tuple(MEASURES))  # made once per set of registered measures


@cache
def _declared(measures: tuple[str, ...]) -> tuple[Declared, ...]:
    own = (*_run_files(), *_report_files(), *_edit_files())
    for kind in MEASURES.values():
        for name in (*kind.ARTEFACTS, *(f"{table}.csv" for table in kind.TABLES)):
            taken = next((d for d in own if d.matches(name)), None)
            if taken is not None:
                raise RegistryError(
                    f"the measure {kind.NAME} ({type(kind).__module__}) writes {name}, which `attnprobe "
                    f"{taken.writer}` writes ({taken.what}); rename that measure's table or file"
                )
    return (*own, *_measure_files())


ALSO = re.compile(r"also/[^/]+/[^/]+/(?P<inner>.+)")  # edit --also: RUN/also/SUITE/EDIT/ is a run of its own


def is_declared(relative: str) -> bool:
    """Whether `relative` (a path inside a run directory, with `/`) is a file attnprobe writes there."""
    nested = ALSO.fullmatch(relative)
    if nested:
        return is_declared(nested["inner"])
    name = relative.rsplit("/", 1)[-1]
    if name.startswith(".") and name.endswith(".tmp"):  # atomic_write's temporary sibling
        relative = relative[: -len(name)] + name[1:-4]
    return any(d.matches(relative) for d in declared())


@contextmanager
def run_writes(directory: Path, lock: bool = True, page: Path | None = None):
    """Within the block, every atomic write into `directory` must be a declared file reached without a
    link (store.atomic_write refuses any other in one line); with `lock`, the directory is held
    exclusively (store.exclusive) meanwhile. `page`: a report the user asked for by name (`--out`),
    allowed with its figures folder wherever it lies."""
    root = Path(directory).absolute()
    chosen = Path(page).absolute() if page else None

    def allowed(relative: str) -> bool:
        if chosen is not None and chosen.is_relative_to(root):
            mine = chosen.relative_to(root).with_suffix("").as_posix()
            if relative == chosen.relative_to(root).as_posix() or relative.startswith(f"{mine}_figures/"):
                return True
        return is_declared(relative)

    _refuse_links(root)
    with store.exclusive(directory) if lock else nullcontext(), store.writing_into(directory, allowed):
        yield


FOLDERS = ("chunks", "figures", "edits", "edits/quarters", "also", "suite")  # the folders commands write


def _refuse_links(root: Path) -> None:
    """A folder a command writes into, planted as a link (or a file), refused before any work: the
    command would write outside the run, or fail at its end with the work lost."""
    for folder in FOLDERS:
        path = root / folder
        below = [Path(at) / name for at, names, _ in os.walk(path) for name in names] if path.is_dir() else []
        for planted in [path, *below]:  # os.walk lists a linked folder but does not enter it
            store.refuse_planted(planted)
