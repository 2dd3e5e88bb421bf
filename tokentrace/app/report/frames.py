"""Result tables as text cells: one formatting rule for the Markdown and HTML reports.

Analyzer result columns carry their unit in their name (``*_ms``, ``*_s``,
``*_rps``) or are shares in 0..1 (``*share``, ``*attainment``, ...), which are
shown as percentages: the same rule as their headers
(:func:`tokentrace.app.report.render_names.is_percent_column`). Pure functions; no I/O.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from tokentrace.app.report.render_names import is_percent_column

__all__ = ["as_float", "format_cell", "frame_cells"]


def as_float(value: Any) -> float:
    """``value`` as a float; NaN for what is not a number (None, text, a missing cell)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def format_cell(value: Any, column: str = "") -> str:
    """One value as short text: ``-`` for missing, ``31.2%`` for shares, ``1,234`` for counts; never in
    scientific notation."""
    if value is None or value is pd.NA or value is pd.NaT:
        return "-"
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (int, np.integer)):
        return f"{int(value):,}" if abs(int(value)) < 10**12 else str(int(value))
    if isinstance(value, (float, np.floating)):
        v = float(value)
        if math.isnan(v):
            return "-"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        if is_percent_column(column):
            return f"{v * 100:+.1f}%" if column == "rel_change" else f"{v * 100:.1f}%"
        if abs(v) >= 100:
            return f"{v:,.1f}"
        if abs(v) >= 1:
            return f"{v:.2f}"
        if v == 0:
            return "0"
        # three significant digits, never scientific notation (-3.97e-05 reads as -0.000040)
        return f"{v:.{min(6, max(3, 2 - math.floor(math.log10(abs(v)))))}f}"
    return str(value)


def frame_cells(df: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    """(headers, rows of cells) of ``df``, every value formatted by :func:`format_cell`."""
    headers = [str(c) for c in df.columns]
    rows = [[format_cell(v, h) for v, h in zip(row, headers)] for row in df.itertuples(index=False, name=None)]
    return headers, rows
