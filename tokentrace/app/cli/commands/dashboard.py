"""``tokentrace dashboard STORE``: serve the Dash dashboard of a store on loopback by default."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from tokentrace.app.cli import check_path, usage_error
from tokentrace.app.cli.store_arg import StoreOption, store_of

__all__ = ["register", "dashboard_command"]


def dashboard_command(
    store: Annotated[Optional[Path], typer.Argument(help="Store folder whose runs to serve; --store works too.",
                                                    show_default=False)] = None,
    host: Annotated[str, typer.Option(help="Interface to bind; the default serves this machine only.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")] = 8050,
    live: Annotated[bool, typer.Option("--live", help="Refresh pages while a server still writes the store.")] = False,
    refresh_s: Annotated[float, typer.Option(min=0.5, help="Live mode: seconds between refreshes.")] = 5.0,
    store_option: StoreOption = None,
) -> None:
    """Browse the runs of STORE in a web browser (Dash); Ctrl-C stops it."""
    store = store_of(store, store_option)
    check_path(store, "store")
    if not store.is_dir():
        usage_error(f"store {store} {'does not exist' if not store.exists() else 'is not a folder'}.")
    if not live:
        from tokentrace.store import StoreError, list_runs

        try:
            list_runs(store)
        except StoreError as err:
            usage_error(str(err))
        except OSError as err:
            usage_error(f"cannot read {err.filename or store}: {err.strerror or err}")
    _check_can_listen(host, port)
    from dashboard.app import create_app

    app = create_app(store, live=live, refresh_s=refresh_s, warm=True)
    typer.echo(f"tokentrace dashboard of {store} on http://{host}:{port}/ (Ctrl-C to stop)")
    app.run(host=host, port=port, debug=False)


def _check_can_listen(host: str, port: int) -> None:
    """A usage error, before the dashboard is built, if ``host:port`` cannot be listened on."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as err:
        usage_error(f"--host {host}: unknown host ({getattr(err, 'strerror', None) or err})")
    family, _, _, _, address = infos[0]
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as err:
        usage_error(f"cannot listen on {host}:{port}: {err.strerror or err}")


def register(app: typer.Typer) -> None:
    app.command("dashboard")(dashboard_command)
