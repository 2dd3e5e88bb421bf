"""Serving one generation request: hand it to the backend, stream tokens back as SSE (or
collect them into one JSON answer), and abort it when the client goes away.

:class:`GenerationResponse` is an ASGI response. It runs the request in a task of its own
while a second task waits for the client's ``http.disconnect``; a disconnect cancels the
request task, whose ``finally`` closes the backend iterator, which aborts the request on
every worker and frees its KV blocks. Headers are sent once the first token (or the
backend's refusal) is known, so a request the backend rejects before any token gets a
proper status: 400 (``ValueError``), 503 (``BackendUnavailable``), 500 (anything else).
After the first token, a failure ends the stream with an ``error`` event and ``[DONE]``.

Event-loop thread only.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from reference_server.serving.backend import BackendUnavailable, GenerateRequest, TokenEvent
from reference_server.serving.gateway_hooks import ChunkWritten, GatewayRequestFinished, ResponseWritten, Routed
from reference_server.serving.gateway_intake import RequestContext
from reference_server.serving.gateway_openai import (
    CHAT, OpenAIError, chat_chunk, chat_response, completion_chunk, completion_response, usage, usage_chunk,
)

if TYPE_CHECKING:
    from reference_server.serving.gateway import Gateway

__all__ = ["GenerationResponse", "error_for_backend_failure", "sse_event"]

_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]
_JSON_HEADERS = [(b"content-type", b"application/json")]


def sse_event(obj: Any) -> bytes:
    """One SSE event: ``data: <json>\\n\\n``."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def error_for_backend_failure(exc: BaseException) -> OpenAIError:
    """The error answer for an exception out of the backend's stream."""
    if isinstance(exc, ValueError):
        return OpenAIError(400, str(exc), param=None)
    if isinstance(exc, BackendUnavailable):
        return OpenAIError(503, str(exc), type="server_error", code="service_unavailable")
    return OpenAIError(500, f"the backend failed: {exc!r}", type="server_error", code="internal_error")


class _Progress:
    """What has happened so far (read after a cancellation to report the outcome)."""

    __slots__ = ("status", "num_output_tokens", "last_token_ns", "prev_sent_ns", "first", "finish_reason",
                 "error", "routed", "complete", "finished")

    def __init__(self) -> None:
        self.status = 0  # HTTP status sent; 0 = nothing sent yet
        self.num_output_tokens = 0
        self.last_token_ns = 0  # gateway monotonic clock, ns: last token received from the backend
        self.prev_sent_ns = 0  # ... previous token sent (streamed) or received (collected)
        self.first: TokenEvent | None = None
        self.finish_reason: str | None = None
        self.error: OpenAIError | None = None
        self.routed = False
        self.complete = False  # the last byte of the answer was sent
        self.finished = False  # metrics and on_request_finished recorded


