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

Analyzers show ``[first byte read, app received)`` as the ``gateway.accept``
stage. What it cannot see is time the bytes spent in the kernel's socket buffer
before the loop read them: a stalled loop delays that read too.

Cost: one clock read and a few attribute operations per ``data_received``.
Set-up code may raise nothing: a uvicorn without these classes is left alone.
"""

from __future__ import annotations

import contextvars
import importlib
import logging
import threading
import time
from typing import Any

__all__ = ["FIRST_BYTE_NS", "SCOPE_KEY", "install", "first_byte_ns", "is_installed"]

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
_lock = threading.Lock()
_patched: set[type] = set()


def first_byte_ns(scope: Any = None) -> int:
    """The first-byte time of the current request: from ``scope`` if given and set, else the context; -1."""
    if scope is not None:
        ext = (scope.get("extensions") or {}).get(SCOPE_KEY)
        if ext is not None:
            return int(ext.get("first_byte_ns", -1))
    return FIRST_BYTE_NS.get()


def _patch(cls: type) -> None:
    original = cls.data_received

    def data_received(self: Any, data: bytes) -> None:
        pending = self.__dict__.get(_PENDING, -1)
        if pending < 0:  # the first bytes of a new request on this connection
            pending = time.monotonic_ns()
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

    data_received.__wrapped__ = original  # type: ignore[attr-defined]
    cls.data_received = data_received  # type: ignore[method-assign]


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
            if not callable(getattr(cls, "data_received", None)):
                log.warning("tokentrace: %s.%s has no data_received; transport timing off", module_name, class_name)
                continue
            _patch(cls)
            _patched.add(cls)
        return bool(_patched)


def is_installed() -> bool:
    """Whether some uvicorn protocol is patched in this process."""
    with _lock:
        return bool(_patched)
