"""Breakdown: which stages TTFT and ITL are made of, by tenant and SLO class, mean and tail; the critical path."""

from __future__ import annotations

from typing import Any

import dash
import pandas as pd
import plotly.graph_objects as go

from analyzers.analysis import RunAnalysis
from dashboard.components.controls import grouping_picker, run_picker
from dashboard.components.explanations import EXPLAIN
from dashboard.components.figures import LAYOUT, explained, graph_or_notice, kpis
from dashboard.components.shell import GROUP_COLUMN, GROUPINGS, ViewQuery, live_callback, notice, page
from dashboard.data import DataSource
from tokentrace.app.report.headline import attribution_sentence, hidden_stages_sentence
from tokentrace.app.report.sections import hidden_stages
from tokentrace.palette import label_colour
from tokentrace.schema import SPANS, col

PATH = "/breakdown"
dash.register_page(__name__, path=PATH, name="Breakdown", title="tokentrace · breakdown")

_KINDS = (("ttft", "TTFT"), ("itl", "ITL"))
_EPS = 1e-9  # shares below this are left out of the legend


def stacked_shares(frame: pd.DataFrame, kind: str, group: str | None, title: str,
                   names: dict[int, str] | None = None) -> go.Figure:
    """Stacked bars of stage shares in pipeline order: for each group a ``mean`` and a ``tail`` bar, one trace
    per stage (the palette's colour), its share and its mean ms per token in the hover."""
    fig = go.Figure()
    label_of = (lambda g: (names or {}).get(int(g), "unknown instance")) if group == col.INSTANCE_ID else str
    groups = [None] if group is None else sorted(frame[group].unique(), key=lambda g: label_of(g))
    stages = [s for s in frame["stage"].unique()
              if frame.loc[frame["stage"] == s, [f"{kind}_share", f"{kind}_tail_share"]].abs().to_numpy().max() > _EPS]
    for stage in stages:
        rows = frame[frame["stage"] == stage]
        x0, x1, y, ms = [], [], [], []
        for g in groups:
            row = rows if group is None else rows[rows[group] == g]
            for label, column in (("mean", f"{kind}_share"), ("tail 1%", f"{kind}_tail_share")):
                x0.append("all" if g is None else (label_of(g) or "(none)"))
                x1.append(label)
                y.append(float(row[column].iloc[0]) if len(row) else 0.0)
                ms.append(float(row[f"{kind}_mean_ms"].iloc[0]) if len(row) and label == "mean" else float("nan"))
        fig.add_trace(go.Bar(x=[x0, x1], y=y, name=stage, marker_color=label_colour(stage), customdata=ms,
                             hovertemplate=f"{stage}: %{{y:.1%}} of {kind.upper()}<br>%{{x}}<extra></extra>"))
    fig.update_layout(barmode="stack", title=title, yaxis_title=f"share of {kind.upper()}", **{
        **LAYOUT, "height": 380, "legend": dict(orientation="h", y=-0.25, traceorder="normal")})
    fig.update_layout(yaxis_tickformat=".0%")
    return fig


def _attribution(frame: pd.DataFrame) -> Any:
    """KPI cards: unattributed (signed) and overlap shares of TTFT and ITL, and the sentence."""
    if len(frame) == 0 or frame["latency_ms"].sum() == 0:
        return notice("No token latency in this run: nothing to attribute.")
    a = frame.set_index("kind")
    cards = []
    for kind in ("ttft", "itl"):
        for column, label in (("unattributed_share", "unattributed"), ("overlap_share", "overlap")):
            value = a.loc[kind, column] if kind in a.index else float("nan")
            sign = "+" if column == "unattributed_share" else ""  # unattributed is signed; overlap is >= 0
            cards.append((f"{kind.upper()} {label}", "—" if pd.isna(value) else f"{value * 100:{sign}.3f}%"))
    return dash.html.Div([kpis(cards, kpi_id="breakdown-attribution"),
                          dash.html.P(attribution_sentence(frame), className="tt-explain")])


def critical_path_figure(frame: pd.DataFrame) -> go.Figure:
    """Horizontal stacked bars (p50 and p99 request): the stages of token 0 in order, mean ms each."""
    fig = go.Figure()
    for _, row in frame.sort_values(["group", "position"]).iterrows():
        fig.add_trace(go.Bar(y=[row["group"]], x=[row["mean_ms"]], orientation="h", name=row["stage"],
                             marker_color=label_colour(row["stage"]),
                             legendgroup=row["stage"], showlegend=bool(row["group"] == frame["group"].iloc[0]),
                             hovertemplate=f"{row['stage']}: %{{x:,.3f}} ms<extra>{row['group']} request</extra>"))
    fig.update_layout(barmode="stack", title="Critical path of the first token", xaxis_title="ms (mean per request)",
                      **{**LAYOUT, "height": 300, "legend": dict(orientation="h", y=-0.35)})
    return fig


def body(src: DataSource, q: ViewQuery) -> list[Any]:
    """Stage shares of run ``q.run`` for the whole run, by tenant and by SLO class; its critical path."""
    rid = src.resolve(q.run)
    sections = [explained("Attribution", EXPLAIN["attribution"], _attribution(src.result(rid, RunAnalysis.attribution)))]
    if not src.info(rid).tables.get(SPANS.name, 0):
        return sections + [explained("Stage shares", EXPLAIN["breakdown"], notice(
            "This run recorded no stage spans: its TTFT and ITL cannot be split into stages (all of their time is "
            "unattributed). Trace the server with tokentrace's adapters or the manual API to record stages."))]
    for by in dict.fromkeys(["", q.by]):  # the whole run, and the grouping the URL asks for
        label = GROUPINGS[by]
        frame = src.result(rid, RunAnalysis.stage_breakdown, by=by or None)
        group = GROUP_COLUMN.get(by)
        names = src.instance_names(rid) if group == col.INSTANCE_ID else None
        graphs = [graph_or_notice(frame, f"breakdown-{kind}-{by or 'all'}", lambda f, kind=kind, klabel=klabel:
                                  stacked_shares(f, kind, group, f"{klabel} by stage, {label}", names),
                                  f"No {klabel} samples in this run.") for kind, klabel in _KINDS]
        children: list[Any] = [dash.html.Div(graphs, className="tt-row")]
        hidden = hidden_stages_sentence(hidden_stages(frame)) if not by and len(frame) else ""
        if hidden:  # every stage is drawn or named
            children.append(dash.html.P(hidden, id="breakdown-hidden", className="tt-explain"))
        sections.append(explained(f"Stage shares, {label}", EXPLAIN["breakdown"], *children))
    path = src.result(rid, RunAnalysis.critical_path)
    sections.append(explained("Critical path", EXPLAIN["critical_path"], graph_or_notice(
        path, "breakdown-critical-path", critical_path_figure, "No first tokens with stages in this run.")))
    return sections


def controls(src: DataSource, q: ViewQuery) -> list[Any]:
    return [run_picker(src, q.run), grouping_picker(q)]


def layout(**query: str) -> Any:
    return page(PATH, "Where the time went", query, body, controls)


live_callback(PATH, body)