class GenerationResponse:
    """The ASGI response of ``/v1/completions`` and ``/v1/chat/completions``."""

    def __init__(self, gateway: Gateway, ctx: RequestContext, req: GenerateRequest) -> None:
        self.gateway = gateway
        self.ctx = ctx
        self.req = req
        self.progress = _Progress()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        work = asyncio.create_task(self._serve(send))
        watcher = asyncio.create_task(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done() and not self.progress.complete:  # the client left (or the server stops)
                work.cancel()
            watcher.cancel()
            await asyncio.gather(work, watcher, return_exceptions=True)
            if work.cancelled():
                self._finish("aborted")
        error = None if work.cancelled() else work.exception()
        if error is not None:  # a bug in the gateway: record it, then let uvicorn log it
            self._finish("error")
            raise error

    async def _serve(self, send: Any) -> None:
        gw, ctx = self.gateway, self.ctx
        ctx.route_start_ns = time.monotonic_ns()
        gw.route_listener.expect(ctx.request_id)
        stream: AsyncIterator[TokenEvent] | None = None
        try:
            await gw.config.delays.delay("route")
            stream = gw.backend.generate(self.req)
            try:
                first = await stream.__anext__()
            except StopAsyncIteration:
                first = None
            except Exception as exc:  # the backend refused the request before any token
                self._emit_routed(time.monotonic_ns(), "")
                await self._send_error_response(send, error_for_backend_failure(exc))
                return
            received_ns = time.monotonic_ns()
            self._emit_routed(received_ns, first.instance if first else "", first.accepted_ns if first else -1)
            if first is None:
                await self._send_error_response(send, OpenAIError(
                    500, "the backend ended the stream without a token", type="server_error"))
                return
            if ctx.stream:
                await self._stream(send, stream, first, received_ns)
            else:
                await self._collect(send, stream, first, received_ns)
        finally:
            gw.route_listener.forget(ctx.request_id)
            if stream is not None:
                await stream.aclose()  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ streaming

    async def _stream(self, send: Any, stream: AsyncIterator[TokenEvent], first: TokenEvent,
                      received_ns: int) -> None:
        progress = self.progress
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*_SSE_HEADERS, (b"x-request-id", self.ctx.request_id.encode())]})
        progress.status = 200
        event: TokenEvent | None = first
        while event is not None:
            await self._write_token(send, event, received_ns)
            if event.finish_reason is not None:
                break
            try:
                event = await stream.__anext__()
            except StopAsyncIteration:
                event = None
                progress.error = OpenAIError(500, "the backend ended the stream without a finish reason",
                                             type="server_error")
            except Exception as exc:  # failure mid-stream: an error event, then [DONE]
                event = None
                progress.error = error_for_backend_failure(exc)
            received_ns = time.monotonic_ns()
        tail = b""
        if progress.error is not None:
            tail += sse_event(progress.error.body())
        elif self.ctx.include_usage:
            tail += sse_event(usage_chunk(self.ctx.request_id, self.ctx.created, self.ctx.model, self.ctx.operation,
                                          self._usage()))
        await send({"type": "http.response.body", "body": tail + _DONE, "more_body": False})
        progress.complete = True
        self._finish("error" if progress.error is not None else progress.finish_reason or "stop")

    async def _write_token(self, send: Any, event: TokenEvent, received_ns: int) -> None:
        gw, ctx, progress = self.gateway, self.ctx, self.progress
        delays = gw.config.delays
        detok_start_ns = time.monotonic_ns()
        await delays.delay("detokenize")
        if ctx.operation == CHAT:
            chunk = chat_chunk(ctx.request_id, ctx.created, ctx.model, event.text, event.finish_reason,
                               first=progress.num_output_tokens == 0, include_usage=ctx.include_usage)
        else:
            chunk = completion_chunk(ctx.request_id, ctx.created, ctx.model, event.text, event.finish_reason,
                                     include_usage=ctx.include_usage)
        data = sse_event(chunk)
        detok_end_ns = write_start_ns = time.monotonic_ns()
        await delays.delay("stream_send")
        await send({"type": "http.response.body", "body": data, "more_body": True})
        write_end_ns = time.monotonic_ns()
        self._count_token(event, received_ns, write_end_ns)
        if gw.hooks.observers:
            gw.hooks.emit("on_chunk_written", ChunkWritten(
                ctx.request_id, event.index, event.token_id, event.instance, received_ns, detok_start_ns,
                detok_end_ns, write_start_ns, write_end_ns, len(data), event.emitted_ns))

    # ------------------------------------------------------------------ one JSON answer

    async def _collect(self, send: Any, stream: AsyncIterator[TokenEvent], first: TokenEvent,
                       received_ns: int) -> None:
        progress, ctx = self.progress, self.ctx
        texts: list[str] = []
        event: TokenEvent | None = first
        while event is not None:
            texts.append(event.text)
            self._count_token(event, received_ns, received_ns)
            if event.finish_reason is not None:
                break
            try:
                event = await stream.__anext__()
            except StopAsyncIteration:
                event = None
                progress.finish_reason = None
            except Exception as exc:
                await self._send_error_response(send, error_for_backend_failure(exc))
                return
            received_ns = time.monotonic_ns()
        build = chat_response if ctx.operation == CHAT else completion_response
        body = json.dumps(build(ctx.request_id, ctx.created, ctx.model, "".join(texts), progress.finish_reason,
                                self._usage()), ensure_ascii=False).encode()
        write_start_ns = time.monotonic_ns()
        await _send_whole(send, 200, _JSON_HEADERS, ctx.request_id, body)
        progress.status, progress.complete = 200, True
        if self.gateway.hooks.observers:
            self.gateway.hooks.emit("on_response_written", ResponseWritten(
                ctx.request_id, progress.last_token_ns, write_start_ns, time.monotonic_ns(), len(body)))
        self._finish(progress.finish_reason or "stop")

    # ------------------------------------------------------------------ bookkeeping

    def _count_token(self, event: TokenEvent, received_ns: int, sent_ns: int) -> None:
        """Metrics of one token: TTFT for the first, inter-token time for the others."""
        progress = self.progress
        labels = self.ctx.metric_labels()
        if progress.num_output_tokens == 0:
            progress.first = event
            self.gateway.metrics.ttft.labels(*labels).observe((sent_ns - self.ctx.arrival_ns) / 1e9)
        else:
            self.gateway.metrics.tpot.labels(*labels).observe((sent_ns - progress.prev_sent_ns) / 1e9)
        progress.prev_sent_ns = sent_ns
        progress.last_token_ns = received_ns
        progress.num_output_tokens += 1
        progress.finish_reason = event.finish_reason

    def _usage(self) -> dict[str, Any]:
        first = self.progress.first
        num_prompt = first.num_prompt_tokens if first else self.ctx.num_prompt_tokens
        return usage(num_prompt, self.progress.num_output_tokens, first.num_cached_tokens if first else 0)

    def _emit_routed(self, fallback_end_ns: int, fallback_instance: str, accepted_ns: int = -1) -> None:
        """Fire ``on_routed`` once: the backend's own route decision when it reported one
        (its end is when it handed the request over), else up to the first token."""
        decision = self.gateway.route_listener.decision(self.ctx.request_id)
        self.progress.routed = True
        if not self.gateway.hooks.observers:
            return
        end_ns, instance = decision if decision is not None else (fallback_end_ns, fallback_instance)
        self.gateway.hooks.emit("on_routed", Routed(self.ctx.request_id, self.ctx.route_start_ns, end_ns, instance,
                                                    accepted_ns))

    async def _send_error_response(self, send: Any, err: OpenAIError) -> None:
        self.progress.error = err
        await _send_whole(send, err.status, _JSON_HEADERS, self.ctx.request_id, json.dumps(err.body()).encode())
        self.progress.status, self.progress.complete = err.status, True
        self._finish("error" if err.status >= 500 else "rejected")

    def _finish(self, outcome: str) -> None:
        """Record the end of the request once (metrics, ``on_request_finished``)."""
        gw, ctx, progress = self.gateway, self.ctx, self.progress
        if progress.finished:
            return
        progress.finished = True
        end_ns = time.monotonic_ns()
        status = progress.status if progress.status else 499  # 499: the client closed the request first
        labels = ctx.metric_labels()
        if progress.num_output_tokens:
            gw.metrics.duration.labels(*labels).observe((end_ns - ctx.arrival_ns) / 1e9)
            gw.metrics.output_tokens.labels(*labels).inc(progress.num_output_tokens)
            gw.metrics.prompt_tokens.labels(*labels).inc(ctx.num_prompt_tokens)
        gw.metrics.requests.labels(ctx.endpoint, str(status), outcome).inc()
        if gw.hooks.observers:
            error = progress.error.message if progress.error is not None else None
            gw.hooks.emit("on_request_finished", GatewayRequestFinished(
                ctx.request_id, end_ns, progress.status, outcome, ctx.num_prompt_tokens, progress.num_output_tokens,
                error))


async def _send_whole(send: Any, status: int, headers: list[tuple[bytes, bytes]], request_id: str,
                      body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode()),
                            (b"x-request-id", request_id.encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _wait_for_disconnect(receive: Any) -> None:
    """Return when the client goes away (the body has been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
