"""SLO targets drawn on latency charts: a dashed line per SLO class at its TTFT or TPOT target.

The targets are the ones the SLO analyzer judged the run by (``slo()``: per class
``ttft_target_ms`` and ``tpot_target_ms``). TTFT charts get the TTFT targets, ITL and
TPOT charts the TPOT targets (a token later than the TPOT target misses the pace the
class was promised). A target far above the data (a 30 s batch target over 50 ms
latencies) is named in a note instead of drawn, so the data keeps the chart's height.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from tokentrace.schema import col

__all__ = ["slo_targets", "add_slo_lines", "TARGET_COLUMN", "OFF_SCALE"]

_ALL = "*"  # the analyzers' every-class row
TARGET_COLUMN: dict[str, str] = {"ttft": "ttft_target_ms", "itl": "tpot_target_ms", "tpot": "tpot_target_ms"}
"""Latency metric -> the SLO analyzer's target column it is judged against."""
OFF_SCALE = 2.0  # a target above this many times the chart's largest value is named, not drawn
_LINE = dict(color="#8a1c14", width=1.5, dash="dash")


def slo_targets(slo: pd.DataFrame | None) -> dict[str, dict[str, float]]:
    """SLO class -> {target column: ms} from the SLO analyzer's result (the every-class row left out)."""
    if slo is None or len(slo) == 0:
        return {}
    out: dict[str, dict[str, float]] = {}
    for _, row in slo.iterrows():
        name = str(row[col.SLO_CLASS])
        if name == _ALL:
            continue
        values = {c: float(row[c]) for c in set(TARGET_COLUMN.values()) if c in row and pd.notna(row[c])}
        if values:
            out[name or "no class"] = values
    return out


def _data_max(fig: go.Figure, axis: str) -> float:
    best = -math.inf
    for trace in fig.data:
        values = getattr(trace, axis, None)
        if values is None:
            continue
        arr = pd.to_numeric(pd.Series(list(values)), errors="coerce").to_numpy(float)
        arr = arr[np.isfinite(arr)]
        if arr.size:
            best = max(best, float(arr.max()))
    return best


def add_slo_lines(fig: go.Figure, targets: Mapping[str, Mapping[str, float]], metric: str, *,
                  axis: str = "y") -> go.Figure:
    """Dashed target lines (horizontal for ``axis="y"``, vertical for ``"x"``) for ``metric``; returns ``fig``."""
    column = TARGET_COLUMN.get(metric)
    if column is None or not targets:
        return fig
    by_value: dict[float, list[str]] = {}
    for name, values in sorted(targets.items()):
        if column in values:
            by_value.setdefault(values[column], []).append(name)
    top = _data_max(fig, axis)
    hidden = []
    for value, classes in sorted(by_value.items()):
        text = f"SLO {', '.join(classes)}: {value:,.0f} ms"
        if math.isfinite(top) and value > OFF_SCALE * top:
            hidden.append(text)
            continue
        if axis == "y":
            fig.add_hline(y=value, line=_LINE, annotation_text=text, annotation_position="top left",
                          annotation_font=dict(size=11, color=_LINE["color"]))
        else:
            fig.add_vline(x=value, line=_LINE)
            # on a log axis a shape takes its value and an annotation its logarithm
            at = math.log10(value) if fig.layout.xaxis.type == "log" and value > 0 else value
            fig.add_annotation(x=at, y=1, xref="x", yref="paper", text=text, showarrow=False, xanchor="left",
                               yanchor="top", font=dict(size=11, color=_LINE["color"]))
    if hidden:
        fig.add_annotation(text="above the chart: " + "; ".join(hidden), xref="paper", yref="paper", x=1, y=1.0,
                           xanchor="right", yanchor="bottom", showarrow=False,
                           font=dict(size=11, color=_LINE["color"]))
    return fig
