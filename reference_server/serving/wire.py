"""Framing for the worker protocol: length-prefixed frames of a JSON header plus bytes.

A frame on the wire is::

    u32 header_len | u32 payload_len | header (UTF-8 JSON object) | payload (raw bytes)

lengths big-endian. The header says what the frame is (``{"type": "generate", ...}``);
the payload carries bulk data (KV blocks) without JSON encoding, and is empty for most
messages. Frames larger than the limits below are refused (``WireError``) before their
body is read, so a broken peer cannot make a process allocate without bound.

Reading and writing are asyncio stream operations on the caller's event loop thread.
"""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any

__all__ = ["MAX_HEADER_BYTES", "MAX_PAYLOAD_BYTES", "WireError", "encode_frame", "read_frame", "write_frame"]

MAX_HEADER_BYTES = 16 * 1024 * 1024  # a header holds at most a prompt's token ids and stats
MAX_PAYLOAD_BYTES = 1024 * 1024 * 1024  # one KV chunk is far smaller; this only bounds a bad peer
_PREFIX = struct.Struct(">II")


class WireError(RuntimeError):
    """A malformed or oversized frame; the connection should be closed."""


def encode_frame(header: dict[str, Any], payload: bytes | bytearray | memoryview = b"") -> bytes:
    """One frame as bytes. ``header`` must be JSON-serializable."""
    head = json.dumps(header, separators=(",", ":")).encode()
    if len(head) > MAX_HEADER_BYTES or len(payload) > MAX_PAYLOAD_BYTES:
        raise WireError(f"frame too large: header {len(head)} bytes, payload {len(payload)} bytes")
    return b"".join((_PREFIX.pack(len(head), len(payload)), head, bytes(payload)))


def write_frame(writer: asyncio.StreamWriter, header: dict[str, Any],
                payload: bytes | bytearray | memoryview = b"") -> None:
    """Queue one frame on ``writer`` (no drain: call ``await writer.drain()`` for flow
    control on bulk transfers). Never blocks."""
    writer.write(encode_frame(header, payload))


async def read_frame(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes] | None:
    """The next frame as ``(header, payload)``, or ``None`` at a clean end of stream
    (EOF before a frame starts). ``WireError`` on a malformed frame or EOF inside one."""
    try:
        prefix = await reader.readexactly(_PREFIX.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise WireError("connection closed inside a frame prefix") from None
    head_len, payload_len = _PREFIX.unpack(prefix)
    if head_len > MAX_HEADER_BYTES or payload_len > MAX_PAYLOAD_BYTES:
        raise WireError(f"frame too large: header {head_len} bytes, payload {payload_len} bytes")
    try:
        head = await reader.readexactly(head_len)
        payload = await reader.readexactly(payload_len) if payload_len else b""
    except asyncio.IncompleteReadError:
        raise WireError("connection closed inside a frame") from None
    try:
        header = json.loads(head)
    except ValueError as exc:
        raise WireError(f"frame header is not JSON: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise WireError("frame header must be a JSON object with a string 'type'")
    return header, payload
