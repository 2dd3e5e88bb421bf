"""``tokentrace export``: a run as a Perfetto / Chrome trace-event JSON file, or over OTLP.

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
    fmt: Annotated[str, typer.Option("--format", help="Export format: perfetto, or otlp (send to --endpoint).")]
    = "perfetto",
    out: Annotated[Optional[Path], typer.Option("--out", help="Output file (default: stdout).")] = None,
    endpoint: Annotated[Optional[str], typer.Option(
        help="--format otlp: the OTLP/HTTP traces endpoint, e.g. http://127.0.0.1:4318/v1/traces.")] = None,
) -> None:
    """Export a run: Chrome trace-event JSON for ui.perfetto.dev, or OTLP span trees (--format otlp --endpoint URL).

    The OTLP export is lossless: `tokentrace ingest-otlp` on the other end reproduces the run
    (every instance, request row, stage span and token time)."""
    from tokentrace.cli.commands.report import exit_on_bad_input
    from tokentrace.export import EXPORT_FORMATS, write_perfetto
    from tokentrace.report.inputs import ReportInputError, open_checked
    from tokentrace.schema import SPANS, STEPS, TOKENS

    with exit_on_bad_input():
        if fmt.strip().lower() not in EXPORT_FORMATS:
            raise ReportInputError(f"unknown export format {fmt!r}; formats: {', '.join(EXPORT_FORMATS)}")
        if out is not None and out.is_dir():
            raise ReportInputError(f"--out {out} is a folder; give the file to write, e.g. --out {out / 'trace.json'}")
        if out is not None and not out.parent.is_dir():
            raise ReportInputError(f"--out {out}: the folder {out.parent} does not exist")
        if fmt.strip().lower() == "otlp":
            _export_otlp(store, run, endpoint)
            return
        opened, rows = open_checked(store, run, required=())
        if not any(rows.get(t.name, 0) for t in (SPANS, TOKENS, STEPS)):
            raise ReportInputError(f"run {opened.run_id} has no spans, tokens or steps: nothing to export")
        try:
            num = write_perfetto(opened, sys.stdout if out is None else out)
        except OSError as err:  # name the file asked for, not the temporary one written first
            raise ReportInputError(f"cannot write {out}: {err.strerror or err}") from None
        if out is not None:
            typer.echo(f"wrote {num:,} trace events to {out}; open it at https://ui.perfetto.dev", err=True)


def _export_otlp(store: Path, run: Optional[str], endpoint: Optional[str]) -> None:
    from instrument.otel_export import export_run_to_otel, otlp_exporter
    from tokentrace.report.inputs import ReportInputError, open_checked

    if not endpoint or not endpoint.startswith(("http://", "https://")):
        raise ReportInputError("--format otlp needs --endpoint http://HOST:PORT/v1/traces")
    opened, _ = open_checked(store, run, required=())
    try:
        exporter = otlp_exporter(endpoint)
    except ImportError as err:
        raise ReportInputError(str(err)) from None
    try:
        summary = export_run_to_otel(opened, exporter, token_events=True)
    finally:
        exporter.shutdown()
    if summary.num_failed_batches:
        raise ReportInputError(f"{summary.num_failed_batches} batches were not accepted by {endpoint}")
    typer.echo(f"sent {summary.num_spans:,} spans of {summary.num_requests:,} requests to {endpoint}", err=True)


def register(app: typer.Typer) -> None:
    app.command("export")(export_command)
