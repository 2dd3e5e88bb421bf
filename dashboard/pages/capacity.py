"""Capacity: throughput (req/s, output tokens/s), p50/p90/p95/p99, latency against offered load (across the
windows of a run and across runs), TTFT against prompt length, distributions, SLO targets, and requests in
flight and waiting on the latency's time axis. The numbers come from :mod:`analyzers.capacity`."""

from __future__ import annotations

import math
from typing import Any

import dash
import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from analyzers.analysis import RunAnalysis
from dashboard.components.controls import run_picker
from dashboard.components.explanations import EXPLAIN
from dashboard.components.figures import LAYOUT, explained, fmt, graph, graph_or_notice, kpis, table
from dashboard.components.shell import ViewQuery, live_callback, notice, page
from dashboard.components.slo_lines import add_slo_lines, slo_targets
from dashboard.data import DataSource, series_window_s
from tokentrace.schema import STEPS, col

PATH = "/capacity"
dash.register_page(__name__, path=PATH, name="Capacity", title="tokentrace · capacity")

_PCTS = ("p50", "p90", "p95", "p99")
_METRIC_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "end-to-end"}
_LINE_COLOURS = {"p50": "#4477AA", "p90": "#66CCEE", "p95": "#CCBB44", "p99": "#EE6677", "mean": "#999999"}
_MAX_RUNS = 12  # runs drawn in the across-runs chart (the newest)


def _values(series: pd.Series) -> list[float]:
    """Plain numbers for the browser (a pandas series would travel as an encoded typed array)."""
    return pd.to_numeric(series, errors="coerce").astype(float).tolist()


def _summary(src: DataSource, rid: str) -> list[Any]:
    s = src.result(rid, RunAnalysis.capacity_throughput_summary)
    pct = src.result(rid, RunAnalysis.capacity_percentiles)
    offered = src.result(rid, RunAnalysis.capacity_offered_load).iloc[0]["offered_rps"]  # the load analysis's figure, alone
    if len(s) == 0 or int(s.iloc[0]["num_requests"]) == 0:
        return [notice("This run has no requests with an arrival time: no throughput to measure.")]
    r = s.iloc[0]
    cards = kpis([("offered load (arrival window)", fmt(offered, "req/s", 2)),
                  ("completed", fmt(r["completed_rps"], "req/s", 2)),
                  ("output tokens", fmt(r["output_tokens_per_s"], "tokens/s", 1)),
                  ("prompt tokens", fmt(r["prompt_tokens_per_s"], "tokens/s", 0)),
                  ("requests", f"{fmt(int(r['num_completed']))} of {fmt(int(r['num_requests']))} completed"),
                  ("run duration", fmt(r["duration_s"], "s", 1))], kpi_id="capacity-kpis")
    shown = pct.assign(metric=pct["metric"].map(_METRIC_NAMES))[["metric", "count", "mean_ms", "p50_ms", "p90_ms",
                                                                   "p95_ms", "p99_ms"]]
    return [cards, table(shown, "capacity-percentiles", page_size=4)]


