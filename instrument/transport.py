"""Transport timing: when a request's first byte was read, before the app sees it.

The ASGI app of a server learns of a request only after uvicorn has read and
parsed its head and the event loop has run the app's task; on a busy loop that
takes milliseconds no stage of the app can see. :func:`install` patches
uvicorn's HTTP protocols (``h11`` and ``httptools``) once per process so that,
for each request, the monotonic time at which the loop read the request's first
bytes travels with it, two ways:

* in the ASGI scope, ``scope["extensions"]["tokentrace.transport"]["first_byte_ns"]``
  (read by :class:`instrument.asgi.TokentraceMiddleware`);
* in the context variable :data:`FIRST_BYTE_NS`, which the request's task
  inherits (read by the reference gateway's tracer, whose events carry no scope;
  uvicorn's opt-in ``reset_contextvars`` clears it, and then only the scope has it).

When did the first byte arrive? A busy event loop reads a request's bytes late,
so the time of the read is not enough. On Linux the kernel timestamps every
arriving segment once receive timestamping is on (``SO_TIMESTAMPNS``; one socket
holding the option keeps it on for all). On asyncio's socket transports the
connection's socket is wrapped (:class:`_StampedReads`) so that each read also
returns the arrival time of the bytes it read (``recvmsg`` with the timestamp as
ancillary data): the first read of a request gives its first byte's arrival,
however late the loop read it. On other transports (uvloop) the protocol peeks
(``MSG_PEEK``, non-blocking, on a duplicate of the descriptor) at bytes already
waiting when a connection is accepted and when a response completes on a
kept-alive connection. Kernel times are wall-clock; they are moved onto the
monotonic clock by :meth:`tokentrace.clock.Anchor.to_mono_ns`. When no kernel
time is known, the time of the read stands in. Elsewhere (no ``SO_TIMESTAMPNS``)
only the read time is used.

Analyzers show ``[first byte, app received)`` as the ``gateway.accept`` stage.

Cost: a ``recvmsg`` instead of a ``recv`` per read, and one clock read per
``data_received``; without the wrapper, four system calls (about 10 us) per
connection and per kept-alive response. Set-up code raises nothing: a uvicorn
without these classes is left alone.
"""

from __future__ import annotations

import atexit
import contextvars
import importlib
import logging
import os
import platform
import socket
import struct
import sys
import threading
import time
from typing import Any

from tokentrace.clock import take_anchor

__all__ = ["FIRST_BYTE_NS", "SCOPE_KEY", "install", "first_byte_ns", "is_installed", "waiting_bytes_arrival_ns"]

log = logging.getLogger("tokentrace")

FIRST_BYTE_NS: contextvars.ContextVar[int] = contextvars.ContextVar("tokentrace_first_byte_ns", default=-1)
"""The monotonic ns at which the server read the first bytes of the request this task serves."""
SCOPE_KEY = "tokentrace.transport"
"""The ASGI scope extension holding ``{"first_byte_ns": ...}``."""

_PROTOCOLS = (
    ("uvicorn.protocols.http.h11_impl", "H11Protocol"),
    ("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol"),
)
_PENDING = "_tokentrace_first_byte_ns"  # on a protocol instance: first byte of the request being read
_STAMPED = "_tokentrace_stamped_reads"  # on a protocol instance: its transport's wrapped socket, or None
# Linux's SO_TIMESTAMPNS (Python's socket module does not name it): 35 in the generic ABI of the
# 64-bit architectures listed, whose timespec is two 64-bit integers.
_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", None) or (
    35 if sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64", "riscv64") else None)
_TIMESPEC = struct.Struct("qq")
_MAX_AGE_NS = 60_000_000_000  # a kernel timestamp older than this is not the request's (ns)
_lock = threading.Lock()
_patched: set[type] = set()
_keeper: list[socket.socket] = []  # one socket holding SO_TIMESTAMPNS keeps the kernel stamping


def _keep_kernel_timestamps_on() -> bool:
    """Turn the kernel's receive timestamps on for this process's lifetime; False if unsupported."""
    if _keeper:
        return True
    if _SO_TIMESTAMPNS is None:
        return False
    try:
        keeper = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        keeper.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    _keeper.append(keeper)
    atexit.register(keeper.close)
    return True


def _kernel_ns_to_mono(ancillary: list[tuple[int, int, bytes]]) -> int:
    """The receive timestamp among ``ancillary`` (recvmsg's) on the monotonic clock; -1 if none."""
    for level, kind, value in ancillary:
        if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS and len(value) >= _TIMESPEC.size:
            sec, nsec = _TIMESPEC.unpack(value[:_TIMESPEC.size])
            if sec == 0 and nsec == 0:
                return -1
            anchor = take_anchor(tries=1)
            mono = anchor.to_mono_ns(sec * 1_000_000_000 + nsec)
            return mono if 0 <= anchor.mono_ns - mono <= _MAX_AGE_NS else -1
    return -1


