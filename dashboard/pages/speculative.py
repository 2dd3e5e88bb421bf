"""Speculative decoding: acceptance by draft position, accepted proposals per step, draft cost, and ITL of
speculative against plain decode tokens by batch size (where speculation was slower)."""

from __future__ import annotations

from typing import Any

import dash
import plotly.graph_objects as go
from dash import html

from analyzers.analysis import RunAnalysis
from dashboard.components.controls import run_picker
from dashboard.components.explanations import EXPLAIN
from dashboard.components.figures import LAYOUT, explained, fmt, graph, kpis, table
from dashboard.components.shell import ViewQuery, live_callback, notice, page
from dashboard.data import DataSource
from tokentrace.app.report import speculative_charts as charts
from tokentrace.app.report.speculative import NO_SPECULATION, speculation_sentences
from tokentrace.schema import col

PATH = "/speculative"
dash.register_page(__name__, path=PATH, name="Speculative", title="tokentrace · speculative decoding")

_MODE_COLUMNS = ["mode", "num_steps", "num_tokens", "tokens_per_step", "mean_itl_ms", "p50_itl_ms", "p99_itl_ms",
                 "mean_carrier_itl_ms", "ms_per_token"]
_BATCH_COLUMNS = ["batch", "spec_tokens", "plain_tokens", "spec_mean_itl_ms", "plain_mean_itl_ms", "itl_delta_ms",
                  "spec_ms_per_token", "plain_ms_per_token", "p_adjusted", "slower"]
MAX_LISTED_REQUESTS = 1000  # the requests with the most speculative steps listed (the browser gets every listed row)
_GROUP_COLUMNS = ["num_steps", col.NUM_PROPOSED, col.NUM_ACCEPTED, "acceptance_rate", "mean_tokens_per_step",
                  "draft_share"]


def _figure(fig: Any, graph_id: str, *, height: int = 360) -> Any:
    fig.update_layout(**{**LAYOUT, "height": height})
    return graph(fig, graph_id)


def _pct(value: Any) -> str:
    return fmt(100 * float(value), "%")


def _cards(rep: Any) -> Any:
    s, c, r = rep.summary.iloc[0], rep.cost.iloc[0], rep.rejected.iloc[0]
    by_mode = rep.itl.set_index("mode") if len(rep.itl) else None
    items = [("acceptance rate", _pct(s["acceptance_rate"])),
             ("tokens per verify step", fmt(float(s["mean_tokens_per_step"]), "", 2)),
             ("draft share of decode compute", _pct(c["draft_share_of_decode"])),
             ("draft time on rejected proposals", _pct(r["rejected_draft_share"]))]
    for mode, label in (("speculative", "speculative"), ("plain", "plain")):
        if by_mode is not None and mode in by_mode.index:
            items.append((f"{label}: step time per token", fmt(float(by_mode.loc[mode, "ms_per_token"]), "ms", 2)))
    return kpis(items, kpi_id="spec-kpis")


def _itl_parts(rep: Any) -> list[Any]:
    parts: list[Any] = []
    if len(rep.by_batch):
        parts.append(_figure(charts.itl_by_batch_figure(go, rep.by_batch), "spec-itl-batch", height=400))
        shown = rep.by_batch.assign(batch=[charts.batch_label(lo, hi) for lo, hi in
                                           zip(rep.by_batch["batch_size_lo"], rep.by_batch["batch_size_hi"])])
        parts.append(table(shown[_BATCH_COLUMNS], "spec-batch-table", highlight="slower"))
    else:
        parts.append(notice("No decode token has a batch size (no steps rows): nothing to compare by batch size."))
    if len(rep.itl):
        parts.append(table(rep.itl[_MODE_COLUMNS], "spec-itl-table"))
    if len(rep.neighbours):
        parts.append(table(rep.neighbours, "spec-neighbours-table"))
    return parts


def body(src: DataSource, q: ViewQuery) -> list[Any]:
    """Speculative-decoding analyses of run ``q.run``."""
    rid = src.resolve(q.run)
    rep = src.result(rid, RunAnalysis.speculation)
    if rep.is_empty:
        return [notice(NO_SPECULATION)]
    sentences = html.Div([html.P(s) for s in speculation_sentences(rep)], id="spec-sentences",
                         className="tt-verdict tt-unjudged")
    cost = [notice("No draft or verify time was recorded.")]
    if len(rep.cost) and len(rep.rejected):
        cost = [_figure(charts.cost_figure(go, rep.cost, rep.rejected), "spec-cost", height=220),
                table(rep.rejected, "spec-rejected-table")]
    groups = [table(rep.by_tenant[[col.TENANT, *_GROUP_COLUMNS]], "spec-tenant-table"),
              table(rep.by_request.sort_values(["num_steps", col.REQUEST_KEY], ascending=[False, True]).head(
                  MAX_LISTED_REQUESTS)[[col.REQUEST_KEY, col.TENANT, *_GROUP_COLUMNS]], "spec-request-table",
                  page_size=10)]
    return [explained("Speculative decoding", EXPLAIN["spec"], sentences, _cards(rep)),
            explained("Acceptance by draft position", EXPLAIN["spec_position"],
                      html.Div([_figure(charts.acceptance_figure(go, rep.by_position), "spec-acceptance"),
                                _figure(charts.accepted_per_step_figure(go, rep.accepted_per_step),
                                        "spec-accepted")], className="tt-row")),
            explained("Draft cost and rejected work", EXPLAIN["spec_cost"], *cost),
            explained("ITL with and without speculation", EXPLAIN["spec_itl"], *_itl_parts(rep)),
            explained("Acceptance by tenant and request", EXPLAIN["spec_groups"], *groups)]


def controls(src: DataSource, q: ViewQuery) -> list[Any]:
    return [run_picker(src, q.run)]


def layout(**query: str) -> Any:
    return page(PATH, "Speculative decoding", query, body, controls)


live_callback(PATH, body)
