"""The report as one self-contained HTML file with Plotly charts.

plotly.js is inlined (tokentrace's basic partial bundle,
:mod:`tokentrace.app.report.plotly_bundle`, 1.2 MB): the file opens offline, from a
CI artifact, with no CDN. Charts: latency percentiles, stage shares of TTFT and
ITL (mean and tail) as stacked bars, latency and queue lengths over time, and, when
the run speculated, acceptance, draft cost and ITL by batch size
(:mod:`tokentrace.app.report.speculative_charts`).
Every table of the Markdown report follows. Pure function of a :class:`Report`;
plotly is imported inside :func:`render_html`.
"""

from __future__ import annotations

import html
from typing import Any

import pandas as pd

from tokentrace.app.report import speculative_charts as spec_charts
from tokentrace.app.report.budget import format_value
from tokentrace.app.report.frames import frame_cells
from tokentrace.app.report.model import Report
from tokentrace.app.report.plotly_bundle import bundle_text
from tokentrace.app.report.render_names import column_label, for_people, instance_labels
from tokentrace.palette import BETTER_COLOUR, SERIES_COLOURS, UNCHANGED_COLOUR, WORSE_COLOUR, label_colour
from tokentrace.schema import REQUESTS, SPANS, TOKENS, col

__all__ = ["render_html", "html_table"]

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; padding: 0 1em; color: #222; }
.table-wrap { max-width: 100%; overflow-x: auto; margin: 0.5em 0 1.5em; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { white-space: normal; vertical-align: bottom; } td { white-space: nowrap; }
th:first-child, td:first-child { text-align: left; }
th { background: #f3f3f3; }
.pass { color: #1a7f37; } .fail { color: #cf222e; font-weight: bold; }
.note { color: #555; } .caption { font-weight: bold; margin-top: 1em; } .headline { font-weight: bold; }
"""
_BARS = (("TTFT mean", "ttft_share"), ("TTFT tail 1%", "ttft_tail_share"),
         ("ITL mean", "itl_share"), ("ITL tail 1%", "itl_tail_share"))
_PERCENTILES = ("p50_ms", "p90_ms", "p99_ms", "p99.9_ms")


def html_table(df: pd.DataFrame, names: dict[int, str] | None = None) -> str:
    """``df`` as an HTML table in a box that scrolls sideways when it is wider than the page: readable headers
    with units, instances by name (``names``: instance id -> name), every cell escaped."""
    headers, rows = frame_cells(for_people(df, names or {}))
    head = "".join(f"<th title='{html.escape(h)}'>{html.escape(column_label(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<div class='table-wrap'><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"


def _figure_html(fig: Any, div_id: str, *, height: int = 380) -> str:
    fig.update_layout(height=height, margin={"l": 60, "r": 20, "t": 50, "b": 50}, template="plotly_white",
                      separators=".,", colorway=list(SERIES_COLOURS))
    if fig.layout.yaxis.type != "log" and not fig.layout.yaxis.tickformat:  # (a chart of shares keeps its %)
        fig.update_yaxes(tickformat=",~r")  # 30,600, never 3.06e+4
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id)


def _latency_chart(go: Any, df: pd.DataFrame) -> str:
    if len(df) == 0:
        return "<p class='note'>No latency samples to chart.</p>"
    fig = go.Figure()
    for p in _PERCENTILES:
        if p in df.columns:
            fig.add_bar(name=p.removesuffix("_ms"), x=[str(m).upper() for m in df["metric"]], y=df[p])
    fig.update_layout(title="Latency percentiles (ms, log scale)", barmode="group", yaxis_type="log",
                      yaxis_title="ms")
    return _figure_html(fig, "chart-latency")


def _breakdown_chart(go: Any, df: pd.DataFrame) -> str:
    if len(df) == 0:
        return "<p class='note'>No stage spans to chart.</p>"
    fig = go.Figure()
    for _, r in df.iterrows():  # pipeline order, the one palette (tokentrace.palette)
        fig.add_bar(name=str(r["stage"]), x=[b for b, _ in _BARS], y=[float(r[c]) * 100 for _, c in _BARS],
                    marker_color=label_colour(str(r["stage"])),
                    hovertemplate=f"{r['stage']}: %{{y:.1f}}% of %{{x}}<extra></extra>")
    fig.update_layout(title="Where the time went: share of each stage (%)", barmode="stack",
                      yaxis_title="% of latency", yaxis_range=[0, 100])
    return _figure_html(fig, "chart-stages")


def _timeline_charts(go: Any, windows: pd.DataFrame, queues: pd.DataFrame, names: dict[int, str]) -> str:
    out = []
    if len(windows):
        fig = go.Figure()
        for metric in ("ttft", "itl"):
            part = windows[windows["metric"] == metric].sort_values("window_start_s")
            for p in ("p50_ms", "p99_ms"):
                fig.add_scatter(x=part["window_start_s"], y=part[p], mode="lines+markers",
                                name=f"{metric.upper()} {p.removesuffix('_ms')}")
        fig.update_layout(title="Latency over time (per window)", xaxis_title="s since run start",
                          yaxis_title="ms")
        out.append(_figure_html(fig, "chart-latency-time"))
    if len(queues):
        fig = go.Figure()
        for instance, part in queues.groupby(col.INSTANCE_ID):
            part = part.sort_values("t_s")
            name = names.get(int(instance), "unknown instance")
            fig.add_scatter(x=part["t_s"], y=part[col.NUM_WAITING], mode="lines+markers", name=f"waiting {name}")
            fig.add_scatter(x=part["t_s"], y=part[col.NUM_RUNNING], mode="lines+markers", name=f"running {name}",
                            line_dash="dot")
        fig.update_layout(title="Queue lengths over time (mean per bucket)", xaxis_title="s since run start",
                          yaxis_title="requests")
        out.append(_figure_html(fig, "chart-queues"))
    return "".join(out) or "<p class='note'>No time series: the run has no steps or windows to chart.</p>"


def _diff_chart(go: Any, diff: pd.DataFrame | None) -> str:
    if diff is None or len(diff) == 0:
        return ""
    diff = diff[(diff["baseline"].fillna(0) != 0) | (diff["candidate"].fillna(0) != 0)]  # stages neither run had
    colors = [WORSE_COLOUR if reg else BETTER_COLOUR if sig else UNCHANGED_COLOUR
              for reg, sig in zip(diff["regression"].astype(bool), diff["significant"].astype(bool))]
    fig = go.Figure()
    fig.add_bar(x=[f"{m} {s}" for m, s in zip(diff["metric"], diff["statistic"])],
                y=diff["rel_change"].astype(float) * 100, marker_color=colors, showlegend=False)
    fig.update_layout(title="Change against the baseline (%): vermillion = significant regression, "
                            "blue = significant improvement", yaxis_title="% change")
    return _figure_html(fig, "chart-diff")


def _speculative_charts(go: Any, rep: Any) -> str:
    """Acceptance by draft position, accepted proposals per step, draft cost, ITL by batch size; nothing without
    speculation (its section says so)."""
    if rep is None or rep.is_empty:
        return ""
    out = [_figure_html(spec_charts.acceptance_figure(go, rep.by_position), "chart-spec-acceptance"),
           _figure_html(spec_charts.accepted_per_step_figure(go, rep.accepted_per_step), "chart-spec-accepted")]
    if len(rep.cost) and len(rep.rejected):
        out.append(_figure_html(spec_charts.cost_figure(go, rep.cost, rep.rejected), "chart-spec-cost", height=240))
    if len(rep.by_batch):
        out.append(_figure_html(spec_charts.itl_by_batch_figure(go, rep.by_batch), "chart-spec-itl"))
    return "".join(out)


def _instance_names(report: Report) -> dict[int, str]:
    """Instance id -> the name a person reads, from the run manifest's instances (never the id)."""
    return instance_labels(list(report.run.instances))


_HTML_NOTES = {"queues": "Waiting and running requests over time, per engine instance: the chart "
                         "\u201cQueue lengths over time\u201d above."}
"""Section notes that point at the HTML report, as this report says them."""


def _headline_html(report: Report) -> str:
    """The report's first lines: the SLO verdict (red when a target was missed) and its causes, then the load
    verdict (red when saturated), the advice, the attribution."""
    if not report.headline:
        return ""
    out = []
    for line in report.headline:
        if report.diagnosis and line == report.diagnosis.get("verdict"):
            cls = "fail" if report.diagnosis.get("num_missed") else "pass"
            out.append(f"<p class='{cls}' id='slo-verdict'>{html.escape(line)}</p>")
        elif line == report.load.get("verdict"):
            cls = "fail" if report.load.get("saturated") is True else "headline"
            out.append(f"<p class='{cls}' id='load-verdict'>{html.escape(line)}</p>")
        elif line.startswith("Why #"):
            out.append(f"<p class='why'>{html.escape(line)}</p>")
        else:
            out.append(f"<p>{html.escape(line)}</p>")
    return "".join(out)


def _budgets_html(report: Report) -> str:
    if not report.budgets:
        return "<p class='note'>No budgets were checked (--budget FILE).</p>"
    rows = "".join(
        f"<tr><td class='{'pass' if r.passed else 'fail'}'>{'pass' if r.passed else 'FAIL'}</td>"
        f"<td>{html.escape(r.budget.text)}</td><td>{html.escape(format_value(r.actual, r.budget.kind))}</td>"
        f"<td>{html.escape(r.message)}</td></tr>" for r in report.budgets)
    verdict = "<p class='pass'>All budgets hold.</p>" if report.passed else "<p class='fail'>Budgets violated.</p>"
    return f"{verdict}<table><thead><tr><th></th><th>budget</th><th>measured</th><th>detail</th></tr></thead>" \
           f"<tbody>{rows}</tbody></table>"


def _sections_html(report: Report) -> str:
    names = _instance_names(report)
    parts = []
    for s in report.sections:
        if s.key == "diff" and report.baseline is None:
            continue
        parts.append(f"<h2 id='{html.escape(s.key)}'>{html.escape(s.title)}</h2>")
        note = _HTML_NOTES.get(s.key, s.note) if "HTML report" in s.note else s.note
        if note:
            parts.append(f"<p class='note'>{html.escape(note)}</p>")
        for caption, df in s.tables:
            if caption:
                parts.append(f"<p class='caption'>{html.escape(caption)}</p>")
            parts.append(html_table(df, names))
    return "".join(parts)


def run_line(report: Report) -> str:
    """How much the run holds, in requests (not rows: each process writes its own row of a request)."""
    run = report.run
    rows = run.rows
    num = report.load.get("num_requests")
    requests = f"{int(num):,} requests" if isinstance(num, (int, float)) and num == num else "requests"
    names = sorted(_instance_names(report).values())
    return (f"{requests} ({rows.get(REQUESTS.name, 0):,} request rows, {rows.get(TOKENS.name, 0):,} token rows and "
            f"{rows.get(SPANS.name, 0):,} span rows from {len(names)} traced process(es): {', '.join(names) or '-'})")


def render_html(report: Report) -> str:
    """The whole report as a standalone HTML document (plotly.js inlined; no network access)."""
    import plotly.graph_objects as go

    run = report.run
    title = f"tokentrace report: run {run.run_id}"
    baseline = "" if report.baseline is None else f"; baseline run {html.escape(report.baseline.run_id)}"
    regressions = "".join(f"<li class='fail'>{html.escape(r)}</li>" for r in report.regressions)
    charts = (_latency_chart(go, report.charts.latency) + _breakdown_chart(go, report.charts.breakdown)
              + _timeline_charts(go, report.charts.windows, report.charts.queues, _instance_names(report))
              + _speculative_charts(go, report.charts.speculation) + _diff_chart(go, report.diff))
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style>"
        f"<script type='text/javascript'>{bundle_text()}</script></head><body>"
        f"<h1>{html.escape(title)}</h1>{_headline_html(report)}<p class='note'>{html.escape(run_line(report))}; "
        f"store {html.escape(run.path)}; created {html.escape(run.created or '-')}{baseline}</p>"
        f"<h2>Budgets</h2>{_budgets_html(report)}"
        + (f"<h2>Significant regressions</h2><ul>{regressions}</ul>" if regressions else "")
        + f"<h2>Charts</h2>{charts}{_sections_html(report)}</body></html>\n"
    )
