"""Files on disk: tables (Parquet as the typed source of truth, CSV as a spreadsheet-safe export),
atomic writes, chunks with their markers, and the run directory's lock. Knows no measure: the
run's storage (attnprobe.run.files.layout) names the files each phase writes.

Every table a run or a report writes is written twice: `<name>.parquet` with the values as
computed (readers and the notebook API read this) and `<name>.csv` for spreadsheets.

A text cell (or header cell) that starts with `=`, `+`, `-`, `@`, a tab or a carriage return can be run as a
formula by Excel, LibreOffice or Google Sheets (CSV injection). Such cells get a leading
apostrophe, which spreadsheets show as text. Only text cells change: numbers (negative
log-probabilities, effects) are written as numbers.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from .errors import RunError

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def neutralise(value):
    """'=cmd()' -> "'=cmd()"; anything that is not risky text is returned unchanged."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


def write_csv(table: pd.DataFrame, path) -> None:
    safe = table.copy()
    safe.columns = [neutralise(c) for c in safe.columns]  # a header cell is read as a formula too
    for column in safe.columns:
        if safe[column].dtype == object or pd.api.types.is_string_dtype(safe[column]):
            safe[column] = safe[column].map(neutralise)
    safe.to_csv(path, index=False)


def parquet_safe(table: pd.DataFrame) -> pd.DataFrame:
    """A column mixing text and numbers (a metadata column of a sentence file, say) is stored as
    text; every other column keeps its type."""
    out = table.copy()
    for column in out.columns:
        if out[column].dtype == object:
            kinds = {type(v) for v in out[column].dropna()}
            if len(kinds) > 1 or (kinds and not kinds <= {str}):
                out[column] = out[column].map(
                    lambda v: v if v is None or (isinstance(v, float) and v != v) else str(v)
                )
    return out


def write_parquet(table: pd.DataFrame, path) -> None:
    parquet_safe(table).to_parquet(path, index=False)


def read_table(directory, name: str) -> pd.DataFrame:
    """`<name>.parquet` when present (as computed), else `<name>.csv` written by an older version
    (only empty cells are missing; an empty file is an empty table)."""
    directory = Path(directory)
    if (directory / f"{name}.parquet").is_file():
        return pd.read_parquet(directory / f"{name}.parquet")
    try:
        return pd.read_csv(directory / f"{name}.csv", keep_default_na=False, na_values=[""])
    except pd.errors.EmptyDataError:
        return pd.DataFrame()


_WRITING: list[tuple[Path, object]] = []  # (run directory, which relative paths may be written there)


@contextmanager
def writing_into(directory: Path, allowed):
    """Within the block, every atomic_write under `directory` must satisfy `allowed(relative path)`
    and reach its file through no symbolic link (which would carry the write out of the run)."""
    _WRITING.append((Path(os.path.abspath(directory)), allowed))
    try:
        yield
    finally:
        _WRITING.pop()


def refuse_planted(path: Path, folder: bool = True) -> None:
    """One line where `path` is a symbolic link (a write through it would leave the run) or, where a
    folder is expected (`folder`), a file."""
    if path.is_symlink() or (folder and path.exists() and not path.is_dir()):
        kind = "a symbolic link" if path.is_symlink() else "not a directory"
        raise RunError(
            f"{path} is {kind}; attnprobe writes only inside the run directory: remove it or choose "
            "another --out"
        )


