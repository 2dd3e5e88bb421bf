"""Plotly figures and tables from analyzer result frames (reshaping only, no statistics).

Every builder takes a pandas DataFrame an analyzer returned and the names of
its columns to draw. What a person reads is written for a person:

* legends and headers are labels with units (``p99 (ms)``), never column names
  (:func:`tokentrace.app.report.render_names.column_label`);
* numbers have thousands separators and a unit, shares are percentages; never
  scientific notation;
* instances are named (``prefill-0``); an integer id is never drawn, and one that
  must reach the browser (a request id) goes as a string, since JavaScript's
  numbers corrupt 64-bit integers.

A figure is only shown when it has something to draw: :func:`graph_or_notice`
says in a sentence that there is nothing, instead of an empty pair of axes.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from dash import dash_table, dcc, html
from dash.dash_table.Format import Format, Group, Scheme

from dashboard.components.shell import notice
from dashboard.data import downsample
from tokentrace.app.report.render_names import ID_COLUMNS, column_label, is_percent_column, with_instance_names
from tokentrace.palette import SERIES_COLOURS
from tokentrace.schema import col

__all__ = ["graph", "graph_or_notice", "has_values", "bars", "bars_row", "lines", "kpis", "table", "fmt", "shown_label",
           "explained", "warm_up", "unit_of", "LAYOUT", "hover_number"]

MARKER_POINTS = 300
"""Above this many points a line is drawn without markers: thousands of SVG markers cost the
browser most of a view's render time and cannot be told apart anyway."""
LAYOUT = dict(template="plotly_white", margin=dict(l=60, r=20, t=50, b=50), height=360,
              legend=dict(orientation="h", y=-0.2), separators=".,", colorway=list(SERIES_COLOURS))
GRAPH_CONFIG = {"displaylogo": False, "modeBarButtonsToRemove": [
    "select2d", "lasso2d", "zoomIn2d", "zoomOut2d", "autoScale2d", "toggleSpikelines", "hoverClosestCartesian",
    "hoverCompareCartesian"]}
"""Plotly's tool bar keeps download, zoom, pan and reset: short enough to stay clear of a chart's title in a
three-column row."""
_MAX_SAFE_INT = 2**53  # larger integers are not exact in JavaScript


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
    return dcc.Graph(id=graph_id, figure=fig, config=GRAPH_CONFIG, className="tt-graph")


def has_values(fig: go.Figure) -> bool:
    """True when some trace of ``fig`` has a finite number to draw (on either axis)."""
    for trace in fig.data:
        for axis in ("x", "y"):
            values = getattr(trace, axis, None)
            if values is None:
                continue
            arr = np.asarray(values, dtype=object)
            numbers = [v for v in arr.ravel() if isinstance(v, (int, float, np.integer, np.floating))
                       and not isinstance(v, bool)]
            if any(math.isfinite(float(v)) for v in numbers):
                return True
    return False


def graph_or_notice(frame: pd.DataFrame | None, graph_id: str, build: Callable[[pd.DataFrame], go.Figure],
                    empty: str) -> Any:
    """``graph(build(frame))``, or the sentence ``empty`` when the frame has no rows or nothing finite to draw."""
    if frame is None or len(frame) == 0:
        return notice(empty)
    fig = build(frame)
    if not has_values(fig):
        return notice(empty)
    return graph(fig, graph_id)


def unit_of(column: str) -> str:
    """The unit a column's values are in (``ms``, ``req/s``, ``%``...), from its label; '' if none."""
    label = column_label(column)
    return label[label.rindex("(") + 1:-1] if label.endswith(")") and "(" in label else ""


def hover_number(axis: str, column: str) -> str:
    """A hover template part for ``column``'s values on ``axis``: separators, unit, percentages."""
    if is_percent_column(column):
        return f"%{{{axis}:.1%}}"
    unit = unit_of(column)
    return f"%{{{axis}:,.4~r}}" + (f" {unit}" if unit else "")


def _category(frame: pd.DataFrame, x: str, names: Mapping[int, str] | None) -> list[str]:
    """Category labels of column ``x``: instance names for instance ids, text otherwise."""
    if x == col.INSTANCE_ID and names is not None:
        return [names.get(int(v), "unknown instance") for v in frame[x]]
    values = frame[x]
    return ["(none)" if (isinstance(v, str) and v == "") else str(v) for v in values]


