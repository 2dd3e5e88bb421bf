"""The ASGI middleware on a small third-party-style OpenAI-compatible server (Starlette only)."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from instrument.asgi import TokenTraceMiddleware, parse_traceparent
from instrument.sse import SseScanner, classify_event
from tokentrace.recorder import BufferedRecorder, Recorder
from tokentrace.recorder.sink import InMemorySink
from tokentrace.schema import REQUESTS, SPANS, TOKENS, RequestStatus, Stage, col, request_id_of

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the deployments helpers
from deployments import serve_app  # noqa: E402

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def _chunk(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def _completions(request: Request):
    """A toy OpenAI-compatible endpoint: '{"prompt": str, "max_tokens": n, "stream": bool}'."""
    body = await request.json()
    if body.get("max_tokens", 0) < 0:
        return JSONResponse({"error": {"type": "invalid_request_error", "message": "bad"}}, status_code=400)
    if body.get("prompt") == "crash":
        raise RuntimeError("model fell over")
    words = [f"w{i}" for i in range(body["max_tokens"])]
    usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": len(words),
             "prompt_tokens_details": {"cached_tokens": 1}}
    if not body.get("stream"):
        return JSONResponse({"id": "c", "choices": [{"index": 0, "text": " ".join(words)}], "usage": usage})

    async def events():
        yield _chunk({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        for i, w in enumerate(words):
            chunk = _chunk({"id": "c", "choices": [{"index": 0, "delta": {"content": w}}]})
            if i == 1:  # one event split over two writes
                yield chunk[:9]
                yield chunk[9:]
            else:
                yield chunk
        yield _chunk({"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        yield _chunk({"id": "c", "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _app() -> Starlette:
    return Starlette(routes=[Route("/v1/completions", _completions, methods=["POST"]),
                             Route("/health", lambda r: JSONResponse({"ok": True}))])


def _serve(app: Any) -> contextlib.AbstractContextManager[str]:
    return serve_app(app, lifespan="off", timeout_s=20)


def _wait_rows(rec: Recorder, sink: InMemorySink, n: int) -> None:
    """The request row is written when the app returns, just after the client saw the end."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rec.flush()
        if sink.num_rows(REQUESTS.name) >= n:
            # A flush racing with the app's finish can drain the spans table just before the
            # request's gateway.receive span is appended and the requests table just after
            # its row: one more flush takes everything written before the row.
            rec.flush()
            return
        time.sleep(0.01)
    raise AssertionError(f"expected {n} request rows, got {sink.num_rows(REQUESTS.name)}")


@pytest.fixture()
def traced():
    sink = InMemorySink()
    rec = BufferedRecorder(sink, instance_id=7)
    with _serve(TokenTraceMiddleware(_app(), recorder=rec)) as url:
        yield url, rec, sink
    rec.close()


def _rows(sink: InMemorySink, table: str, key: str) -> list[dict]:
    (rid,) = {r[col.REQUEST_ID] for r in sink.table(REQUESTS.name).to_pylist() if r[col.REQUEST_KEY] == key}
    return [r for r in sink.table(table).to_pylist() if r[col.REQUEST_ID] == rid]


