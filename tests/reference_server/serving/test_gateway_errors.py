"""Bad requests and backend failures get OpenAI-shaped errors; the server keeps serving."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from reference_server.engine import EngineConfig
from reference_server.model import ByteTokenizer
from reference_server.serving.backend import (
    BackendStats,
    BackendUnavailable,
    GenerateRequest,
    InstanceStats,
    LocalBackend,
    TokenEvent,
)
from reference_server.serving.gateway import GatewayConfig, create_app
from reference_server.serving.gateway_server import ServerThread, serve_in_thread

torch.set_num_threads(1)

MAX_BODY = 4096  # bytes, small so the limit is cheap to hit
GOOD = {"model": "tiny", "prompt": "still serving", "max_tokens": 3}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    config = EngineConfig(model="tiny", device="cpu", block_size=4, num_device_blocks=64)  # max_model_len 256
    app = create_app(LocalBackend(config), config=GatewayConfig(max_body_bytes=MAX_BODY))
    with serve_in_thread(app) as srv:
        yield srv


def assert_error(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code


def assert_still_serving(server: ServerThread) -> None:
    r = httpx.post(server.url + "/v1/completions", json=GOOD, timeout=30)
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] >= 1


BAD_JSON_BODIES = [
    (b"{not json", "/v1/completions", None),
    (b"\xff\xfe\x00", "/v1/completions", None),
    (b"[1, 2]", "/v1/completions", None),
    (b'{"prompt": "x"}', "/v1/completions", "model"),
    (b'{"model": "tiny"}', "/v1/completions", "prompt"),
    (b'{"model": "tiny"}', "/v1/chat/completions", "messages"),
    (b'{"model": "tiny", "messages": "hi"}', "/v1/chat/completions", "messages"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": -1}', "/v1/completions", "max_tokens"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 0}', "/v1/completions", "max_tokens"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": "many"}', "/v1/completions", "max_tokens"),
    (b'{"model": "tiny", "prompt": "x", "temperature": "warm"}', "/v1/completions", "temperature"),
    (b'{"model": "tiny", "prompt": "x", "stream": 1}', "/v1/completions", "stream"),
    (b'{"model": "tiny", "prompt": [99999]}', "/v1/completions", "prompt"),
]


@pytest.mark.parametrize(("body", "path", "param"), BAD_JSON_BODIES)
def test_bad_bodies_get_400_and_the_server_keeps_serving(server: ServerThread, body: bytes, path: str,
                                                         param: str | None) -> None:
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    assert_error(r, 400, param)
    assert_still_serving(server)


def test_prompt_over_the_context_window(server: ServerThread) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x" * 300})
    assert_error(r, 400, "prompt", "context_length_exceeded")
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": "tiny", "messages": [{"role": "user", "content": "y" * 300}]})
    assert_error(r, 400, "messages", "context_length_exceeded")
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x" * 200, "max_tokens": 100})
    assert_error(r, 400, "max_tokens", "context_length_exceeded")
    assert_still_serving(server)


def test_unknown_model_is_404_for_the_openai_client(server: ServerThread) -> None:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        c.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    assert_still_serving(server)


def test_body_over_the_limit_by_content_length(server: ServerThread) -> None:
    big = json.dumps({"model": "tiny", "prompt": "z" * (2 * MAX_BODY)}).encode()
    r = httpx.post(server.url + "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert_error(r, 413, code="request_too_large")
    assert_still_serving(server)


def test_body_over_the_limit_while_streaming_in(server: ServerThread) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer encoding
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(8):
            yield b"w" * 1024
        yield b'"}'

    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_error(r, 413, code="request_too_large")
    assert_still_serving(server)


def test_unknown_fields_are_ignored(server: ServerThread) -> None:
    r = httpx.post(server.url + "/v1/completions", json={**GOOD, "frequency_penalty": 0.0, "whatever": [1]})
    assert r.status_code == 200


# ---------------------------------------------------------------------- backend failures


class FailingBackend:
    """A backend double: yields ``num_good`` tokens, then raises ``exc`` (or raises it
    before any token when ``num_good`` is 0)."""

    def __init__(self, num_good: int, exc: Exception) -> None:
        self.num_good = num_good
        self.exc = exc
        self.closed: list[str] = []

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    @property
    def model_name(self) -> str:
        return "fake"

    @property
    def max_model_len(self) -> int:
        return 128

    @property
    def tokenizer(self) -> ByteTokenizer:
        return ByteTokenizer()

    def add_observer(self, observer: Any) -> None:
        return None

    def remove_observer(self, observer: Any) -> None:
        return None

    def stats(self) -> BackendStats:
        inst = InstanceStats("fake-0", "colocated", True, 0, 0, 0, (0, 0, 0), (8, 0, 0), 0, 0, 0, 0)
        return BackendStats((inst,))

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        try:
            for i in range(self.num_good):
                yield TokenEvent(i, 65, "A", None, len(req.prompt_token_ids), 0, "fake-0")
            raise self.exc
        finally:
            self.closed.append(req.request_id)


@pytest.mark.parametrize(("num_good", "exc", "status", "code"), [
    (0, BackendUnavailable("no live decode worker"), 503, "service_unavailable"),
    (0, ValueError("duplicate request_id"), 400, None),
    (0, RuntimeError("worker crashed"), 500, "internal_error"),
])
def test_backend_refusal_before_any_token(num_good: int, exc: Exception, status: int, code: str | None) -> None:
    backend = FailingBackend(num_good, exc)
    with serve_in_thread(create_app(backend)) as srv:
        for stream in (True, False):
            r = httpx.post(srv.url + "/v1/completions", json={"model": "fake", "prompt": "x", "stream": stream})
            assert_error(r, status, code=code)
    assert len(backend.closed) == 2


def test_backend_failure_mid_stream_ends_with_an_error_event_then_done() -> None:
    backend = FailingBackend(3, BackendUnavailable("no live decode worker left"))
    with serve_in_thread(create_app(backend)) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json={
            "model": "fake", "messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 10})
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.text.split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert len(events) == 5  # 3 tokens, the error, [DONE]
        error = json.loads(events[-2])["error"]
        assert error["code"] == "service_unavailable" and "decode" in error["message"]
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIError, match="decode"):
            list(c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}], stream=True))
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'gateway_requests_total{endpoint="/v1/chat/completions",outcome="error",status="200"} 2.0' in metrics


def test_unknown_path_and_wrong_method_use_the_error_shape(server: ServerThread) -> None:
    assert_error(httpx.get(server.url + "/v1/nothing"), 404)
    r = httpx.get(server.url + "/v1/completions")
    assert_error(r, 405)
    assert "POST" in r.headers["allow"]


def _raw_exchange(server: ServerThread, request: bytes) -> bytes:
    """Send raw bytes on one connection; everything the server answers until it closes (or goes quiet)."""
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                return data
            if not chunk:
                return data
            data += chunk


SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.parametrize("framing", [
    b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n",
    b"Transfer-Encoding: chunked\r\nContent-Length: %d\r\n",
    b"Content-Length: %d\r\nTransfer-Encoding: gzip, chunked\r\n",
])
def test_content_length_with_transfer_encoding_is_400_and_smuggles_nothing(server: ServerThread,
                                                                           framing: bytes) -> None:
    body = b"0\r\n\r\n" + SMUGGLED  # chunked: an empty body, then a second request; by length: one body
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + framing % len(body)
    answer = _raw_exchange(server, head + b"\r\n" + body)
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert answer.count(b"HTTP/1.1 ") == 1, answer  # the smuggled GET /v1/models got no answer
    assert b'"object"' not in answer
    assert_still_serving(server)


def test_plain_chunked_body_is_served(server: ServerThread) -> None:
    payload = json.dumps(GOOD).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload))
    answer = _raw_exchange(server, request)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert b'"completion_tokens"' in answer
