"""Starting over in a run directory, and the directories a run writes into: `--fresh` deletes only
the files attnprobe declares (run.files.inventory), and chunks/ or figures/ planted as a link or a file
are refused. A run keeps a copy of
its suite and data files (suite/, `copy_suite`), which `attnprobe edit` reopens wherever the run
directory has moved."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ...errors import RunError
from ...store import atomic_write, own_directory, refuse_links_on_the_way
from .inventory import is_declared
from .manifest import Manifest


def prepare_directory(
    directory: Path, expected: str, resume: bool, suite_name: str, log=print, settings: dict | None = None
) -> Manifest | None:
    """Make `directory` ready for a run with this fingerprint; return the manifest to continue (the
    same fingerprint and `resume`), else None. Starting over (--fresh) replaces only a run of the
    same suite, and deletes only what attnprobe writes, where manifest.json is an attnprobe manifest.
    `settings`: the new run's, to name what differs from the run there when resuming is refused."""
    path = directory / "manifest.json"
    if not path.is_file():
        return None
    previous = Manifest.read(path, check=resume)  # --fresh may replace a run of another format
    if resume and previous.fingerprint == expected:
        return previous
    if resume:
        raise RunError(
            f"{directory} holds a run with other settings ({_differences(previous.settings, settings)}); "
            "rerun with --fresh to replace it, or choose --out"
        )
    other = previous.suite.name
    if other != suite_name:
        raise RunError(
            f"{directory} holds a run of suite '{other}', not '{suite_name}'; --fresh replaces only a run "
            "of the same suite: choose another --out (nothing was deleted)"
        )
    kept = remove_run(directory)
    if kept:
        log(f"--fresh kept {len(kept)} files attnprobe did not write in {directory}: {', '.join(kept[:5])}")
    return None


def _differences(there: dict, here: dict | None) -> str:
    """The settings that differ, e.g. "batch_size 512 there, 256 here (to continue it: --batch-size
    512)", or the list of what may where the new run's are not given or none differs."""
    may = "suite, model, dtype, batch or chunk size, limit, tokenisation, saved edits"
    if not here:
        return may
    keys = sorted(k for k in set(there) | set(here) if here.get(k) != there.get(k))
    keys = [k for k in keys if k != "plan_sha256"] or keys  # the plan's hash follows what it is made of
    if not keys:
        return may
    said = ", ".join(_difference(k, there.get(k), here.get(k)) for k in keys[:4])
    if keys == ["batch_size"]:  # a run started on another kind of device: its batch can be given
        said += f" (to continue it: --batch-size {there['batch_size']})"
    return said


def _difference(key: str, there, here) -> str:
    """One differing setting, with both values where they are short (not a hash or a list of them)."""
    if len(str(there)) > 40 or len(str(here)) > 40:
        return f"{key} differ" if key.endswith("s") else f"{key} differs"
    return f"{key} {there} there, {here} here"


SUITE_COPY = "suite"  # RUN/suite/: the suite file and its data files as the run read them
COPY_LIST = "files.json"  # in it: what attnprobe copied there (the only files --fresh removes there)


def copy_suite(directory: Path, suite) -> str:
    """Copy the suite file and every data file it read into RUN/suite/, each at its place relative to
    the folder holding them all (a data file `../data/x.tsv` stays at ../data from the copied suite,
    readable with RUN/suite as the data root); returns the copied suite's path within the run."""
    target = own_directory(directory / SUITE_COPY)
    files = [Path(suite.path).resolve(), *(Path(f) for f in suite.data_files)]
    if files[0].is_relative_to(target.resolve()):  # run from its own copy: it stays as it is
        return f"{SUITE_COPY}/{files[0].relative_to(target.resolve())}"
    _remove_copy(target)
    base = Path(os.path.commonpath([f.parent for f in files]))
    written = []
    for source in dict.fromkeys(files):
        relative = source.relative_to(base)
        dest = target / relative
        refuse_links_on_the_way(target, relative, to_the_file=True)  # a copy writes through a link
        own_directory(dest.parent)
        shutil.copyfile(source, dest)
        written.append(str(relative))
    listed = json.dumps(written, indent=1) + "\n"
    atomic_write(target / COPY_LIST, lambda p: p.write_text(listed))  # replaces a planted link, never follows
    return f"{SUITE_COPY}/{written[0]}"


def _remove_copy(target: Path) -> None:
    """The files an earlier copy_suite listed in `target`, removed (and folders left empty)."""
    try:
        listed = json.loads((target / COPY_LIST).read_text())
    except (OSError, ValueError):
        return
    for relative in listed if isinstance(listed, list) else []:
        path = (target / str(relative)).resolve()
        if path.is_relative_to(target.resolve()) and path.is_file() and not (target / relative).is_symlink():
            path.unlink()
            for folder in path.parents:
                if folder == target.resolve() or any(folder.iterdir()):
                    break
                folder.rmdir()
    (target / COPY_LIST).unlink()


def remove_run(directory: Path) -> list[str]:
    """Delete every file attnprobe declares for a run directory (run.files.inventory: the run's, the
    report's, every `attnprobe edit` table and saved edit, the runs of `--also`), and the folders left
    empty; return what was kept (anything else, relative to the directory). The suite's copy stays
    until the new run copies its own over it (it may be what the new run is reading), the lock while
    it is held."""
    kept, emptied = [], []
    for folder, subfolders, names in os.walk(directory):  # links are not followed
        here = Path(folder)
        relative = here.relative_to(directory)
        if relative.parts[:1] == (SUITE_COPY,):
            subfolders.clear()
            continue
        for name in sorted(names) + sorted(s for s in subfolders if (here / s).is_symlink()):
            path = (relative / name).as_posix()
            if is_declared(path) and path != ".lock":
                (here / name).unlink()
            elif path != ".lock":
                kept.append(path)
        emptied.append(here)
    for folder in reversed(emptied[1:]):  # deepest first
        if not any(folder.iterdir()):
            folder.rmdir()
    return kept
