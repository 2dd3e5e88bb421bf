"""Run an ASGI app under uvicorn on a background thread (tests, notebooks, embedding).

``with serve_in_thread(app) as server: httpx.get(server.url + "/health")``. The server
binds a free loopback port itself (no race between choosing and binding a port), runs
the app's lifespan (so a gateway app starts and stops its backend), and is shut down
and joined when the block ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

__all__ = ["ServerThread", "serve_in_thread"]


class ServerThread:
    """A uvicorn server on its own thread with its own event loop."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY: launcher._bind
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name=f"uvicorn-{self.port}", daemon=True)
        self.error: BaseException | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` of the server."""
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve(sockets=[self._sock]))
        except BaseException as exc:  # reported by start() / stop()
            self.error = exc

    def start(self, *, timeout_s: float = 60.0) -> None:
        """Start serving; returns once the app's startup finished. Raises ``RuntimeError``
        when the server fails to start within ``timeout_s``."""
        self._thread.start()
        stop_at = threading.Event()
        waited = 0.0
        while not self.server.started and self._thread.is_alive() and waited < timeout_s:
            stop_at.wait(0.01)
            waited += 0.01
        if not self.server.started:
            self.stop()
            raise RuntimeError(f"uvicorn did not start on {self.url}: {self.error!r}")

    def stop(self, *, timeout_s: float = 30.0) -> None:
        """Ask uvicorn to exit (runs the app's shutdown) and join the thread."""
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._sock.close()


@contextlib.contextmanager
def serve_in_thread(app: Any, *, host: str = "127.0.0.1", port: int = 0) -> Iterator[ServerThread]:
    """Serve ``app`` for the duration of the ``with`` block."""
    server = ServerThread(app, host=host, port=port)
    server.start()
    try:
        yield server
    finally:
        server.stop()
