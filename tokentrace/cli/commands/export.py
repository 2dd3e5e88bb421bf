"""``tokentrace export``: a run as a Perfetto / Chrome trace-event JSON file.

Exit codes: 0 on success, 2 on bad input (missing or empty store, unknown run,
a corrupt file, a run with nothing to draw, an unknown format): one sentence on
stderr, never a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

__all__ = ["register", "export_command"]


def export_command(
    store: Annotated[Path, typer.Argument(help="Store folder (or one run's folder).", show_default=False)],
    run: Annotated[Optional[str], typer.Option("--run", help="Run id (default: the newest run).")] = None,
    fmt: Annotated[str, typer.Option("--format", help="Export format: perfetto.")] = "perfetto",
    out: Annotated[Optional[Path], typer.Option("--out", help="Output file (default: stdout).")] = None,
) -> None:
    """Export a run as Chrome trace-event JSON for ui.perfetto.dev: a track per instance and request."""
    from tokentrace.cli.commands.report import exit_on_bad_input
    from tokentrace.export import EXPORT_FORMATS, write_perfetto
    from tokentrace.report.inputs import ReportInputError, open_checked
    from tokentrace.schema import SPANS, STEPS, TOKENS

    with exit_on_bad_input():
        if fmt.strip().lower() not in EXPORT_FORMATS:
            raise ReportInputError(f"unknown export format {fmt!r}; formats: {', '.join(EXPORT_FORMATS)}")
        opened, rows = open_checked(store, run, required=())
        if not any(rows.get(t.name, 0) for t in (SPANS, TOKENS, STEPS)):
            raise ReportInputError(f"run {opened.run_id} has no spans, tokens or steps: nothing to export")
        num = write_perfetto(opened, sys.stdout if out is None else out)
        if out is not None:
            typer.echo(f"wrote {num:,} trace events to {out}; open it at https://ui.perfetto.dev", err=True)


def register(app: typer.Typer) -> None:
    app.command("export")(export_command)
