"""OpenTelemetry export (span trees) and OTLP/HTTP ingest (vLLM llm_request spans)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from instrument import semconv as sc
from instrument.otlp_decode import PayloadError, decode_request
from instrument.otlp_ingest import PAYLOADS_REJECTED, SPANS_IGNORED, SPANS_MAPPED, LlmRequestMapper
from tokentrace.app.export.otlp import export_run_to_otel
from tokentrace.clock import Anchor, now_ns
from tokentrace.recorder import BufferedRecorder
from tokentrace.recorder.sink import InMemorySink
from tokentrace.schema import INSTANCES, REQUESTS, SPANS, TOKENS, RequestStatus, Role, Stage, col
from tokentrace.store import StoreWriter, open_run

REPO = Path(__file__).resolve().parents[2]
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
MS = 1_000_000


def _make_run(path: Path):
    """Two requests on one instance: an ok one with 2 tokens, a failed one."""
    writer = StoreWriter(path, run_id="exp")
    rec = BufferedRecorder(writer, instance_id=writer.instance_id)
    rec.instance(role=Role.COLOCATED, name="engine")
    t = now_ns()
    r1 = rec.request_begin("req-ok", tenant="acme", arrival_ns=t, num_prompt_tokens=7, trace_id=TRACE)
    rec.span(r1, Stage.SCHEDULE_QUEUE, t, t + 1 * MS, 0)
    rec.span(r1, Stage.PREFILL_COMPUTE, t + 1 * MS, t + 3 * MS, 0, step=4, batch_size=2)
    rec.token(r1, 0, emit_ns=t + 3 * MS)
    rec.span(r1, Stage.DECODE_QUEUE, t + 3 * MS, t + 3 * MS + MS // 2, 1)
    rec.span(r1, Stage.DECODE_COMPUTE, t + 3 * MS + MS // 2, t + 4 * MS, 1, step=5)
    rec.token(r1, 1, emit_ns=t + 4 * MS)
    rec.request_end(r1, finish_ns=t + 4 * MS, first_token_ns=t + 3 * MS, num_output_tokens=2)
    r2 = rec.request_begin("req-bad", arrival_ns=t + 10 * MS)
    rec.span(r2, Stage.SCHEDULE_QUEUE, t + 10 * MS, t + 12 * MS, 0)
    rec.request_end(r2, finish_ns=t + 12 * MS, status=RequestStatus.ERROR, error="oom")
    rec.close()
    return open_run(path, "exp")


def _by_name(spans, name):
    return [s for s in spans if s.name == name]


def test_export_builds_one_span_tree_per_request(tmp_path):
    run = _make_run(tmp_path)
    exporter = InMemorySpanExporter()
    summary = export_run_to_otel(run, exporter)
    spans = exporter.get_finished_spans()
    assert (summary.num_requests, summary.num_spans, summary.num_failed_batches) == (2, 7, 0)
    roots = {s.attributes[sc.GEN_AI_REQUEST_ID]: s for s in _by_name(spans, sc.LLM_REQUEST_SPAN)}
    ok, bad = roots["req-ok"], roots["req-bad"]
    assert ok.context.trace_id == int(TRACE, 16) and ok.parent is None and ok.kind == SpanKind.SERVER
    children = [s for s in spans if s.parent is not None and s.parent.span_id == ok.context.span_id]
    assert sorted(s.name for s in children) == sorted(
        ["schedule.queue", "prefill.compute", "decode.queue", "decode.compute"])
    assert all(s.context.trace_id == ok.context.trace_id for s in children)
    prefill = _by_name(children, "prefill.compute")[0]
    assert prefill.start_time - ok.start_time == 1 * MS and prefill.end_time - prefill.start_time == 2 * MS
    assert prefill.attributes[sc.TT_TOKEN_INDEX] == 0 and prefill.attributes[sc.TT_ENGINE_STEP] == 4
    assert prefill.attributes[sc.TT_BATCH_SIZE] == 2
    assert ok.end_time - ok.start_time == 4 * MS
    assert abs(ok.start_time - time.time_ns()) < 600 * 10**9  # Unix time via the instance anchor
    a = ok.attributes
    assert a[sc.GEN_AI_USAGE_INPUT_TOKENS] == 7 and a[sc.GEN_AI_USAGE_OUTPUT_TOKENS] == 2
    assert a[sc.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN] == pytest.approx(0.003)
    assert a[sc.GEN_AI_LATENCY_TIME_IN_QUEUE] == pytest.approx(0.001)
    assert a[sc.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] == pytest.approx(0.002)
    assert a[sc.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] == pytest.approx(0.0005)
    assert a[sc.TT_TENANT] == "acme" and ok.status.status_code == StatusCode.UNSET
    assert bad.status.status_code == StatusCode.ERROR and bad.attributes[sc.ERROR_TYPE] == "oom"
    assert bad.context.trace_id != ok.context.trace_id
    assert len(ok.events) == 0


def test_export_token_events_and_stable_ids(tmp_path):
    run = _make_run(tmp_path)
    first, second = InMemorySpanExporter(), InMemorySpanExporter()
    export_run_to_otel(run, first, token_events=True, include_token_stages=False)
    export_run_to_otel(run, second, token_events=True, include_token_stages=False)
    spans = first.get_finished_spans()
    assert all(s.attributes.get(sc.TT_TOKEN_INDEX, -1) == -1 for s in spans if s.name != sc.LLM_REQUEST_SPAN)
    ok = next(s for s in spans if s.attributes.get(sc.GEN_AI_REQUEST_ID) == "req-ok")
    tokens = [e for e in ok.events if e.name == sc.TOKEN_EVENT]
    assert [(e.attributes[sc.TT_TOKEN_INDEX], e.attributes[sc.TT_TOKEN_TIME]) for e in tokens] == [(0, "emit"), (1, "emit")]
    assert tokens[1].timestamp - tokens[0].timestamp == 1 * MS
    (row,) = [e for e in ok.events if e.name == sc.TT_REQUEST_EVENT]  # the request's one requests row
    assert row.attributes[sc.TT_TENANT] == "acme" and row.attributes[sc.TT_FINISH_UNIX_NS] == ok.end_time
    assert [s.context.span_id for s in spans] == [s.context.span_id for s in second.get_finished_spans()]


# --------------------------------------------------------------------------- ingest, in process

def _json_payload(spans: list[dict]) -> bytes:
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}).encode()


def _attr(key, value):
    kind = "doubleValue" if isinstance(value, float) else "intValue" if isinstance(value, int) else "stringValue"
    return {"key": key, "value": {kind: str(value) if kind == "intValue" else value}}


def test_mapper_without_ttft_lays_queue_then_prefill_from_arrival():
    sink = InMemorySink()
    rec = BufferedRecorder(sink, instance_id=3)
    anchor = Anchor(mono_ns=5_000_000_000, wall_ns=1_700_000_000_000_000_000)
    start = anchor.wall_ns + 2 * MS
    span = {"name": "llm_request", "traceId": "00" * 16, "spanId": "ab" * 8,
            "startTimeUnixNano": str(start), "endTimeUnixNano": str(start + 50 * MS),
            "attributes": [_attr(sc.GEN_AI_LATENCY_TIME_IN_QUEUE, 0.004),
                           _attr(sc.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL, 0.006),
                           _attr(sc.GEN_AI_USAGE_COMPLETION_TOKENS, 9)]}
    mapper = LlmRequestMapper(rec, anchor)
    assert [mapper.map(s) for s in decode_request(_json_payload([span, dict(span, name="other")]),
                                                  "application/json")] == [True, False]
    rec.close()
    req = sink.table(REQUESTS.name).to_pylist()[0]
    arrival = anchor.mono_ns + 2 * MS
    assert req[col.REQUEST_KEY] == "ab" * 8 and req[col.TRACE_ID] == ""  # span id; all-zero trace id
    assert (req[col.ARRIVAL_NS], req[col.FIRST_TOKEN_NS], req[col.FINISH_NS]) == (
        arrival, arrival + 10 * MS, arrival + 50 * MS)
    assert req[col.NUM_OUTPUT_TOKENS] == 9 and req[col.NUM_PROMPT_TOKENS] is None
    spans = sorted((r[col.STAGE], r[col.START_NS], r[col.END_NS], r[col.TOKEN_INDEX])
                   for r in sink.table(SPANS.name).to_pylist())
    assert spans == [(Stage.SCHEDULE_QUEUE, arrival, arrival + 4 * MS, 0),
                     (Stage.PREFILL_COMPUTE, arrival + 4 * MS, arrival + 10 * MS, 0)]


@pytest.mark.parametrize("body,ctype,fragment", [
    (b"{not json", "application/json", "not valid JSON"),
    (b'{"resourceSpans": 5}', "application/json", "must be a list"),
    (_json_payload([{"name": "x", "traceId": "zz"}]), "application/json", "not hex"),
    (b"\xff\x00garbage", "application/x-protobuf", "not a protobuf"),
    (b"{}", "text/plain", "unsupported Content-Type"),
])
def test_malformed_payloads_raise_payload_error(body, ctype, fragment):
    with pytest.raises(PayloadError, match=fragment):
        decode_request(body, ctype)


# --------------------------------------------------------------------------- ingest, real receiver

def _ingest_cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", "from tokentrace.app.cli import main; main()", "ingest-otlp", *args]


@contextlib.contextmanager
def _receiver(store: Path, *args: str) -> Iterator[tuple[subprocess.Popen, list[str]]]:
    """``tokentrace ingest-otlp`` into run ``otlp`` of ``store`` in a child process, and its endpoints
    (HTTP first, then gRPC if asked for); killed on the way out if a test did not stop it."""
    cmd = _ingest_cmd("--listen", "127.0.0.1:0", "--store", str(store), "--run", "otlp", *args)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else ""
        if "listening on " not in line:
            pytest.fail(f"receiver did not start: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}")
        yield proc, line.split("listening on ", 1)[1].split(" (store ", 1)[0].split(" and ")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def _stop_and_open(proc: subprocess.Popen, signum: int, store: Path):
    """Stop the receiver with ``signum``: it must exit 0 having flushed the run. The run and its
    (mapped, ignored, rejected) counters."""
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "stopped" in out
    run = open_run(store, "otlp")
    counters = run.counters()
    return run, (counters[SPANS_MAPPED], counters[SPANS_IGNORED], counters[PAYLOADS_REJECTED])


def _vllm_like_spans(exporter, t0_unix: int) -> None:
    """Emit an llm_request span the way vLLM does (and an unrelated one) through a real OTLP exporter."""
    provider = TracerProvider(resource=Resource.create({sc.SERVICE_NAME: "vllm"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("vllm.tracing")
    span = tracer.start_span(sc.LLM_REQUEST_SPAN, kind=SpanKind.SERVER, start_time=t0_unix)
    span.set_attributes({sc.GEN_AI_REQUEST_ID: "cmpl-1", sc.GEN_AI_LATENCY_TIME_IN_QUEUE: 0.010,
                         sc.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: 0.050,
                         sc.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: 0.030,
                         sc.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: 0.200, sc.GEN_AI_LATENCY_E2E: 0.260,
                         sc.GEN_AI_USAGE_PROMPT_TOKENS: 100, sc.GEN_AI_USAGE_COMPLETION_TOKENS: 20})
    span.end(end_time=t0_unix + 261 * MS)
    tracer.start_span("unrelated", start_time=t0_unix).end(end_time=t0_unix + MS)
    provider.shutdown()


def _http_exporter(url: str):
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=url, timeout=10)


def test_receiver_ingests_protobuf_and_json_and_survives_bad_payloads(tmp_path):
    with _receiver(tmp_path) as (proc, (url,)):
        t0 = time.time_ns()
        _vllm_like_spans(_http_exporter(url), t0)
        json_span = {"name": "llm_request", "traceId": TRACE, "spanId": "00f067aa0ba902b7",
                     "startTimeUnixNano": str(t0 + 5 * MS), "endTimeUnixNano": str(t0 + 105 * MS),
                     "status": {"code": 2},
                     "attributes": [_attr(sc.GEN_AI_REQUEST_ID, "cmpl-2"),
                                    _attr(sc.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN, 0.080),
                                    _attr(sc.GEN_AI_LATENCY_TIME_IN_QUEUE, 0.020),
                                    _attr(sc.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL, 0.040),
                                    _attr(sc.GEN_AI_USAGE_PROMPT_TOKENS, 5)]}
        with httpx.Client(timeout=10) as client:
            bad = client.post(url, content=b"{oops", headers={"Content-Type": "application/json"})
            assert bad.status_code == 400 and "not valid JSON" in bad.json()["message"]
            bad_pb = client.post(url, content=b"\xff\xff\xff", headers={"Content-Type": "application/x-protobuf"})
            assert bad_pb.status_code == 400 and b"not a protobuf" in bad_pb.content
            good = client.post(url, content=_json_payload([json_span]), headers={"Content-Type": "application/json"})
            assert good.status_code == 200 and good.json() == {}
        run, counts = _stop_and_open(proc, signal.SIGTERM, tmp_path)
    assert counts == (2, 1, 2)
    reqs, spans, to_mono = _received(run, t0)
    r2 = reqs["cmpl-2"]
    _check_vllm_like_request(reqs["cmpl-1"], spans, t0 + to_mono)
    assert r2[col.STATUS] == RequestStatus.ERROR and r2[col.TRACE_ID] == TRACE
    assert r2[col.FINISH_NS] - r2[col.ARRIVAL_NS] == 100 * MS  # no e2e attribute: the span's end
    assert sorted(spans[r2[col.REQUEST_ID]]) == [
        (Stage.SCHEDULE_QUEUE, 25 * MS, 45 * MS, 0), (Stage.PREFILL_COMPUTE, 45 * MS, 85 * MS, 0)]
    tokens = run.table(TOKENS.name).to_pylist()
    r2_tokens = [(t[col.TOKEN_INDEX], t[col.EMIT_NS] - t0 - to_mono) for t in tokens
                 if t[col.REQUEST_ID] == r2[col.REQUEST_ID]]
    assert r2_tokens == [(0, 85 * MS)]  # no decode time, no output count: no later token is placed
    r1_tokens = sorted((t[col.TOKEN_INDEX], t[col.EMIT_NS] - t0 - to_mono) for t in tokens
                       if t[col.REQUEST_ID] == reqs["cmpl-1"][col.REQUEST_ID])
    assert r1_tokens == [(i, 50 * MS + 200 * MS * i // 19) for i in range(20)]
    assert run.counters()["otlp_token_times_interpolated"] == 18


def _received(run, t0: int) -> tuple[dict, dict, int]:
    """Requests rows by key; per request id, (stage, start, end, token) relative to ``t0``; Unix->mono shift."""
    inst = run.table(INSTANCES.name).to_pylist()[-1]
    to_mono = inst[col.MONO_ANCHOR_NS] - inst[col.WALL_ANCHOR_NS]
    reqs = {r[col.REQUEST_KEY]: r for r in run.table(REQUESTS.name).to_pylist()}
    spans: dict[int, list] = {}
    for r in run.table(SPANS.name).to_pylist():
        spans.setdefault(r[col.REQUEST_ID], []).append(
            (r[col.STAGE], r[col.START_NS] - t0 - to_mono, r[col.END_NS] - t0 - to_mono, r[col.TOKEN_INDEX]))
    return reqs, spans, to_mono


def _check_vllm_like_request(r1: dict, spans: dict, arrival: int) -> None:
    """The rows of the ``cmpl-1`` span that ``_vllm_like_spans`` sends."""
    assert r1[col.ARRIVAL_NS] == arrival
    assert (r1[col.FIRST_TOKEN_NS] - r1[col.ARRIVAL_NS], r1[col.FINISH_NS] - r1[col.ARRIVAL_NS]) == (50 * MS, 260 * MS)
    assert (r1[col.NUM_PROMPT_TOKENS], r1[col.NUM_OUTPUT_TOKENS], r1[col.STATUS]) == (100, 20, RequestStatus.OK)
    # the 200 ms of decode is decode.compute of tokens 1..19 (an even split: vLLM reports only the total)
    decode = [(Stage.DECODE_COMPUTE, 50 * MS + 200 * MS * (i - 1) // 19, 50 * MS + 200 * MS * i // 19, i)
              for i in range(1, 20)]
    assert sorted(spans[r1[col.REQUEST_ID]]) == [
        (Stage.SCHEDULE_QUEUE, 10 * MS, 20 * MS, 0),
        (Stage.PREFILL_COMPUTE, 20 * MS, 50 * MS, 0),
        *decode,
    ]


# --------------------------------------------------------------------------- ingest over OTLP/gRPC

def test_grpc_receiver_takes_vllms_default_exporter_beside_http_into_one_run(tmp_path):
    import grpc
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import Compression, OTLPSpanExporter

    from instrument.otlp_grpc import METHOD, SERVICE

    with _receiver(tmp_path, "--grpc-listen", "127.0.0.1:0") as (proc, (http_url, grpc_url)):
        assert http_url.startswith("http://127.0.0.1:") and grpc_url.startswith("grpc://127.0.0.1:")
        t0 = time.time_ns()
        # What vLLM runs with --otlp-traces-endpoint grpc://HOST:4317 and OTEL_EXPORTER_OTLP_TRACES_INSECURE=true
        _vllm_like_spans(OTLPSpanExporter(endpoint=grpc_url, insecure=True, compression=Compression.Gzip,
                                          timeout=10), t0)
        with grpc.insecure_channel(grpc_url.removeprefix("grpc://")) as channel:
            export = channel.unary_unary(f"/{SERVICE}/{METHOD}")  # raw bytes in and out
            with pytest.raises(grpc.RpcError) as bad:
                export(b"\xff\xff\xff", timeout=10)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a protobuf ExportTraceServiceRequest" in bad.value.details()
            assert export(b"", timeout=10) == b""  # an empty export is a valid one, answered with success
        json_span = {"name": "llm_request", "traceId": TRACE, "spanId": "00f067aa0ba902b7",
                     "startTimeUnixNano": str(t0 + 5 * MS), "endTimeUnixNano": str(t0 + 105 * MS),
                     "attributes": [_attr(sc.GEN_AI_REQUEST_ID, "cmpl-http")]}
        r = httpx.post(http_url, content=_json_payload([json_span]), headers={"Content-Type": "application/json"},
                       timeout=10)
        assert r.status_code == 200
        run, counts = _stop_and_open(proc, signal.SIGINT, tmp_path)
    assert counts == (2, 1, 1)
    reqs, spans, to_mono = _received(run, t0)
    assert set(reqs) == {"cmpl-1", "cmpl-http"}
    _check_vllm_like_request(reqs["cmpl-1"], spans, t0 + to_mono)
    assert reqs["cmpl-http"][col.ARRIVAL_NS] == t0 + 5 * MS + to_mono


def test_grpc_listen_errors_exit_before_creating_the_store(tmp_path):
    import socket

    env = dict(os.environ, PYTHONPATH=str(REPO))
    store = tmp_path / "store"
    with socket.create_server(("127.0.0.1", 0)) as taken:  # a port someone else holds
        port = taken.getsockname()[1]
        busy = subprocess.run(_ingest_cmd("--listen", "127.0.0.1:0", "--grpc-listen", f"127.0.0.1:{port}",
                                          "--store", str(store)), capture_output=True, text=True, env=env,
                              cwd=REPO, timeout=60)
    assert busy.returncode == 2 and "Traceback" not in busy.stderr
    assert f"cannot listen for OTLP/gRPC on 127.0.0.1:{port}: Address already in use" in busy.stderr
    bad = subprocess.run(_ingest_cmd("--grpc-listen", "4317", "--store", str(store)), capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=60)
    assert bad.returncode == 2 and "--grpc-listen must be HOST:PORT, e.g. 127.0.0.1:4317" in bad.stderr
    no_grpc = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['grpc'] = None; from tokentrace.app.cli import main; main()",
         "ingest-otlp", "--listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0", "--store", str(store)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert no_grpc.returncode == 2 and "pip install 'tokentrace[otlp-grpc]'" in no_grpc.stderr
    assert "Traceback" not in no_grpc.stderr
    assert not store.exists()
