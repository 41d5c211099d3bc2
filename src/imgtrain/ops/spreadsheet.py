"""Cells of the CSV files imgtrain writes for people (``predict``'s table, ``dedupe.csv``):
a spreadsheet runs a cell that starts with one of FORMULA_STARTS as a formula
(``=HYPERLINK(...)``), and class names and file names come from users' folders. OWASP's
CSV-injection advice: a leading ``'`` makes it text. For CSV only: Parquet and JSON keep the
exact value."""

from __future__ import annotations

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def safe_cell(value):
    """``value``, with a leading ``'`` where it is text a spreadsheet would run."""
    return "'" + value if isinstance(value, str) and value.startswith(FORMULA_STARTS) else value


def safe_row(values) -> list:
    return [safe_cell(v) for v in values]