def own_directory(path: Path) -> Path:
    """`path` (chunks/, figures/ of a run) made as a real directory: a symbolic link or a file planted
    there would make the run write outside --out, so it is refused."""
    refuse_planted(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def refuse_links_on_the_way(root: Path, relative: Path, to_the_file: bool = False) -> None:
    """refuse_planted for every step from `root` down to `relative` (its file too with `to_the_file`:
    a copy writes through a link, a rename replaces it)."""
    for depth in range(1, len(relative.parts) + to_the_file):
        refuse_planted(root.joinpath(*relative.parts[:depth]), folder=False)


def check_inside(path: Path) -> None:
    """`path` refused, in one line, where a run being written declares no such file or a link on the
    way to it leads out of the run (the innermost run holding it decides: --also runs are nested)."""
    target = Path(os.path.abspath(path))
    holding = [(root, allowed) for root, allowed in _WRITING if target.is_relative_to(root)]
    if not holding:
        return
    outer = min(holding, key=lambda pair: len(pair[0].parts))[0]  # links: anywhere below the outermost
    refuse_links_on_the_way(outer, target.relative_to(outer))  # the file itself is replaced, not followed
    root, allowed = max(holding, key=lambda pair: len(pair[0].parts))
    relative = target.relative_to(root)
    if not allowed(relative.as_posix()):
        raise RunError(
            f"attnprobe bug: {relative.as_posix()} is not a declared file of the run {root} "
            "(attnprobe.run.files.inventory); please report it"
        )


def atomic_write(path: Path, write) -> None:
    """Write to a temporary sibling, then rename: a reader never sees a half-written file. A failed
    write (disk full, permissions) leaves what was there before and says how to go on. Inside a run
    being written (`writing_into`), only its declared files, and never through a link."""
    check_inside(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise RunError(
            f"cannot write {path}: {exc.strerror or exc}; results written so far are kept: "
            "free space or fix permissions, then rerun the same command to resume"
        ) from None


def write_table(directory: Path, name: str, table: pd.DataFrame, why: str | None = None) -> None:
    """`<name>.csv` (spreadsheet export), then `<name>.parquet` (the typed table readers use). A table
    with no columns is exported as one `note` saying why it is empty (`why`), so that every CSV has a
    header a spreadsheet or pandas reads."""
    shown = table
    if table.columns.empty:
        shown = pd.DataFrame({"note": [f"no rows: {why or 'this run has nothing for ' + name}"]})
    atomic_write(directory / f"{name}.csv", lambda p: write_csv(shown, p))
    atomic_write(directory / f"{name}.parquet", lambda p: write_parquet(table, p))


def digest(path: Path) -> str:
    """SHA-256 of a file, read in blocks."""
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def write_chunk(
    chunk_dir: Path, k: int, tables: dict, files, prefix: str = "", plan: str | None = None
) -> None:
    """Chunk k of a phase (`prefix`: its file prefix): a file per table (a pyarrow Table or a
    DataFrame) for each of `files` (the first names the row count), then the marker with the row
    count, the files' SHA-256 and the phase's plan."""
    for name in files:
        table = tables[name.removesuffix(".parquet")]
        write = (
            (lambda p, t=table: pq.write_table(t, p))
            if isinstance(table, pa.Table)
            else (lambda p, t=table: t.to_parquet(p, index=False))
        )
        atomic_write(chunk_dir / f"{prefix}{k:05d}.{name}", write)
    rows = len(tables[files[0].removesuffix(".parquet")])
    # the marker comes last: a chunk without it is recomputed on resume
    sha = {name: digest(chunk_dir / f"{prefix}{k:05d}.{name}") for name in files}
    marker = {"rows": rows, "sha256": sha}
    if plan is not None:
        marker["plan"] = plan
    atomic_write(chunk_dir / f"{prefix}{k:05d}.done", lambda p: p.write_text(json.dumps(marker)))


def complete_chunks(
    chunk_dir: Path, n_chunks: int, log, files, prefix: str = "", plan: str | None = None
) -> set[int]:
    """Chunks with a marker whose files are byte for byte what was written (SHA-256 in the marker)
    and were made for this plan (phases that have one); a damaged or foreign chunk loses its marker
    and is redone."""
    done = set()
    for k in range(n_chunks):
        marker = chunk_dir / f"{prefix}{k:05d}.done"
        if not marker.is_file():
            continue
        try:
            info = json.loads(marker.read_text())
            if plan is not None and info.get("plan") != plan:
                raise ValueError("made for another plan of items")
            paths = {name: chunk_dir / f"{prefix}{k:05d}.{name}" for name in files}
            for name, path in paths.items():
                if digest(path) != info["sha256"].get(name):
                    raise ValueError(f"{path.name} differs from what was written")
            if pq.read_metadata(paths[files[0]]).num_rows != info["rows"]:
                raise ValueError(f"expected {info['rows']} rows")
        except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as exc:
            log(f"chunk {prefix}{k} in {chunk_dir} is damaged or stale ({exc}); recomputing it")
            marker.unlink()
            continue
        done.add(k)
    return done


def read_chunks(directory: Path, n_chunks: int, files, prefix: str) -> dict[str, pd.DataFrame]:
    """The tables of a phase's chunks, joined: name -> DataFrame."""
    chunk_dir = directory / "chunks"
    out = {}
    for name in files:
        parts = [pd.read_parquet(chunk_dir / f"{prefix}{k:05d}.{name}") for k in range(n_chunks)]
        out[name.removesuffix(".parquet")] = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    return out


@contextmanager
def exclusive(directory: Path):
    """Hold an exclusive lock on the run directory (released by the OS even if we are killed)."""
    refuse_planted(directory / ".lock", folder=False)  # opening a link would create or touch its target
    try:
        handle = open(directory / ".lock", "a+")
    except OSError as exc:
        raise RunError(
            f"cannot lock {directory / '.lock'} ({exc.strerror}); make the directory writable or choose "
            "another --out"
        ) from None
    busy = (
        f"another attnprobe command (a run, an edit or a compare) is using {directory}; wait for it "
        "to finish or choose --out"
    )
    with _locked(handle, fcntl.LOCK_EX, busy):
        yield


@contextmanager
def shared(directory: Path):
    """Hold a shared lock on a run directory while reading several of its files, so that no run or
    edit (which hold it exclusively) rewrites the directory in between: a manifest of one model beside
    tables of another. One line if one is writing now. A directory that cannot hold a lock file
    (read-only, or a planted link) is read without one: no attnprobe command can write it either."""
    lock = directory / ".lock"
    try:
        handle = None if lock.is_symlink() else open(lock, "a+")
    except OSError:
        handle = None
    if handle is None:
        yield
        return
    busy = (
        f"{directory} is being written by another attnprobe command (a run or an edit); wait for it "
        "to finish and read it again"
    )
    with _locked(handle, fcntl.LOCK_SH, busy):
        yield


@contextmanager
def _locked(handle, mode: int, busy: str):
    """`handle` locked in `mode` (exclusive or shared) within the block, or `busy` as one line."""
    try:
        fcntl.flock(handle, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise RunError(busy) from None
    try:
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()
