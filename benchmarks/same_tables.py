"""Whether two run directories hold the same tables: every Parquet table of a run, its statistics
and its edit sweep, compared cell for cell (wall-time columns and paths aside). Used to check that
a restructure changes no number: the same commands run with the code before and after.

    python benchmarks/same_tables.py RUN_BEFORE RUN_AFTER

Prints one line per table (identical, or the columns that differ and by how much) and exits 1 if
any differ or exist on one side only.
"""

import sys
from pathlib import Path

import numpy as np
import pandas as pd

IGNORED = {"seconds", "elapsed_s", "started", "finished"}  # wall time, not results


def compare(a: Path, b: Path) -> list[str]:
    names = sorted(
        {p.relative_to(a) for p in a.rglob("*.parquet")} | {p.relative_to(b) for p in b.rglob("*.parquet")}
    )
    names = [n for n in names if n.parts[0] != "chunks"]  # the joined tables say the same
    lines = []
    for name in names:
        if not (a / name).is_file() or not (b / name).is_file():
            lines.append(f"{name}: only in {'the first' if (a / name).is_file() else 'the second'}")
            continue
        x, y = (pd.read_parquet(d / name) for d in (a, b))
        x, y = (t.drop(columns=[c for c in t.columns if c in IGNORED]) for t in (x, y))
        if list(x.columns) != list(y.columns) or len(x) != len(y):
            lines.append(f"{name}: columns or rows differ ({x.shape} against {y.shape})")
            continue
        differ = []
        for column in x.columns:
            u, v = x[column], y[column]
            if pd.api.types.is_numeric_dtype(u) and pd.api.types.is_numeric_dtype(v):
                gap = np.nanmax(np.abs(u.to_numpy(float) - v.to_numpy(float)), initial=0.0)
                same_nan = (u.isna() == v.isna()).all()
                if gap > 0 or not same_nan:
                    differ.append(f"{column} (max |diff| {gap:.3g})")
            elif not u.astype(str).equals(v.astype(str)):
                differ.append(column)
        lines.append(f"{name}: " + ("identical" if not differ else "differs in " + ", ".join(differ)))
    return lines


if __name__ == "__main__":
    found = compare(Path(sys.argv[1]), Path(sys.argv[2]))
    print("\n".join(found))
    sys.exit(0 if all(line.endswith("identical") for line in found) else 1)
