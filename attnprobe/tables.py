"""CSV output that is safe to open in a spreadsheet.

A text cell that starts with `=`, `+`, `-`, `@`, a tab or a carriage return can be run as a
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
    for column in safe.columns:
        if safe[column].dtype == object or pd.api.types.is_string_dtype(safe[column]):
            safe[column] = safe[column].map(neutralise)
    safe.to_csv(path, index=False)
