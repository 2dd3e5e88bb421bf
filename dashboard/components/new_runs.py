"""Noticing runs that appear in the store while the dashboard is open, with or without ``--live``.

The app's frame (outside the pages) holds the run ids known when the current view
was loaded (a ``dcc.Store``: ids only) and polls the store every refresh period.
When the store has a run that was not there, a banner names it with a link that
opens the current view on it. The listing is cheap: in static mode
:meth:`dashboard.data.DataSource.runs` lists the store again only when its run
folders changed.
"""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, State, dcc, html
from flask import current_app

from dashboard.components.controls import new_search
from dashboard.components.shell import SOURCE_KEY, notice
from tokentrace.store import StoreError

__all__ = ["frame_parts", "register_callbacks", "BANNER_ID"]

BANNER_ID = "tt-new-run"
_SEEN_ID = "tt-runs-seen"
_POLL_ID = "tt-runs-poll"
_ANNOUNCED_ID = "tt-runs-announced"  # the search string the banner links to now (unchanged: the banner is left alone)


def frame_parts(refresh_s: float) -> list[Any]:
    """The components the app's frame needs (next to ``dash.page_container``)."""
    return [dcc.Store(id=_SEEN_ID), dcc.Store(id=_ANNOUNCED_ID), dcc.Interval(id=_POLL_ID, interval=int(refresh_s * 1000)),
            html.Div(id=BANNER_ID, className="tt-new-run", role="status")]


def _run_ids() -> list[str]:
    try:
        return [i.run_id for i in current_app.config[SOURCE_KEY].runs()]
    except StoreError:
        return []


def register_callbacks(app: dash.Dash) -> None:
    """Add the two callbacks to ``app``: remember the runs at each navigation; poll for new ones."""

    @app.callback(Output(_SEEN_ID, "data"), Output(BANNER_ID, "children"), Output(_ANNOUNCED_ID, "data"),
                  Input("_pages_location", "pathname"), Input("_pages_location", "search"))
    def _remember(_path: str | None, _search: str | None) -> tuple[list[str], list[Any], None]:
        return _run_ids(), [], None

    @app.callback(Output(BANNER_ID, "children", allow_duplicate=True),
                  Output(_ANNOUNCED_ID, "data", allow_duplicate=True), Input(_POLL_ID, "n_intervals"),
                  State(_SEEN_ID, "data"), State(_ANNOUNCED_ID, "data"), State("_pages_location", "pathname"),
                  State("_pages_location", "search"), prevent_initial_call=True)
    def _poll(_n: int | None, seen: list[str] | None, announced: str | None, path: str | None,
              search: str | None) -> Any:
        if seen is None:
            return dash.no_update, dash.no_update
        new = [r for r in _run_ids() if r not in set(seen)]
        if not new:
            return ([], None) if announced else (dash.no_update, dash.no_update)
        newest = new[-1]
        target = (path or "/") + new_search(search, {"run": newest, "base": None})
        if target == announced:  # said already: leave the banner (and its link) as it is
            return dash.no_update, dash.no_update
        more = f" (and {len(new) - 1} more)" if len(new) > 1 else ""
        return [notice([f"A new run is in the store: {newest}{more}.",
                        dcc.Link("Open it", href=target, id="tt-new-run-link")])], target
