"""Refuse requests whose body length is ambiguous, before any route sees them.

A request carrying both ``Content-Length`` and ``Transfer-Encoding`` (RFC 9112 §6.1) can
be framed two ways: a proxy in front may honour the length while the gateway's HTTP
parser (h11) honours the chunked encoding, so bytes the proxy took for one body are read
here as a second, smuggled request. Such a request is answered 400 and the connection is
closed, so nothing after it on that connection is parsed. The same for a
``Transfer-Encoding`` other than plain ``chunked`` and for several differing
``Content-Length`` values.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["FramingGuard", "framing_error"]


def framing_error(headers: list[tuple[bytes, bytes]]) -> str | None:
    """Why these request headers frame the body ambiguously, or None when they do not."""
    lengths = {v.strip() for k, v in headers if k.lower() == b"content-length"}
    encodings = [v.strip().lower() for k, v in headers if k.lower() == b"transfer-encoding"]
    if encodings and lengths:
        return "a request may not carry both Content-Length and Transfer-Encoding"
    if encodings and encodings != [b"chunked"]:
        return "Transfer-Encoding must be exactly 'chunked'"
    if len(lengths) > 1:
        return "a request may carry only one Content-Length"
    return None


class FramingGuard:
    """ASGI middleware: 400 (OpenAI error shape) and ``Connection: close`` for an ambiguously
    framed HTTP request; everything else goes to ``app`` untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        reason = framing_error(scope.get("headers") or []) if scope.get("type") == "http" else None
        if reason is None:
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {"message": reason, "type": "invalid_request_error", "param": None,
                                     "code": "ambiguous_framing"}}).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