def bars(frame: pd.DataFrame, x: str, ys: Sequence[str], *, title: str, yaxis: str = "", barmode: str = "group",
         names: Sequence[str] | None = None, horizontal: bool = False,
         instance_names: Mapping[int, str] | None = None, colors: Sequence[str] | None = None) -> go.Figure:
    """One bar trace per column in ``ys`` over categories ``x`` (legend: readable labels)."""
    fig = go.Figure()
    cats = _category(frame, x, instance_names)
    for i, y in enumerate(ys):
        vals = frame[y].astype(float).tolist()
        name = names[i] if names else column_label(y)
        hover = f"%{{{'y' if horizontal else 'x'}}}<br>{name}: {hover_number('x' if horizontal else 'y', y)}<extra></extra>"
        kw = dict(name=name, hovertemplate=hover)
        if colors is not None:
            kw["marker_color"] = colors[i]
        fig.add_trace(go.Bar(y=cats, x=vals, orientation="h", **kw) if horizontal else go.Bar(x=cats, y=vals, **kw))
    fig.update_layout(title=title, barmode=barmode, **LAYOUT)
    value_axis = "xaxis" if horizontal else "yaxis"
    fig.update_layout(**{f"{value_axis}_title": yaxis})
    if ys and all(is_percent_column(y) for y in ys):
        fig.update_layout(**{f"{value_axis}_tickformat": ".0%"})
    else:
        fig.update_layout(**{f"{value_axis}_tickformat": ",~r"})
    fig.update_layout(**{f"{'yaxis' if horizontal else 'xaxis'}_type": "category"})
    return fig


def bars_row(frame: pd.DataFrame | None, x: str, metrics: Sequence[tuple[str, str, str]], id_prefix: str,
             empty: str, *, instance_names: Mapping[int, str] | None = None) -> Any:
    """Small bar charts side by side, one per (column, title, unit), for metrics with different units.

    Each bar carries its value as text, with separators and the unit (shares as percentages)."""
    if frame is None or len(frame) == 0:
        return notice(empty)
    charts = []
    for column, title, unit in metrics:
        values = pd.to_numeric(frame[column], errors="coerce")
        if not np.isfinite(values.to_numpy(float)).any():  # e.g. a ratio with a zero denominator everywhere
            charts.append(notice(f"{title}: not defined for this run."))
            continue
        fig = bars(frame, x, [column], title=title, yaxis=unit, instance_names=instance_names)
        text = ("%{y:.1%}" if is_percent_column(column)
                else "%{y:,.4~r}" + (f" {unit}" if unit and unit not in ("ratio", "share") else ""))
        fig.update_traces(texttemplate=text, textposition="outside", cliponaxis=False)
        fig.update_layout(height=300, showlegend=False, margin=dict(l=60, r=10, t=50, b=40))
        if (values.dropna() >= 0).all():  # counts, rates, ratios: the axis starts at 0 (never -1..1 for zeros)
            fig.update_yaxes(rangemode="nonnegative")
        charts.append(graph(fig, f"{id_prefix}-{column}".replace("_", "-")))
    return html.Div(charts, className="tt-row")


def lines(frame: pd.DataFrame, x: str, ys: Sequence[str], *, title: str, yaxis: str = "", xaxis: str = "",
          group: str | None = None, names: Sequence[str] | None = None,
          instance_names: Mapping[int, str] | None = None) -> go.Figure:
    """One line per column in ``ys`` (per group value if ``group``), downsampled for drawing;
    markers on each point only for lines of at most :data:`MARKER_POINTS` points. Groups of
    instance ids are named by ``instance_names``."""
    fig = go.Figure()
    parts = [("", frame)] if group is None else list(frame.groupby(group, sort=True))
    for key, part in parts:
        part = downsample(part[[x, *ys]], x)
        key_text = (instance_names or {}).get(int(key), "unknown instance") if group == col.INSTANCE_ID else str(key)
        for i, y in enumerate(ys):
            label = names[i] if names else column_label(y)
            name = label if group is None else (f"{key_text} · {label}" if len(ys) > 1 else key_text)
            mode = "lines+markers" if len(part) <= MARKER_POINTS else "lines"
            fig.add_trace(go.Scatter(x=part[x].tolist(), y=part[y].astype(float).tolist(), name=name, mode=mode,
                                     marker=dict(size=4),
                                     hovertemplate=f"{name}<br>{hover_number('y', y)} at %{{x:,.4~r}}<extra></extra>"))
    fig.update_layout(title=title, xaxis_title=xaxis, yaxis_title=yaxis, **LAYOUT)
    if ys and all(is_percent_column(y) for y in ys):
        fig.update_layout(yaxis_tickformat=".0%")
    return fig


def fmt(value: Any, unit: str = "", digits: int = 1) -> str:
    """A number for a KPI card: thousands separators, ``unit`` appended, an em dash for missing."""
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, (float, np.floating)):
        text = f"{float(value):,.{digits}f}"
    else:
        text = f"{int(value):,}"
    return f"{text}%" if unit == "%" else f"{text} {unit}".strip()


