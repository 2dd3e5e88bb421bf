"""How every command ends on a user's error: one ``error:`` line on stderr and exit status 2."""

from __future__ import annotations

from typing import NoReturn

import typer

__all__ = ["EXIT_USAGE", "usage_error"]

EXIT_USAGE = 2
"""Exit status of every command on bad input: a bad path, host, endpoint or option, an unwritable output."""


def usage_error(message: str) -> NoReturn:
    """``error: <message>`` on stderr and exit :data:`EXIT_USAGE`."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(EXIT_USAGE)
