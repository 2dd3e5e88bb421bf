"""Request explorer: the chosen request's waterfall and its causes beside a server-side paged, sortable, filterable
table.

The waterfall is there at once: without a chosen request it shows the first row of
the table (the request of the page with the slowest first token: the table sorts by TTFT). A click on a row puts its id into the
URL (``request``) and the page re-renders with that request's waterfall; the zoom
picker puts a token index into the URL (``token``) and the waterfall's time axis
closes in on that token's interval. Beside the waterfall, the request's
diagnosis: which targets it missed and the causes of its time over target, with
their evidence and fixes (the words of ``tokentrace why``). Request ids (63-bit
integers) travel as strings and are never shown: a request is named by its own key.
"""

from __future__ import annotations

from typing import Any

import dash
import pandas as pd
from dash import Input, Output, State, dash_table, html
from dash.dash_table.Format import Format, Group, Scheme

from analyzers.analysis import RunAnalysis
from dashboard.components.controls import choice, new_search, run_picker
from dashboard.components.explanations import EXPLAIN
from dashboard.components.figures import explained, fmt, graph, shown_label
from dashboard.components.shell import ViewQuery, guarded, live_callback, notice, page, parse_query, source
from dashboard.components.waterfall import request_name, token_intervals_ms, waterfall_figure
from dashboard.data import MAX_LISTED_REQUESTS, DataSource
from tokentrace.app.report.diagnosis import request_story
from tokentrace.app.report.render_names import column_label
from tokentrace.schema import col

PATH = "/explorer"
dash.register_page(__name__, path=PATH, name="Requests", title="tokentrace · requests")

PAGE_SIZE = 20  # rows per page of the request table
TABLE_ID = "explorer-table"
COLUMNS = (col.REQUEST_KEY, col.TENANT, col.SLO_CLASS, "ttft_ms", "tpot_ms", "e2e_ms", col.NUM_OUTPUT_TOKENS)
"""Shown columns; each row also carries its request id (as a string) for the selection, not shown."""
_DEFAULT_SORT = "ttft_ms"  # slowest first by time to first token: what a user waits on before any text
_MS = Format(group=Group.yes, precision=1, scheme=Scheme.fixed)


def table_rows(rows: pd.DataFrame) -> list[dict[str, Any]]:
    """Rows for the browser: the shown columns and the id as a string (JavaScript numbers lose 63-bit ids)."""
    keep = [c for c in (col.REQUEST_ID, *COLUMNS) if c in rows.columns]
    shown = rows[keep].copy()
    shown[col.REQUEST_ID] = shown[col.REQUEST_ID].astype("int64").astype(str)
    for c in ("ttft_ms", "tpot_ms", "e2e_ms"):
        if c in shown:
            shown[c] = shown[c].astype(float).round(3)
    for c in (col.TENANT, col.SLO_CLASS):
        if c in shown:
            shown[c] = shown[c].fillna("").replace({"": "(none)"})
    for c in (col.REQUEST_KEY, col.TENANT, col.SLO_CLASS):
        if c in shown:
            shown[c] = shown[c].map(lambda v: v if v is None else shown_label(v))
    return shown.astype(object).where(shown.notna(), None).to_dict("records")


def _sort_of(q: ViewQuery) -> tuple[str, bool]:
    """(column, descending) from the URL's ``sort`` (``-col`` = descending)."""
    text = q.sort or "-" + _DEFAULT_SORT
    return (text[1:], True) if text.startswith("-") else (text, False)


def _fetch(src: DataSource, q: ViewQuery, page_no: int) -> tuple[list[dict[str, Any]], int]:
    sort, desc = _sort_of(q)
    rows, pages = src.request_page(q.run, tenant=q.tenant or None, slo_class=q.slo or None, sort=sort,
                                   descending=desc, page=page_no, page_size=PAGE_SIZE)
    return table_rows(rows), pages


