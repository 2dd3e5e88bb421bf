"""``tokentrace ingest-client``: another load generator's per-request results as a run's client lane."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tokentrace.app.cli import check_path, usage_error

__all__ = ["register", "ingest_client_command"]


def ingest_client_command(
    file: Annotated[Path, typer.Argument(help="The tool's results file.", show_default=False)],
    fmt: Annotated[str, typer.Option("--format", help="aiperf (profile_export.jsonl), guidellm (benchmarks.json) "
                                     "or vllm-bench (vllm bench serve --save-result --save-detailed).",
                                     show_default=False)],
    store: Annotated[Path, typer.Option(help="Store folder holding the server's run.", show_default=False)],
    run: Annotated[str, typer.Option(help="The server's run the client ran against.", show_default=False)],
) -> None:
    """Import AIPerf / guidellm / vllm bench per-request results as the run's client lane.

    Records are matched to the server's requests by the request id the tool sent (X-Request-Id),
    else by send time and order, and recorded as an instance of role client, so that
    `tokentrace report` shows how far the server's timeline disagrees with the tool's.
    """
    from tokentrace.app.clients import import_client_file

    check_path(file, "results file")
    check_path(store, "store")
    try:
        summary = import_client_file(file, fmt, store=store, run=run)
    except ValueError as err:
        usage_error(str(err))
    except OSError as err:
        usage_error(f"cannot write the store {store}: {err.strerror or err}")
    version = f" {summary.version}" if summary.version else ""
    typer.echo(f"{summary.tool}{version}: {summary.num_records} requests, {summary.num_chunks} chunks into run "
               f"{summary.run_id} as instance {summary.instance_name}; matched {summary.num_by_id} by request id, "
               f"{summary.num_by_time} by send time, {summary.num_unmatched} unmatched")
    for note in summary.notes:
        typer.echo(f"note: {note}")


def register(app: typer.Typer) -> None:
    app.command("ingest-client")(ingest_client_command)
