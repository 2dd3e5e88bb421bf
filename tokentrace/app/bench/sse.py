"""The response side of one streamed request: SSE events in, token receive times out.

:class:`SseStream` is the :class:`~tokentrace.app.bench.connections.ResponseSink` of one
request. It is fed each network read with the time it arrived (stamped by the
connection before any parsing) and gives every SSE event in that read that stamp.

A chunk counts as an output token when its first choice carries content
(``text`` for completions, ``delta.content`` for chat). Content-less bookkeeping
chunks are dropped: chat's role announcement (``{"role": "assistant",
"content": ""}`` first) and an empty closing chunk that only carries
``finish_reason``. When the server reports ``usage.completion_tokens``, those
empty chunks are dropped only as far as needed to match it: a server may stream
a real token whose text delta is empty (half a UTF-8 character), and the
reference server's first chat chunk carries both the role and the first token.

Per chunk it keeps an int and two bools in lists; nothing else outlives the chunk.
"""

from __future__ import annotations

import json
from typing import Any

from tokentrace.app.bench.connections import Want
from tokentrace.app.bench.requests import FailureKind

__all__ = ["MAX_ERROR_BODY", "SseStream"]

MAX_ERROR_BODY = 2048  # bytes of an error response kept for the detail text
_DONE = b"[DONE]"


class SseStream:
    """Parse state of one response: HTTP status, SSE framing, token chunks, usage, how it failed.

    Event-loop thread only (the connection's protocol callbacks call ``on_head`` / ``on_body``).
    """

    __slots__ = ("buf", "times", "empty", "finish_flags", "usage", "done", "done_ns", "failure", "detail", "chat",
                 "role_first", "status", "error_body", "text_parts")

    def __init__(self, chat: bool, *, keep_text: bool = False) -> None:
        self.buf = b""
        self.times: list[int] = []  # recv ns of each content chunk
        self.empty: list[bool] = []  # that chunk's content was ""
        self.finish_flags: list[bool] = []  # that chunk carried a finish_reason
        self.usage: dict[str, Any] | None = None
        self.done = False
        self.done_ns = 0  # arrival of the read that held [DONE]
        self.failure: FailureKind | None = None
        self.detail = ""
        self.chat = chat
        self.role_first = False  # the first content chunk was a chat role announcement with content ""
        self.status = 0  # HTTP status; 0 = no response head yet
        self.error_body = b""  # start of a non-200 response's body
        # the content of every chunk, in order (the answer's text), when asked to keep it
        self.text_parts: list[str] | None = [] if keep_text else None

    # -- ResponseSink

    def on_head(self, status: int, headers: dict[str, str]) -> Want:
        self.status = status
        if status != 200:
            return Want.MORE  # read the start of the error body for the detail
        content_type = headers.get("content-type", "")
        if not content_type.startswith("text/event-stream"):
            self.fail(FailureKind.MALFORMED_SSE, f"content-type {content_type!r}")
            return Want.CLOSE
        encoding = headers.get("content-encoding", "identity")
        if encoding.lower() != "identity":
            self.fail(FailureKind.MALFORMED_SSE, f"content-encoding {encoding!r} (none was accepted)")
            return Want.CLOSE
        return Want.MORE

    def on_body(self, data: bytes, t_ns: int) -> Want:
        if self.status != 200:
            self.error_body += data[:MAX_ERROR_BODY - len(self.error_body)]
            return Want.CLOSE if len(self.error_body) >= MAX_ERROR_BODY else Want.MORE
        self.feed(data, t_ns)
        if self.failure is not None:
            return Want.CLOSE
        return Want.DRAIN if self.done else Want.MORE

    # -- SSE

    def feed(self, data: bytes, t_ns: int) -> None:
        """Consume one network read that arrived at ``t_ns``; stops at [DONE] or a failure."""
        buf = self.buf + data if self.buf else data
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        while not self.done and self.failure is None:
            end = buf.find(b"\n\n")
            if end < 0:
                break
            self._event(buf[:end], t_ns)
            buf = buf[end + 2:]
        self.buf = buf

    def _event(self, raw: bytes, t_ns: int) -> None:
        if raw.startswith(b"data: ") and b"\n" not in raw:  # the usual event: one data line
            payload = raw[6:]
        else:
            data = []
            for line in raw.split(b"\n"):
                if line.startswith(b"data:"):
                    data.append(line[5:].lstrip(b" "))
                elif line and not line.startswith((b":", b"event:", b"id:", b"retry:")):
                    self.fail(FailureKind.MALFORMED_SSE, f"not an SSE line: {line[:80]!r}")
                    return
            if not data:
                return
            payload = b"\n".join(data)
        if payload == _DONE:
            self.done, self.done_ns = True, t_ns
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            self.fail(FailureKind.MALFORMED_SSE, f"SSE data is not JSON: {payload[:80]!r}")
            return
        if not isinstance(obj, dict):
            self.fail(FailureKind.MALFORMED_SSE, "SSE data is not a JSON object")
            return
        if obj.get("error") is not None:
            err = obj["error"]
            message = err.get("message", "") if isinstance(err, dict) else str(err)
            self.fail(FailureKind.STREAM_ERROR, str(message)[:200])
            return
        self._chunk(obj, t_ns)

    def _chunk(self, obj: dict[str, Any], t_ns: int) -> None:
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        choices = obj.get("choices")
        if not choices:
            if "choices" not in obj and self.usage is None:
                self.fail(FailureKind.MALFORMED_SSE, "chunk has neither choices nor usage")
            return
        choice = choices[0]
        if not isinstance(choice, dict):
            self.fail(FailureKind.MALFORMED_SSE, "a choice is not a JSON object")
            return
        if self.chat:
            delta = choice.get("delta") or {}
            content = delta.get("content") if isinstance(delta, dict) else None
            if content == "" and "role" in delta and not self.times:
                self.role_first = True  # OpenAI's role announcement (or a first token with an empty delta)
        else:
            content = choice.get("text")
        if not isinstance(content, str):
            if choice.get("finish_reason") is None:
                self.fail(FailureKind.MALFORMED_SSE, "a choice has no text content")
            return
        self.times.append(t_ns)
        if self.text_parts is not None:
            self.text_parts.append(content)
        self.empty.append(content == "")
        self.finish_flags.append(choice.get("finish_reason") is not None)

    def fail(self, kind: FailureKind, detail: str) -> None:
        self.failure, self.detail = kind, detail

    # -- results

    def token_times(self) -> tuple[int, ...]:
        """Receive times of the output tokens (see the module doc for the counting rule)."""
        times = list(self.times)
        empty, fin = list(self.empty), list(self.finish_flags)
        reported = self.usage_int("completion_tokens")
        if reported >= 0:  # drop empty bookkeeping chunks only as far as the server's count says
            if len(times) > reported and self.role_first:
                del times[0], empty[0], fin[0]
            while len(times) > reported and empty and empty[-1]:
                times.pop()
                empty.pop()
        else:  # no count: OpenAI's conventions
            if self.role_first and len(times) > 1:
                del times[0], empty[0], fin[0]
            if len(times) > 1 and empty[-1] and fin[-1]:
                times.pop()
        return tuple(times)

    def usage_int(self, name: str) -> int:
        value = self.usage.get(name) if self.usage else None
        return value if isinstance(value, int) else -1

    def cached_tokens(self) -> int:
        details = self.usage.get("prompt_tokens_details") if self.usage else None
        value = details.get("cached_tokens") if isinstance(details, dict) else None
        return value if isinstance(value, int) else -1
