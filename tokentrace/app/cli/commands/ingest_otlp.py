"""``tokentrace ingest-otlp``: receive OTLP/HTTP and OTLP/gRPC traces (e.g. from vLLM) into a store."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from tokentrace.app.cli import EXIT_USAGE, check_path, usage_error

__all__ = ["register", "parse_listen"]


def parse_listen(value: str, *, option: str = "--listen", example: str = "127.0.0.1:4318") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as (host, port); ``ValueError`` if malformed."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{option} must be HOST:PORT, e.g. {example}; got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def ingest_otlp_command(
    store: Annotated[Path, typer.Option(help="Store folder the received spans are written into.")],
    listen: Annotated[str, typer.Option(help="HOST:PORT to listen on (port 0: any free port).")] = "127.0.0.1:4318",
    run: Annotated[Optional[str], typer.Option(help="Run id to write (default: a new time-stamped id).")] = None,
    role: Annotated[str, typer.Option(help="Role recorded for the traced server (colocated, prefill, decode, ...).")] = "colocated",
    grpc_listen: Annotated[Optional[str], typer.Option(
        help="Also receive OTLP/gRPC on HOST:PORT (4317 by convention; needs grpcio).")] = None,
    tenant_attribute: Annotated[Optional[list[str]], typer.Option(
        help="Span or resource attribute holding the tenant (repeatable; default tokentrace.tenant).")] = None,
    tenant_header: Annotated[Optional[list[str]], typer.Option(
        help="Request header holding the tenant, as recorded in http.request.header.<name> (default X-Tenant).")]
    = None,
    slo_class_attribute: Annotated[Optional[list[str]], typer.Option(
        help="Attribute holding the SLO class (repeatable; default tokentrace.slo_class).")] = None,
    slo_class_header: Annotated[Optional[list[str]], typer.Option(
        help="Request header holding the SLO class (default X-SLO-Class).")] = None,
    session_attribute: Annotated[Optional[list[str]], typer.Option(
        help="Attribute holding the session id (repeatable; default tokentrace.session, gen_ai.conversation.id).")]
    = None,
    session_header: Annotated[Optional[list[str]], typer.Option(
        help="Request header holding the session id (default X-Session-Id).")] = None,
    max_instances: Annotated[int, typer.Option(
        min=1, help="Traced processes (OTLP resources) recorded as instances; spans of more are refused.")] = 64,
) -> None:
    """Receive OTLP traces (e.g. vLLM's) into a store until Ctrl-C / SIGTERM: HTTP, and gRPC with --grpc-listen.

    OTLP/HTTP on POST /v1/traces (protobuf or JSON); OTLP/gRPC's TraceService/Export.
    vLLM's llm_request and request-lifecycle spans, SGLang's request traces and tokentrace's own
    OTLP export become requests, stage spans and tokens; each traced process (its OTLP resource)
    its own instance. Other spans are counted and ignored.

    vLLM exports over gRPC by default. With --grpc-listen 127.0.0.1:4317, start it as:
    OTEL_EXPORTER_OTLP_TRACES_INSECURE=true vllm serve MODEL --otlp-traces-endpoint grpc://127.0.0.1:4317

    Over HTTP (no grpcio needed):
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf vllm serve MODEL --otlp-traces-endpoint http://127.0.0.1:4318/v1/traces
    """
    from instrument.otlp_requests import IngestOptions, header_attribute
    from instrument.otlp_server import serve_otlp

    check_path(store, "store")
    defaults = IngestOptions()

    def keys(attributes: Optional[list[str]], headers: Optional[list[str]], default: tuple[str, ...]) -> tuple[str, ...]:
        if not attributes and not headers:
            return default
        return tuple(attributes or ()) + tuple(header_attribute(h) for h in headers or ())

    options = IngestOptions(tenant_keys=keys(tenant_attribute, tenant_header, defaults.tenant_keys),
                            slo_class_keys=keys(slo_class_attribute, slo_class_header, defaults.slo_class_keys),
                            session_keys=keys(session_attribute, session_header, defaults.session_keys),
                            max_instances=max_instances)

    try:
        host, port = parse_listen(listen)
        grpc_address = (None if grpc_listen is None
                        else parse_listen(grpc_listen, option="--grpc-listen", example="127.0.0.1:4317"))
    except ValueError as err:
        usage_error(str(err))

    def ready(urls: list[str], run_id: str | None) -> None:
        typer.echo(f"listening on {' and '.join(urls)} (store {store}, run {run_id})")

    try:
        summary = serve_otlp(host=host, port=port, store=str(store), run=run, role=role,
                             grpc_listen=grpc_address, on_ready=ready, options=options)
    except (ImportError, ValueError) as err:
        usage_error(str(err))
    except OSError as err:  # an address that cannot be listened on, a store that cannot be written
        message = err.strerror or str(err)
        if not message.startswith("cannot listen"):  # the store could not be created
            message = f"cannot write the store {store}: {message}"
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    counts = ", ".join(f"{k}={v}" for k, v in summary.counts.items())
    typer.echo(f"stopped; run {summary.run_id}: {counts}")


def register(app: typer.Typer) -> None:
    app.command("ingest-otlp")(ingest_otlp_command)
