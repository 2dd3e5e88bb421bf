"""``tokentrace dashboard STORE``: serve the Dash dashboard of a store on loopback by default."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["register", "dashboard_command"]

EXIT_USAGE = 2


def dashboard_command(
    store: Annotated[Path, typer.Argument(help="Store folder whose runs to serve.", show_default=False)],
    host: Annotated[str, typer.Option(help="Interface to bind; the default serves this machine only.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")] = 8050,
    live: Annotated[bool, typer.Option("--live", help="Refresh pages while a server still writes the store.")] = False,
    refresh_s: Annotated[float, typer.Option(min=0.5, help="Live mode: seconds between refreshes.")] = 5.0,
) -> None:
    """Browse the runs of STORE in a web browser (Dash); Ctrl-C stops it."""
    if not store.is_dir():
        what = "does not exist" if not store.exists() else "is not a folder"
        typer.echo(f"error: store {store} {what}.", err=True)
        raise typer.Exit(EXIT_USAGE)
    if not live:
        import tokentrace
        from tokentrace.store import StoreError

        try:
            tokentrace.runs(store)
        except StoreError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(EXIT_USAGE) from None
    from dashboard.app import create_app

    app = create_app(store, live=live, refresh_s=refresh_s, warm=True)
    typer.echo(f"tokentrace dashboard of {store} on http://{host}:{port}/ (Ctrl-C to stop)")
    app.run(host=host, port=port, debug=False)


def register(app: typer.Typer) -> None:
    app.command("dashboard")(dashboard_command)
