"""Where a traced request's session comes from: the configured source (header, OpenAI ``user`` field, OTLP
attribute), through the ASGI middleware, the reference gateway's tracer and OTLP ingest."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the ASGI and OTLP tests' servers and span builders
from deployments import serve_app  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from test_asgi import _app, _serve, _wait_rows  # noqa: E402
from test_otlp_mapping import _ingest, _provider, _vllm_request  # noqa: E402

import tokentrace  # noqa: E402
from instrument import semconv as sc  # noqa: E402
from instrument.asgi import TokenTraceMiddleware  # noqa: E402
from instrument.reference_engine import EngineTracer  # noqa: E402
from instrument.reference_gateway import GatewayTracer  # noqa: E402
from instrument.sessions import SESSION_SOURCE_ENV, SessionSource, parse_turn, session_source  # noqa: E402
from reference_server.engine.config import EngineConfig  # noqa: E402
from reference_server.serving.backend import LocalBackend  # noqa: E402
from reference_server.serving.gateway import GatewayConfig, create_app  # noqa: E402
from tokentrace.app.export.otlp import export_run_to_otel  # noqa: E402
from tokentrace.recorder import BufferedRecorder  # noqa: E402
from tokentrace.recorder.sink import InMemorySink  # noqa: E402
from tokentrace.schema import REQUESTS, Role, Stage, col  # noqa: E402
from tokentrace.store import StoreWriter  # noqa: E402

torch.set_num_threads(1)


@pytest.mark.parametrize(("spec", "expected"), [
    ("header", SessionSource("header", "X-Session-Id")),
    ("header:X-Conversation", SessionSource("header", "X-Conversation")),
    (" USER ", SessionSource("user", "user")),
    ("attribute:gen_ai.conversation.id", SessionSource("attribute", "gen_ai.conversation.id")),
])
def test_session_sources_parse(spec, expected):
    assert SessionSource.parse(spec) == expected


@pytest.mark.parametrize("spec", ["cookie", "attribute", "attribute:", "user:x"])
def test_bad_session_sources_are_one_sentence(spec):
    with pytest.raises(ValueError, match="session source"):
        SessionSource.parse(spec)


def test_the_environment_names_the_source_of_tracers_built_without_one(monkeypatch):
    monkeypatch.setenv(SESSION_SOURCE_ENV, "user")
    assert session_source().kind == "user"
    monkeypatch.delenv(SESSION_SOURCE_ENV)
    assert session_source() == SessionSource()


@pytest.mark.parametrize(("text", "turn"), [("3", 3), (" 0 ", 0), (7, 7), ("-1", -1), ("x", -1), (None, -1),
                                            (True, -1), ("99999999999", -1)])
def test_turn_numbers(text, turn):
    assert parse_turn(text) == turn


@pytest.mark.parametrize(("sessions", "headers", "body_user", "expected"), [
    (None, {"X-Session-Id": "chat-1", "X-Session-Turn": "2"}, None, ("chat-1", 2)),
    ("header:X-Conversation", {"X-Conversation": "c9"}, None, ("c9", None)),
    ("user", {"X-Session-Id": "ignored"}, "alice-session", ("alice-session", None)),
    (None, {}, "alice", ("", None)),
])
def test_the_asgi_middleware_records_the_configured_session(sessions, headers, body_user, expected):
    sink = InMemorySink()
    rec = BufferedRecorder(sink, instance_id=7)
    body = {"prompt": "a b", "max_tokens": 2, "stream": True}
    if body_user is not None:
        body["user"] = body_user
    with _serve(TokenTraceMiddleware(_app(), recorder=rec, sessions=sessions)) as url:
        httpx.post(url + "/v1/completions", json=body, headers={"X-Request-Id": "r1", **headers}, timeout=10)
        _wait_rows(rec, sink, 1)
    rec.close()
    row, = sink.table(REQUESTS.name).to_pylist()
    assert (row[col.SESSION], row[col.SESSION_TURN]) == expected


def _serve_with_lifespan(app: Any) -> contextlib.AbstractContextManager[str]:
    return serve_app(app, lifespan="on", timeout_s=20)


@pytest.mark.parametrize(("sessions", "expected"), [(None, "hdr-7"), ("user", "body-7")])
def test_the_reference_gateway_passes_the_session_to_its_tracer_and_engine(sessions, expected):
    sink = InMemorySink()
    rec = BufferedRecorder(sink, instance_id=9)
    backend = LocalBackend(EngineConfig(model="tiny", num_device_blocks=64))
    backend.engine.add_observer(EngineTracer(rec))
    app = create_app(backend, config=GatewayConfig(), observers=[GatewayTracer(rec, sessions=sessions)])
    with _serve_with_lifespan(app) as url:
        r = httpx.post(url + "/v1/completions", timeout=30, headers={"X-Session-Id": "hdr-7", "X-Session-Turn": "1",
                                                                     "X-Request-Id": "g1"},
                       json={"model": "tiny", "prompt": "hello", "max_tokens": 2, "user": "body-7"})
        assert r.status_code == 200
    rec.close()
    rows = sink.table(REQUESTS.name).to_pylist()
    gateway = [r for r in rows if r[col.SESSION_TURN] is not None]
    assert [(r[col.SESSION], r[col.SESSION_TURN]) for r in gateway] == [(expected, 1)]
    # the engine's retention keys on the gateway's own choice: the header, else the user field
    assert {r[col.SESSION] for r in rows if r[col.SESSION_TURN] is None} == {"hdr-7"}


def test_otlp_ingest_reads_the_conversation_attribute(tmp_path):
    t0 = tokentrace.clock.take_anchor().wall_ns
    provider, exporter = _provider({sc.SERVICE_NAME: "vllm"})
    tracer = provider.get_tracer("vllm.tracing")
    for key, extra in (("a", {sc.GEN_AI_CONVERSATION_ID: "conv-1", sc.TT_SESSION_TURN: 4}), ("b", {})):
        _vllm_request(tracer, arrival_ns=t0, key=key, ttft=0.01, e2e=0.02, queue=0.001, prefill=0.005,
                      decode=0.005, prompt=5, completion=2, extra=extra)
    provider.shutdown()
    run, _ = _ingest(tmp_path, [list(exporter.get_finished_spans())])
    rows = {r[col.REQUEST_KEY]: (r[col.SESSION], r[col.SESSION_TURN]) for r in run.table(REQUESTS.name).to_pylist()}
    assert rows == {"a": ("conv-1", 4), "b": ("", None)}


def test_sessions_survive_an_otlp_export_and_ingest(tmp_path):
    writer = StoreWriter(tmp_path / "src", run_id="orig")
    rec = BufferedRecorder(writer, instance_id=writer.instance_id)
    rec.instance(role=Role.COLOCATED, name="engine")
    t = rec.clock()
    for key, session, turn in (("t0", "conv-9", 0), ("t1", "conv-9", 1), ("solo", "", -1)):
        rid = rec.request_begin(key, arrival_ns=t, num_prompt_tokens=4, session=session, session_turn=turn)
        rec.span(rid, Stage.PREFILL_COMPUTE, t, t + 1_000_000, 0)
        rec.token(rid, 0, emit_ns=t + 1_000_000)
        rec.request_end(rid, finish_ns=t + 2_000_000, first_token_ns=t + 1_000_000, num_output_tokens=1)
    rec.close()
    exporter = InMemorySpanExporter()
    export_run_to_otel(tokentrace.open(tmp_path / "src", run="orig"), exporter)
    run, _ = _ingest(tmp_path / "dst", [list(exporter.get_finished_spans())])
    rows = {r[col.REQUEST_KEY]: (r[col.SESSION], r[col.SESSION_TURN]) for r in run.table(REQUESTS.name).to_pylist()}
    assert rows == {"t0": ("conv-9", 0), "t1": ("conv-9", 1), "solo": ("", None)}
