"""Overview: whether the run met its SLO targets and why not (the causes ranked by the share of the missed time
they explain, with their fixes), then whether it was saturated (offered against served load, and which pool), the
instance advice, headline latency percentiles, SLO attainment, goodput, and latency over time."""

from __future__ import annotations

from typing import Any

import dash
import pandas as pd

from analyzers.analysis import RunAnalysis
from dashboard.components.controls import grouping_picker, run_picker
from dashboard.components.explanations import EXPLAIN
from dashboard.components.figures import bars, explained, fmt, graph_or_notice, kpis, lines
from dashboard.components.shell import GROUP_COLUMN, GROUPINGS, ViewQuery, live_callback, notice, page
from dashboard.components.slo_lines import add_slo_lines, slo_targets
from dashboard.data import DataSource, series_window_s
from tokentrace.app.report.diagnosis import cause_lines, slo_verdict
from tokentrace.app.report.headline import advice_sentence, load_sentence
from tokentrace.schema import STEPS, col
from tokentrace.store.manifest import DROPPED, SAMPLED_OUT

PATH = "/"
dash.register_page(__name__, path=PATH, name="Overview", title="tokentrace · overview")

_ALL = "*"  # the analyzers' row for all SLO classes together
_SERIES = (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "End-to-end"))


def _pct(frame: pd.DataFrame, metric: str, column: str) -> Any:
    rows = frame[frame["metric"] == metric]
    return None if rows.empty else rows[column].iloc[0]


def _all_row(frame: pd.DataFrame, column: str) -> Any:
    rows = frame[frame[col.SLO_CLASS] == _ALL]
    return None if rows.empty else rows[column].iloc[0]


def _headline(src: DataSource, rid: str) -> list[Any]:
    lat = src.result(rid, RunAnalysis.latency)
    slo = src.result(rid, RunAnalysis.slo)
    good = src.result(rid, RunAnalysis.goodput)
    cards = []
    for metric, label in (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "E2E")):
        cards.append((f"{label} p50", fmt(_pct(lat, metric, "p50_ms"), "ms")))
        cards.append((f"{label} p99", fmt(_pct(lat, metric, "p99_ms"), "ms")))
    attainment = _all_row(slo, "attainment")
    cards.append(("SLO attainment", _measured(None if attainment is None else 100 * attainment, "%")))
    cards.append(("goodput", _measured(_all_row(good, "goodput_rps"), "req/s", 2)))
    return [kpis(cards, kpi_id="overview-kpis")]


def _measured(value: Any, unit: str, digits: int = 1) -> str:
    """A KPI value, or "not measured" where the run did not measure it (never 0 or met)."""
    if value is None or (isinstance(value, float) and value != value):
        return "not measured"
    return fmt(value, unit, digits)


_WHY_EXPLAIN = ("Whether every served request met its SLO class's targets (TTFT, TPOT, and ITL on every token gap), "
                "and for those that missed, the causes of their time over target found in the trace by documented "
                "rules (docs/diagnosis.md), ranked by the share of all the missed time each explains, with the "
                "setting that changes it. `tokentrace why` tells each request's story.")


def _why(src: DataSource, rid: str) -> list[Any]:
    """The SLO verdict (the report's first line) and the causes of the missed time, with their fixes."""
    d = src.result(rid, RunAnalysis.diagnosis)
    kind = "tt-saturated" if d.num_missed else "tt-not-saturated" if d.num_judged else "tt-unjudged"
    parts: list[Any] = [dash.html.P(slo_verdict(d), id="overview-slo-verdict", className=f"tt-verdict {kind}")]
    lines = cause_lines(d)
    if lines:
        parts.append(dash.html.Ul([dash.html.Li(line) for line in lines], id="overview-causes"))
    return [explained("Targets and why they were missed", _WHY_EXPLAIN, *parts)]


def _load(src: DataSource, rid: str) -> list[Any]:
    """The saturation verdict, offered and served load, and the instance advice (never an all-clear while a target
    is missed)."""
    report = src.result(rid, RunAnalysis.load)
    row = report.row
    saturated = row.get("saturated")
    missed = bool(src.result(rid, RunAnalysis.diagnosis).num_missed)
    kind = ("tt-saturated" if saturated is True else "tt-not-saturated" if saturated is False and not missed
            else "tt-unjudged")
    verdict = dash.html.P(load_sentence(row, report.pools, report.stages), id="overview-load-verdict",
                          className=f"tt-verdict {kind}")
    cards = kpis([("offered load (arrival window)", fmt(row.get("offered_rps"), "req/s", 2)),
                  ("served load", fmt(row.get("served_rps"), "req/s", 2)),
                  ("saturated", {True: "yes", False: "no"}.get(saturated, "not judged")),
                  ("pool that saturates", row.get("saturated_pool") or "—")], kpi_id="overview-load")
    parts: list[Any] = [verdict, cards]
    if src.info(rid).tables.get(STEPS.name, 0):
        pd_report = src.result(rid, RunAnalysis.pd_ratio)
        parts.append(dash.html.P(advice_sentence(pd_report.recommendation, pd_report.demand, slo_missed=missed),
                                 id="overview-advice", className="tt-explain"))
    return [explained("Load", EXPLAIN["load"], *parts)]


