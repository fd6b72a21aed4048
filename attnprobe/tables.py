"""Tables on disk: Parquet as the typed source of truth, CSV as a spreadsheet-safe export.

Every table a run or a report writes is written twice: `<name>.parquet` with the values as
computed (readers and the notebook API read this) and `<name>.csv` for spreadsheets.

A text cell (or header cell) that starts with `=`, `+`, `-`, `@`, a tab or a carriage return can be run as a
formula by Excel, LibreOffice or Google Sheets (CSV injection). Such cells get a leading
apostrophe, which spreadsheets show as text. Only text cells change: numbers (negative
log-probabilities, effects) are written as numbers.
"""

from __future__ import annotations

import pandas as pd

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
    from pathlib import Path

    directory = Path(directory)
    if (directory / f"{name}.parquet").is_file():
        return pd.read_parquet(directory / f"{name}.parquet")
    try:
        return pd.read_csv(directory / f"{name}.csv", keep_default_na=False, na_values=[""])
    except pd.errors.EmptyDataError:
        return pd.DataFrame()
