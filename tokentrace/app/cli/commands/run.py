"""``tokentrace run``: trace a whole deployment, every Python process it starts, with no code change.

``tokentrace run --store DIR [--run ID] [--sample RATE] -- <command...>`` runs the command
traced through :func:`tokentrace.app.cli.supervise.run_traced`, the supervisor: it sets up the
command's environment, forwards SIGINT, SIGTERM and SIGHUP, takes the command down with it
when it dies (Linux), says at exit which processes were hooked and what, and saves the
finished run's analysis facts. The exit status is the command's (128 + signal number if a
signal ended it, 127 if it could not be started).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from tokentrace.app.cli import check_path, usage_error
from tokentrace.app.cli.supervise import run_traced

__all__ = ["register", "run_traced"]


def run_command(
    command: Annotated[list[str], typer.Argument(help="The command to trace, after --.")],
    store: Annotated[Path, typer.Option(help="Store folder every traced process writes into.")],
    run: Annotated[Optional[str], typer.Option(help="Run id (default: a new time-stamped id).")] = None,
    sample: Annotated[Optional[float], typer.Option(help="Head-sampling rate in (0, 1]; default: every request.")] = None,
    metrics_port: Annotated[Optional[int], typer.Option(
        help="Serve live Prometheus metrics (/metrics on 127.0.0.1) from each traced process, on the first "
             "free port from this one.")] = None,
    derive: Annotated[bool, typer.Option(
        "--derive/--no-derive",
        help="When the command has ended, save the run's analysis facts next to it so that its first report "
             "and dashboard views are quick.")] = True,
) -> None:
    """Run a command with every Python process it starts traced (like opentelemetry-instrument)."""
    check_path(store, "store")
    try:
        code = run_traced(list(command), store=store, run=run, sample=sample, metrics_port=metrics_port,
                          derive=derive)
    except ValueError as err:
        usage_error(str(err))
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command("run", context_settings={"allow_interspersed_args": False})(run_command)
