"""The waterfall of one request: every stage on one aligned timeline, one lane per process.

Input is a :class:`dashboard.data.RequestTrace` (rows already on the run's
reference clock, by :meth:`tokentrace.clock.RunClocks.align`). Drawing only:

* one lane per traced process that recorded a row of the request, named as every
  view names it (``prefill-0``, ``colocated · engine-0``;
  :func:`tokentrace.app.report.render_names.instance_labels`) and ordered gateway,
  prefill, colocated, decode, other, client;
* each stage interval is a horizontal bar on its process's lane, in the stage's
  colour of the one palette (:mod:`tokentrace.palette`), one legend entry per stage;
* each token is a tick on the lane of the process that recorded it: the time the
  server sent it (its emit time if it was never sent), or, on the client's lane,
  the time the client received it; so the client's view sits against the server's;
* the client's lane also carries a bar from when it sent the request to when the
  last chunk arrived;
* a hand-over between processes (the gateway routing to a worker, the prefill
  worker's KV going to the decode worker, a token relayed back to the gateway) is
  an arrow from the end of the stage on one lane to the start of the next stage of
  the same token on another lane.

The x axis is milliseconds since the earliest time of the request on any lane.
``focus_token`` zooms the x axis to one token's interval (token 0: arrival to first
token; token i: token i-1's delivery to token i's), with a margin on each side.
Token tick traces are named ``TICKS_PREFIX + lane``; the arrows' trace is
:data:`HANDOVER_NAME` (tests count their points).
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from dashboard.components.figures import shown_label
from dashboard.data import RequestTrace
from tokentrace.app.report.render_names import instance_labels
from tokentrace.palette import STAGE_COLOURS
from tokentrace.schema import Role, Stage, col

__all__ = ["waterfall_figure", "TICKS_PREFIX", "HANDOVER_NAME", "token_intervals_ms", "lane_names", "request_name",
           "MAX_HANDOVERS"]

TICKS_PREFIX = "tokens · "
HANDOVER_NAME = "hand-over between processes"
MAX_HANDOVERS = 400  # arrows drawn at most (the first ones in time); a long request has one per token
_ROLE_ORDER = [Role.GATEWAY, Role.PREFILL, Role.COLOCATED, Role.DECODE, Role.OTHER, Role.CLIENT]
_MARGIN = 0.15  # of a zoomed token's interval, on each side


def _seen(trace: RequestTrace) -> set[int]:
    return {int(i) for frame in (trace.spans, trace.tokens, trace.requests) for i in frame[col.INSTANCE_ID]}


def lane_names(trace: RequestTrace) -> dict[int, str]:
    """Instance id -> lane name, for every process with a row of the request."""
    names = instance_labels(trace.instances, _seen(trace))
    return {iid: names[iid] for iid in _seen(trace)}


def _lane_order(trace: RequestTrace, names: dict[int, str]) -> list[str]:
    roles = {int(r[col.INSTANCE_ID]): int(r[col.ROLE]) for _, r in trace.instances.iterrows()}

    def key(iid: int) -> tuple[int, str]:
        role = roles.get(iid)
        return (_ROLE_ORDER.index(Role(role)) if role is not None else len(_ROLE_ORDER), names[iid])

    return [names[i] for i in sorted(names, key=key)]


def _origin_ns(trace: RequestTrace) -> int:
    candidates = [trace.spans[col.START_NS].min(), trace.requests[col.ARRIVAL_NS].min(),
                  trace.tokens[col.EMIT_NS].min(), trace.tokens[col.RECV_NS].min()]
    values = [int(v) for v in candidates if pd.notna(v)]
    return min(values) if values else 0


def _client_ids(trace: RequestTrace) -> set[int]:
    return {int(r[col.INSTANCE_ID]) for _, r in trace.instances.iterrows() if int(r[col.ROLE]) == int(Role.CLIENT)}


def request_name(trace: RequestTrace) -> str:
    """The request's own id string (``requests.request_key``): what its server and client call it."""
    keys = [str(k) for k in trace.requests.get(col.REQUEST_KEY, pd.Series(dtype=object)).dropna() if str(k)]
    return shown_label(keys[0]) if keys else "(no request key recorded)"


def token_intervals_ms(trace: RequestTrace) -> dict[int, tuple[float, float]]:
    """Token index -> (start, end) ms on the waterfall's axis: the server's delivery times
    (sent, else emitted), token 0 from the request's first server arrival."""
    t0 = _origin_ns(trace)
    tok = trace.tokens[~trace.tokens[col.INSTANCE_ID].isin(_client_ids(trace))]
    if tok.empty:
        return {}
    when = tok[col.SENT_NS].where(tok[col.SENT_NS].notna(), tok[col.EMIT_NS])
    ends = when.groupby(tok[col.TOKEN_INDEX]).min().dropna().sort_index()
    req = trace.requests[~trace.requests[col.INSTANCE_ID].isin(_client_ids(trace))]
    arrival = req[col.ARRIVAL_NS].min() if len(req) else None
    out: dict[int, tuple[float, float]] = {}
    previous = int(arrival) if arrival is not None and pd.notna(arrival) else None
    for index, end in ends.items():
        if previous is not None:
            out[int(index)] = ((previous - t0) / 1e6, (int(end) - t0) / 1e6)
        previous = int(end)
    return out