def over_time_figure(tp: pd.DataFrame, lat: pd.DataFrame, queue: pd.DataFrame | None,
                     targets: dict[str, dict[str, float]], window_s: float) -> go.Figure:
    """Four rows on one time axis: TTFT percentiles (SLO lines), requests in flight and waiting, request rates,
    output tokens per second."""
    fig = make_subplots(rows=4, cols=1, shared_xaxes=True, vertical_spacing=0.05,
                        subplot_titles=(f"TTFT of the requests arriving in each {window_s:g} s window (ms)",
                                        "Requests in flight and waiting (time average per window)",
                                        "Requests per second", "Output tokens per second"))
    for p in ("p50", "p95", "p99"):
        column = f"ttft_{p}_ms"
        if column in lat:
            fig.add_trace(go.Scatter(x=_values(lat["window_start_s"]), y=_values(lat[column]), name=f"TTFT {p}", mode="lines",
                                     line=dict(color=_LINE_COLOURS[p]), legendgroup="ttft",
                                     hovertemplate=f"TTFT {p}: %{{y:,.1f}} ms at %{{x:,.0f}} s<extra></extra>"),
                          row=1, col=1)
    series = [("in_flight", "in flight", "#332288"), ("waiting_first_token", "waiting for a first token", "#E69F00")]
    for column, name, colour in series:
        fig.add_trace(go.Scatter(x=_values(tp["window_start_s"]), y=_values(tp[column]), name=name, mode="lines",
                                 line=dict(color=colour), hovertemplate=f"{name}: %{{y:,.1f}}<extra></extra>"),
                      row=2, col=1)
    if queue is not None and len(queue):
        fig.add_trace(go.Scatter(x=_values(queue["t_s"]), y=_values(queue[col.NUM_WAITING]), name="waiting in engine queues",
                                 mode="lines", line=dict(color="#CC3311", dash="dot"),
                                 hovertemplate="engine queues: %{y:,.1f} waiting<extra></extra>"), row=2, col=1)
    for column, name, colour in (("offered_rps", "offered", "#999999"), ("completed_rps", "completed", "#117733")):
        fig.add_trace(go.Scatter(x=_values(tp["window_start_s"]), y=_values(tp[column]), name=f"{name} req/s", mode="lines",
                                 line=dict(color=colour), hovertemplate=f"{name}: %{{y:,.2f}} req/s<extra></extra>"),
                      row=3, col=1)
    fig.add_trace(go.Scatter(x=_values(tp["window_start_s"]), y=_values(tp["output_tokens_per_s"]), name="output tokens/s",
                             mode="lines", line=dict(color="#882255"),
                             hovertemplate="%{y:,.1f} output tokens/s<extra></extra>"), row=4, col=1)
    top = float(np.nanmax(lat[[c for c in lat.columns if c.startswith("ttft_")]].to_numpy(float))) \
        if len(lat) and lat.filter(like="ttft_").notna().any().any() else math.nan
    above = []
    for name, values in sorted(targets.items()):
        value = values.get("ttft_target_ms")
        if value is None:
            continue
        if math.isfinite(top) and value > 2 * top:
            above.append(f"SLO {name}: {value:,.0f} ms")
            continue
        fig.add_hline(y=value, row=1, col=1, line=dict(color="#8a1c14", width=1.5, dash="dash"),
                      annotation_text=f"SLO {name}: {value:,.0f} ms", annotation_position="top left",
                      annotation_font=dict(size=11, color="#8a1c14"))
    if above:
        fig.add_annotation(text="TTFT targets above the chart: " + "; ".join(above), xref="x domain",
                           yref="y domain", x=1, y=1, xanchor="right", yanchor="top", showarrow=False,
                           font=dict(size=11, color="#8a1c14"), row=1, col=1)
    fig.update_layout(**{**LAYOUT, "height": 820, "legend": dict(orientation="h", y=-0.06),
                         "margin": dict(l=60, r=20, t=40, b=50)})
    fig.update_xaxes(title_text="s since the run's first arrival", row=4, col=1)
    fig.update_yaxes(tickformat=",~r")
    return fig


def _over_time(src: DataSource, rid: str, targets: dict[str, dict[str, float]]) -> Any:
    w = series_window_s(src.info(rid).duration_ns)
    tp = src.result(rid, RunAnalysis.capacity_throughput, window_s=w)
    if len(tp) == 0:
        return notice("This run has no requests with an arrival time: no time series to draw.")
    lat = src.result(rid, RunAnalysis.capacity_load_latency, window_s=w)
    queue = None
    if src.info(rid).tables.get(STEPS.name, 0):
        timeline = src.result(rid, RunAnalysis.queues, bucket_s=float(w)).timeline
        queue = timeline.groupby("t_s", as_index=False)[col.NUM_WAITING].sum() if len(timeline) else None
    return graph(over_time_figure(tp, lat, queue, targets, w), "capacity-over-time")