class _StampedReads:
    """A transport's socket whose reads also keep the kernel's arrival time of what they read.

    Every attribute but ``recv`` and ``recv_into`` is the wrapped socket's. The loop's
    thread only (the transport's). ``last_arrival_ns``: monotonic ns of the latest read's
    first bytes, -1 when the kernel gave none. ``send`` (every chunk a transport writes) is
    the socket's own method, bound once: found through ``__getattr__`` it would cost a failed
    attribute lookup (~0.5 us) per write.
    """

    __slots__ = ("_sock", "last_arrival_ns", "send")
    _ANCILLARY = socket.CMSG_SPACE(_TIMESPEC.size) if _SO_TIMESTAMPNS is not None else 0

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.last_arrival_ns = -1
        self.send = sock.send

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        data, ancillary, _, _ = self._sock.recvmsg(bufsize, self._ANCILLARY, flags)
        self.last_arrival_ns = _kernel_ns_to_mono(ancillary)
        return data

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        view = memoryview(buffer)
        n, ancillary, _, _ = self._sock.recvmsg_into([view[:nbytes] if nbytes else view], self._ANCILLARY, flags)
        self.last_arrival_ns = _kernel_ns_to_mono(ancillary)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _stamp_reads(transport: Any) -> _StampedReads | None:
    """Wrap an asyncio socket transport's socket (see :class:`_StampedReads`); None if it is not one."""
    sock = transport.__dict__.get("_sock") if hasattr(transport, "__dict__") else None
    if not _keeper or type(sock) is not socket.socket or sock.type != socket.SOCK_STREAM:
        return None
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
    except OSError:
        return None
    stamped = _StampedReads(sock)
    transport._sock = stamped
    return stamped


def waiting_bytes_arrival_ns(transport: Any) -> int:
    """When the bytes now waiting in ``transport``'s socket arrived (monotonic ns); -1 if none
    are waiting, the kernel gave no timestamp, or the platform cannot tell. Never raises."""
    if not _keeper:
        return -1
    try:
        sock = transport.get_extra_info("socket")
        if sock is None or sock.type != socket.SOCK_STREAM:
            return -1
        with socket.socket(fileno=os.dup(sock.fileno())) as peek:
            peek.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
            data, ancillary, _, _ = peek.recvmsg(1, socket.CMSG_SPACE(_TIMESPEC.size),
                                                 socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (OSError, AttributeError, ValueError):  # nothing waiting (EAGAIN), closed, not a socket
        return -1
    return _kernel_ns_to_mono(ancillary) if data else -1


def first_byte_ns(scope: Any = None) -> int:
    """The first-byte time of the current request: from ``scope`` if given and set, else the context; -1."""
    if scope is not None:
        ext = (scope.get("extensions") or {}).get(SCOPE_KEY)
        if ext is not None:
            return int(ext.get("first_byte_ns", -1))
    return FIRST_BYTE_NS.get()


def _patch(cls: type) -> None:
    original = cls.data_received
    made, completed = cls.connection_made, cls.on_response_complete

    def connection_made(self: Any, transport: Any) -> None:
        made(self, transport)
        stamped = _stamp_reads(transport)
        self.__dict__[_STAMPED] = stamped
        self.__dict__[_PENDING] = -1 if stamped is not None else waiting_bytes_arrival_ns(transport)

    def on_response_complete(self: Any) -> None:
        completed(self)  # may already start a pipelined request (its pending time was kept)
        if self.__dict__.get(_STAMPED) is None and self.__dict__.get(_PENDING, -1) < 0:
            transport = self.__dict__.get("transport")
            if transport is not None:
                self.__dict__[_PENDING] = waiting_bytes_arrival_ns(transport)

    def data_received(self: Any, data: bytes) -> None:
        pending = self.__dict__.get(_PENDING, -1)
        if pending < 0:  # the first bytes of a new request on this connection
            read_ns = time.monotonic_ns()
            stamped = self.__dict__.get(_STAMPED)
            arrived = stamped.last_arrival_ns if stamped is not None else -1
            pending = arrived if 0 <= arrived <= read_ns else read_ns
            self.__dict__[_PENDING] = pending
        FIRST_BYTE_NS.set(pending)  # the request's task, created inside, copies this context
        cycle = self.__dict__.get("cycle")
        original(self, data)
        new_cycle = self.__dict__.get("cycle")
        if new_cycle is not None and new_cycle is not cycle:  # the head was complete: a request started
            self.__dict__[_PENDING] = -1
            scope = getattr(new_cycle, "scope", None)
            if isinstance(scope, dict):
                scope.setdefault("extensions", {})[SCOPE_KEY] = {"first_byte_ns": pending}

    for name, wrapper, wrapped in (("data_received", data_received, original),
                                   ("connection_made", connection_made, made),
                                   ("on_response_complete", on_response_complete, completed)):
        wrapper.__wrapped__ = wrapped  # type: ignore[attr-defined]
        setattr(cls, name, wrapper)


def install() -> bool:
    """Patch every importable uvicorn HTTP protocol (idempotent); True if at least one is patched."""
    with _lock:
        for module_name, class_name in _PROTOCOLS:
            try:
                cls = getattr(importlib.import_module(module_name), class_name)
            except (ImportError, AttributeError):  # uvicorn absent, or without this implementation
                continue
            if cls in _patched:
                continue
            needed = ("data_received", "connection_made", "on_response_complete")
            if not all(callable(getattr(cls, name, None)) for name in needed):
                log.warning("tokentrace: %s.%s lacks %s; transport timing off", module_name, class_name,
                            "/".join(needed))
                continue
            _keep_kernel_timestamps_on()
            _patch(cls)
            _patched.add(cls)
        return bool(_patched)


def is_installed() -> bool:
    """Whether some uvicorn protocol is patched in this process."""
    with _lock:
        return bool(_patched)
