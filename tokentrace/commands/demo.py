"""``tokentrace demo``: the reference engine, instrumented, replaying a real trace."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

__all__ = ["register"]


def demo_command(
    store: Annotated[Path, typer.Option(help="Store folder the demo writes its run into.")] = Path("demo-store"),
    requests: Annotated[int, typer.Option(min=1, help="Requests of the trace to replay.")] = 48,
    model: Annotated[str, typer.Option(help="Model preset of the reference engine (tiny, small).")] = "small",
    time_scale: Annotated[float, typer.Option(help="Multiply the trace's arrival times by this.")] = 1.0,
    length_scale: Annotated[float, typer.Option(help="Multiply prompt and output lengths by this.")] = 1 / 64,
    trace: Annotated[Optional[Path], typer.Option(help="Mooncake JSONL trace (default: the shared one).")] = None,
    run: Annotated[Optional[str], typer.Option(help="Run id to write (default: a new time-stamped id).")] = None,
) -> None:
    """Replay a slice of the Mooncake trace through the instrumented reference engine and report."""
    from tokentrace.demo import DemoOptions, run_demo

    opts = DemoOptions(store=store, num_requests=requests, model=model, time_scale=time_scale,
                       length_scale=length_scale, trace=trace, run=run)
    try:
        run_demo(opts)
    except ValueError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_command)