def load_figure(frame: pd.DataFrame, x: str, metrics: list[tuple[str, str]], *, title: str, xaxis: str,
                text: pd.Series | None = None, ring: pd.Series | None = None) -> go.Figure:
    """Markers (and lines through them) of each (column, name) against ``x``, sorted by ``x``."""
    order = frame.sort_values(x, kind="stable")
    fig = go.Figure()
    for column, name in metrics:
        if column not in order or not order[column].notna().any():
            continue
        p = column.split("_")[1] if column.count("_") >= 2 else "mean"
        kw: dict[str, Any] = {}
        if ring is not None:
            rings = ring.loc[order.index].to_numpy()
            kw["marker"] = dict(size=np.where(rings, 13, 8).tolist(), color=_LINE_COLOURS.get(p, "#444"),
                                line=dict(width=np.where(rings, 2.5, 0).tolist(), color="#111"))
        else:
            kw["marker"] = dict(size=7, color=_LINE_COLOURS.get(p, "#444"))
        fig.add_trace(go.Scatter(
            x=_values(order[x]), y=_values(order[column]), name=name, mode="lines+markers", line=dict(color=_LINE_COLOURS.get(p, "#444")),
            text=None if text is None else text.loc[order.index].tolist(), **kw,
            hovertemplate=(("%{text}<br>" if text is not None else "") + f"{name}: %{{y:,.1f}} ms at "
                           "%{x:,.2f} req/s<extra></extra>")))
    fig.update_layout(title=title, xaxis_title=xaxis, yaxis_title="ms", **LAYOUT)
    fig.update_yaxes(tickformat=",~r")
    return fig


def _load_curves(src: DataSource, rid: str, targets: dict[str, dict[str, float]]) -> list[Any]:
    w = series_window_s(src.info(rid).duration_ns)
    lat = src.result(rid, RunAnalysis.capacity_load_latency, window_s=w)
    ttft = [(f"ttft_{p}_ms", f"TTFT {p}") for p in ("p50", "p95", "p99")]
    itl = [(f"itl_{p}_ms", f"ITL {p}") for p in ("p50", "p95", "p99")]
    charts = []
    for metric, metrics, what in (("ttft", ttft, "TTFT"), ("itl", itl, "ITL")):
        charts.append(graph_or_notice(lat, f"capacity-load-{metric}", lambda f, metric=metric, metrics=metrics,
                                      what=what: add_slo_lines(load_figure(
                                          f, "offered_rps", metrics, title=f"{what} against offered load, per {w} s "
                                          "window", xaxis="offered load in the window (req/s)"), targets, metric),
                                      f"No {what} samples in this run."))
    return [dash.html.Div(charts, className="tt-row")]


def _runs_curve(src: DataSource, rid: str) -> Any:
    infos = src.runs()[-_MAX_RUNS:]
    if len(infos) < 2:
        return notice("This store holds one run: run the same server at other loads to draw its latency against "
                      "load across runs.")
    rows = []
    for info in infos:
        try:
            offered = src.result(info.run_id, RunAnalysis.capacity_offered_load).iloc[0]["offered_rps"]  # not the whole load analysis
            pct = src.result(info.run_id, RunAnalysis.capacity_percentiles).set_index("metric")
        except (ValueError, KeyError):
            continue
        row = {"run": info.run_id, "offered_rps": offered, "shown": info.run_id == rid}
        for metric in ("ttft", "itl"):
            for p in ("p50", "p95", "p99"):
                row[f"{metric}_{p}_ms"] = pct.loc[metric, f"{p}_ms"] if metric in pct.index else math.nan
        rows.append(row)
    frame = pd.DataFrame(rows)
    frame = frame[pd.to_numeric(frame["offered_rps"], errors="coerce").notna()] if len(frame) else frame
    return graph_or_notice(frame, "capacity-runs", lambda f: load_figure(
        f.astype({"offered_rps": float}), "offered_rps", [(f"ttft_{p}_ms", f"TTFT {p}") for p in ("p50", "p95", "p99")],
        title="TTFT against offered load, one point per run", xaxis="offered load of the run (req/s)",
        text=f["run"], ring=f["shown"]), "No run of this store has an offered load to draw.")


