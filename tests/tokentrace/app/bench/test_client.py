"""The streaming client: bodies, headers, token timing, and every failure kind, on loopback."""

from __future__ import annotations

import asyncio
import time

import pytest

from tokentrace.app.bench.client import FailureKind, RequestOptions, new_pool, send_request
from tokentrace.app.bench.requests import PlannedRequest, TextRequest


def _req(i: int = 0, **kw) -> PlannedRequest:
    return PlannedRequest(i, f"bench-t-{i:06d}", TextRequest("SYS", "hello", 6), 0.0, **kw)


def _send(url: str, model: str, *, endpoint: str = "completions", req: PlannedRequest | None = None, **opts):
    async def go():
        options = RequestOptions(url, endpoint=endpoint, model=model, **opts)
        async with new_pool(options) as pool:
            return await send_request(pool, req or _req(), options)

    return asyncio.run(go())


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_tokens_are_timed_on_arrival(fake_url, endpoint):
    before = time.monotonic_ns()
    o = _send(fake_url, "ok", endpoint=endpoint)
    assert o.ok and o.http_status == 200 and o.failure is None
    assert len(o.recv_ns) == 6 and o.num_output_tokens == 6  # the chat role chunk is not a token
    assert before <= o.send_ns <= o.recv_ns[0] and list(o.recv_ns) == sorted(o.recv_ns) and o.recv_ns[-1] <= o.finish_ns
    assert o.num_prompt_tokens == len("SYS") + len("hello")


def test_body_and_headers_carry_key_tenant_and_class(recording_server):
    url, seen, _ = recording_server
    _send(url, "ok", endpoint="chat", req=_req(3, api_key="sk-acme", slo_class="batch"))
    h, body = seen[0]["headers"], seen[0]["body"]
    assert h["x-request-id"] == "bench-t-000003"
    assert h["authorization"] == "Bearer sk-acme" and h["x-slo-class"] == "batch"
    assert body["messages"] == [{"role": "system", "content": "SYS"}, {"role": "user", "content": "hello"}]
    assert body["stream"] is True and body["max_tokens"] == 6 and body["stream_options"] == {"include_usage": True}
    _send(url, "ok", req=_req(4))
    assert seen[1]["body"]["prompt"] == "SYShello" and "authorization" not in seen[1]["headers"]


@pytest.mark.parametrize("model, kind, num_tokens", [
    ("http500", FailureKind.HTTP_5XX, 0),
    ("http400", FailureKind.HTTP_4XX, 0),
    ("malformed", FailureKind.MALFORMED_SSE, 2),
    ("cut", FailureKind.STREAM_CUT, 2),
    ("error_event", FailureKind.STREAM_ERROR, 2),
])
def test_failures_are_classified(fake_url, model, kind, num_tokens):
    o = _send(fake_url, model)
    assert o.failure is kind and not o.ok and o.detail
    assert len(o.recv_ns) == num_tokens  # what arrived before the failure is kept


def test_server_down_is_a_connect_failure(dead_url):
    o = _send(dead_url, "ok")
    assert o.failure is FailureKind.CONNECT and o.http_status == 0


def test_silence_longer_than_the_read_timeout_is_a_timeout(fake_url):
    o = _send(fake_url, "slow", read_timeout_s=0.3)
    assert o.failure is FailureKind.TIMEOUT and len(o.recv_ns) == 1


def test_cancelling_returns_a_cancelled_outcome_with_what_arrived(fake_url):
    async def go():
        options = RequestOptions(fake_url, model="slow")
        async with new_pool(options) as pool:
            task = asyncio.create_task(send_request(pool, _req(), options))
            await asyncio.sleep(0.5)
            task.cancel()
            return await task

    o = asyncio.run(go())
    assert o.cancelled and o.failure is None and not o.ok and len(o.recv_ns) == 1


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match="endpoint"):
        RequestOptions("http://x", endpoint="embeddings")
    with pytest.raises(ValueError, match="http"):
        RequestOptions("localhost:8000")
    with pytest.raises(ValueError, match="host"):
        RequestOptions("http://")
