"""The Dash app: ``create_app(store)`` serves the runs of one store as a multi-page dashboard.

Pages live in ``dashboard/pages/`` (one module per view, each with
``register_page``, ``layout(**query)`` and its own callbacks); shared widgets in
``dashboard/components/``. The app holds its :class:`~dashboard.data.DataSource`
in the Flask config (no module-level state), so several apps can run in one
process, e.g. in tests.
"""

from __future__ import annotations

import os
from pathlib import Path

import dash
import flask
from dash import html

from dashboard.components import figures, new_runs
from dashboard.components.controls import register_callbacks
from dashboard.components.shell import SOURCE_KEY
from dashboard.data import DataSource
from tokentrace.app.report.plotly_bundle import BUNDLE_NAME, bundle_path

__all__ = ["create_app"]

_HERE = Path(__file__).resolve().parent
_PLOTLY_ROUTE = "_tokentrace/" + BUNDLE_NAME


def create_app(store_path: str | os.PathLike[str], *, live: bool = False, refresh_s: float = 5.0,
               warm: bool = False) -> dash.Dash:
    """A Dash app serving the runs of the store at ``store_path``.

    ``live``: pages refresh every ``refresh_s`` seconds and cached results are
    dropped when the run's files change (a server is still writing). ``warm``:
    start computing the newest run's analyses in a background thread now.
    A store that is missing or empty is not an error here: every page then says
    so in a sentence (in live mode the first run may appear later).
    """
    if refresh_s <= 0:
        raise ValueError(f"refresh_s must be positive, got {refresh_s}")
    app = dash.Dash(
        "tokentrace-dashboard", use_pages=True, pages_folder=str(_HERE / "pages"),
        assets_folder=str(_HERE / "assets"), suppress_callback_exceptions=True, title="tokentrace",
        update_title=None,
    )
    src = DataSource(store_path, live=live)
    _serve_plotly_bundle(app)
    app.server.config[SOURCE_KEY] = src
    app.server.config["TOKENTRACE_REFRESH_S"] = refresh_s
    app.layout = html.Div([dash.page_container, *new_runs.frame_parts(refresh_s)], className="tt-app")
    register_callbacks(app)
    new_runs.register_callbacks(app)
    # Take this app's share of the callbacks the page modules registered with dash.callback now,
    # rather than at the first browser request, so that a second app built in the same process gets
    # its own: Dash does this before the first request it serves, so serve it one, in-process.
    with app.server.test_client() as client:
        client.get("/_dash-dependencies")
    figures.warm_up()
    if warm:
        try:
            src.warm(None)
        except ValueError:
            pass  # no runs yet: the pages say so
    return app


def _serve_plotly_bundle(app: dash.Dash) -> None:
    """Serve tokentrace's plotly.js partial bundle (:mod:`tokentrace.app.report.plotly_bundle`) and load it
    before Dash's own scripts: Dash's Graph then draws with this ``window.Plotly`` and never fetches
    the full 4.8 MB bundle. The URL carries the file's mtime, so it can be cached for a year."""
    path = bundle_path()
    app.server.add_url_rule(
        app.config.routes_pathname_prefix + _PLOTLY_ROUTE, "tokentrace_plotly_bundle",
        lambda: flask.send_file(path, mimetype="text/javascript", max_age=365 * 24 * 3600))
    app.config.external_scripts.append(
        f"{app.config.requests_pathname_prefix}{_PLOTLY_ROUTE}?m={int(path.stat().st_mtime)}")
