"""OTLP/gRPC trace receiver: ``TraceService/Export`` beside the OTLP/HTTP ``POST /v1/traces``.

vLLM exports its traces over gRPC unless ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` says
otherwise, so ``tokentrace ingest-otlp --grpc-listen 127.0.0.1:4317`` accepts them as
they come (``vllm serve ... --otlp-traces-endpoint grpc://127.0.0.1:4317`` with
``OTEL_EXPORTER_OTLP_TRACES_INSECURE=true``).

The service is a generic handler on raw bytes: each request's protobuf message goes
to :meth:`OtlpIngestor.ingest <instrument.otlp_ingest.OtlpIngestor.ingest>` exactly as
an HTTP body would, so decoding, the ``llm_request`` mapping and the counters are the
HTTP receiver's. gRPC undoes gzip compression itself. A message that is not an
``ExportTraceServiceRequest`` is answered with ``INVALID_ARGUMENT`` and a one-sentence
reason, and counted as rejected; one over the body limit gets ``RESOURCE_EXHAUSTED``
from gRPC. The receiver keeps serving either way. Plaintext only (a loopback or
in-cluster receiver); put an OpenTelemetry Collector in front for TLS.

Needs ``grpcio`` (``pip install 'tokentrace[otlp-grpc]'``); the HTTP receiver does not.
"""

from __future__ import annotations

import errno
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from instrument.otlp_decode import PROTOBUF, PayloadError, response_body
from instrument.otlp_ingest import OtlpIngestor, listen_error

__all__ = ["GrpcReceiver", "SERVICE", "METHOD", "import_grpc"]

SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
METHOD = "Export"
_WORKERS = 4  # concurrent Export calls; each one is a short decode and a few recorder appends


def import_grpc() -> Any:
    """The ``grpc`` module, or an ``ImportError`` saying what to install."""
    try:
        import grpc
    except ImportError as e:
        raise ImportError("OTLP/gRPC ingest needs grpcio: pip install 'tokentrace[otlp-grpc]' "
                          "(or send OTLP/HTTP to --listen instead)") from e
    return grpc


class GrpcReceiver:
    """A gRPC server bound to ``host:port`` at construction; :meth:`start` serves an ingestor.

    Binding first lets the caller fail before it creates a store. ``port`` 0 picks a
    free port (:attr:`port` is the bound one). Raises ``ImportError`` without grpcio
    and ``OSError`` when the address cannot be bound (also when another process
    holds the port: port sharing is switched off).
    """

    def __init__(self, host: str, port: int, *, max_message_bytes: int) -> None:
        grpc = import_grpc()
        self._grpc = grpc
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if port:  # a clear "Address already in use" rather than gRPC's own bind report on stderr
            try:
                socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET).close()
            except OSError as e:
                raise listen_error(e, "OTLP/gRPC", target) from None
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="otlp-grpc"),
            options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", max_message_bytes)])
        try:
            bound = self._server.add_insecure_port(target)
        except RuntimeError as e:  # grpcio >= 1.49 raises instead of returning 0
            raise OSError(errno.EADDRNOTAVAIL, f"cannot listen for OTLP/gRPC on {target}: {e}") from None
        if bound == 0:
            raise OSError(errno.EADDRNOTAVAIL, f"cannot listen for OTLP/gRPC on {target}")
        self.host = host
        self.port: int = bound
        self._started = False

    @property
    def url(self) -> str:
        """The endpoint to give an exporter, e.g. ``grpc://127.0.0.1:4317``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"grpc://{host}:{self.port}"

    def start(self, ingestor: OtlpIngestor) -> None:
        """Serve ``TraceService/Export`` into ``ingestor`` on the server's threads."""
        grpc = self._grpc

        def export(request: bytes, context: Any) -> bytes:
            try:
                done = ingestor.ingest(request, PROTOBUF)
            except PayloadError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            ingestor.push_counters()
            return response_body(PROTOBUF, rejected_spans=done.num_rejected, message=done.message)

        # No (de)serializers: the handler sees the message's bytes and returns the response's bytes.
        handler = grpc.method_handlers_generic_handler(SERVICE, {METHOD: grpc.unary_unary_rpc_method_handler(export)})
        self._server.add_generic_rpc_handlers((handler,))
        self._server.start()
        self._started = True

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop taking calls; wait up to ``grace_s`` for the ones in flight. Idempotent."""
        self._server.stop(grace_s if self._started else None).wait()
        self._started = False