def test_streaming_request_records_every_chunk_usage_and_receive(traced):
    url, rec, sink = traced
    headers = {"X-Request-Id": "abc-1", "X-Tenant": "acme", "traceparent": f"00-{TRACE}-00f067aa0ba902b7-01"}
    recv_ns = []
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", f"{url}/v1/completions", headers=headers,
                           json={"prompt": "a b c", "max_tokens": 5, "stream": True}) as resp:
            for line in resp.iter_lines():
                if '"content"' in line:
                    recv_ns.append(time.monotonic_ns())
    _wait_rows(rec, sink, 1)
    tokens = sorted(_rows(sink, TOKENS.name, "abc-1"), key=lambda r: r[col.TOKEN_INDEX])
    assert [t[col.TOKEN_INDEX] for t in tokens] == list(range(5)) == list(range(len(recv_ns)))
    sent = [t[col.SENT_NS] for t in tokens]
    assert sent == sorted(sent)
    # One clock: each chunk's write started before the client read it. (sent_ns is
    # when the write returned, which the client may beat under load.)
    write_start = {s[col.TOKEN_INDEX]: s[col.START_NS] for s in _rows(sink, SPANS.name, "abc-1")
                   if s[col.STAGE] == Stage.STREAM_SEND and s[col.TOKEN_INDEX] >= 0}
    assert all(write_start[i] <= r for i, r in enumerate(recv_ns))
    (req,) = _rows(sink, REQUESTS.name, "abc-1")
    assert (req[col.TENANT], req[col.TRACE_ID], req[col.STATUS]) == ("acme", TRACE, RequestStatus.OK)
    assert (req[col.NUM_PROMPT_TOKENS], req[col.NUM_OUTPUT_TOKENS], req[col.NUM_CACHED_TOKENS]) == (3, 5, 1)
    assert req[col.FIRST_TOKEN_NS] == sent[0] and req[col.FINISH_NS] >= sent[-1]
    spans = _rows(sink, SPANS.name, "abc-1")
    (receive,) = [s for s in spans if s[col.STAGE] == Stage.GATEWAY_RECEIVE]
    (accept,) = [s for s in spans if s[col.STAGE] == Stage.GATEWAY_ACCEPT]  # uvicorn read the first byte
    assert accept[col.START_NS] == req[col.ARRIVAL_NS] < accept[col.END_NS] == receive[col.START_NS]
    assert receive[col.START_NS] < receive[col.END_NS] <= sent[0]
    assert req[col.FIRST_CONTENT_NS] == req[col.FIRST_TOKEN_NS]
    assert receive[col.TOKEN_INDEX] == 0
    sends = [s for s in spans if s[col.STAGE] == Stage.STREAM_SEND]
    # role + 5 tokens (one split in two writes) + finish + usage + [DONE] chunks
    assert len(sends) == 10
    assert sorted(s[col.TOKEN_INDEX] for s in sends if s[col.TOKEN_INDEX] >= 0) == list(range(5))
    for s in sends:
        if s[col.TOKEN_INDEX] >= 0:
            assert s[col.END_NS] == sent[s[col.TOKEN_INDEX]] and s[col.START_NS] <= s[col.END_NS]


def test_json_response_and_errors_are_recorded(traced):
    url, rec, sink = traced
    with httpx.Client(timeout=10) as client:
        ok = client.post(f"{url}/v1/completions", headers={"X-Request-Id": "j1"},
                         json={"prompt": "x y", "max_tokens": 4})
        rejected = client.post(f"{url}/v1/completions", headers={"X-Request-Id": "bad"},
                               json={"prompt": "x", "max_tokens": -1})
        crashed = client.post(f"{url}/v1/completions", headers={"X-Request-Id": "boom"},
                              json={"prompt": "crash", "max_tokens": 1})
        anonymous = client.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
        health = client.get(f"{url}/health")
    assert (ok.status_code, rejected.status_code, crashed.status_code) == (200, 400, 500)
    assert anonymous.status_code == health.status_code == 200
    _wait_rows(rec, sink, 4)
    rows = {r[col.REQUEST_KEY]: r for r in sink.table(REQUESTS.name).to_pylist()}
    assert len(rows) == 4  # /health is not an OpenAI path: not traced
    assert (rows["j1"][col.NUM_PROMPT_TOKENS], rows["j1"][col.NUM_OUTPUT_TOKENS]) == (2, 4)
    assert rows["j1"][col.STATUS] == RequestStatus.OK and rows["j1"][col.FIRST_TOKEN_NS] is None
    assert (rows["bad"][col.STATUS], rows["bad"][col.ERROR]) == (RequestStatus.REJECTED, "invalid_request_error")
    assert (rows["boom"][col.STATUS], rows["boom"][col.ERROR]) == (RequestStatus.ERROR, "http_500")
    (generated,) = [k for k in rows if k not in ("j1", "bad", "boom")]
    assert len(generated) == 32  # a fresh UUID when the client sends no X-Request-Id
    assert not _rows(sink, TOKENS.name, "j1")


def test_without_a_bound_recorder_requests_pass_through():
    with _serve(TokenTraceMiddleware(_app())) as url:
        with httpx.Client(timeout=10) as client:
            resp = client.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2, "stream": True})
    assert resp.status_code == 200 and resp.text.count("data: ") == 6


