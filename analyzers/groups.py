"""Grouping keys and percentile helpers shared by the analyzers.

Results can be split by tenant, SLO class, serving instance or arrival time
window. A request, and every token of it, belongs to one group: the window its
*arrival* falls into (windows are ``[start + k * window, start + (k+1) * window)``
on the reference clock, ``start`` = the run's first arrival).
"""

from __future__ import annotations

import math

import numpy as np

from tokentrace.schema import col

__all__ = ["GROUP_BY", "WINDOW_START", "ALL", "group_column", "group_sql", "pct_name", "PERCENTILES",
           "percentile_or_nan"]

GROUP_BY: dict[str, str] = {"tenant": col.TENANT, "slo_class": col.SLO_CLASS, "instance": col.INSTANCE_ID}
"""Accepted ``by=`` values and the result column each one produces."""

WINDOW_START = "window_start_s"
"""Group column for time windows: window start, seconds since the run's first arrival."""

ALL = "*"
"""Label of the row that aggregates every group (e.g. every SLO class)."""

PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0, 99.9)


def pct_name(p: float, unit: str = "ms") -> str:
    """Result column name of percentile ``p``: ``p99_ms``, ``p99.9_ms``."""
    return f"p{p:g}_{unit}"


def check_window_s(window_s: float | None) -> None:
    """``ValueError`` unless ``window_s`` is None or a positive, finite number of seconds (a time window)."""
    if window_s is not None and not (isinstance(window_s, (int, float)) and not isinstance(window_s, bool)
                                     and math.isfinite(window_s) and window_s > 0):
        raise ValueError(f"window_s must be a positive number of seconds, got {window_s!r}")


def group_column(by: str | None, window_s: float | None) -> str | None:
    """The result column a grouping produces, or None for no grouping. ``ValueError`` on bad input."""
    if by is not None and window_s is not None:
        raise ValueError("group either by a key (by=...) or by time window (window_s=...), not both")
    if window_s is not None:
        check_window_s(window_s)
        return WINDOW_START
    if by is None:
        return None
    if by not in GROUP_BY:
        raise ValueError(f"unknown grouping {by!r}; use one of: {', '.join(GROUP_BY)}")
    return GROUP_BY[by]


def group_sql(by: str | None, window_s: float | None, *, alias: str, start_ns: int | None) -> str:
    """SQL expression over request-facts alias ``alias`` giving the group key (constant 0 if none)."""
    name = group_column(by, window_s)
    if name is None:
        return "0"
    if name == WINDOW_START:
        w = int(round(window_s * 1e9))  # type: ignore[operator]
        return f"(FLOOR(({alias}.{col.ARRIVAL_NS} - {int(start_ns or 0)}) / {w}) * {float(window_s)})"
    return f"{alias}.{name}"


def percentile_or_nan(v: np.ndarray, p: float) -> float:
    """Linear-interpolated percentile (numpy's default, as DuckDB's quantile_cont); NaN if empty."""
    return float(np.percentile(v, p)) if v.size else float("nan")
