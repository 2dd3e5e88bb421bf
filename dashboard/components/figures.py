"""Plotly figures and tables from analyzer result frames (reshaping only, no statistics).

Every builder takes a pandas DataFrame an analyzer returned and the names of
its columns to draw. A figure is only built from rows that exist: callers use
:func:`graph_or_notice`, so the dashboard never shows an empty chart; it says
in a sentence that there is nothing to draw instead.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import pandas as pd
import plotly.graph_objects as go
from dash import dash_table, dcc, html

from dashboard.components.shell import notice
from dashboard.data import downsample

__all__ = ["graph", "graph_or_notice", "bars", "bars_row", "lines", "kpis", "table", "fmt", "explained", "warm_up"]

MARKER_POINTS = 300
"""Above this many points a line is drawn without markers: thousands of SVG markers cost the
browser most of a view's render time and cannot be told apart anyway."""
_LAYOUT = dict(template="plotly_white", margin=dict(l=60, r=20, t=50, b=50), height=360,
               legend=dict(orientation="h", y=-0.2))


def warm_up() -> None:
    """Build and serialise one throwaway figure of each kind the views draw.

    plotly loads its property validators and the template on first use (about 0.3 s),
    which would otherwise land in the first view anybody opens.
    """
    frame = pd.DataFrame({"x": ["a", "b"], "y": [1.0, 2.0]})
    for fig in (bars(frame, "x", ["y"], title="warm-up"), lines(frame, "x", ["y"], title="warm-up")):
        fig.to_json()


def graph(fig: go.Figure, graph_id: str) -> dcc.Graph:
    """A ``dcc.Graph`` with the dashboard's settings."""
    return dcc.Graph(id=graph_id, figure=fig, config={"displaylogo": False}, className="tt-graph")


def graph_or_notice(frame: pd.DataFrame | None, graph_id: str, build: Callable[[pd.DataFrame], go.Figure],
                    empty: str) -> Any:
    """``graph(build(frame))``, or the sentence ``empty`` when the frame has no rows."""
    if frame is None or len(frame) == 0:
        return notice(empty)
    return graph(build(frame), graph_id)


def bars(frame: pd.DataFrame, x: str, ys: Sequence[str], *, title: str, yaxis: str = "", barmode: str = "group",
         names: Sequence[str] | None = None, horizontal: bool = False) -> go.Figure:
    """One bar trace per column in ``ys`` over categories ``x``."""
    fig = go.Figure()
    for i, y in enumerate(ys):
        cats, vals = frame[x].astype(str).tolist(), frame[y].tolist()
        name = names[i] if names else y
        fig.add_trace(go.Bar(y=cats, x=vals, name=name, orientation="h") if horizontal
                      else go.Bar(x=cats, y=vals, name=name))
    fig.update_layout(title=title, barmode=barmode, **_LAYOUT)
    fig.update_layout(**({"xaxis_title": yaxis} if horizontal else {"yaxis_title": yaxis}))
    return fig


def bars_row(frame: pd.DataFrame | None, x: str, metrics: Sequence[tuple[str, str, str]], id_prefix: str,
             empty: str) -> Any:
    """Small bar charts side by side, one per (column, title, unit), for metrics with different units."""
    if frame is None or len(frame) == 0:
        return notice(empty)
    charts = []
    for column, title, unit in metrics:
        if frame[column].isna().all():  # e.g. a ratio with a zero denominator everywhere
            charts.append(notice(f"{title}: not defined for this run."))
            continue
        fig = bars(frame, x, [column], title=title, yaxis=unit)
        fig.update_traces(texttemplate="%{y:.3~g}", textposition="outside", cliponaxis=False)
        fig.update_layout(height=300, showlegend=False, margin=dict(l=60, r=10, t=50, b=40))
        charts.append(graph(fig, f"{id_prefix}-{column}".replace("_", "-")))
    return html.Div(charts, className="tt-row")


def lines(frame: pd.DataFrame, x: str, ys: Sequence[str], *, title: str, yaxis: str = "", xaxis: str = "",
          group: str | None = None) -> go.Figure:
    """One line per column in ``ys`` (per group value if ``group``), downsampled for drawing;
    markers on each point only for lines of at most :data:`MARKER_POINTS` points."""
    fig = go.Figure()
    parts = [("", frame)] if group is None else list(frame.groupby(group, sort=True))
    for key, part in parts:
        part = downsample(part[[x, *ys]], x)
        for y in ys:
            name = y if group is None else (f"{key} · {y}" if len(ys) > 1 else str(key))
            mode = "lines+markers" if len(part) <= MARKER_POINTS else "lines"
            fig.add_trace(go.Scatter(x=part[x].tolist(), y=part[y].tolist(), name=name, mode=mode,
                                     marker=dict(size=4)))
    fig.update_layout(title=title, xaxis_title=xaxis, yaxis_title=yaxis, **_LAYOUT)
    return fig


def fmt(value: Any, unit: str = "", digits: int = 1) -> str:
    """A number for a KPI card: thousands separators, ``unit`` appended, an em dash for missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, float):
        text = f"{value:,.{digits}f}"
    else:
        text = f"{value:,}"
    return f"{text} {unit}".strip()


def kpis(items: Sequence[tuple[str, str]], *, kpi_id: str = "") -> html.Div:
    """A row of (label, formatted value) cards."""
    cards = [html.Div([html.Div(value, className="tt-kpi-value"), html.Div(label, className="tt-kpi-label")],
                      className="tt-kpi") for label, value in items]
    return html.Div(cards, className="tt-kpis", **({"id": kpi_id} if kpi_id else {}))


def table(frame: pd.DataFrame, table_id: str, *, page_size: int = 15, digits: int = 3,
          highlight: str | None = None) -> dash_table.DataTable:
    """A plain (client-side paged) table of a small result frame; rows where ``highlight`` is true are red."""
    shown = frame.copy()
    for c in shown.columns:
        if pd.api.types.is_float_dtype(shown[c]):
            shown[c] = shown[c].round(digits)
        elif not pd.api.types.is_numeric_dtype(shown[c]) and not pd.api.types.is_bool_dtype(shown[c]):
            shown[c] = shown[c].astype(str)
    style = []
    if highlight is not None and highlight in shown.columns:
        style.append({"if": {"filter_query": f"{{{highlight}}} = 'True'"}, "backgroundColor": "#fde2e1",
                      "color": "#8a1c14", "fontWeight": "bold"})
        shown[highlight] = shown[highlight].astype(str)
    return dash_table.DataTable(
        id=table_id, data=shown.to_dict("records"), columns=[{"name": c, "id": c} for c in shown.columns],
        page_size=page_size, sort_action="native", style_table={"overflowX": "auto"},
        style_cell={"fontFamily": "inherit", "fontSize": "13px", "padding": "4px 8px"},
        style_header={"fontWeight": "bold"}, style_data_conditional=style)


def explained(title: str, text: str, *children: Any) -> html.Section:
    """A titled section with a short explanation of its metric above its content."""
    return html.Section([html.H3(title), html.P(text, className="tt-explain"), *children], className="tt-section")
