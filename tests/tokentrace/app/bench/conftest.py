"""Fixtures of the bench tests: a minimal OpenAI-compatible streaming server on loopback.

The requested ``model`` picks the behaviour, so one server serves every case:
``ok`` (the default), ``http500``, ``http400``, ``malformed`` (non-JSON SSE data
after two tokens), ``cut`` (the connection drops after two tokens, no [DONE]),
``error_event`` (an OpenAI error object mid-stream), ``slow`` (a 3 s pause
after the first token, to trip read timeouts and duration bounds).
Each token chunk carries the server's ``time.monotonic_ns()`` just before the
write in ``"t_ns"``. Served on 127.0.0.1 by uvicorn in a background thread.
"""


from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from typing import Any, AsyncIterator, Iterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


class Counters:
    """Requests in flight now and at most (event-loop thread only)."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0


def make_app(*, token_gap_s: float = 0.0, seen: list[dict[str, Any]] | None = None,
             counters: Counters | None = None) -> Starlette:
    """The app; ``seen`` collects (headers, body) of every completion request."""

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "ok", "object": "model"}]})

    async def completions(request: Request) -> Response:
        body = await request.json()
        chat = request.url.path.endswith("/chat/completions")
        if seen is not None:
            seen.append({"headers": dict(request.headers), "body": body})
        mode = body.get("model") or "ok"
        if mode == "http500":
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
        if mode == "http400":
            return JSONResponse({"error": {"message": "bad", "type": "invalid_request_error"}}, status_code=400)
        rid = request.headers.get("x-request-id", "cmpl-x")
        n = int(body.get("max_tokens", 16))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        prompt_len = len(body.get("prompt", "")) if not chat else sum(len(m["content"]) for m in body["messages"])
        gen = _counted(_stream(rid, n, chat, mode, include_usage, prompt_len, token_gap_s), counters)
        return StreamingResponse(gen, media_type="text/event-stream", headers={"X-Request-Id": rid})

    return Starlette(routes=[
        Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", completions, methods=["POST"]),
    ])


async def _counted(gen: AsyncIterator[bytes], counters: Counters | None) -> AsyncIterator[bytes]:
    if counters is None:
        async for data in gen:
            yield data
        return
    counters.in_flight += 1
    counters.max_in_flight = max(counters.max_in_flight, counters.in_flight)
    try:
        async for data in gen:
            yield data
    finally:
        counters.in_flight -= 1


def _chunk(rid: str, i: int, n: int, chat: bool) -> dict[str, Any]:
    text = chr(ord("a") + i % 26)
    finish = "length" if i == n - 1 else None
    if chat:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish}
    return {"id": rid, "object": "x", "choices": [choice], "t_ns": time.monotonic_ns()}


async def _stream(rid: str, n: int, chat: bool, mode: str, include_usage: bool, prompt_len: int,
                  gap_s: float) -> AsyncIterator[bytes]:
    if chat:  # OpenAI's role announcement, not a token
        yield _sse({"id": rid, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    for i in range(n):
        if i == 2 and mode == "malformed":
            yield b"data: {not json\n\n"
            return
        if i == 2 and mode == "cut":
            raise RuntimeError("connection cut on purpose")  # uvicorn drops the connection mid-body
        if i == 2 and mode == "error_event":
            yield _sse({"error": {"message": "backend died", "type": "server_error"}})
            yield b"data: [DONE]\n\n"
            return
        if i == 1 and mode == "slow":
            await asyncio.sleep(3.0)
        yield _sse(_chunk(rid, i, n, chat))
        if gap_s:
            await asyncio.sleep(gap_s)
    if include_usage:
        yield _sse({"id": rid, "choices": [], "usage": {"prompt_tokens": prompt_len, "completion_tokens": n,
                                                         "total_tokens": prompt_len + n}})
    yield b"data: [DONE]\n\n"


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(app: Any) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 in a daemon thread; yields the base URL; stops on exit."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical", lifespan="auto")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    """Base URL of a fake streaming server (behaviour chosen by the request's model)."""
    with serve(make_app()) as url:
        yield url


@pytest.fixture()
def recording_server() -> Iterator[tuple[str, list[dict[str, Any]], Counters]]:
    """A fake server that keeps every request's headers and body and counts requests in flight;
    yields (url, seen, counters); tokens are 5 ms apart."""
    seen: list[dict[str, Any]] = []
    counters = Counters()
    with serve(make_app(seen=seen, counters=counters, token_gap_s=0.005)) as url:
        yield url, seen, counters


@pytest.fixture()
def dead_url() -> str:
    """A loopback URL where nothing listens (a server that is down)."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture(scope="session")
def serve_app() -> Any:
    """``serve_app(app)``: a context manager serving an ASGI app on loopback, yielding its URL."""
    return serve
