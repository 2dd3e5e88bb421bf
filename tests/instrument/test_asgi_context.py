"""The middleware's request is the current one while the app serves it: engine stages join it by context."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import tokentrace
from instrument.asgi import TokenTraceMiddleware
from tokentrace.recorder import BufferedRecorder
from tokentrace.recorder.sink import InMemorySink
from tokentrace.schema import REQUESTS, SPANS, Stage, col, request_id_of

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the deployments helpers
from deployments import serve_app  # noqa: E402


async def _engine_step(token_index: int) -> None:
    """Engine code that knows nothing of HTTP: it finds its request through the context."""
    request = tokentrace.current_request()
    assert request is not None
    with request.stage(Stage.PREFILL_COMPUTE, token_index=token_index):
        await asyncio.sleep(0.001)


async def _completions(request: Request) -> JSONResponse:
    await request.json()
    current = tokentrace.current_request()
    assert current is not None
    await asyncio.create_task(_engine_step(0))  # a task the handler starts inherits the context
    return JSONResponse({"choices": [{"index": 0, "text": "ok"}], "key": current.key,
                         "rid": current.request_id, "tenant": current.tenant,
                         "received": current.receive_end_ns() > 0})


def _serve(app: Any) -> contextlib.AbstractContextManager[str]:
    return serve_app(app, lifespan="off", timeout_s=20)


def test_the_app_finds_its_request_and_its_stages_join_the_row() -> None:
    sink = InMemorySink()
    rec = BufferedRecorder(sink, instance_id=7, flush_interval_s=600)
    app = Starlette(routes=[Route("/v1/completions", _completions, methods=["POST"])])
    app.add_middleware(TokenTraceMiddleware, recorder=rec)
    with _serve(app) as url:
        with_id = httpx.post(f"{url}/v1/completions", json={"prompt": "x"},
                             headers={"X-Request-Id": "req-7", "X-Tenant": "acme"}, timeout=30).json()
        without_id = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=30).json()
    assert with_id["key"] == "req-7" and with_id["tenant"] == "acme" and with_id["received"]
    assert with_id["rid"] == request_id_of("req-7", "acme")  # ids are scoped by tenant
    assert without_id["rid"] == request_id_of(without_id["key"])  # a drawn id joins just the same
    assert tokentrace.current_request() is None  # nothing leaks out of the request
    rec.flush()
    rows = sink.table(REQUESTS.name).to_pandas()
    spans = sink.table(SPANS.name).to_pandas()
    prefill = spans[spans[col.STAGE] == Stage.PREFILL_COMPUTE]
    assert sorted(prefill[col.REQUEST_ID]) == sorted(rows[col.REQUEST_ID]) == sorted(
        [with_id["rid"], without_id["rid"]])
