"""Reading an OpenAI-compatible response from the outside: SSE events, usage, errors.

Used by the ASGI middleware (``instrument.asgi``) to see, in the bytes a
server sends, which chunks carry output tokens and what the final usage
counts are, without touching the bytes themselves (the middleware forwards the
server's own message objects; this module only reads them).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["SseScanner", "EventInfo", "classify_event", "Usage", "usage_of", "MAX_EVENT_BYTES"]

MAX_EVENT_BYTES = 1 << 20
"""Longest SSE event kept while waiting for its end (bytes); longer ones are skipped."""

_DONE = b"[DONE]"


class SseScanner:
    """Incremental Server-Sent Events parser: feed body chunks, get each event's data.

    Events may be split across chunks or several may share one; lines end
    with ``\\n`` or ``\\r\\n``; an event ends at an empty line; its ``data:``
    lines are joined with ``\\n``; other fields and comments are ignored.
    Memory is bounded by :data:`MAX_EVENT_BYTES`: an event longer than that is
    skipped (``num_skipped``). Not thread-safe (one per response).
    """

    __slots__ = ("_partial", "_data", "_size", "num_skipped")

    def __init__(self) -> None:
        self._partial = b""  # bytes after the last newline seen
        self._data: list[bytes] | None = None  # data lines of the event being read
        self._size = 0
        self.num_skipped = 0

    def feed(self, chunk: bytes) -> list[bytes]:
        """The data of every event completed by ``chunk`` (in order)."""
        if (not self._partial and self._data is None and chunk.startswith(b"data:")
                and chunk.find(b"\n") == len(chunk) - 2 and chunk.endswith(b"\n\n")):
            # the common case: exactly one single-line event per chunk
            return [chunk[6:-2] if chunk.startswith(b"data: ") else chunk[5:-2]] if len(chunk) <= MAX_EVENT_BYTES else []
        if self._partial:
            chunk = self._partial + chunk
        lines = chunk.split(b"\n")
        self._partial = lines.pop()
        out: list[bytes] = []
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data is not None:
                    if self._size <= MAX_EVENT_BYTES:
                        out.append(b"\n".join(self._data))
                    else:
                        self.num_skipped += 1
                    self._data = None
                    self._size = 0
            elif line.startswith(b"data:"):
                value = line[6:] if line.startswith(b"data: ") else line[5:]
                if self._data is None:
                    self._data = []
                self._size += len(value)
                if self._size <= MAX_EVENT_BYTES:
                    self._data.append(value)
        if len(self._partial) > MAX_EVENT_BYTES:  # a runaway line: forget it
            self._partial = b""
            self._size = MAX_EVENT_BYTES + 1
        return out


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts reported by the server (-1 = not reported)."""

    num_prompt_tokens: int = -1
    num_output_tokens: int = -1
    num_cached_tokens: int = -1


@dataclass(frozen=True, slots=True)
class EventInfo:
    """What one SSE event (or a whole JSON response) tells about the request."""

    has_token: bool = False
    """A choice carries output (``text``, ``delta.content``, ``delta.reasoning_content``
    or ``delta.tool_calls``): one output token, by this module's convention."""
    usage: Usage | None = None
    error: str | None = None
    """Error kind from an ``error`` object (its ``type`` or ``code``), if any."""


_NOTHING = EventInfo()
_TOKEN = EventInfo(has_token=True)
# a non-empty JSON string value of an output field
_OUTPUT = re.compile(rb'"(?:text|content|reasoning_content)"\s*:\s*"(?!")')


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else -1


def usage_of(obj: Mapping[str, Any]) -> Usage | None:
    """The ``usage`` object of a completion chunk or response, if it has one."""
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(_int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens")), _int(cached))


def _has_output(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    if choice.get("text"):
        return True
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))
    return False


def _error_kind(obj: Mapping[str, Any]) -> str | None:
    err = obj.get("error")
    if err is None:
        return None
    if isinstance(err, dict):
        kind = err.get("type") or err.get("code")
        if isinstance(kind, (str, int)) and not isinstance(kind, bool):
            return str(kind)[:64]  # error kinds are interned labels: keep them short
    return "stream_error"


def _needs_parse(data: bytes) -> bool:
    """Whether the event may carry usage, an error or tool calls (else a byte scan suffices)."""
    if b'"error"' in data or b'"tool_calls"' in data:
        return True
    return b'"usage"' in data and b'"usage":null' not in data and b'"usage": null' not in data


def classify_event(data: bytes) -> EventInfo:
    """Read one event's data: ``[DONE]``, non-JSON and non-object data tell nothing.

    Fast path: an event without usage, error or tool calls is classified by a
    byte scan for a non-empty ``text`` / ``content`` / ``reasoning_content``
    string (the token chunks of a stream); others are parsed as JSON.
    """
    if data == _DONE or not data:
        return _NOTHING
    if not _needs_parse(data):
        if data[:1] == b"{" and _OUTPUT.search(data) is not None:
            return _TOKEN
        return _NOTHING
    try:
        obj = json.loads(data)
    except ValueError:
        return _NOTHING
    if not isinstance(obj, dict):
        return _NOTHING
    choices = obj.get("choices")
    has_token = isinstance(choices, list) and any(_has_output(c) for c in choices)
    return EventInfo(has_token, usage_of(obj), _error_kind(obj))