_HEADERS = {col.REQUEST_KEY: "request", col.SLO_CLASS: "class", "ttft_ms": "TTFT ms", "tpot_ms": "TPOT ms",
            "e2e_ms": "E2E ms", col.NUM_OUTPUT_TOKENS: "tokens"}  # short: the table sits beside the waterfall


def _column(c: str) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": _HEADERS.get(c, column_label(c)), "id": c}
    if c.endswith("_ms"):
        spec.update(type="numeric", format=_MS)
    elif c == col.NUM_OUTPUT_TOKENS:
        spec.update(type="numeric", format=Format(group=Group.yes))
    return spec


def _table(q: ViewQuery, data: list[dict[str, Any]], pages: int, chosen: str) -> Any:
    sort, desc = _sort_of(q)
    selected = [i for i, r in enumerate(data) if r[col.REQUEST_ID] == chosen]
    return dash_table.DataTable(
        id=TABLE_ID, data=data, columns=[_column(c) for c in COLUMNS],
        page_action="custom", page_current=min(q.page, pages - 1), page_size=PAGE_SIZE, page_count=pages,
        sort_action="custom", sort_mode="single",
        sort_by=[{"column_id": sort, "direction": "desc" if desc else "asc"}],
        style_table={"overflowX": "auto"}, style_cell={"fontSize": "13px", "padding": "4px 6px", "cursor": "pointer"},
        # a long request key is cut (with an ellipsis; the waterfall's title names it whole), never the E2E column
        style_cell_conditional=[{"if": {"column_id": col.REQUEST_KEY}, "maxWidth": "12em", "overflow": "hidden",
                                 "textOverflow": "ellipsis"}],
        style_header={"fontWeight": "bold"},
        style_data_conditional=[{"if": {"row_index": i}, "backgroundColor": "#dbe7fd", "fontWeight": "bold"}
                                for i in selected])


def _zoom_picker(q: ViewQuery, intervals: dict[int, tuple[float, float]]) -> Any:
    options = [{"label": "the whole request", "value": ""}] + [
        {"label": f"token {i}{' (first token)' if i == 0 else ''}: {hi - lo:,.2f} ms", "value": str(i)}
        for i, (lo, hi) in sorted(intervals.items())]
    return choice("token", "Zoom to", options, q.token or "", clearable=False, width="22em")


def _waterfall(src: DataSource, q: ViewQuery, chosen: str, row: dict[str, Any] | None) -> list[Any]:
    if not chosen:
        return [notice("No request matches these filters: nothing to draw.")]
    trace = src.request_trace(q.run, chosen)
    intervals = token_intervals_ms(trace)
    focus = int(q.token) if q.token else None
    if focus is not None and focus not in intervals:
        return [notice(f"Request {request_name(trace)} has no token {focus}: it delivered {len(intervals):,} "
                       f"token(s).", kind="error")]
    facts = []
    if row is not None:
        facts = [f"tenant {shown_label(row.get(col.TENANT) or '(none)')}",
                 f"class {shown_label(row.get(col.SLO_CLASS) or '(none)')}",
                 f"TTFT {fmt(row.get('ttft_ms'), 'ms', 1)}", f"end-to-end {fmt(row.get('e2e_ms'), 'ms', 1)}",
                 f"{fmt(row.get(col.NUM_OUTPUT_TOKENS))} output tokens"]
    zoomed = "" if focus is None else f", zoomed to token {focus}"
    facts.append(f"on the run's reference clock{zoomed}")
    fig = waterfall_figure(trace, title="", focus_token=focus)
    return [html.Div([html.H3(f"Request {request_name(trace)}", className="tt-detail-title"),
                      html.P(" · ".join(facts), className="tt-explain", id="explorer-facts")]),
            _why(src, q, chosen),
            html.Div([_zoom_picker(q, intervals)], className="tt-controls"),
            graph(fig, "explorer-waterfall")]


