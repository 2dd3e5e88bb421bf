"""The gateway served for real (uvicorn on loopback, LocalBackend on the tiny model),
driven by the official ``openai`` client and by httpx."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from polling import wait_for

from reference_server.engine import EngineConfig, TenantConfig
from reference_server.serving.backend import LocalBackend
from reference_server.serving.delays import DelayConfig
from reference_server.serving.gateway import GatewayConfig, create_app
from reference_server.serving.gateway_hooks import (
    ChunkWritten,
    GatewayRequestFinished,
    RecordingGatewayObserver,
    RequestParsed,
    RequestReceived,
    ResponseWritten,
    Routed,
    TokenHeld,
    Tokenized,
)
from reference_server.serving.gateway_server import ServerThread, serve_in_thread
from reference_server.serving.gateway_tenants import TenantAuth

torch.set_num_threads(1)

TENANTS_TOML = """
[tenants.acme]
api_keys = ["sk-acme"]
weight = 2
[tenants.batchco]
api_keys = ["sk-batch"]
default_slo_class = "batch"
[tenants.edu]
api_keys = ["sk-edu"]
max_concurrency = 8
[admin]
api_keys = ["sk-ops"]
"""
KEYS = {"acme": "sk-acme", "batchco": "sk-batch", "edu": "sk-edu"}
ADMIN = {"Authorization": "Bearer sk-ops"}  # /metrics and /health in full


def engine_config(tenants: tuple[TenantConfig, ...] = (TenantConfig("default"),)) -> EngineConfig:
    return EngineConfig(model="tiny", device="cpu", block_size=4, num_device_blocks=1024, max_num_seqs=64,
                        max_num_batched_tokens=1024, tenants=tenants, default_tenant=tenants[0].name)


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gateway") / "tenants.toml"
    path.write_text(TENANTS_TOML)
    return path


@pytest.fixture(scope="module")
def served(tenants_file: Path) -> Iterator[tuple[ServerThread, LocalBackend, RecordingGatewayObserver]]:
    yield from _serve(tenants_file)


def _serve(tenants_file: Path, delays: DelayConfig | None = None
           ) -> Iterator[tuple[ServerThread, LocalBackend, RecordingGatewayObserver]]:
    from reference_server.serving.gateway_tenants import load_tenants

    tenants, _, _ = load_tenants(tenants_file)
    backend = LocalBackend(engine_config(tuple(tenants)), delays=delays)
    recorder = RecordingGatewayObserver()
    app = create_app(backend, config=GatewayConfig(auth=TenantAuth.from_file(tenants_file)), observers=[recorder])
    with serve_in_thread(app) as server:
        yield server, backend, recorder


@pytest.fixture()
def server(served: tuple[ServerThread, LocalBackend, RecordingGatewayObserver]) -> ServerThread:
    return served[0]


def client(server: ServerThread, tenant: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=60)


def data_events(raw: str) -> list[str]:
    return [line[len("data: "):] for line in raw.split("\n\n") if line.startswith("data: ")]


# ---------------------------------------------------------------------- the openai client


def test_openai_completions_streaming_matches_non_streaming(server: ServerThread) -> None:
    c = client(server)
    whole = c.completions.create(model="tiny", prompt="Hello there", max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert whole.object == "text_completion"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens == len("Hello there") + 1  # byte tokenizer plus BOS
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    chunks = list(c.completions.create(model="tiny", prompt="Hello there", max_tokens=12, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True}))
    # One chunk per token, except that a token completing no character (the byte tokenizer
    # emits UTF-8 bytes) is held back and goes out with the next chunk: no empty chunks.
    assert 1 <= len(chunks) <= 12
    assert all(ch.choices[0].text for ch in chunks[:-1])
    assert all(ch.id == chunks[0].id for ch in chunks)
    assert [ch.choices[0].finish_reason for ch in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text  # greedy: same tokens


def test_openai_chat_streaming_with_include_usage(server: ServerThread) -> None:
    stream = client(server, "edu").chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "brief"}, {"role": "user", "content": "hi"}],
        max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    token_chunks, final = chunks[:-1], chunks[-1]
    assert 1 <= len(token_chunks) <= 6  # tokens completing no character go out with the next chunk
    assert all(ch.choices[0].delta.content for ch in token_chunks[:-1])
    assert token_chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.usage is None for ch in token_chunks)
    assert token_chunks[-1].choices[0].finish_reason == "length"
    assert final.choices == [] and final.usage.completion_tokens == 6
    assert final.usage.prompt_tokens > 6


def test_openai_chat_non_streaming(server: ServerThread) -> None:
    resp = client(server, "batchco").chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_completion_tokens=5, temperature=0.8,
        seed=11, extra_body={"ignore_eos": True})
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.completion_tokens == 5
    again = client(server, "batchco").chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_completion_tokens=5, temperature=0.8,
        seed=11, extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == resp.choices[0].message.content  # seeded sampling repeats


def test_models_endpoint_lists_the_backend_model(server: ServerThread) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_unknown_or_missing_api_key_is_401(server: ServerThread) -> None:
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="x", max_tokens=2)
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# ---------------------------------------------------------------------- load, ids, SLO classes


def test_fifty_concurrent_streams_across_three_tenants(server: ServerThread) -> None:
    async def one(http: httpx.AsyncClient, i: int) -> tuple[str, int, list[str]]:
        tenant = ("acme", "batchco", "edu")[i % 3]
        max_tokens = 3 + i % 7
        body = {"model": "tiny", "prompt": f"request number {i}", "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0}
        headers = {"Authorization": f"Bearer {KEYS[tenant]}", "X-Request-Id": f"load-{i}"}
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
            assert resp.status_code == 200
            assert resp.headers["x-request-id"] == f"load-{i}"
            raw = (await resp.aread()).decode()
        return f"load-{i}", max_tokens, data_events(raw)

    async def main() -> list[tuple[str, int, list[str]]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     limits=httpx.Limits(max_connections=60)) as http:
            return await asyncio.gather(*(one(http, i) for i in range(50)))

    results = asyncio.run(main())
    assert len(results) == 50
    for request_id, max_tokens, events in results:
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert 1 <= len(chunks) <= max_tokens  # no chunk without text before the last
        assert all(ch["choices"][0]["text"] for ch in chunks[:-1])
        assert {ch["id"] for ch in chunks} == {request_id}
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_slo_class_from_header_body_and_tenant_default(
        served: tuple[ServerThread, LocalBackend, RecordingGatewayObserver]) -> None:
    server, _, recorder = served
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    cases = [("slo-hdr", "sk-acme", {"X-SLO-Class": "batch"}, {}, "batch"),
             ("slo-body", "sk-acme", {}, {"slo_class": "batch"}, "batch"),
             ("slo-tenant", "sk-batch", {}, {}, "batch"),
             ("slo-default", "sk-acme", {}, {}, "interactive")]
    for request_id, key, headers, extra, _ in cases:
        r = httpx.post(server.url + "/v1/completions", json={**body, **extra},
                       headers={"Authorization": f"Bearer {key}", "X-Request-Id": request_id, **headers})
        assert r.status_code == 200, r.text
        assert r.json()["id"] == request_id
    parsed = {e.request_id: e for e in recorder.of_type(RequestParsed)}
    for request_id, _, _, _, expected in cases:
        assert parsed[request_id].slo_class == expected
    r = httpx.post(server.url + "/v1/completions", json=body,
                   headers={"Authorization": "Bearer sk-acme", "X-SLO-Class": "platinum"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "slo_class"


def test_invalid_client_request_id_is_replaced(server: ServerThread) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1},
                   headers={"Authorization": "Bearer sk-acme", "X-Request-Id": "bad id with spaces"})
    assert r.status_code == 200
    assert r.json()["id"].startswith("cmpl-") and r.headers["x-request-id"] == r.json()["id"]


# ---------------------------------------------------------------------- disconnects


def _device_blocks_free(backend: LocalBackend) -> bool:
    inst = backend.stats().instances[0]
    return inst.num_blocks_used[0] == 0 and inst.num_running == 0 and inst.num_waiting == 0


@pytest.fixture()
def slow_served(tenants_file: Path) -> Iterator[tuple[ServerThread, LocalBackend, RecordingGatewayObserver]]:
    """Like ``served``, with a planted 25 ms per decode step: a 400-token answer takes at least 10 s,
    so it cannot finish while a client on a busy machine is still reading its first tokens (at 5 ms,
    2 s, a client starved of the CPU by other processes read its third chunk after the engine had
    finished and freed the request's blocks). The test leaves after three chunks, so it pays for
    about three steps per request."""
    yield from _serve(tenants_file, DelayConfig.parse("decode_step=25ms"))


def test_disconnect_mid_stream_aborts_and_frees_blocks(
        slow_served: tuple[ServerThread, LocalBackend, RecordingGatewayObserver]) -> None:
    server, backend, recorder = slow_served
    ids = [f"leave-{i}" for i in range(4)]

    def finished() -> dict[str, GatewayRequestFinished]:
        return {e.request_id: e for e in recorder.of_type(GatewayRequestFinished)}

    with httpx.Client(base_url=server.url, timeout=60) as http:
        for request_id in ids:
            body = {"model": "tiny", "prompt": "a long story " * 4, "max_tokens": 400, "stream": True,
                    "ignore_eos": True, "temperature": 0}
            headers = {"Authorization": "Bearer sk-edu", "X-Request-Id": request_id}
            with http.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
                # One iterator, kept until the block ends: leaving a ``for`` loop over ``resp.iter_lines()``
                # closes that generator, and httpcore closes the response (and so the connection) with it.
                lines = resp.iter_lines()
                got: list[str] = []
                while len(got) < 3:
                    line = next(lines)
                    if line.startswith("data: "):
                        got.append(line)
                # the stream is open: the request holds blocks (the stats are the engine thread's snapshot:
                # polled, as below) and the gateway has not ended it
                assert wait_for(lambda: backend.stats().instances[0].num_blocks_used[0] > 0, timeout_s=5.0), (
                    request_id, got, backend.stats().instances[0])
                assert request_id not in finished(), (request_id, got, finished()[request_id])
            # leaving the block closes the response, and with it the connection, mid-stream: the gateway
            # aborts the request and the engine frees its blocks (so the next request's blocks are its own)
            assert wait_for(lambda: request_id in finished() and _device_blocks_free(backend)), (
                request_id, backend.stats().instances[0], finished())
    for request_id in ids:
        assert finished()[request_id].outcome == "aborted"
        assert 3 <= finished()[request_id].num_output_tokens < 400


def test_disconnect_while_waiting_for_a_non_streaming_answer() -> None:
    # A planted decode delay keeps the answer from finishing before the client gives up.
    backend = LocalBackend(engine_config(), delays=DelayConfig.parse("decode_step=5ms"))
    recorder = RecordingGatewayObserver()
    body = {"model": "tiny", "prompt": "wait for me", "max_tokens": 200, "ignore_eos": True}
    with serve_in_thread(create_app(backend, observers=[recorder])) as server:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=0.2, headers={"X-Request-Id": "impatient"})
        assert wait_for(lambda: bool(recorder.of_type(GatewayRequestFinished)))
        event = recorder.of_type(GatewayRequestFinished)[0]
        assert event.request_id == "impatient"
        assert event.outcome == "aborted" and event.status == 0 and event.num_output_tokens < 200
        assert wait_for(lambda: _device_blocks_free(backend))


# ---------------------------------------------------------------------- metrics, health, hooks


def test_metrics_expose_latency_histograms_and_backend_state(server: ServerThread) -> None:
    client(server).completions.create(model="tiny", prompt="metrics", max_tokens=4, stream=False,
                                      extra_body={"ignore_eos": True})
    text = httpx.get(server.url + "/metrics", headers=ADMIN).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)

    def total(prefix: str) -> float:
        return sum(v for k, v in samples.items() if k.startswith(prefix))

    assert total("gen_ai_server_time_to_first_token_seconds_count") > 0
    assert total("gen_ai_server_time_per_output_token_seconds_count") > 0
    assert total("gen_ai_server_request_duration_seconds_count") > 0
    assert total('gateway_requests_total{endpoint="/v1/completions",outcome="length",status="200"}') > 0
    assert 'reference_server_kv_blocks_used{instance="colocated-0",role="colocated",tier="device"}' in samples
    assert samples['reference_server_kv_blocks_total{instance="colocated-0",role="colocated",tier="device"}'] == 1024
    assert samples['reference_server_instance_up{instance="colocated-0",role="colocated"}'] == 1
    assert total("reference_server_prefix_cache_query_tokens_total") > 0
    assert "reference_server_num_requests_waiting" in text
    assert "reference_server_kv_transfer_sent_bytes_total" in text
    assert 'tenant="acme"' in text


def test_health_reports_instances(server: ServerThread) -> None:
    r = httpx.get(server.url + "/health", headers=ADMIN)
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok"
    assert body["instances"][0]["name"] == "colocated-0" and body["instances"][0]["alive"] is True


def test_observers_see_a_request_in_order(served: tuple[ServerThread, LocalBackend, RecordingGatewayObserver]
                                          ) -> None:
    server, _, recorder = served
    list(client(server).completions.create(model="tiny", prompt="hooks", max_tokens=5, stream=True,
                                           extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": "hk-1"}))
    assert wait_for(lambda: any(isinstance(e, GatewayRequestFinished) for e in recorder.for_request("hk-1")))
    events = recorder.for_request("hk-1")
    kinds = [type(e) for e in events]
    num_chunks = sum(k is ChunkWritten for k in kinds)
    assert 1 <= num_chunks <= 5  # a token completing no character is held and goes out with the next chunk
    assert num_chunks + sum(k is TokenHeld for k in kinds) == 5  # every token: written or held
    assert kinds[:4] == [RequestReceived, RequestParsed, Tokenized, Routed] and kinds[-1] is GatewayRequestFinished
    assert kinds[-2] is ChunkWritten  # the last token (with its finish reason) is always written
    held = [e for e in events if isinstance(e, TokenHeld)]
    events = [e for e in events if not isinstance(e, TokenHeld)]
    received, parsed, tokenized, routed, *chunks, finished = events
    assert received.tenant == "acme" and received.path == "/v1/completions"
    assert received.t_ns <= parsed.t_ns <= tokenized.start_ns <= tokenized.end_ns <= routed.start_ns
    assert routed.start_ns <= routed.end_ns <= chunks[0].received_ns and routed.instance == "colocated-0"
    assert tokenized.num_prompt_tokens == len("hooks") + 1
    indices = [c.index for c in chunks]
    assert indices == sorted(set(indices)) and indices[-1] == 4
    assert sorted(indices + [h.index for h in held]) == list(range(5))
    assert all(h.received_ns >= routed.end_ns for h in held)
    assert all(c.has_content for c in chunks[:-1])
    for prev, chunk in zip([None, *chunks], chunks):
        assert chunk.received_ns <= chunk.detok_start_ns <= chunk.detok_end_ns <= chunk.write_start_ns
        assert chunk.write_start_ns <= chunk.write_end_ns
        assert prev is None or prev.write_end_ns <= chunk.received_ns
    assert finished.outcome == "length" and finished.status == 200 and finished.num_output_tokens == 5


def test_non_streaming_request_fires_response_written(
        served: tuple[ServerThread, LocalBackend, RecordingGatewayObserver]) -> None:
    server, _, recorder = served
    client(server).completions.create(model="tiny", prompt="x", max_tokens=2, extra_headers={"X-Request-Id": "nw"})
    assert wait_for(lambda: any(isinstance(e, GatewayRequestFinished) for e in recorder.for_request("nw")))
    kinds = [type(e) for e in recorder.for_request("nw")]
    assert kinds == [RequestReceived, RequestParsed, Tokenized, Routed, ResponseWritten, GatewayRequestFinished]


def test_observer_errors_are_counted_not_raised(served: tuple[ServerThread, LocalBackend, RecordingGatewayObserver]
                                                ) -> None:
    server = served[0]

    class Broken:
        def on_tokenized(self, event: Tokenized) -> None:
            raise RuntimeError("boom")

    gateway = server.server.config.app.state.gateway
    broken = Broken()
    gateway.add_observer(broken)
    try:
        resp = client(server).completions.create(model="tiny", prompt="x", max_tokens=2)
        assert resp.usage.completion_tokens >= 1
        assert gateway.hooks.num_observer_errors >= 1
    finally:
        gateway.remove_observer(broken)


# ---------------------------------------------------------------------- delays, 503


def test_planted_delays_show_up_in_their_hook_intervals() -> None:
    delays = DelayConfig.parse("tokenize=40ms,route=25ms,detokenize=3ms,stream_send=6ms")
    recorder = RecordingGatewayObserver()
    app = create_app(LocalBackend(engine_config()), config=GatewayConfig(delays=delays), observers=[recorder])
    with serve_in_thread(app) as server:
        r = httpx.post(server.url + "/v1/completions", timeout=60, headers={"X-Request-Id": "slow"},
                       json={"model": "tiny", "prompt": "x", "max_tokens": 3, "stream": True, "ignore_eos": True})
        assert r.status_code == 200
    tokenized = recorder.of_type(Tokenized)[0]
    routed = recorder.of_type(Routed)[0]
    chunks = recorder.of_type(ChunkWritten)
    assert tokenized.end_ns - tokenized.start_ns >= 40_000_000
    assert routed.end_ns - routed.start_ns >= 25_000_000
    assert 1 <= len(chunks) <= 3
    assert all(c.detok_end_ns - c.detok_start_ns >= 3_000_000 for c in chunks)
    assert all(c.write_end_ns - c.write_start_ns >= 6_000_000 for c in chunks)


def test_backend_without_live_workers_gives_503() -> None:
    backend = LocalBackend(engine_config())
    app = create_app(backend, manage_backend=False)  # never started: no live instance
    with serve_in_thread(app) as server:
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["missing_roles"] == ["colocated"]
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True})
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "service_unavailable"
    backend.engine.close()


def test_long_prompt_is_tokenized_off_the_loop_and_checked(server: ServerThread) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "q" * 40_000},
                   headers={"Authorization": "Bearer sk-acme"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert "40001 tokens" in r.json()["error"]["message"]  # 40 000 bytes plus BOS
