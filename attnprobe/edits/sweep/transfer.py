"""`attnprobe edit RUN_DIR --also SUITE`: each edit the sweep chose on its own suite (heads chosen and
parameters fitted on all its items: edits/KIND-kK) applied to other suites, and the change of
their measures, paired item by item (stats.compare).

Per --also suite: one run of the original model and one per edit (under RUN_DIR/also/<suite>/, each
resumable like any run), the measures with a paired comparison only (head effects and direct
attribution, which measure the model rather than its bias, are left out); then `compare` of each
edited run against the original. edits_transfer.csv holds, per suite, edit kind and k, every row of
the comparison over all items (scope "all") except the per-head attention rows: e.g. for the
coreference suite the pro - anti gap of the model's referent choice before, after and its paired
change with CI. Each row names its runs (a: the original, b: the edit) and the change's direction,
the share of a's value the edit removed (Fieller CI), McNemar's test for 0/1 outcomes and the sign
test for the others, and p adjusted by Holm over every row of the table (every suite and edit).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ...errors import AttnprobeError, RunError
from ...measures import MEASURES, Measure, batch_kinds, paired
from ...run import RunOptions, run_suite
from ...run.files.manifest import Manifest
from ...run.files.reader import RunFiles
from ...stats.inference import holm
from ...store import own_directory
from ...suite import load_suite
from ..saved import load_edit

ALSO_K = (1, 5)  # the numbers of heads whose edits are transferred, where the sweep measured them


def transfer_suites(paths: tuple[str, ...], also_ks=ALSO_K, ks=None) -> list:
    """The --also suites, loaded and checked before the sweep starts: each given once, with a name of
    its own (its runs go under RUN_DIR/also/NAME/), and each must compare two labels (its analysis'
    positive and negative, the contrast a bias is measured on) or ask multiple-choice questions
    (BBQ's shape: the biased answers are its measure). `also_ks` must name edits the sweep measures
    (`ks`, None where the heads are listed)."""
    if paths and (any(k < 1 for k in also_ks) or (ks is not None and not set(also_ks) & set(ks))):
        raise RunError(
            f"--also-k {','.join(map(str, also_ks))}: the edits --also applies are those of the sweep's "
            f"numbers of heads (--k {','.join(map(str, ks or ()))}); give some of those"
        )
    suites, seen = [], {}
    for path in paths:
        suite = load_suite(path)
        same = seen.get(suite.name)
        if same is not None:
            twice = Path(same).resolve() == Path(path).resolve()
            which = f"--also {path} is given twice" if twice else f"--also {same} and --also {path} are both"
            raise RunError(
                f"{which} (suite '{suite.name}'); each --also suite runs under RUN_DIR/also/{suite.name}/: "
                "give each suite once, with a name of its own"
            )
        seen[suite.name] = path
        contrast = suite.analysis.positive and suite.analysis.negative
        if not (contrast or suite.measures.get("multiple_choice")):
            raise RunError(
                f"--also {path}: the suite compares no two labels and asks no multiple-choice question, so "
                "it has no bias to measure an edit on; declare `analysis: {contrast: ..., positive: ..., "
                "negative: ...}`"
            )
        suites.append(suite)
    return suites


def compared_only() -> tuple[str, ...]:
    """The measures a transfer run leaves out: those with phases of their own and no paired comparison."""
    return tuple(
        name
        for name, kind in MEASURES.items()
        if kind not in batch_kinds() and type(kind).paired is Measure.paired
    )


def _made_with(out: Path, saved) -> bool:
    """Whether the run in `out` (if any) was made with this very edit, and so may be continued: a
    re-sweep with other heads saves a different edit under the same name, whose run starts over."""
    try:
        return Manifest.read(out / "manifest.json").settings.get("edits") == [saved.key]
    except (AttnprobeError, AttributeError):
        return True  # no run there yet (a damaged one: the run itself says so)


def transfer(directory: Path, suites: list, chosen: list[tuple[str, int]], model, log) -> pd.DataFrame:
    """Run each suite with and without each chosen edit and compare; `chosen`: (kind, k) of the
    edits the sweep saved as edits/KIND-kK, k 0 for one without heads (edits/KIND: the stream's)."""
    rows = []
    for suite in suites:
        base = own_directory(own_directory(directory / "also") / suite.name)  # never a link out of the run
        options = dict(skip=compared_only(), progress=False, log=log)
        log(f"edit --also {suite.name}: the original model")
        original = run_suite(suite, model, RunOptions(out=own_directory(base / "original"), **options))
        for kind, k in chosen:
            path = directory / "edits" / (f"{kind}-k{k}.json" if k else f"{kind}.json")
            if not path.is_file():
                continue
            saved = load_edit(path)
            log(f"edit --also {suite.name}: {saved.name}")
            out = own_directory(base / saved.name)
            edited = run_suite(
                suite, model, RunOptions(out=out, edits=(saved,), resume=_made_with(out, saved), **options)
            )
            for name, table in paired(RunFiles(original), RunFiles(edited)).items():
                if "head" in table:  # per-head rows: in the comparison's own files, not here
                    continue
                about = dict(suite=suite.name, kind=kind, k=k, heads=saved.manifest()["heads"], table=name)
                rows.append(table[table["scope"] == "all"].assign(**about, a="original", b=saved.name))
    if not rows:
        return pd.DataFrame()
    out = pd.concat(rows, ignore_index=True).assign(direction="change = b - a, per item")
    out["change_p_holm"] = holm(out["change_p"].to_numpy())  # over every row of the table: every suite, edit
    first = ["suite", "kind", "k", "heads", "table", "a", "b", "direction"]
    return out[first + [c for c in out.columns if c not in first]]
