"""What-if: the simulator fitted to the run, its error on the run itself, the predicted latency and SLO
attainment against the request rate, and the rate each single setting change would sustain. The numbers
come from :mod:`analyzers.whatif` (its sweeps run on the server, cached per run)."""

from __future__ import annotations

import math
from typing import Any

import dash
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dashboard.components.controls import run_picker
from dashboard.components.figures import LAYOUT, explained, fmt, graph, kpis, table
from dashboard.components.shell import ViewQuery, live_callback, notice, page
from dashboard.data import DataSource
from tokentrace.app.report.whatif import error_text, metric_text
from tokentrace.schema import STEPS

PATH = "/whatif"
dash.register_page(__name__, path=PATH, name="What-if", title="tokentrace · what-if")

_EXPLAIN_FIT = ("A discrete-event simulator of the run's own engines (the scheduler's admission, chunked prefill, "
                "KV blocks and preemption) whose step time is fitted by least squares to the run's steps, replays "
                "the run's own requests. Measured against replayed: the simulator's error on this run, before it "
                "predicts anything else.")
_EXPLAIN_SWEEP = ("The run's requests replayed at 0.25x to 4x their rate (arrival gaps divided by the scale). "
                  "The dashed line is the SLO target share (90% of requests within their TTFT and TPOT targets).")
_EXPLAIN_CAPACITY = ("The highest rate scale at which 90% of requests still meet their SLO, under the run's own "
                     "configuration and with one setting changed at a time.")
_COLOURS = {"ttft.p50": "#4477AA", "ttft.p99": "#EE6677", "itl.p99": "#228833", "e2e.p99": "#AA3377"}
_NAMES = {"ttft.p50": "TTFT p50", "ttft.p99": "TTFT p99", "itl.p50": "ITL p50", "itl.p99": "ITL p99",
          "e2e.p50": "E2E p50", "e2e.p99": "E2E p99", "tpot.p50": "TPOT p50", "tpot.p99": "TPOT p99",
          "slo.all.attainment": "SLO attainment", "load.served_rps": "served (req/s)"}


def _fitted(src: DataSource, rid: str) -> Any:
    """The run's fitted what-if model, its capacity answer and its rate sweep (computed once per run)."""
    def compute() -> Any:
        from analyzers.whatif import fit_whatif
        from tokentrace.app.report.whatif import RATE_GRID, REPORT_MAX_REQUESTS, REPORT_REPLAYS, capacity_answer

        model = fit_whatif(src._analysis(rid, src.version(rid)).source, num_replays=REPORT_REPLAYS,
                           max_requests=REPORT_MAX_REQUESTS)
        sweep = model.sweep("rate_scale", list(RATE_GRID))
        frame, text = capacity_answer(model)
        return model, sweep, frame, text
    return src.cached(rid, ("whatif",), compute)


def fit_frame(model: Any) -> pd.DataFrame:
    """Measured against replayed per metric, with units, and the replay's error (signed)."""
    err = model.fit_error
    rows = [{"metric": _NAMES.get(k, k), "measured": metric_text(k, model.measured.get(k, math.nan)),
             "replayed": metric_text(k, model.fitted.get(k, math.nan)), "error": error_text(k, err.get(k, math.nan))}
            for k in _NAMES]
    return pd.DataFrame(rows)


def sweep_figure(sweep: Any) -> go.Figure:
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("Predicted latency (ms)", "Predicted SLO attainment"))
    x = [float(v) for v in sweep.values]
    for metric, colour in _COLOURS.items():
        y = [float(p.metrics.get(metric, math.nan)) for p in sweep.predictions]
        fig.add_trace(go.Scatter(x=x, y=y, name=_NAMES[metric], mode="lines+markers", line=dict(color=colour),
                                 hovertemplate=f"{_NAMES[metric]}: %{{y:,.1f}} ms at %{{x}}x<extra></extra>"),
                      row=1, col=1)
    att = [float(p.metrics.get("slo.all.attainment", math.nan)) for p in sweep.predictions]
    fig.add_trace(go.Scatter(x=x, y=att, name="SLO attainment", mode="lines+markers", line=dict(color="#332288"),
                             hovertemplate="%{y:.0%} of requests within their SLO at %{x}x<extra></extra>"),
                  row=2, col=1)
    fig.add_hline(y=sweep.target_share, row=2, col=1, line=dict(color="#8a1c14", width=1.5, dash="dash"),
                  annotation_text=f"target {sweep.target_share:.0%}", annotation_position="bottom left")
    fig.update_layout(**{**LAYOUT, "height": 620, "legend": dict(orientation="h", y=-0.1)})
    fig.update_xaxes(title_text="request rate, times the run's", row=2, col=1)
    fig.update_yaxes(tickformat=",~r", row=1, col=1)
    fig.update_yaxes(tickformat=".0%", range=[0, 1.05], row=2, col=1)
    return fig


def body(src: DataSource, q: ViewQuery) -> list[Any]:
    """The what-if view of run ``q.run``."""
    rid = src.resolve(q.run)
    if not src.info(rid).tables.get(STEPS.name, 0):
        return [notice("This run has no engine steps: there is no engine to fit a simulator to.")]
    try:
        model, sweep, capacity, text = _fitted(src, rid)
    except ValueError as err:
        return [notice(f"The simulator cannot be fitted to this run: {err}.")]
    step = model.models.all_steps
    best = sweep.highest_meeting
    cards = kpis([("highest rate meeting the SLO", "none swept" if best is None else f"{best:g}x"),
                  ("step-time error on the run's steps", fmt(100 * step.mape, "%", 0)),
                  ("step-time form (least held-out error)", step.form),
                  ("engine steps fitted", fmt(step.num_steps)),
                  ("requests replayed", fmt(sum(1 for r in model.trace.requests if r.ok)))], kpi_id="whatif-kpis")
    notes = [notice(n) for n in model.notes]
    return [explained("The fit, checked on the run itself", _EXPLAIN_FIT, cards, *notes,
                      table(fit_frame(model), "whatif-fit", page_size=12)),
            explained("Latency and SLO against request rate", _EXPLAIN_SWEEP,
                      graph(sweep_figure(sweep), "whatif-sweep")),
            explained("What moves the SLO-breaking rate", _EXPLAIN_CAPACITY, dash.html.P(text),
                      table(capacity, "whatif-capacity", page_size=8))]


def controls(src: DataSource, q: ViewQuery) -> list[Any]:
    return [run_picker(src, q.run)]


def layout(**query: str) -> Any:
    return page(PATH, "What-if", query, body, controls)


live_callback(PATH, body)
