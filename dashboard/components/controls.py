"""Run picker and filter bar: dropdowns whose values live in the URL.

Every control has the id ``{"type": PARAM, "name": <URL parameter>}``. One
callback (:func:`register_callbacks`, added to the app by ``create_app``) turns
a change of any of them into a new query string on the pages' location, and
the page re-renders from its URL: a view is always exactly what its link says.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlencode

import dash
from dash import ALL, Input, Output, State, dcc, html

from dashboard.components.shell import GROUPINGS, ViewQuery
from dashboard.data import DataSource

__all__ = ["PARAM", "run_picker", "choice", "grouping_picker", "register_callbacks", "new_search"]

PARAM = "tt-param"
"""Pattern-matching id type of every control that writes a URL parameter."""

_RESETS = {"run": ("request", "page", "token"), "tenant": ("request", "page", "token"),
           "slo": ("request", "page", "token"), "sort": ("page",), "request": ("token",)}
# changing a key invalidates these


def run_picker(src: DataSource, selected: str | None, *, name: str = "run", label: str = "Run") -> html.Label:
    """A dropdown of the store's runs (newest first), writing URL parameter ``name``."""
    infos = list(reversed(src.runs()))
    options = [{"label": _run_label(i), "value": i.run_id} for i in infos]
    ids = [i.run_id for i in infos]
    # An id that is not a run of the store is never put in the dropdown: it would replace it with a valid one
    # and the page would silently show another run instead of saying that the id is unknown.
    value = (selected if selected in ids else None) if selected else (ids[0] if ids else None)
    return choice(name, label, options, value, clearable=False, width="28em")


def _run_label(info: Any) -> str:
    seconds = info.duration_ns / 1e9
    created = (info.created or "")[:19].replace("T", " ")
    return f"{info.run_id} · {created} · {seconds:.1f} s"


def grouping_picker(q: ViewQuery) -> html.Label:
    """Whole run, by tenant, by SLO class or by instance (URL parameter ``by``)."""
    options = [{"label": label, "value": key} for key, label in GROUPINGS.items()]
    return choice("by", "Group", options, q.by, clearable=False)


def choice(name: str, label: str, options: list[dict[str, Any]], value: Any, *, clearable: bool = True,
           width: str = "14em") -> html.Label:
    """A labelled dropdown writing URL parameter ``name``."""
    dropdown = dcc.Dropdown(id={"type": PARAM, "name": name}, options=options, value=value,
                            clearable=clearable, style={"width": width})
    return html.Label([html.Span(label, className="tt-label"), dropdown], className="tt-control")


def new_search(search: str | None, changes: dict[str, Any]) -> str:
    """``search`` (a URL query string) with ``changes`` applied; empty values (None, "", 0: the defaults) remove
    their key, so a link stays as short as what it says."""
    params = dict(parse_qsl((search or "").lstrip("?")))
    for key, value in changes.items():
        empty = value is None or value == "" or value == 0
        if params.get(key, "") != ("" if empty else str(value)):
            for dependent in _RESETS.get(key, ()):
                params.pop(dependent, None)
        if empty:
            params.pop(key, None)
        else:
            params[key] = str(value)
    return "?" + urlencode(params) if params else ""


def register_callbacks(app: dash.Dash) -> None:
    """Add the URL-writing callback of the controls to ``app`` (once per app)."""

    @app.callback(
        Output("_pages_location", "search", allow_duplicate=True),
        Input({"type": PARAM, "name": ALL}, "value"),
        State({"type": PARAM, "name": ALL}, "id"),
        State("_pages_location", "search"),
        prevent_initial_call=True,
    )
    def _controls_to_url(values: list[Any], ids: list[dict[str, str]], search: str | None) -> Any:
        changes = {i["name"]: v for i, v in zip(ids, values)}
        updated = new_search(search, changes)
        return dash.no_update if updated == (search or "") else updated
