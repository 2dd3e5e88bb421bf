"""HTTP/1.1 keep-alive connections that hand every network read to a sink with its arrival time.

The load generator's timing is only as good as the moment it reads the clock. Here
the clock is read first thing in :meth:`asyncio.Protocol.data_received`, i.e. in the
event loop's own callback for the socket, before any parsing and without waking a
task; through an HTTP library (httpx: anyio, httpcore, h11, then its async iterators)
the caller's code runs a hundred function calls and a task switch later, and at high
rates that per-chunk cost is what delays the next chunk's timestamp.

What is spoken: ``POST`` with a body; a response framed by ``Transfer-Encoding:
chunked``, ``Content-Length``, or the connection's end; informational (1xx) responses
skipped; no compression (no ``Accept-Encoding`` is sent); ``http`` and ``https``; no
proxies (a proxy would be part of what is measured).

:class:`ConnectionPool` keeps idle connections for reuse (keep-alive). Everything runs
on the event-loop thread. A :class:`ResponseSink` receives the response head and body
(de-chunked) from the protocol callback and says after each piece whether it wants more
(:class:`Want`); :meth:`ConnectionPool.request` returns how the exchange ended
(:class:`End`) and raises :class:`ConnectFailed` only when no connection could be made.
"""

from __future__ import annotations

import asyncio
import enum
import ssl
import time
from typing import Protocol
from urllib.parse import urlsplit

__all__ = ["Want", "End", "ResponseSink", "ConnectFailed", "ConnectionPool"]

_now_ns = time.monotonic_ns  # this process's monotonic clock, ns
_MAX_HEAD = 64 * 1024  # bytes of a response head (status line and headers)
_MAX_CHUNK_LINE = 1024  # bytes of a chunk-size or trailer line
_DRAIN_S = 1.0  # longest wait for the body's end once the sink has what it wanted


class Want(enum.Enum):
    """What a sink wants after a piece of the response."""

    MORE = 0  # keep feeding the body
    DRAIN = 1  # satisfied: read the rest of the body (at most 1 s) so the connection can be reused
    CLOSE = 2  # stop now and close the connection


class End(enum.Enum):
    """How an exchange ended."""

    COMPLETE = "complete"  # the whole response body was read
    STOPPED = "stopped"  # the sink said CLOSE, or the body did not end within 1 s of DRAIN
    LOST = "lost"  # the connection closed or broke before the body's end
    READ_TIMEOUT = "read_timeout"  # no byte for read_timeout_s
    BAD_HTTP = "bad_http"  # the server's bytes are not HTTP/1.1


class ResponseSink(Protocol):
    """Receives one response; called from the protocol's callbacks on the event-loop thread,
    so it must not block. ``t_ns`` is when the network read holding ``data`` arrived."""

    def on_head(self, status: int, headers: dict[str, str]) -> Want: ...

    def on_body(self, data: bytes, t_ns: int) -> Want: ...


class ConnectFailed(Exception):
    """No connection to the server (refused, unreachable, name not found, TLS handshake, timeout)."""


class _BadHttp(ValueError):
    pass


class _Framing(enum.Enum):
    CHUNKED = 0
    LENGTH = 1
    UNTIL_CLOSE = 2