def _why(src: DataSource, q: ViewQuery, chosen: str) -> Any:
    """The chosen request's diagnosis: what it missed and each cause, largest first, with its fix."""
    d = src.result(q.run, RunAnalysis.diagnosis)
    rid = int(chosen)
    mine = d.requests[d.requests[col.REQUEST_ID] == rid]
    if not len(mine):
        return html.P("It met its SLO targets (TTFT, TPOT and ITL on every token gap): nothing to explain.",
                      className="tt-explain", id="explorer-why")
    causes = d.causes[d.causes[col.REQUEST_ID] == rid]
    items = [html.Li(f"{c.cause}{' (' + c.stage + ')' if c.stage else ''}: {c.ms:,.1f} ms, {c.share * 100:.0f}% of "
                     f"the time over target" + (f"; fix: {c.fix}" if c.fix else ""))
             for c in causes.sort_values("rank").itertuples(index=False)]
    return html.Div([html.P(request_story(mine.iloc[0], causes), className="tt-verdict tt-saturated"),
                     html.Ol(items)], id="explorer-why")


def body(src: DataSource, q: ViewQuery) -> list[Any]:
    """The waterfall of ``q.request`` (else the table's first row) beside the request table of run ``q.run``."""
    src.resolve(q.run)
    data, pages = _fetch(src, q, q.page)
    chosen = q.request or (data[0][col.REQUEST_ID] if data else "")
    row = next((r for r in data if r[col.REQUEST_ID] == chosen), None)
    listing = explained("Requests", EXPLAIN["explorer"].format(n=MAX_LISTED_REQUESTS), _table(q, data, pages, chosen))
    detail = html.Div(guarded(_waterfall, src, q, chosen, row), id="explorer-detail",
                      className="tt-section tt-explorer-detail")
    return [html.Div([detail, html.Div([listing], className="tt-explorer-list")], className="tt-explorer")]


def controls(src: DataSource, q: ViewQuery) -> list[Any]:
    choices = src.request_choices(src.resolve(q.run))
    opts = {c: [{"label": shown_label(v), "value": v} for v in vals if v] for c, vals in choices.items()}
    return [run_picker(src, q.run), choice("tenant", "Tenant", opts[col.TENANT], q.tenant or None),
            choice("slo", "SLO class", opts[col.SLO_CLASS], q.slo or None)]


def layout(**query: str) -> Any:
    return page(PATH, "Requests", query, body, controls)


@dash.callback(Output(TABLE_ID, "data"), Output(TABLE_ID, "page_count"),
               Input(TABLE_ID, "page_current"), Input(TABLE_ID, "sort_by"), State("explorer-query", "data"),
               prevent_initial_call=True)
def _page_or_sort(page_current: int | None, sort_by: list[dict[str, str]] | None,
                  params: dict[str, str] | None) -> tuple[Any, Any]:
    """Server-side paging and sorting: only the rows of one page ever reach the browser."""
    try:
        q = parse_query(params or {})
        if sort_by:
            q = parse_query({**q.to_params(), "sort": ("-" if sort_by[0]["direction"] == "desc" else "")
                             + sort_by[0]["column_id"]})
        return _fetch(source(), q, int(page_current or 0))
    except ValueError:
        return [], 1


@dash.callback(Output("_pages_location", "search", allow_duplicate=True),
               Input(TABLE_ID, "active_cell"), State(TABLE_ID, "data"), State(TABLE_ID, "page_current"),
               State(TABLE_ID, "sort_by"), State("_pages_location", "search"), prevent_initial_call=True)
def _select(cell: dict[str, Any] | None, data: list[dict[str, Any]] | None, page_current: int | None,
            sort_by: list[dict[str, str]] | None, search: str | None) -> Any:
    """A click on a row puts its request id (and the table's page and sort) into the URL."""
    if not cell or not data or cell.get("row", -1) >= len(data):
        return dash.no_update
    changes: dict[str, Any] = {}
    if sort_by:  # first: a new sort resets the page, which is set next
        changes["sort"] = ("-" if sort_by[0]["direction"] == "desc" else "") + sort_by[0]["column_id"]
    changes["page"] = page_current or None
    changes["request"] = data[cell["row"]][col.REQUEST_ID]
    return new_search(search, changes)


live_callback(PATH, body)
