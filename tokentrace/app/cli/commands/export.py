"""``tokentrace export``: a run as a Perfetto / Chrome trace-event JSON file, or over OTLP.

Exit codes: 0 on success, 2 on bad input (missing or empty store, unknown run,
a corrupt file, a run with nothing to draw, an unknown format, an output that
cannot be written, an OTLP endpoint that cannot be reached): one sentence on
stderr, never a traceback.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from tokentrace.app.cli.store_arg import StoreOption, store_of

__all__ = ["register", "export_command"]


def export_command(
    store: Annotated[Optional[Path], typer.Argument(help="Store folder (or one run's folder); --store works too.",
                                                    show_default=False)] = None,
    run: Annotated[Optional[str], typer.Option("--run", help="Run id (default: the newest run).")] = None,
    fmt: Annotated[str, typer.Option("--format", help="Export format: perfetto, or otlp (send to --endpoint).")]
    = "perfetto",
    out: Annotated[Optional[Path], typer.Option("--out", help="Output file (default: stdout).")] = None,
    endpoint: Annotated[Optional[str], typer.Option(
        help="--format otlp: the OTLP/HTTP traces endpoint, e.g. http://127.0.0.1:4318/v1/traces.")] = None,
    store_option: StoreOption = None,
) -> None:
    """Export a run: Chrome trace-event JSON for ui.perfetto.dev, or OTLP span trees (--format otlp --endpoint URL).

    The OTLP export is lossless: `tokentrace ingest-otlp` on the other end reproduces the run
    (every instance, request row, stage span and token time)."""
    store = store_of(store, store_option)
    from tokentrace.app.cli import check_path, writing_stdout
    from tokentrace.app.cli.commands.report import exit_on_bad_input
    from tokentrace.app.export import EXPORT_FORMATS, write_perfetto
    from tokentrace.app.report.inputs import ReportInputError, open_checked
    from tokentrace.schema import SPANS, STEPS, TOKENS

    check_path(store, "store")
    check_path(out, "--out path")
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
        if out is None:
            with writing_stdout():
                write_perfetto(opened, sys.stdout)
            return
        try:
            num = write_perfetto(opened, out)
        except OSError as err:  # name the file asked for, not the temporary one written first
            raise ReportInputError(f"cannot write {out}: {err.strerror or err}") from None
        typer.echo(f"wrote {num:,} trace events to {out}; open it at https://ui.perfetto.dev", err=True)


def _export_otlp(store: Path, run: Optional[str], endpoint: Optional[str]) -> None:
    from tokentrace.app.cli import check_reachable
    from tokentrace.app.export.otlp import export_run_to_otel, otlp_exporter
    from tokentrace.app.report.inputs import ReportInputError, open_checked

    if not endpoint or not endpoint.startswith(("http://", "https://")):
        raise ReportInputError("--format otlp needs --endpoint http://HOST:PORT/v1/traces")
    opened, _ = open_checked(store, run, required=())
    check_reachable(endpoint, "the OTLP endpoint")
    try:
        exporter = otlp_exporter(endpoint)
    except ImportError as err:
        raise ReportInputError(str(err)) from None
    exporter_log = logging.getLogger("opentelemetry.exporter.otlp")
    level = exporter_log.level
    exporter_log.setLevel(logging.CRITICAL)  # a failed batch is counted and said once below, not per retry
    try:
        summary = export_run_to_otel(opened, exporter, token_events=True)
    finally:
        exporter.shutdown()
        exporter_log.setLevel(level)
    if summary.num_failed_batches:
        raise ReportInputError(f"{summary.num_failed_batches} batches were not accepted by {endpoint}")
    typer.echo(f"sent {summary.num_spans:,} spans of {summary.num_requests:,} requests to {endpoint}", err=True)


def register(app: typer.Typer) -> None:
    app.command("export")(export_command)