class _Chunked:
    """Decoder of a chunked body, fed network reads in order."""

    __slots__ = ("pending", "left", "need_crlf", "in_trailer", "done")

    def __init__(self) -> None:
        self.pending = b""  # an incomplete size line, chunk terminator or trailer line
        self.left = 0  # data bytes of the current chunk still to come
        self.need_crlf = False  # the current chunk's data is read; its CRLF is next
        self.in_trailer = False  # the last chunk was seen; reading the trailer up to its empty line
        self.done = False

    def feed(self, data: bytes) -> bytes:
        """The body bytes in ``data``; sets ``done`` at the body's end. ``_BadHttp`` on bad framing."""
        buf = self.pending + data if self.pending else data
        self.pending = b""
        out: list[bytes] = []
        pos, n = 0, len(buf)
        while pos < n and not self.done:
            if self.left:
                take = min(self.left, n - pos)
                out.append(buf[pos:pos + take])
                pos += take
                self.left -= take
                self.need_crlf = self.left == 0
                continue
            if self.need_crlf:
                if n - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise _BadHttp("a chunk does not end with CRLF")
                pos += 2
                self.need_crlf = False
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                if n - pos > _MAX_CHUNK_LINE:
                    raise _BadHttp("chunk-size line too long")
                break
            line = buf[pos:eol]
            pos = eol + 2
            if self.in_trailer:
                self.done = not line  # trailer fields end with an empty line
                continue
            try:
                size = int(line.split(b";", 1)[0], 16)
            except ValueError:
                raise _BadHttp(f"bad chunk size {line[:40]!r}") from None
            if size < 0:
                raise _BadHttp(f"bad chunk size {line[:40]!r}")
            self.in_trailer = size == 0
            self.left = size
        if not self.done:
            self.pending = buf[pos:]
        return out[0] if len(out) == 1 else b"".join(out)


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    """Status and headers (names lower-cased, repeated ones joined with ", ") of a response head."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise _BadHttp(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise _BadHttp(f"bad header line {line[:80]!r}")
        key = name.strip().lower()
        headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
    return int(parts[1]), headers


class _Exchange:
    """One request and its response on one connection: parse state and the future of its end."""

    __slots__ = ("conn", "sink", "head", "framing", "chunked", "length_left", "keep_alive", "draining",
                 "num_bytes", "last_ns", "timer", "read_timeout_ns", "end", "detail", "reusable")

    def __init__(self, conn: _Connection, sink: ResponseSink, read_timeout_s: float) -> None:
        self.conn = conn
        self.sink = sink
        self.head: bytes | None = b""  # the head's bytes so far; None once it is parsed
        self.framing = _Framing.UNTIL_CLOSE
        self.chunked = _Chunked()
        self.length_left = 0
        self.keep_alive = True
        self.draining = False
        self.num_bytes = 0  # response bytes received
        self.last_ns = _now_ns()  # the request's write, then the latest read
        self.read_timeout_ns = int(read_timeout_s * 1e9)
        self.timer = conn.loop.call_later(read_timeout_s, self._check_idle)
        self.end: asyncio.Future[End] = conn.loop.create_future()
        self.detail = ""  # why a LOST or BAD_HTTP end
        self.reusable = False

    # -- called by the protocol

    def on_data(self, data: bytes, t_ns: int) -> None:
        self.last_ns = t_ns
        self.num_bytes += len(data)
        try:
            if self.head is not None:
                data = self._read_head(data)
                if self.head is not None or self.end.done():
                    return
            body, complete = self._body(data)
        except _BadHttp as err:
            self.detail = str(err)
            self._finish(End.BAD_HTTP)
            return
        if body and not self.draining:
            self._want(self.sink.on_body(body, t_ns))
        if complete and not self.end.done():
            self.reusable = self.keep_alive
            self._finish(End.COMPLETE)

    def on_closed(self, exc: Exception | None) -> None:
        if self.head is None and self.framing is _Framing.UNTIL_CLOSE and exc is None:
            self._finish(End.COMPLETE)
        else:
            self.detail = f"{type(exc).__name__}: {exc}" if exc else "the server closed the connection"
            self._finish(End.LOST)

    def abort(self) -> None:
        """Stop reading (the caller was cancelled or timed out); the connection will be closed."""
        self.timer.cancel()
        if self.conn.exchange is self:
            self.conn.exchange = None
        if not self.end.done():
            self.end.cancel()
        self.reusable = False

    # -- internals

    def _read_head(self, data: bytes) -> bytes:
        """Consume the response head; the bytes after it (the body's start)."""
        while self.head is not None:
            buf = self.head + data
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > _MAX_HEAD:
                    raise _BadHttp("response head over 64 KiB")
                self.head = buf
                return b""
            status, headers = _parse_head(buf[:end])
            data = buf[end + 4:]
            if 100 <= status < 200:  # informational (100 Continue): the real response follows
                self.head = b""
                continue
            self.head = None
            self._set_framing(status, headers)
            self._want(self.sink.on_head(status, headers))
        return data

    def _set_framing(self, status: int, headers: dict[str, str]) -> None:
        self.keep_alive = "close" not in headers.get("connection", "").lower()
        if status in (204, 304):  # never a body
            self.framing, self.length_left = _Framing.LENGTH, 0
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self.framing = _Framing.CHUNKED
        elif "content-length" in headers:
            try:
                self.length_left = int(headers["content-length"])
            except ValueError:
                raise _BadHttp(f"bad content-length {headers['content-length']!r}") from None
            self.framing = _Framing.LENGTH
        else:
            self.keep_alive = False

    def _body(self, data: bytes) -> tuple[bytes, bool]:
        """The body bytes in ``data`` and whether the body is complete."""
        if self.framing is _Framing.CHUNKED:
            return self.chunked.feed(data), self.chunked.done
        if self.framing is _Framing.LENGTH:
            body = data[:self.length_left]
            self.length_left -= len(body)
            return body, self.length_left == 0
        return data, False

    def _want(self, want: Want) -> None:
        if want is Want.CLOSE:
            self._finish(End.STOPPED)
        elif want is Want.DRAIN and not self.draining:
            self.draining = True
            self.timer.cancel()
            self.timer = self.conn.loop.call_later(_DRAIN_S, self._finish, End.STOPPED)

    def _check_idle(self) -> None:
        idle = _now_ns() - self.last_ns
        if idle >= self.read_timeout_ns:
            self._finish(End.READ_TIMEOUT)
        else:
            self.timer = self.conn.loop.call_later((self.read_timeout_ns - idle) / 1e9, self._check_idle)

    def _finish(self, end: End) -> None:
        if self.end.done():
            return
        self.timer.cancel()
        self.conn.exchange = None
        if end is not End.COMPLETE:
            self.reusable = False
        self.end.set_result(end)


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection; serves one exchange at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.exchange: _Exchange | None = None
        self.is_closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        t_ns = _now_ns()  # first thing: when these bytes arrived
        exchange = self.exchange
        if exchange is None:  # bytes nobody asked for: this connection cannot carry another request
            self.close()
            return
        exchange.on_data(data, t_ns)

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_closed = True
        if self.exchange is not None:
            self.exchange.on_closed(exc)

    def close(self) -> None:
        self.is_closed = True
        if self.transport is not None:
            self.transport.close()


class ConnectionPool:
    """Keep-alive HTTP/1.1 connections to the server of ``base_url`` (event-loop thread only).

    Use as ``async with ConnectionPool(url) as pool``. Connections are opened on demand
    (no cap: an open-loop run holds one per request in flight) and up to ``max_idle``
    idle ones are kept for reuse.
    """

    def __init__(self, base_url: str, *, connect_timeout_s: float = 5.0, read_timeout_s: float = 60.0,
                 max_idle: int = 1024) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"the URL must be http:// or https:// with a host, got {base_url!r}")
        default_port = 443 if url.scheme == "https" else 80
        self.host = url.hostname
        self.port = url.port or default_port
        self._host_header = (f"[{self.host}]" if ":" in self.host else self.host) + (
            "" if self.port == default_port else f":{self.port}")
        self._path_prefix = url.path.rstrip("/")
        # Built now, not on the first request: loading the CA bundle takes ~40 ms.
        self._ssl = ssl.create_default_context() if url.scheme == "https" else None
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._max_idle = max_idle
        self._idle: list[_Connection] = []

    def encode_post(self, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        """The bytes of ``POST <base path><path>`` with ``body`` and ``headers``.

        ``ValueError`` if a header value holds a line break (it would split the request).
        """
        lines = [f"POST {self._path_prefix}{path} HTTP/1.1", f"Host: {self._host_header}",
                 f"Content-Length: {len(body)}"]
        for name, value in headers.items():
            if "\r" in value or "\n" in value:
                raise ValueError(f"header {name} holds a line break")
            lines.append(f"{name}: {value}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    async def request(self, data: bytes, sink: ResponseSink) -> tuple[End, str]:
        """Write ``data`` (a whole request) and feed the response to ``sink``; how it ended, and
        why in words when it was LOST or BAD_HTTP ("" otherwise).

        A reused connection that the server closed before answering anything is retried
        once on a new one. ``ConnectFailed`` when no connection can be made. If the
        caller is cancelled (or times out), the connection is closed.
        """
        conn = self._take_idle()
        if conn is not None:
            exchange = await self._exchange(conn, data, sink)
            if not (exchange.end.result() is End.LOST and exchange.num_bytes == 0):
                return exchange.end.result(), exchange.detail
        exchange = await self._exchange(await self._connect(), data, sink)
        return exchange.end.result(), exchange.detail

    async def _exchange(self, conn: _Connection, data: bytes, sink: ResponseSink) -> _Exchange:
        exchange = _Exchange(conn, sink, self._read_timeout_s)
        conn.exchange = exchange
        assert conn.transport is not None
        conn.transport.write(data)
        try:
            await exchange.end
        finally:
            if not exchange.end.done() or exchange.end.cancelled():
                exchange.abort()
            if exchange.reusable and not conn.is_closed and len(self._idle) < self._max_idle:
                self._idle.append(conn)
            else:
                conn.close()
        return exchange

    def _take_idle(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.is_closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop), self.host, self.port, ssl=self._ssl,
                    server_hostname=self.host if self._ssl is not None else None)
        except TimeoutError:
            raise ConnectFailed(f"no connection to {self._host_header} within {self._connect_timeout_s:g} s") from None
        except (OSError, ssl.SSLError) as err:
            raise ConnectFailed(f"{type(err).__name__}: {err}"[:200]) from None
        return conn

    async def aclose(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    async def __aenter__(self) -> ConnectionPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