def waterfall_figure(trace: RequestTrace, *, title: str | None = None, focus_token: int | None = None) -> go.Figure:
    """The request's waterfall (see the module doc)."""
    names = lane_names(trace)
    order = _lane_order(trace, names)
    t0 = _origin_ns(trace)
    fig = go.Figure()
    spans = trace.spans
    for stage in Stage:
        rows = spans[spans[col.STAGE] == int(stage)]
        if rows.empty:
            continue
        start_ms = (rows[col.START_NS] - t0) / 1e6
        dur_ms = (rows[col.END_NS] - rows[col.START_NS]) / 1e6
        token = ["request" if int(i) < 0 else f"token {int(i)}" for i in rows[col.TOKEN_INDEX]]
        fig.add_trace(go.Bar(
            y=[names[int(i)] for i in rows[col.INSTANCE_ID]], x=dur_ms.tolist(), base=start_ms.tolist(),
            orientation="h", name=stage.label, marker_color=STAGE_COLOURS[stage], customdata=token,
            hovertemplate=(f"<b>{stage.label}</b> (%{{customdata}})<br>starts at %{{base:,.3f}} ms, "
                           f"lasts %{{x:,.3f}} ms<extra>%{{y}}</extra>")))
    _client_bars(fig, trace, names, t0)
    _handovers(fig, trace, names, t0)
    _token_ticks(fig, trace, names, t0)
    heading = f"Request {request_name(trace)}" if title is None else title
    fig.update_layout(template="plotly_white", barmode="overlay", height=(230 if heading else 190) + 60 * len(order),
                      title=dict(text=heading, y=0.98, yanchor="top"),
                      xaxis_title="ms since the request's first recorded time (run's reference clock)",
                      yaxis=dict(categoryorder="array", categoryarray=list(reversed(order)), type="category"),
                      margin=dict(l=170, r=20, t=120 if heading else 90, b=50),  # the legend: between title and plot
                      legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0, font=dict(size=11)),
                      separators=".,")
    if focus_token is not None:
        interval = token_intervals_ms(trace).get(int(focus_token))
        if interval is not None:
            lo, hi = interval
            pad = max((hi - lo) * _MARGIN, 0.01)
            fig.update_xaxes(range=[lo - pad, hi + pad], autorange=False)
    return fig


def _client_bars(fig: go.Figure, trace: RequestTrace, names: dict[int, str], t0: int) -> None:
    req = trace.requests
    rows = req[req[col.INSTANCE_ID].isin(_client_ids(trace)) & req[col.ARRIVAL_NS].notna()]
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
        y=[names[int(i)] for i in rows[col.INSTANCE_ID]],
        x=[(e - s) / 1e6 for e, s in zip(ends, rows[col.ARRIVAL_NS])],
        base=start_ms.tolist(), orientation="h", name="client: sent → last chunk", marker_color="rgba(0,0,0,0.12)",
        marker_line=dict(color="#555", width=1),
        hovertemplate="client: sent at %{base:,.3f} ms, last chunk %{x:,.3f} ms later<extra></extra>"))


def _handovers(fig: go.Figure, trace: RequestTrace, names: dict[int, str], t0: int) -> None:
    """An arrow wherever the next stage of the same token (in time) runs on another process."""
    spans = trace.spans.sort_values([col.TOKEN_INDEX, col.START_NS, col.END_NS], kind="stable")
    xs: list[float | None] = []
    ys: list[str | None] = []
    sizes: list[int] = []
    text: list[str] = []
    count = 0
    for _, rows in spans.groupby(col.TOKEN_INDEX, sort=True):
        previous = None
        for r in rows.itertuples(index=False):
            row = r._asdict()
            if previous is not None and int(previous[col.INSTANCE_ID]) != int(row[col.INSTANCE_ID]):
                a, b = names[int(previous[col.INSTANCE_ID])], names[int(row[col.INSTANCE_ID])]
                x0, x1 = (int(previous[col.END_NS]) - t0) / 1e6, (int(row[col.START_NS]) - t0) / 1e6
                label = (f"{Stage(int(previous[col.STAGE])).label} on {a} → {Stage(int(row[col.STAGE])).label} on {b}"
                         f" ({x1 - x0:+,.3f} ms)")
                xs += [x0, x1, None]
                ys += [a, b, None]
                sizes += [0, 11, 0]
                text += [label, label, ""]
                count += 1
                if count >= MAX_HANDOVERS:
                    break
            previous = row
        if count >= MAX_HANDOVERS:
            break
    if not count:
        return
    fig.add_trace(go.Scatter(
        x=xs, y=ys, mode="lines+markers", name=HANDOVER_NAME, line=dict(color="#444", width=1.2),
        marker=dict(symbol="arrow", angleref="previous", size=sizes, color="#444"), text=text,
        hovertemplate="%{text}<extra>hand-over</extra>", connectgaps=False))


def _token_ticks(fig: go.Figure, trace: RequestTrace, names: dict[int, str], t0: int) -> None:
    tok = trace.tokens
    for iid in sorted(set(int(i) for i in tok[col.INSTANCE_ID])):
        rows = tok[tok[col.INSTANCE_ID] == iid]
        when = rows[col.RECV_NS].where(rows[col.RECV_NS].notna(), rows[col.SENT_NS])
        when = when.where(when.notna(), rows[col.EMIT_NS])
        keep = when.notna()
        if not keep.any():
            continue
        lane = names[iid]
        fig.add_trace(go.Scatter(
            x=((when[keep] - t0) / 1e6).tolist(), y=[lane] * int(keep.sum()), mode="markers",
            name=TICKS_PREFIX + lane, marker=dict(symbol="line-ns-open", size=22, line=dict(width=2), color="#222"),
            customdata=rows.loc[keep, col.TOKEN_INDEX].tolist(),
            hovertemplate="token %{customdata} at %{x:,.3f} ms<extra>%{y}</extra>"))
