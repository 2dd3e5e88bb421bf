"""Fault and fuzz tests of the gateway's intake: any body, header or pace a client sends gets
an answer below 500 with OpenAI's JSON error shape (or a normal answer), and the server keeps
serving. Bounded: each property runs a fixed number of examples against one tiny server."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference_server.engine import EngineConfig, TenantConfig
from reference_server.model import ByteTokenizer
from reference_server.serving.backend import LocalBackend
from reference_server.serving.delays import DelayConfig
from reference_server.serving.gateway import GatewayConfig, create_app
from reference_server.serving.gateway_hooks import RecordingGatewayObserver, RequestReceived
from reference_server.serving.gateway_openai import OpenAIError, parse_chat_request, parse_completion_request
from reference_server.serving.gateway_server import ServerThread, serve_in_thread
from reference_server.serving.gateway_tenants import TenantAuth

torch.set_num_threads(1)

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                          HealthCheck.function_scoped_fixture])
KEYS = {"sk-acme": "acme", "sk-globex": "globex"}
ADMIN = "sk-ops"
SURROGATE = "\ud800"

scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80)
           | st.floats() | st.text(max_size=12) | st.just(SURROGATE) | st.just("tiny"))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=12)
fields = st.sampled_from(["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
                          "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n", "ignore_eos", "user",
                          "slo_class", "echo", "logit_bias", "presence_penalty", "frequency_penalty", "logprobs",
                          "top_logprobs", "best_of", "suffix", "response_format", "min_p", "repetition_penalty",
                          "min_tokens"])
small = st.integers(min_value=-2, max_value=6)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", 5]),
                                 "content": st.one_of(st.text(max_size=10), st.just(SURROGATE), json_values)})
plausible = st.fixed_dictionaries(
    {"model": st.sampled_from(["tiny", "tiny" + SURROGATE, "gpt-9", 3])},
    optional={"prompt": st.one_of(st.text(max_size=20), st.just("hi" + SURROGATE), st.lists(small, max_size=4),
                                  json_values),
              "messages": st.one_of(st.lists(message, max_size=3), json_values),
              "max_tokens": st.one_of(small, json_values), "temperature": st.one_of(st.floats(), json_values),
              "top_p": st.floats(), "top_k": small, "seed": st.integers(min_value=-(2**70), max_value=2**70),
              "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2), json_values),
              "stream": st.one_of(st.booleans(), json_values), "stream_options": json_values,
              "ignore_eos": st.booleans(), "user": st.one_of(st.text(max_size=5), st.just(SURROGATE))})
bodies = st.one_of(plausible, st.dictionaries(fields, json_values, max_size=6), json_values)


def _parse_or_refuse(parse: Any, body: Any) -> None:
    try:
        parse(body)
    except OpenAIError as err:
        assert 400 <= err.status < 500
        json.dumps(err.body())  # the error echoes input: it must serialize


@settings(max_examples=200, deadline=None)
@given(body=bodies)
def test_the_request_parser_returns_a_request_or_a_4xx(body: Any) -> None:
    _parse_or_refuse(parse_completion_request, body)
    _parse_or_refuse(parse_chat_request, body)


# --------------------------------------------------------------------------- one live server


def _engine_config() -> EngineConfig:
    return EngineConfig(model="tiny", device="cpu", block_size=4, num_device_blocks=256, max_num_seqs=32,
                        tenants=(TenantConfig("acme"), TenantConfig("globex")), default_tenant="acme")


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ServerThread, RecordingGatewayObserver]]:
    auth = TenantAuth(keys=KEYS, admin_keys=frozenset({ADMIN}))
    observer = RecordingGatewayObserver()
    backend = LocalBackend(_engine_config(), delays=DelayConfig.parse("decode_step=3ms"))
    app = create_app(backend, config=GatewayConfig(auth=auth, max_body_bytes=8192, body_timeout_s=1.0),
                     observers=[observer])
    with serve_in_thread(app) as server:
        yield server, observer


def _post(server: ServerThread, body: bytes, *, key: str = "sk-acme", path: str = "/v1/completions",
          headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(server.url + path, content=body, timeout=60,
                      headers={"content-type": "application/json", "authorization": f"Bearer {key}",
                               **(headers or {})})


def _assert_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _assert_serving(server: ServerThread) -> None:
    r = _post(server, json.dumps({"model": "tiny", "prompt": "still here", "max_tokens": 2}).encode())
    assert r.status_code == 200, r.text


@FUZZ
@given(body=bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_any_json_body_gets_an_answer_below_500(served, body: Any, path: str) -> None:
    server, _ = served
    if isinstance(body, dict) and isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = min(body["max_tokens"], 8)  # keep each example short to generate
    raw = json.dumps(body).encode()  # lone surrogates go out as "\ud800" escapes, as a client would send them
    r = _post(server, raw, path=path)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        _assert_error(r, r.status_code)


@FUZZ
@given(raw=st.binary(max_size=200))
def test_any_bytes_get_an_answer_below_500(served, raw: bytes) -> None:
    server, _ = served
    r = _post(server, raw)
    assert r.status_code < 500, r.text


header_text = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=200)


@FUZZ
@given(request_id=header_text, slo=header_text, traceparent=header_text, authorization=header_text,
       content_length=st.sampled_from([None, "-1", "abc", "99999999999999999999999", "0", "12"]))
def test_any_header_values_get_an_answer_below_500(served, request_id, slo, traceparent, authorization,
                                                   content_length) -> None:
    server, _ = served
    body = json.dumps({"model": "tiny", "prompt": "headers", "max_tokens": 2}).encode()
    headers = {"x-request-id": request_id, "x-slo-class": slo, "traceparent": traceparent,
               "authorization": authorization or "Bearer sk-acme", "content-type": "application/json",
               "content-length": str(len(body)) if content_length is None else content_length}
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())  # sent raw: no client tidies them up
    with socket.create_connection((server.host, server.port), timeout=60) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{lines}Connection: close\r\n\r\n".encode()
                     + body)
        answer = b""
        while b"\r\n" not in answer:  # a declared length beyond the body waits for the body timeout (408)
            chunk = sock.recv(200)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 "), answer
    assert int(answer.split(b" ", 2)[1]) < 500, answer


def test_lone_surrogates_in_prompt_chat_and_model_are_400s(served) -> None:
    server, _ = served
    cases = [("/v1/completions", {"model": "tiny", "prompt": "a" + SURROGATE}, "prompt"),
             ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": SURROGATE}]},
              "messages[0].content"),
             ("/v1/completions", {"model": "tiny" + SURROGATE, "prompt": "x"}, "model"),
             ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": [SURROGATE]}, "stop")]
    for path, body, param in cases:
        error = _assert_error(_post(server, json.dumps(body).encode(), path=path), 400)
        assert error["param"] == param and "surrogate" in error["message"]
    _assert_serving(server)


def test_the_tokenizer_refuses_a_lone_surrogate_with_a_value_error() -> None:
    with pytest.raises(ValueError, match="lone surrogate"):
        ByteTokenizer().encode("ok" + SURROGATE)


def test_json_nested_thousands_deep_is_a_400(served) -> None:
    server, _ = served
    for depth in (1_000, 3_000):
        body = b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
        error = _assert_error(_post(server, body), 400)
        assert "nested too deeply" in error["message"]
    huge_number = b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"
    _assert_error(_post(server, huge_number), 400)
    _assert_serving(server)


@pytest.mark.parametrize("logit_bias", [{"x": "y"}, {"50256": 101}, {"-1": 0}, {"7": None}, [1, 2], "bias"])
def test_junk_logit_bias_is_a_400_naming_it(served, logit_bias: Any) -> None:
    server, _ = served
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1, "logit_bias": logit_bias}).encode()
    assert _assert_error(_post(server, body), 400)["param"] == "logit_bias"
    good = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1, "logit_bias": {"7": -100, "8": 2.5}})
    assert _post(server, good.encode()).status_code == 200


def test_a_nan_temperature_says_it_must_be_finite(served) -> None:
    server, _ = served
    error = _assert_error(_post(server, b'{"model": "tiny", "prompt": "x", "temperature": NaN}'), 400)
    assert error["param"] == "temperature"
    assert error["message"] == "temperature must be a finite number, got nan"


def test_a_body_trickled_in_too_slowly_gets_408_and_the_server_keeps_serving(served) -> None:
    server, _ = served
    head = ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-acme\r\n"
            "Content-Type: application/json\r\nContent-Length: 2000\r\n\r\n").encode()
    with socket.create_connection((server.host, server.port), timeout=60) as sock:
        sock.sendall(head)
        sock.settimeout(0.1)
        answer = b""
        deadline = time.monotonic() + 60  # the body would take 200 s at this pace
        while b"\r\n\r\n" not in answer and time.monotonic() < deadline:
            try:
                sock.sendall(b" ")  # one byte per tick: the server never gets a whole body
            except OSError:
                pass  # the server may close after answering
            try:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
            except TimeoutError:
                continue
    status_line = answer.split(b"\r\n", 1)[0]
    assert status_line.startswith(b"HTTP/1.1 408"), answer[:300]
    _assert_serving(server)


# --------------------------------------------------------------------------- tenants apart


def test_metrics_and_health_need_a_key_and_a_tenant_sees_only_itself(served) -> None:
    server, _ = served
    for key in ("sk-acme", "sk-globex"):
        assert _post(server, json.dumps({"model": "tiny", "prompt": "count me", "max_tokens": 2}).encode(),
                     key=key).status_code == 200
    for path in ("/metrics", "/health"):
        for headers in ({}, {"authorization": "Bearer sk-nope"}):
            r = httpx.get(server.url + path, headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert _assert_error(r, 401)["code"] == "invalid_api_key"
    admin = {"authorization": f"Bearer {ADMIN}"}
    full = httpx.get(server.url + "/metrics", headers=admin).text
    assert 'tenant="acme"' in full and 'tenant="globex"' in full and "reference_server_kv_blocks_used" in full
    mine = httpx.get(server.url + "/metrics", headers={"authorization": "Bearer sk-acme"}).text
    assert 'tenant="acme"' in mine and "gen_ai_server_time_to_first_token_seconds_bucket" in mine
    assert "globex" not in mine and "reference_server_" not in mine and "gateway_requests" not in mine
    health = httpx.get(server.url + "/health", headers={"authorization": "Bearer sk-globex"})
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert httpx.get(server.url + "/health", headers=admin).json()["instances"][0]["name"] == "colocated-0"


def test_a_reused_request_id_never_reveals_another_tenants_request(served) -> None:
    server, observer = served
    rid = "shared-id-1"
    stream_body = json.dumps({"model": "tiny", "prompt": "long one", "max_tokens": 60, "ignore_eos": True,
                              "stream": True}).encode()
    short = json.dumps({"model": "tiny", "prompt": "short one", "max_tokens": 2}).encode()
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", content=stream_body,
                         headers={"authorization": "Bearer sk-acme", "x-request-id": rid,
                                  "content-type": "application/json"}) as acme:
            lines = acme.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))  # acme's request is in flight
            other = _post(server, short, key="sk-globex", headers={"x-request-id": rid})
            assert other.status_code == 200, other.text  # as if the id were free
            assert other.headers["x-request-id"] == rid and other.json()["id"] == rid
            again = _post(server, short, key="sk-acme", headers={"x-request-id": rid})
            assert _assert_error(again, 409)["code"] == "duplicate_request_id"  # acme's own id: it may know
            rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
    after = _post(server, short, key="sk-acme", headers={"x-request-id": rid})
    assert after.status_code == 200  # free again once it finished
    received = [e for e in observer.events if isinstance(e, RequestReceived) and e.request_id == rid]
    assert len(received) == 2  # acme's two served requests; globex's never reached the trace