def prompt_figure(frame: pd.DataFrame) -> go.Figure:
    fig = go.Figure()
    for p in ("p50", "p95", "p99"):
        fig.add_trace(go.Scatter(
            x=_values(frame["prompt_tokens_mid"]), y=_values(frame[f"ttft_{p}_ms"]), name=f"TTFT {p}", mode="lines+markers",
            line=dict(color=_LINE_COLOURS[p]),
            customdata=np.stack([frame["prompt_tokens_lo"], frame["prompt_tokens_hi"], frame["num_requests"]], axis=-1).tolist(),
            hovertemplate=(f"TTFT {p}: %{{y:,.1f}} ms<br>prompts of %{{customdata[0]:,}}-%{{customdata[1]:,}} tokens "
                           "(%{customdata[2]:,} requests)<extra></extra>")))
    fig.update_layout(title="TTFT against prompt length", xaxis_title="prompt length (tokens, bin median)",
                      yaxis_title="ms", **LAYOUT)
    fig.update_yaxes(tickformat=",~r")
    fig.update_xaxes(tickformat=",~r")
    return fig


def cdf_figure(frame: pd.DataFrame, metrics: tuple[str, ...], title: str) -> go.Figure:
    fig = go.Figure()
    colours = {"ttft": "#882255", "e2e": "#4477AA", "itl": "#117733", "tpot": "#E69F00"}
    for metric in metrics:
        part = frame[frame["metric"] == metric]
        if part.empty:
            continue
        name = _METRIC_NAMES[metric]
        fig.add_trace(go.Scatter(x=_values(part["value_ms"]), y=_values(part["quantile"]), name=name, mode="lines",
                                 line=dict(color=colours[metric], width=2),
                                 hovertemplate=f"{name}: %{{y:.1%}} at or under %{{x:,.2f}} ms<extra></extra>"))
    fig.update_layout(title=title, xaxis_title="ms", yaxis_title="share at or under", **LAYOUT)
    fig.update_yaxes(tickformat=".0%", range=[0, 1.02])
    values = frame[frame["metric"].isin(metrics)]["value_ms"].to_numpy(float)
    values = values[np.isfinite(values) & (values > 0)]
    if values.size and values.max() / values.min() > 100:
        fig.update_xaxes(type="log")
    return fig


def _cdfs(src: DataSource, rid: str, targets: dict[str, dict[str, float]]) -> list[Any]:
    frame = src.result(rid, RunAnalysis.capacity_cdf)
    charts = []
    for metrics, title, slo_metric, graph_id in ((("ttft", "e2e"), "TTFT and end-to-end latency", "ttft", "long"),
                                                (("itl", "tpot"), "ITL and TPOT", "itl", "short")):
        def build(f: pd.DataFrame, metrics: tuple[str, ...] = metrics, title: str = title,
                  slo_metric: str = slo_metric) -> go.Figure:
            return add_slo_lines(cdf_figure(f, metrics, f"Distribution: {title}"), targets, slo_metric, axis="x")
        part = frame[frame["metric"].isin(metrics)] if len(frame) else frame
        charts.append(graph_or_notice(part, f"capacity-cdf-{graph_id}", build, f"No {title} samples in this run."))
    return [dash.html.Div(charts, className="tt-row")]


def body(src: DataSource, q: ViewQuery) -> list[Any]:
    """The capacity view of run ``q.run``."""
    rid = src.resolve(q.run)
    targets = slo_targets(src.result(rid, RunAnalysis.capacity_slo_targets))  # the targets only: no request judged
    prompt = src.result(rid, RunAnalysis.capacity_ttft_by_prompt)
    prompt_part = graph_or_notice(prompt, "capacity-prompt", lambda f: add_slo_lines(prompt_figure(f), targets, "ttft"),
                                  "No request has both a prompt length and a first token in this run.")
    return [explained("Throughput and percentiles", EXPLAIN["capacity_throughput"], *_summary(src, rid)),
            explained("Latency, load and throughput over time", EXPLAIN["capacity_time"],
                      _over_time(src, rid, targets)),
            explained("Latency against offered load", EXPLAIN["capacity_load"], *_load_curves(src, rid, targets)),
            explained("Across runs", EXPLAIN["capacity_runs"], _runs_curve(src, rid)),
            explained("TTFT against prompt length", EXPLAIN["capacity_prompt"], prompt_part),
            explained("Distributions", EXPLAIN["capacity_cdf"], *_cdfs(src, rid, targets))]


def controls(src: DataSource, q: ViewQuery) -> list[Any]:
    return [run_picker(src, q.run)]


def layout(**query: str) -> Any:
    return page(PATH, "Capacity", query, body, controls)


live_callback(PATH, body)
