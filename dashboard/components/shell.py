"""The frame every view shares: URL query parsing, navigation, notices, live refresh.

A view is a function ``body(src, query) -> list of components``. :func:`page`
wraps it in the common frame (title, links to the other views carrying the
same run, the view's controls) and renders it through :func:`guarded`, so bad
input (unknown run, missing table, malformed id) becomes one sentence on the
page, never a traceback in the browser or an error in the server.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace
from typing import Any, Callable
from urllib.parse import urlencode

import dash
from dash import Input, Output, State, dcc, html
from flask import current_app

from dashboard.data import DataSource
from tokentrace.schema import col
from tokentrace.store import StoreError

__all__ = ["ViewQuery", "VIEWS", "SOURCE_KEY", "source", "parse_query", "href", "notice", "guarded", "page",
           "live_callback", "GROUPINGS", "GROUP_COLUMN"]

SOURCE_KEY = "TOKENTRACE_DATA_SOURCE"
"""Flask config key under which :func:`dashboard.app.create_app` puts the app's DataSource."""

VIEWS: tuple[tuple[str, str], ...] = (
    ("/", "Overview"), ("/capacity", "Capacity"), ("/breakdown", "Breakdown"), ("/explorer", "Requests"), ("/queues", "Queues"),
    ("/cache", "Cache"), ("/pd-ratio", "PD ratio"), ("/batch", "Batch"), ("/speculative", "Speculative"),
    ("/sessions", "Sessions"), ("/tenants", "Tenants"), ("/whatif", "What-if"),
    ("/compare", "Compare"),
)
GROUPINGS: dict[str, str] = {"": "whole run", "tenant": "by tenant", "slo_class": "by SLO class",
                             "instance": "by instance"}
"""Values of the ``by`` URL parameter (analyzers' ``by=`` argument) and their labels."""
GROUP_COLUMN: dict[str, str] = {"tenant": col.TENANT, "slo_class": col.SLO_CLASS, "instance": col.INSTANCE_ID}
"""The column an analyzer's ``by=`` result is grouped on."""

_MAX_PARAM_CHARS = 200  # longer URL parameters are refused
_log = logging.getLogger("dashboard")


