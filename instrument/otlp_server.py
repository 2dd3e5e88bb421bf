"""``tokentrace ingest-otlp``: OTLP/HTTP (and OTLP/gRPC) receivers serving one store run.

:func:`serve_otlp` binds the addresses, opens the run, serves the
:class:`~instrument.otlp_ingest.OtlpIngestor`'s Starlette app on uvicorn and,
with ``grpc_listen``, a :class:`~instrument.otlp_grpc.GrpcReceiver` into the
same ingestor, until SIGINT/SIGTERM; then it stops both and flushes the store.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from instrument.otlp_ingest import MAX_BODY_BYTES, OtlpIngestor, create_app, listen_error
from instrument.otlp_requests import IngestOptions, InstanceIdentity
from tokentrace.clock import take_anchor
from tokentrace.recorder import BufferedRecorder
from tokentrace.schema import Role
from tokentrace.store import StoreWriter

__all__ = ["serve_otlp", "store_ingestor", "IngestSummary"]

OnReady = Callable[[list[str], "str | None"], None]


@dataclass(frozen=True, slots=True)
class IngestSummary:
    """What one :func:`serve_otlp` session received."""

    run_id: str | None
    url: str
    counts: Mapping[str, int]
    grpc_url: str | None = None
    """The OTLP/gRPC endpoint, when one was served."""


def serve_otlp(*, host: str, port: int, store: str, run: str | None = None, role: str = "colocated",
               grpc_listen: tuple[str, int] | None = None, on_ready: OnReady | None = None,
               options: IngestOptions | None = None) -> IngestSummary:
    """Receive OTLP/HTTP (and, with ``grpc_listen``, OTLP/gRPC) traces into run ``run``
    of ``store`` until SIGINT/SIGTERM.

    Blocks. Port 0 picks a free port; ``on_ready(urls, run_id)`` is called once
    listening, with the HTTP endpoint first and then the gRPC one. Raises
    ``OSError`` if an address cannot be bound or the store cannot be created,
    ``ValueError`` for a bad role or run id, ``ImportError`` for ``grpc_listen``
    without grpcio. Nothing is created on disk before every address is bound. The
    store is flushed and closed however the server stops.
    """
    try:
        import starlette  # noqa: F401 - the app's framework, imported by create_app
        import uvicorn
    except ImportError as e:
        raise ImportError("the OTLP/HTTP receiver needs starlette and uvicorn: pip install 'tokentrace[otlp]'") from e

    from tokentrace.store import validate_run_id

    the_role = Role.from_label(role)
    options = replace(options or IngestOptions(), role=the_role)
    if run is not None:
        validate_run_id(run)  # before binding: a bad id must not leave a listening socket behind
    sock, receiver, writer = _bind_and_open(host, port, store, run, grpc_listen)
    ingestor = store_ingestor(writer, options=options)
    url = f"http://{host if ':' not in host else f'[{host}]'}:{sock.getsockname()[1]}/v1/traces"
    urls = [url] + ([receiver.url] if receiver is not None else [])
    server = uvicorn.Server(uvicorn.Config(create_app(ingestor), log_level="warning", lifespan="off"))
    previous = _stop_on_signals(server)
    try:
        if receiver is not None:
            receiver.start(ingestor)
        if on_ready is not None:
            threading.Thread(target=_announce, args=(server, on_ready, urls, writer.run_id), daemon=True).start()
        server.run(sockets=[sock])
    finally:
        _restore_signals(previous)
        sock.close()
        if receiver is not None:
            receiver.stop()  # calls in flight finish before the store is closed
        ingestor.close()
    return IngestSummary(writer.run_id, url, dict(ingestor.counts), receiver.url if receiver is not None else None)


def store_ingestor(writer: Any, *, options: IngestOptions | None = None, name: str = "otlp-ingest") -> OtlpIngestor:
    """An :class:`OtlpIngestor` writing into ``writer``'s run (a ``StoreWriter``): the receiver's own
    instance (``name``, ``options.role``) and one more instance, with its own writer, per traced
    process its spans' resources name. Times go onto this process's monotonic clock."""
    options = options or IngestOptions()
    recorder = BufferedRecorder(writer, instance_id=writer.instance_id)
    anchor = take_anchor()
    recorder.instance(role=options.role, name=name, anchor=anchor)

    def replica(identity: InstanceIdentity) -> BufferedRecorder:
        w = StoreWriter(writer.store_path, run_id=writer.run_id)
        rec = BufferedRecorder(w, instance_id=w.instance_id)
        rec.instance(role=identity.role, name=identity.name, host=identity.host, pid=identity.pid, anchor=anchor)
        return rec

    return OtlpIngestor(recorder, anchor=anchor, replica_factory=replica, options=options)


def _bind_and_open(host: str, port: int, store: str, run: str | None,
                   grpc_listen: tuple[str, int] | None) -> tuple[socket.socket, Any, Any]:
    """The bound HTTP socket, the gRPC receiver (or None) and the store writer, in that order:
    nothing is created on disk before both addresses are bound; nothing stays bound if a step fails."""
    from tokentrace.store import StoreWriter

    try:
        sock = socket.create_server((host, port))
    except OSError as e:
        raise listen_error(e, "OTLP/HTTP", f"{host}:{port}") from None
    receiver = None
    try:
        if grpc_listen is not None:
            from instrument.otlp_grpc import GrpcReceiver

            receiver = GrpcReceiver(*grpc_listen, max_message_bytes=MAX_BODY_BYTES)
        config = {"source": "otlp-ingest", "listen": f"{host}:{port}"}
        if receiver is not None:
            config["grpc_listen"] = f"{receiver.host}:{receiver.port}"
        return sock, receiver, StoreWriter(store, run_id=run, config=config)
    except BaseException:
        if receiver is not None:
            receiver.stop()
        sock.close()
        raise


def _announce(server: Any, on_ready: OnReady, urls: list[str], run_id: str) -> None:
    deadline = time.monotonic() + 30.0
    while not server.started and not server.should_exit and time.monotonic() < deadline:
        time.sleep(0.01)  # polls uvicorn's start-up flag; no compute is being simulated
    if server.started:
        on_ready(urls, run_id)


def _stop_on_signals(server: Any) -> dict[int, Any]:
    """Handlers asking ``server`` to exit on SIGINT/SIGTERM (main thread only).

    uvicorn installs its own while serving and re-raises the signal after
    shutdown; that re-raise lands here (a no-op by then) instead of killing
    the process before the store is flushed.
    """
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum: int, frame: Any) -> None:
        server.should_exit = True

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


def _restore_signals(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
