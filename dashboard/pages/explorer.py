"""Request explorer: a server-side paged, sortable, filterable table of requests; the selected one's waterfall."""

from __future__ import annotations

from typing import Any

import dash
import pandas as pd
from dash import Input, Output, State, dash_table, html

from dashboard.components.controls import choice, new_search, run_picker
from dashboard.components.explanations import EXPLAIN
from dashboard.components.figures import explained, graph
from dashboard.components.shell import ViewQuery, guarded, live_callback, notice, page, parse_query, source
from dashboard.components.waterfall import waterfall_figure
from dashboard.data import MAX_LISTED_REQUESTS, DataSource
from tokentrace.schema import col

PATH = "/explorer"
dash.register_page(__name__, path=PATH, name="Requests", title="tokentrace · requests")

PAGE_SIZE = 20  # rows per page of the request table
TABLE_ID = "explorer-table"
COLUMNS = (col.REQUEST_ID, col.REQUEST_KEY, col.TENANT, col.SLO_CLASS, "ttft_ms", "tpot_ms", "e2e_ms",
           col.NUM_OUTPUT_TOKENS)
_DEFAULT_SORT = "e2e_ms"


def table_rows(rows: pd.DataFrame) -> list[dict[str, Any]]:
    """Rows for the browser: the shown columns only, ids as strings (JavaScript numbers lose 63-bit ids)."""
    shown = rows[[c for c in COLUMNS if c in rows.columns]].copy()
    shown[col.REQUEST_ID] = shown[col.REQUEST_ID].astype("int64").astype(str)
    for c in ("ttft_ms", "tpot_ms", "e2e_ms"):
        if c in shown:
            shown[c] = shown[c].astype(float).round(3)
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


def _table(src: DataSource, q: ViewQuery) -> Any:
    data, pages = _fetch(src, q, q.page)
    sort, desc = _sort_of(q)
    return dash_table.DataTable(
        id=TABLE_ID, data=data, columns=[{"name": c, "id": c} for c in COLUMNS],
        page_action="custom", page_current=min(q.page, pages - 1), page_size=PAGE_SIZE, page_count=pages,
        sort_action="custom", sort_mode="single",
        sort_by=[{"column_id": sort, "direction": "desc" if desc else "asc"}],
        style_table={"overflowX": "auto"}, style_cell={"fontSize": "13px", "padding": "4px 8px", "cursor": "pointer"},
        style_header={"fontWeight": "bold"},
        style_data_conditional=[{"if": {"filter_query": f"{{{col.REQUEST_ID}}} = '{q.request}'"},
                                 "backgroundColor": "#e8f0fe"}] if q.request else [])


def _waterfall(src: DataSource, q: ViewQuery) -> list[Any]:
    if not q.request:
        return [notice("Select a request in the table to see its waterfall.")]
    trace = src.request_trace(q.run, q.request)
    return [graph(waterfall_figure(trace), "explorer-waterfall")]


def body(src: DataSource, q: ViewQuery) -> list[Any]:
    """The request table of run ``q.run`` and the waterfall of ``q.request``."""
    src.resolve(q.run)
    return [explained("Requests", EXPLAIN["explorer"].format(n=MAX_LISTED_REQUESTS), _table(src, q)),
            html.Div(guarded(_waterfall, src, q), id="explorer-detail", className="tt-section")]


def controls(src: DataSource, q: ViewQuery) -> list[Any]:
    choices = src.request_choices(src.resolve(q.run))
    opts = {c: [{"label": v or "(none)", "value": v} for v in vals if v] for c, vals in choices.items()}
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
