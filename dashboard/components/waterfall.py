"""The waterfall of one request: every stage on one aligned timeline, one lane per process.

Input is a :class:`dashboard.data.RequestTrace` (rows already on the run's
reference clock, by :meth:`tokentrace.clock.RunClocks.align`). Drawing only:

* one lane per traced process that recorded a row of the request, labelled
  ``role · name`` and ordered gateway, prefill, colocated, decode, other, client;
* each stage interval is a horizontal bar on its process's lane, coloured by stage
  (one legend entry per stage);
* each token is a tick on the lane of the process that recorded it: the time the
  server sent it (its emit time if it was never sent), or, on the client's lane,
  the time the client received it; so the client's view sits against the server's;
* the client's lane also carries a bar from when it sent the request to when the
  last chunk arrived.

The x axis is milliseconds since the earliest time of the request on any lane.
Token tick traces are named ``TICKS_PREFIX + lane`` (tests count their points).
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from dashboard.data import RequestTrace
from tokentrace.schema import Role, Stage, col

__all__ = ["waterfall_figure", "TICKS_PREFIX", "lane_label", "stage_color"]

TICKS_PREFIX = "tokens · "
_ROLE_ORDER = [Role.GATEWAY, Role.PREFILL, Role.COLOCATED, Role.DECODE, Role.OTHER, Role.CLIENT]
_PALETTE = {  # one per stage
    Stage.GATEWAY_ACCEPT: "#9c755f", Stage.GATEWAY_RECEIVE: "#4e79a7", Stage.GATEWAY_TOKENIZE: "#a0cbe8",
    Stage.GATEWAY_ROUTE: "#f28e2b", Stage.SCHEDULE_QUEUE: "#ffbe7d", Stage.CACHE_LOOKUP: "#59a14f",
    Stage.CACHE_LOAD: "#8cd17d", Stage.PREFILL_COMPUTE: "#b6992d", Stage.TRANSFER_KV: "#f1ce63",
    Stage.DECODE_QUEUE: "#499894", Stage.DECODE_COMPUTE: "#86bcb6", Stage.SCHEDULE_PREEMPTED: "#e15759",
    Stage.DETOKENIZE: "#ff9d9a", Stage.STREAM_RELAY: "#d37295", Stage.STREAM_SEND: "#79706e",
}


def stage_color(label: str) -> str:
    """The colour of a stage (by its dotted label) in every chart; grey for unattributed or unknown labels."""
    try:
        return _PALETTE[Stage.from_label(label)]
    except ValueError:
        return "#bab0ac"


def lane_label(role: int | None, name: str | None, instance_id: int) -> str:
    """``role · name`` of a process (its id when it has no instances row)."""
    if role is None:
        return f"instance {instance_id}"
    return f"{Role(int(role)).label} · {name or instance_id}"


def _lanes(trace: RequestTrace) -> dict[int, tuple[int, str]]:
    """instance id -> (sort key, label) for every process with a row of the request."""
    seen = set(trace.spans[col.INSTANCE_ID]) | set(trace.tokens[col.INSTANCE_ID]) | set(
        trace.requests[col.INSTANCE_ID])
    known = {int(r[col.INSTANCE_ID]): r for _, r in trace.instances.iterrows()}
    lanes = {}
    for iid in sorted(int(i) for i in seen):
        row = known.get(iid)
        role = None if row is None else int(row[col.ROLE])
        order = _ROLE_ORDER.index(Role(role)) if role is not None else len(_ROLE_ORDER)
        lanes[iid] = (order, lane_label(role, None if row is None else row[col.NAME], iid))
    return lanes


def _origin_ns(trace: RequestTrace) -> int:
    candidates = [trace.spans[col.START_NS].min(), trace.requests[col.ARRIVAL_NS].min(),
                  trace.tokens[col.EMIT_NS].min(), trace.tokens[col.RECV_NS].min()]
    values = [int(v) for v in candidates if pd.notna(v)]
    return min(values) if values else 0


def waterfall_figure(trace: RequestTrace) -> go.Figure:
    """The request's waterfall (see the module doc)."""
    lanes = _lanes(trace)
    label = {iid: lab for iid, (_, lab) in lanes.items()}
    order = [lab for _, (_, lab) in sorted(lanes.items(), key=lambda kv: (kv[1][0], kv[1][1]))]
    t0 = _origin_ns(trace)
    fig = go.Figure()
    spans = trace.spans
    for stage in Stage:
        rows = spans[spans[col.STAGE] == int(stage)]
        if rows.empty:
            continue
        start_ms = (rows[col.START_NS] - t0) / 1e6
        dur_ms = (rows[col.END_NS] - rows[col.START_NS]) / 1e6
        fig.add_trace(go.Bar(
            y=[label[int(i)] for i in rows[col.INSTANCE_ID]], x=dur_ms.tolist(), base=start_ms.tolist(),
            orientation="h", name=stage.label, marker_color=_PALETTE[stage],
            customdata=rows[col.TOKEN_INDEX].tolist(),
            hovertemplate=f"{stage.label}<br>token %{{customdata}}<br>%{{base:.3f}} ms + %{{x:.3f}} ms<extra></extra>"))
    _client_bars(fig, trace, label, t0)
    _token_ticks(fig, trace, label, t0)
    fig.update_layout(template="plotly_white", barmode="overlay", height=200 + 60 * len(order),
                      title=dict(text=f"Request {trace.request_id}: stages and tokens on the run's reference clock",
                                 y=0.98, yanchor="top"),
                      xaxis_title="ms since the request's first recorded time",
                      yaxis=dict(categoryorder="array", categoryarray=list(reversed(order))),
                      margin=dict(l=160, r=20, t=100, b=50),  # the legend sits between title and plot
                      legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0))
    return fig