def _counters(src: DataSource, rid: str) -> list[Any]:
    counters = src.open(rid).counters()
    lost = {k: counters.get(k, 0) for k in (DROPPED, SAMPLED_OUT) if counters.get(k, 0)}
    if not lost:
        return []
    text = ", ".join(f"{v:,} events {k.replace('_', ' ')}" for k, v in lost.items())
    return [explained("Missing events", EXPLAIN["counters"], notice(f"This run has {text}.", kind="error"))]


def _series(src: DataSource, rid: str) -> list[Any]:
    w = series_window_s(src.info(rid).duration_ns)
    frame = src.result(rid, RunAnalysis.latency, window_s=w)
    targets = slo_targets(src.result(rid, RunAnalysis.slo))
    graphs = []
    for metric, label in _SERIES:
        rows = frame[frame["metric"] == metric] if len(frame) else frame

        def build(r: pd.DataFrame, metric: str = metric, label: str = label) -> Any:
            fig = lines(r, "window_start_s", ["p50_ms", "p99_ms"], title=f"{label} per {w} s window",
                        xaxis="s since the run started", yaxis="ms")
            return add_slo_lines(fig, targets, metric)

        graphs.append(graph_or_notice(rows, f"overview-series-{metric}", build, f"No {label} samples in this run."))
    return [explained("Over time", EXPLAIN["latency_series"], html_row(graphs))]


def html_row(children: list[Any]) -> Any:
    """Children side by side."""
    return dash.html.Div(children, className="tt-row")


def _slo(src: DataSource, rid: str) -> list[Any]:
    slo = src.result(rid, RunAnalysis.slo)
    good = src.result(rid, RunAnalysis.goodput)
    slo, good = _all_label(slo), _all_label(good)
    return [explained("SLO attainment and goodput", EXPLAIN["slo"] + " " + EXPLAIN["goodput"], html_row([
        graph_or_notice(slo, "overview-slo", lambda f: bars(
            f, col.SLO_CLASS, ["ttft_attainment", "tpot_attainment", "attainment"], title="SLO attainment by class",
            yaxis="share of requests", names=["TTFT met", "TPOT met", "both met"]), "No requests to judge."),
        graph_or_notice(good, "overview-goodput", lambda f: bars(
            f, col.SLO_CLASS, ["request_rate_rps", "goodput_rps"], title="Throughput and goodput by class",
            yaxis="requests/s", names=["completed", "met both SLOs"]), "No requests to judge."),
    ]))]


def _all_label(frame: pd.DataFrame) -> pd.DataFrame:
    """The analyzers' all-classes row relabelled for display."""
    return frame.assign(**{col.SLO_CLASS: frame[col.SLO_CLASS].replace({_ALL: "all classes"})}) if len(frame) else frame


def _grouped(src: DataSource, rid: str, by: str) -> list[Any]:
    if not by:
        return []
    frame = src.result(rid, RunAnalysis.latency, by=by)
    group = GROUP_COLUMN[by]
    names = src.instance_names(rid) if group == col.INSTANCE_ID else None
    graphs = []
    for metric, label in _SERIES:
        rows = frame[frame["metric"] == metric] if len(frame) else frame
        graphs.append(graph_or_notice(rows, f"overview-by-{metric}", lambda r, label=label: bars(
            r, group, ["p50_ms", "p99_ms"], title=f"{label} {GROUPINGS[by]}", yaxis="ms", instance_names=names),
            f"No {label} samples {GROUPINGS[by]} in this run."))
    return [explained(f"Latency {GROUPINGS[by]}", EXPLAIN["latency"], html_row(graphs))]


def body(src: DataSource, q: ViewQuery) -> list[Any]:
    """The overview of run ``q.run``."""
    rid = src.resolve(q.run)
    return (_why(src, rid) + _load(src, rid) + _headline(src, rid) + _counters(src, rid) + _series(src, rid) + _slo(src, rid)
            + _grouped(src, rid, q.by))


def controls(src: DataSource, q: ViewQuery) -> list[Any]:
    return [run_picker(src, q.run), grouping_picker(q)]


def layout(**query: str) -> Any:
    return page(PATH, "Overview", query, body, controls)


live_callback(PATH, body)
