"""``tokentrace bench``: the load generator (see :mod:`tokentrace.bench`)."""

from __future__ import annotations

import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    from tokentrace.bench.cli import bench_command  # options only; httpx loads when the command runs

    app.command("bench")(bench_command)