SHOWN_LABEL_CHARS = 64
"""Longest tenant, SLO class or request key shown whole; a longer one (a store written before labels
were capped, or a hostile name) is cut with an ellipsis, so no cell or option is a 100 KB string."""


def shown_label(value: Any) -> str:
    """``value`` as text for a table cell, a title or an option's label, cut to :data:`SHOWN_LABEL_CHARS`."""
    text = "" if value is None else str(value)
    return text if len(text) <= SHOWN_LABEL_CHARS else text[:SHOWN_LABEL_CHARS - 1] + "…"


def kpis(items: Sequence[tuple[str, str]], *, kpi_id: str = "") -> html.Div:
    """A row of (label, formatted value) cards."""
    cards = [html.Div([html.Div(value, className="tt-kpi-value"), html.Div(label, className="tt-kpi-label")],
                      className="tt-kpi") for label, value in items]
    return html.Div(cards, className="tt-kpis", **({"id": kpi_id} if kpi_id else {}))


def _browser_safe(frame: pd.DataFrame, instance_names: Mapping[int, str] | None) -> pd.DataFrame:
    """Instance ids named, other ids as text, any integer JavaScript cannot hold as text."""
    shown = with_instance_names(frame, instance_names) if instance_names is not None else frame.copy()
    for c in shown.columns:
        series = shown[c]
        if c in ID_COLUMNS:
            shown[c] = [None if pd.isna(v) else str(int(v)) for v in series]
        elif pd.api.types.is_integer_dtype(series) and series.notna().any() and \
                series.dropna().abs().max() >= _MAX_SAFE_INT:
            shown[c] = [None if pd.isna(v) else str(int(v)) for v in series]
    return shown


def _column_spec(c: str, series: pd.Series, digits: int) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": column_label(c), "id": c}
    if pd.api.types.is_bool_dtype(series) or not pd.api.types.is_numeric_dtype(series):
        return spec
    spec["type"] = "numeric"
    if is_percent_column(c):
        spec["format"] = Format(precision=1, scheme=Scheme.percentage, nully="—")
    elif pd.api.types.is_integer_dtype(series) or _is_count(c, series):
        spec["format"] = Format(group=Group.yes, precision=0, scheme=Scheme.fixed, nully="—")
    else:
        precision = max(digits, 3) if c.startswith("p_") else digits  # p-values: 0.004, not 0.00
        spec["format"] = Format(group=Group.yes, precision=precision, scheme=Scheme.fixed, nully="—")
    return spec


def _is_count(c: str, series: pd.Series) -> bool:
    """A count held as floats (nullable after a join or a sum): whole numbers under a count's name."""
    named = c.startswith("num_") or c.endswith(("_tokens", "_blocks", "_requests", "_steps"))
    values = series.dropna().to_numpy(float)
    return named and bool(np.all(np.isfinite(values) & (values == np.round(values))))


def table(frame: pd.DataFrame, table_id: str, *, page_size: int = 15, digits: int = 2,
          highlight: str | None = None, instance_names: Mapping[int, str] | None = None) -> dash_table.DataTable:
    """A (client-side paged, sortable) table of a small result frame: readable headers with units, numbers
    with separators, shares as percentages, instances by name; rows where ``highlight`` is true in red."""
    shown = _browser_safe(frame, instance_names)
    for c in shown.columns:
        if pd.api.types.is_bool_dtype(shown[c]) or shown[c].map(lambda v: isinstance(v, (bool, np.bool_))).all():
            shown[c] = shown[c].map({True: "yes", False: "no"}).fillna("—")
        elif not pd.api.types.is_numeric_dtype(shown[c]):
            shown[c] = shown[c].map(lambda v: "—" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v))
    style = []
    if highlight is not None and highlight in shown.columns:
        style.append({"if": {"filter_query": f"{{{highlight}}} = 'yes'"}, "backgroundColor": "#fde2e1",
                      "color": "#8a1c14", "fontWeight": "bold"})
    columns = [_column_spec(c, shown[c], digits) for c in shown.columns]
    data = shown.astype(object).where(shown.notna(), None).to_dict("records")
    return dash_table.DataTable(
        id=table_id, data=data, columns=columns, page_size=page_size, sort_action="native",
        style_table={"overflowX": "auto"},
        style_cell={"fontFamily": "inherit", "fontSize": "13px", "padding": "4px 8px", "whiteSpace": "normal",
                    "height": "auto"},
        style_header={"fontWeight": "bold"}, style_data_conditional=style)


def explained(title: str, text: str, *children: Any) -> html.Section:
    """A titled section with a short explanation of its metric above its content."""
    return html.Section([html.H3(title), html.P(text, className="tt-explain"), *children], className="tt-section")