@dataclass(frozen=True, slots=True)
class ViewQuery:
    """What a view's URL carries: ids and filters only, never data."""

    run: str | None = None
    base: str | None = None  # compare: the baseline run
    by: str = ""  # grouping, a key of GROUPINGS
    tenant: str = ""  # explorer filter
    slo: str = ""  # explorer filter
    request: str = ""  # explorer: the selected request id
    sort: str = ""  # explorer: column to sort by
    page: int = 0  # explorer: page of the request table
    token: str = ""  # explorer: the output token the waterfall is zoomed to ("" = the whole request)

    def to_params(self) -> dict[str, str]:
        """Non-default fields as URL parameters."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value not in (None, "", 0):
                out[f.name] = str(value)
        return out


def parse_query(query: dict[str, Any]) -> ViewQuery:
    """A :class:`ViewQuery` from URL parameters; ``StoreError`` naming a bad one. Unknown keys are ignored."""
    known = {f.name for f in fields(ViewQuery)}
    values: dict[str, Any] = {}
    for key, raw in query.items():
        if key not in known:
            continue
        text = str(raw)
        if len(text) > _MAX_PARAM_CHARS:
            raise StoreError(f"the URL parameter {key!r} is too long")
        values[key] = text
    if values.get("by", "") not in GROUPINGS:
        raise StoreError(f"grouping {values['by'][:40]!r} is not one of: {', '.join(k for k in GROUPINGS if k)}")
    if values.get("token", "") and not values["token"].isdigit():
        raise StoreError(f"token {values['token'][:40]!r} is not a token index (0, 1, 2, ...)")
    if "page" in values:
        if not values["page"].isdigit():
            raise StoreError(f"page {values['page'][:40]!r} is not a page number")
        values["page"] = int(values["page"])
    return ViewQuery(**values)


def source() -> DataSource:
    """The DataSource of the app serving the current request (call inside a layout or callback)."""
    return current_app.config[SOURCE_KEY]


def href(path: str, q: ViewQuery, **changes: Any) -> str:
    """``path`` with ``q`` (updated by ``changes``) as its query string."""
    params = replace(q, **changes).to_params() if changes else q.to_params()
    return path + ("?" + urlencode(params) if params else "")


def notice(sentence: Any, *, kind: str = "info") -> html.Div:
    """A one-sentence message box (``kind``: info or error); ``sentence`` may be a list of text and links."""
    return html.Div(sentence, className=f"tt-notice tt-{kind}", role="alert" if kind == "error" else "status")


def guarded(body: Callable[..., list[Any]], *args: Any) -> list[Any]:
    """``body(*args)``, or a sentence saying why it could not be shown; never raises.

    ``StoreError``/``ValueError`` are the user's input (bad store, run, table,
    parameter): shown as they are. Anything else is a bug: logged with its
    traceback on the server, one sentence on the page.
    """
    try:
        return body(*args)
    except (StoreError, ValueError) as err:
        return [notice(str(err), kind="error")]
    except Exception as err:  # noqa: BLE001 - the UI boundary: the browser never sees a traceback
        _log.exception("dashboard view failed")
        return [notice(f"This view could not be computed ({type(err).__name__}: {err}).", kind="error")]


def _nav(path: str, q: ViewQuery) -> html.Nav:
    keep = ViewQuery(run=q.run)
    links = [dcc.Link(label, href=href(p, keep), className="tt-nav-link" + (" tt-active" if p == path else ""))
             for p, label in VIEWS]
    return html.Nav([html.Span("tokentrace", className="tt-brand"), *links], className="tt-nav")


def page(path: str, title: str, query: dict[str, Any], body: Callable[[DataSource, ViewQuery], list[Any]],
         controls: Callable[[DataSource, ViewQuery], list[Any]] | None = None) -> html.Div:
    """The full layout of a view: navigation, title, controls, body; live refresh in live mode."""
    view = _view_id(path)
    src = source()
    try:
        q = parse_query(query)
    except StoreError as err:
        return html.Div([_nav(path, ViewQuery()), html.H2(title, className="tt-title"), notice(str(err), kind="error")],
                        className="tt-page")
    head: list[Any] = [_nav(path, q), html.H2(title, className="tt-title")]
    try:
        src.runs()
    except StoreError as err:  # missing or empty store: say it once, and let live mode retry
        children = head + [dcc.Store(id=f"{view}-query", data=q.to_params()),
                           html.Div([notice(str(err), kind="error")], id=f"{view}-body")]
        if src.live:
            children.append(dcc.Interval(id=f"{view}-live", interval=int(_live_interval_s() * 1000)))
        return html.Div(children, className="tt-page")
    if controls is not None:
        head.append(html.Div(guarded(controls, src, q), className="tt-controls"))
    children = head + [
        dcc.Store(id=f"{view}-query", data=q.to_params()),
        dcc.Loading(html.Div(guarded(body, src, q), id=f"{view}-body"), type="circle", delay_show=300),
    ]
    if src.live:
        children.append(dcc.Interval(id=f"{view}-live", interval=int(_live_interval_s() * 1000)))
    return html.Div(children, className="tt-page", **{"data-view": view})


def live_callback(path: str, body: Callable[[DataSource, ViewQuery], list[Any]]) -> None:
    """Register (on the app being built) the live-mode refresh of a view's body. Call at page import."""
    view = _view_id(path)

    @dash.callback(Output(f"{view}-body", "children"), Input(f"{view}-live", "n_intervals"),
                   State(f"{view}-query", "data"), prevent_initial_call=True)
    def _refresh(_n: int, params: dict[str, str] | None) -> list[Any]:
        return guarded(lambda: body(source(), parse_query(params or {})))


def _view_id(path: str) -> str:
    return "overview" if path == "/" else path.strip("/").replace("-", "_")


def _live_interval_s() -> float:
    return float(current_app.config.get("TOKENTRACE_REFRESH_S", 5.0))