def test_sse_scanner_handles_split_and_joined_events():
    s = SseScanner()
    assert s.feed(b"data: {\"a\"") == []
    assert s.feed(b": 1}\r\n\r\ndata: x\ndata: y\n\n: comment\n\ndata: [DONE]\n") == [b'{"a": 1}', b"x\ny"]
    assert s.feed(b"\n") == [b"[DONE]"]
    assert classify_event(b'{"choices": [{"delta": {"content": "hi"}}]}').has_token
    assert not classify_event(b'{"choices": [{"delta": {"role": "assistant", "content": ""}}]}').has_token
    info = classify_event(b'{"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}')
    assert not info.has_token and (info.usage.num_prompt_tokens, info.usage.num_output_tokens) == (4, 2)
    assert classify_event(b'{"error": {"type": "overloaded"}}').error == "overloaded"


def test_traceparent_parsing():
    assert parse_traceparent(f"00-{TRACE}-00f067aa0ba902b7-01") == TRACE
    assert parse_traceparent(f"00-{'0' * 32}-00f067aa0ba902b7-01") == ""
    assert parse_traceparent("garbage") == ""


def test_sampling_in_front_of_the_middleware_keeps_only_failed_requests():
    from instrument.sampling import SamplingRecorder
    from tokentrace.store import SAMPLED_OUT

    sink = InMemorySink()
    sampler = SamplingRecorder(BufferedRecorder(sink, instance_id=8), rate=0.0, keep_failed=True)
    with _serve(TokenTraceMiddleware(_app(), recorder=sampler)) as url:
        with httpx.Client(timeout=10) as client:
            client.post(f"{url}/v1/completions", headers={"X-Request-Id": "fine"},
                        json={"prompt": "a", "max_tokens": 3, "stream": True})
            client.post(f"{url}/v1/completions", headers={"X-Request-Id": "refused"},
                        json={"prompt": "a", "max_tokens": -1})
        deadline = time.monotonic() + 10
        while sampler.sampling_counters[SAMPLED_OUT] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # the sampled-out request's end is decided when its app call returns
    sampler.close()
    assert [r[col.REQUEST_KEY] for r in sink.table(REQUESTS.name).to_pylist()] == ["refused"]
    assert sink.num_rows(TOKENS.name) == 0
    # "fine": request row + accept and receive spans + 3 tokens + 8 stream.send spans (role,
    # 3 tokens with one split in two writes, finish, usage, [DONE])
    assert sampler.sampling_counters[SAMPLED_OUT] == 1 + 2 + 3 + 8


def test_one_request_id_from_two_tenants_is_two_requests(traced):
    url, rec, sink = traced
    body = {"prompt": "a b", "max_tokens": 3, "stream": True}
    for tenant in ("acme", "globex"):  # one after the other: acme's request is finished when globex's comes
        r = httpx.post(url + "/v1/completions", json=body, headers={"X-Request-Id": "req-collide", "X-Tenant": tenant})
        assert r.status_code == 200
    _wait_rows(rec, sink, 2)
    requests = [r for r in sink.table(REQUESTS.name).to_pylist() if r[col.REQUEST_KEY] == "req-collide"]
    assert sorted(r[col.TENANT] for r in requests) == ["acme", "globex"]
    ids = {r[col.TENANT]: r[col.REQUEST_ID] for r in requests}
    assert ids["acme"] != ids["globex"]
    for table in (TOKENS.name, SPANS.name):  # each request's rows under its own id: 3 tokens each, never 6
        rows = sink.table(table).to_pylist()
        for tenant, rid in ids.items():
            mine = [r for r in rows if r[col.REQUEST_ID] == rid]
            assert mine, (table, tenant)
            if table == TOKENS.name:
                assert sorted(r[col.TOKEN_INDEX] for r in mine) == [0, 1, 2]


def test_label_headers_are_capped_like_every_other_path(traced):
    url, rec, sink = traced
    from tokentrace.schema import MAX_LABEL_CHARS

    huge = {"X-Tenant": "t" * 100_000, "X-Request-Id": "r" * 8_000, "X-SLO-Class": "s" * 8_000}
    r = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}, headers=huge)
    assert r.status_code == 200
    _wait_rows(rec, sink, 1)
    (row,) = sink.table(REQUESTS.name).to_pylist()
    assert row[col.TENANT] == "t" * MAX_LABEL_CHARS
    assert row[col.REQUEST_KEY] == "r" * MAX_LABEL_CHARS
    assert row[col.SLO_CLASS] == "s" * MAX_LABEL_CHARS
    assert row[col.REQUEST_ID] == request_id_of("r" * 8_000, "t" * 100_000)  # the id of the capped labels