def _client_bars(fig: go.Figure, trace: RequestTrace, label: dict[int, str], t0: int) -> None:
    req = trace.requests
    clients = [iid for iid, lab in label.items() if lab.startswith(Role.CLIENT.label + " ")]
    rows = req[req[col.INSTANCE_ID].isin(clients) & req[col.ARRIVAL_NS].notna()]
    if rows.empty:
        return
    tok = trace.tokens
    ends = []
    for _, r in rows.iterrows():
        recv = tok.loc[tok[col.INSTANCE_ID] == r[col.INSTANCE_ID], col.RECV_NS].dropna()
        end = recv.max() if len(recv) else r[col.FINISH_NS]
        ends.append(end if pd.notna(end) else r[col.ARRIVAL_NS])
    start_ms = (rows[col.ARRIVAL_NS] - t0) / 1e6
    fig.add_trace(go.Bar(
        y=[label[int(i)] for i in rows[col.INSTANCE_ID]], x=[(e - s) / 1e6 for e, s in zip(ends, rows[col.ARRIVAL_NS])],
        base=start_ms.tolist(), orientation="h", name="client: sent → last chunk", marker_color="rgba(0,0,0,0.12)",
        marker_line=dict(color="#555", width=1), hovertemplate="client<br>%{base:.3f} ms + %{x:.3f} ms<extra></extra>"))


def _token_ticks(fig: go.Figure, trace: RequestTrace, label: dict[int, str], t0: int) -> None:
    tok = trace.tokens
    for iid in sorted(set(int(i) for i in tok[col.INSTANCE_ID])):
        rows = tok[tok[col.INSTANCE_ID] == iid]
        when = rows[col.RECV_NS].where(rows[col.RECV_NS].notna(), rows[col.SENT_NS])
        when = when.where(when.notna(), rows[col.EMIT_NS])
        keep = when.notna()
        if not keep.any():
            continue
        lane = label[iid]
        fig.add_trace(go.Scatter(
            x=((when[keep] - t0) / 1e6).tolist(), y=[lane] * int(keep.sum()), mode="markers",
            name=TICKS_PREFIX + lane, marker=dict(symbol="line-ns-open", size=22, line=dict(width=2), color="#222"),
            customdata=rows.loc[keep, col.TOKEN_INDEX].tolist(),
            hovertemplate="token %{customdata}<br>%{x:.3f} ms<extra></extra>"))
