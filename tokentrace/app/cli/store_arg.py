"""The store a command reads: the STORE argument, or ``--store`` as ``run``, ``bench`` and ``demo`` take it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from tokentrace.app.cli.errors import usage_error

__all__ = ["StoreOption", "store_of"]

StoreOption = Annotated[Optional[Path], typer.Option(
    "--store", help="The store folder, as run, bench and demo take it (the same as the STORE argument).",
    show_default=False)]


def store_of(positional: Path | None, option: Path | None) -> Path:
    """The store named by the STORE argument or by ``--store`` (one of them, or both alike); a usage
    error (one line, exit 2) when neither or two different ones are given."""
    if positional is not None and option is not None and positional != option:
        usage_error(f"two stores given ({positional} and --store {option}); give one")
    store = positional if positional is not None else option
    if store is None:
        usage_error("give the store folder: tokentrace COMMAND STORE, or --store STORE")
    return store
