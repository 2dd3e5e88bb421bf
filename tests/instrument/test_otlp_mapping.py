"""What each emitter's spans become: vLLM (llm_request, lifecycle spans, per-token arrays),
SGLang's request trace, and tokentrace's own export read back (a lossless round trip).

Spans are made with the OpenTelemetry SDK exactly as each emitter makes them, encoded to
OTLP protobuf by the exporters' own encoder and handed to the receiver's ingestor, which
writes a real store.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from opentelemetry import trace as otel_trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

import tokentrace
from instrument import semconv as sc
from instrument.otlp_decode import PROTOBUF
from instrument.otlp_requests import IngestOptions, header_attribute
from instrument.otlp_server import store_ingestor
from tokentrace.app.export.otlp import export_run_to_otel
from tokentrace.schema import INSTANCES, REQUESTS, SPANS, TOKENS, RequestStatus, Stage, col
from tokentrace.store import StoreWriter

MS = 1_000_000
REAL_RUN = Path(__file__).resolve().parents[1] / "data" / "real_run"


def _provider(resource: dict) -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create(resource))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _ingest(store: Path, batches: list[list], options: IngestOptions | None = None):
    """Each batch of SDK spans as one OTLP protobuf payload into run ``otlp`` of ``store``."""
    ingestor = store_ingestor(StoreWriter(store, run_id="otlp"), options=options)
    for spans in batches:
        ingestor.ingest(encode_spans(spans).SerializeToString(), PROTOBUF)
    ingestor.close()
    return tokentrace.open(store, run="otlp"), ingestor.counts


def _vllm_request(tracer, *, arrival_ns: int, key: str, ttft: float, e2e: float, queue: float, prefill: float,
                  decode: float, prompt: int, completion: int, finish: str = "stop", extra: dict | None = None,
                  error: Exception | None = None) -> None:
    """An llm_request span as vllm/v1/engine/output_processor.py's do_tracing builds it (through
    vllm/tracing's instrument_manual: start at the arrival, SERVER kind, ended when built)."""
    attributes = {
        sc.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: ttft, sc.GEN_AI_LATENCY_E2E: e2e,
        sc.GEN_AI_LATENCY_TIME_IN_QUEUE: queue, sc.GEN_AI_USAGE_PROMPT_TOKENS: prompt,
        sc.GEN_AI_USAGE_COMPLETION_TOKENS: completion, sc.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: prefill,
        sc.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: decode, sc.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: prefill + decode,
        sc.GEN_AI_REQUEST_ID: key, sc.GEN_AI_RESPONSE_FINISH_REASON: json.dumps([finish]),
        "gen_ai.request.max_tokens": completion, "gen_ai.request.temperature": 0.7, "gen_ai.request.top_p": 0.9,
        "gen_ai.request.n": 1, **(extra or {})}
    span = tracer.start_span(sc.LLM_REQUEST_SPAN, kind=SpanKind.SERVER, start_time=arrival_ns, attributes=attributes)
    if error is not None:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, str(error)))
        span.set_attribute(sc.ERROR_TYPE, type(error).__name__)
    span.end(end_time=arrival_ns + round(e2e * 1e9) + MS)


def test_vllm_llm_request_per_replica_gives_the_ttft_tpot_e2e_it_carries(tmp_path: Path):
    t0 = tokentrace.clock.take_anchor().wall_ns
    batches = []
    expected = {}
    for r, replica in enumerate(("replica-a", "replica-b")):
        provider, exporter = _provider({sc.SERVICE_NAME: "vllm", sc.SERVICE_INSTANCE_ID: replica,
                                        sc.HOST_NAME: f"gpu-{r}", sc.PROCESS_PID: 4000 + r})
        tracer = provider.get_tracer("vllm.tracing")
        ttft, decode, n = 0.05 + 0.1 * r, 2.9, 211
        _vllm_request(tracer, arrival_ns=t0 + r * 10 * MS, key=f"cmpl-{r}", ttft=ttft, e2e=ttft + decode + 0.004,
                      queue=0.01, prefill=0.03, decode=decode, prompt=100, completion=n,
                      extra={header_attribute("X-Tenant"): ("acme",), sc.GEN_AI_USAGE_CACHE_READ_DOT_INPUT_TOKENS: 64})
        expected[replica] = (ttft * 1e3, decode / (n - 1) * 1e3, (ttft + decode + 0.004) * 1e3)
        provider.shutdown()
        batches.append(list(exporter.get_finished_spans()))
    provider, exporter = _provider({sc.SERVICE_NAME: "vllm", sc.SERVICE_INSTANCE_ID: "replica-c"})
    tracer = provider.get_tracer("vllm.tracing")
    for r in (0, 1):
        _vllm_request(tracer, arrival_ns=t0 + 5 * MS, key=f"aborted-{r}", ttft=0.2, e2e=0.3, queue=0.1, prefill=0.1,
                      decode=0.1, prompt=10, completion=3, finish="abort")
        _vllm_request(tracer, arrival_ns=t0 + 6 * MS, key=f"failed-{r}", ttft=0.2, e2e=0.25, queue=0.1, prefill=0.1,
                      decode=0.05, prompt=10, completion=2, error=RuntimeError("engine died"))
    provider.shutdown()
    batches.append(list(exporter.get_finished_spans()))
    run, counts = _ingest(tmp_path, batches)
    assert counts["otlp_spans_mapped"] == 6 and counts["otlp_spans_ignored"] == 0
    names = {i[col.NAME]: i for i in run.table(INSTANCES.name).to_pylist()}
    assert (names["replica-a"][col.HOST], names["replica-a"][col.PID]) == ("gpu-0", 4000)
    assert (names["replica-b"][col.HOST], names["replica-b"][col.PID]) == ("gpu-1", 4001)
    by_instance = run.analyze().latency(by="instance")
    for replica, (ttft_ms, tpot_ms, e2e_ms) in expected.items():
        iid = names[replica][col.INSTANCE_ID]
        rows = by_instance[by_instance[col.INSTANCE_ID] == iid].set_index("metric")
        # the analyzers' TTFT, TPOT and E2E of the replica are what its span carried, to the ns
        assert rows.loc["ttft", "count"] == 1 and rows.loc["ttft", "mean_ms"] == pytest.approx(ttft_ms, abs=1e-6)
        assert rows.loc["tpot", "mean_ms"] == pytest.approx(tpot_ms, abs=1e-6)
        assert rows.loc["e2e", "mean_ms"] == pytest.approx(e2e_ms, abs=1e-6)
        assert rows.loc["itl", "count"] == 210 and rows.loc["itl", "mean_ms"] == pytest.approx(tpot_ms, abs=1e-3)
        (ok,) = [r for r in run.table(REQUESTS.name).to_pylist() if r[col.INSTANCE_ID] == iid]
        assert ok[col.TENANT] == "acme" and ok[col.NUM_CACHED_TOKENS] == 64
        assert ok[col.NUM_OUTPUT_TOKENS] == 211 and ok[col.NUM_PROMPT_TOKENS] == 100
    reqs = {r[col.REQUEST_KEY]: r for r in run.table(REQUESTS.name).to_pylist()}
    assert reqs["aborted-0"][col.STATUS] == RequestStatus.ABORTED
    assert (reqs["failed-1"][col.STATUS], reqs["failed-1"][col.ERROR]) == (RequestStatus.ERROR, "RuntimeError")
    # TPOT from the tokens rows = decode / (n - 1); the decode time is decode.compute of tokens 1..n-1
    req = reqs["cmpl-0"]
    tokens = sorted(t[col.EMIT_NS] for t in run.table(TOKENS.name).to_pylist() if t[col.REQUEST_ID] == req[col.REQUEST_ID])
    assert len(tokens) == 211 and tokens[-1] - tokens[0] == round(2.9e9)
    decode = [s for s in run.table(SPANS.name).to_pylist()
              if s[col.REQUEST_ID] == req[col.REQUEST_ID] and s[col.STAGE] == Stage.DECODE_COMPUTE]
    assert sorted(s[col.TOKEN_INDEX] for s in decode) == list(range(1, 211))
    assert sum(s[col.END_NS] - s[col.START_NS] for s in decode) == round(2.9e9)
    assert run.counters()["otlp_token_times_interpolated"] == 2 * 209 + 2 * 1  # and 0 for the 2-token ones
    breakdown = run.analyze().stage_breakdown()
    assert "decode.compute" in set(breakdown.get("stage", breakdown.iloc[:, 0]))
    # not reported is not zero: the aborted request carried no cache attribute
    assert reqs["aborted-0"][col.NUM_CACHED_TOKENS] is None


def test_vllm_lifecycle_spans_and_per_token_arrays_replace_the_estimates(tmp_path: Path):
    t0 = tokentrace.clock.take_anchor().wall_ns
    provider, exporter = _provider({sc.SERVICE_NAME: "vllm"})
    tracer = provider.get_tracer("vllm.tracing")
    gen = [0.05, 0.07, 0.10, 0.12]  # s since arrival, one per output token
    sched = [0.02, 0.06, 0.08, 0.11]
    root = tracer.start_span(sc.LLM_REQUEST_SPAN, kind=SpanKind.SERVER, start_time=t0, attributes={
        sc.GEN_AI_REQUEST_ID: "tok-1", sc.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: 0.05, sc.GEN_AI_LATENCY_E2E: 0.125,
        sc.GEN_AI_LATENCY_TIME_IN_QUEUE: 0.02, sc.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: 0.03,
        sc.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: 0.07, sc.GEN_AI_USAGE_COMPLETION_TOKENS: 4,
        sc.GEN_AI_LATENCY_PER_TOKEN_GENERATION_TIME: gen,
        sc.GEN_AI_LATENCY_PER_TOKEN_SCHEDULED_TIME: json.dumps(sched),  # some senders JSON-encode the array
        sc.GEN_AI_ITERATION_PER_TOKEN_BATCH_SIZE: [1, 3, 3, 2]})
    ctx = otel_trace.set_span_in_context(root)
    children = []
    for name, a, b in (("vllm_queue", 0, 0.02), ("vllm_prefill", 0.02, 0.05)):
        c = tracer.start_span(name, context=ctx, start_time=t0 + round(a * 1e9))
        c.end(end_time=t0 + round(b * 1e9))
    children = list(exporter.get_finished_spans())
    root.end(end_time=t0 + 126 * MS)
    provider.shutdown()
    root_span = [s for s in exporter.get_finished_spans() if s.name == sc.LLM_REQUEST_SPAN]
    run, counts = _ingest(tmp_path, [children, root_span])  # children first, in their own payload
    assert counts["otlp_spans_mapped"] == 3 and counts["otlp_token_times_interpolated"] == 0
    (req,) = [r for r in run.table(REQUESTS.name).to_pylist()]
    arrival = req[col.ARRIVAL_NS]
    tokens = sorted((t[col.TOKEN_INDEX], t[col.EMIT_NS] - arrival) for t in run.table(TOKENS.name).to_pylist())
    assert tokens == [(i, round(g * 1e9)) for i, g in enumerate(gen)]
    spans = sorted((s[col.STAGE], s[col.START_NS] - arrival, s[col.END_NS] - arrival, s[col.TOKEN_INDEX])
                   for s in run.table(SPANS.name).to_pylist())
    # the lifecycle spans (measured intervals) replace the latencies derived from attributes
    assert spans == [(Stage.SCHEDULE_QUEUE, 0, 20 * MS, 0), (Stage.PREFILL_COMPUTE, 20 * MS, 50 * MS, 0)]


def test_per_token_arrays_without_lifecycle_spans_give_decode_queue_and_compute(tmp_path: Path):
    t0 = tokentrace.clock.take_anchor().wall_ns
    provider, exporter = _provider({sc.SERVICE_NAME: "vllm"})
    tracer = provider.get_tracer("vllm.tracing")
    tracer.start_span(sc.LLM_REQUEST_SPAN, start_time=t0, attributes={
        sc.GEN_AI_REQUEST_ID: "tok-2", sc.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: 0.05,
        sc.GEN_AI_LATENCY_TIME_IN_QUEUE: 0.02, sc.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: 0.03,
        sc.GEN_AI_USAGE_COMPLETION_TOKENS: 3, sc.GEN_AI_LATENCY_PER_TOKEN_GENERATION_TIME: [0.05, 0.07, 0.1],
        sc.GEN_AI_LATENCY_PER_TOKEN_SCHEDULED_TIME: [0.02, 0.06, 0.08],
        sc.GEN_AI_ITERATION_PER_TOKEN_BATCH_SIZE: [1, 3, 2]}).end(end_time=t0 + 100 * MS)
    provider.shutdown()
    run, _ = _ingest(tmp_path, [list(exporter.get_finished_spans())])
    arrival = run.table(REQUESTS.name).to_pylist()[0][col.ARRIVAL_NS]
    spans = sorted((s[col.TOKEN_INDEX], s[col.STAGE], s[col.START_NS] - arrival, s[col.END_NS] - arrival,
                    s[col.BATCH_SIZE]) for s in run.table(SPANS.name).to_pylist())
    assert spans == [
        (0, Stage.SCHEDULE_QUEUE, 0, 20 * MS, None), (0, Stage.PREFILL_COMPUTE, 20 * MS, 50 * MS, None),
        (1, Stage.DECODE_QUEUE, 50 * MS, 60 * MS, None), (1, Stage.DECODE_COMPUTE, 60 * MS, 70 * MS, 3),
        (2, Stage.DECODE_QUEUE, 70 * MS, 80 * MS, None), (2, Stage.DECODE_COMPUTE, 80 * MS, 100 * MS, 2)]


def test_sglang_request_trace_maps_its_stages(tmp_path: Path):
    """The spans of sglang/srt/tracing/trace.py: a bootstrap-room span, the request's ``Req`` span
    (attribute rid), a span per thread, and trace_slice spans named by RequestStage."""
    t0 = tokentrace.clock.take_anchor().wall_ns
    provider, exporter = _provider({sc.SERVICE_NAME: "sglang"})
    tracer = provider.get_tracer("sglang server")

    def at(ms: float) -> int:
        return t0 + round(ms * MS)

    room = tracer.start_span("Bootstrap Room 0x0", start_time=at(0), attributes={"bootstrap_room": "0x0"})
    req = tracer.start_span(" Req 5e1d2c3b", start_time=at(0), context=otel_trace.set_span_in_context(room),
                            attributes={"rid": "5e1d2c3b9a"})
    thread = tracer.start_span("Scheduler [TP 0] (host:abcd | pid:42)", start_time=at(0),
                               context=otel_trace.set_span_in_context(req),
                               attributes={"host_id": "abcd", "pid": 42, "thread_label": "Scheduler", "tp_rank": 0})
    in_thread = otel_trace.set_span_in_context(thread)
    for name, a, b in (("tokenize", 0, 2), ("dispatch", 2, 3), ("prefill_waiting", 3, 10),
                       ("prefill_forward", 10, 30), ("decode_loop", 30, 90)):
        s = tracer.start_span(name, start_time=at(a), context=in_thread)
        if name == "decode_loop":  # a nested slice: its time is inside the loop's
            tracer.start_span("decode_forward", start_time=at(40), context=otel_trace.set_span_in_context(s)).end(
                end_time=at(45))
        s.end(end_time=at(b))
    thread.end(end_time=at(90))
    req.end(end_time=at(91))
    room.end(end_time=at(91))
    provider.shutdown()
    run, counts = _ingest(tmp_path, [list(exporter.get_finished_spans())])
    (row,) = run.table(REQUESTS.name).to_pylist()
    assert row[col.REQUEST_KEY] == "5e1d2c3b9a"
    arrival = row[col.ARRIVAL_NS]
    assert (row[col.FIRST_TOKEN_NS] - arrival, row[col.FINISH_NS] - arrival) == (30 * MS, 91 * MS)
    spans = sorted((s[col.STAGE], s[col.START_NS] - arrival, s[col.END_NS] - arrival, s[col.TOKEN_INDEX])
                   for s in run.table(SPANS.name).to_pylist())
    assert spans == sorted([(Stage.GATEWAY_TOKENIZE, 0, 2 * MS, 0), (Stage.GATEWAY_ROUTE, 2 * MS, 3 * MS, 0),
                            (Stage.SCHEDULE_QUEUE, 3 * MS, 10 * MS, 0), (Stage.PREFILL_COMPUTE, 10 * MS, 30 * MS, 0),
                            (Stage.DECODE_COMPUTE, 30 * MS, 90 * MS, -1)])
    assert counts["otlp_spans_mapped"] == 7  # the Req span and every slice, the nested one included
    assert counts["otlp_spans_ignored"] == 2  # the bootstrap-room and thread spans carry no stage
    # SGLang's spans report no cached tokens: the hit rate is not measured, not 0%
    assert row[col.NUM_CACHED_TOKENS] is None
    hits = run.analyze().cache().prefix
    assert hits["token_hit_rate"].isna().all() and hits["request_hit_rate"].isna().all()


def _snapshot(run) -> tuple[dict, Counter, Counter]:
    """A run as the analyzers see it, relative to each request's arrival, instances by name:
    requests (key -> tenant, class, status, first token, first content, finish, counts), stage
    spans and token times (multisets)."""
    clocks = tokentrace.clock.RunClocks.from_instances(run.table(INSTANCES.name))
    inst = {i[col.INSTANCE_ID]: i[col.NAME] for i in run.table(INSTANCES.name).to_pylist()}
    arrival: dict[int, int] = {}
    reqs: dict[str, tuple] = {}
    rows = sorted(run.table(REQUESTS.name).to_pylist(), key=lambda r: (r[col.REQUEST_KEY], r[col.ARRIVAL_NS] or 0))
    key_of = {r[col.REQUEST_ID]: r[col.REQUEST_KEY] for r in rows}  # ids as keys: how ids are drawn is not compared
    merged: dict[str, dict] = defaultdict(dict)
    for r in rows:
        shift = clocks.offset(r[col.INSTANCE_ID])
        m = merged[r[col.REQUEST_KEY]]
        if r[col.ARRIVAL_NS] is not None:
            a = r[col.ARRIVAL_NS] + shift
            arrival[r[col.REQUEST_ID]] = min(arrival.get(r[col.REQUEST_ID], a), a)
        for c in (col.TENANT, col.SLO_CLASS):
            m[c] = m.get(c) or r[c]
        m[col.STATUS] = max(m.get(col.STATUS, 0), r[col.STATUS])
        for c in (col.NUM_PROMPT_TOKENS, col.NUM_OUTPUT_TOKENS, col.NUM_CACHED_TOKENS):
            if r[c] is not None:
                m[c] = max(m.get(c, r[c]), r[c])
        for c in (col.FINISH_NS,):
            if r[c] is not None:
                m[c] = max(m.get(c, r[c] + shift), r[c] + shift)
        for c in (col.FIRST_CONTENT_NS,):
            if r[c] is not None:
                m[c] = min(m.get(c, r[c] + shift), r[c] + shift)
    id_of = {key: rid for rid, key in key_of.items()}
    for key, m in merged.items():
        a = arrival[id_of[key]]
        reqs[key] = tuple(sorted((k, v - a if k.endswith("_ns") else v) for k, v in m.items()))
    spans = Counter((inst[s[col.INSTANCE_ID]], key_of[s[col.REQUEST_ID]], s[col.STAGE], s[col.TOKEN_INDEX],
                     s[col.START_NS] + clocks.offset(s[col.INSTANCE_ID]) - arrival[s[col.REQUEST_ID]],
                     s[col.END_NS] - s[col.START_NS], s[col.STEP], s[col.NUM_BYTES], s[col.TIER], s[col.BATCH_SIZE])
                    for s in run.table(SPANS.name).to_pylist() if s[col.REQUEST_ID] in arrival)
    tokens = Counter()
    for t in run.table(TOKENS.name).to_pylist():
        for kind in (col.EMIT_NS, col.SENT_NS, col.RECV_NS):
            if t[kind] is not None and t[col.REQUEST_ID] in arrival:
                tokens[(inst[t[col.INSTANCE_ID]], key_of[t[col.REQUEST_ID]], t[col.TOKEN_INDEX], kind,
                        t[kind] + clocks.offset(t[col.INSTANCE_ID]) - arrival[t[col.REQUEST_ID]], t[col.STEP])] += 1
    return reqs, spans, tokens


def test_export_then_ingest_reproduces_the_run(tmp_path: Path):
    original = tokentrace.open(REAL_RUN)
    exporter = InMemorySpanExporter()
    summary = export_run_to_otel(original, exporter, token_events=True, batch_size=300)
    spans = list(exporter.get_finished_spans())
    assert summary.num_failed_batches == 0 and len(spans) == summary.num_spans
    batches = [spans[i:i + 300] for i in range(0, len(spans), 300)]  # as the exporter batches them
    run, counts = _ingest(tmp_path, batches)
    assert counts["otlp_spans_ignored"] == 0 and counts["otlp_spans_unmatched"] == 0
    assert counts["otlp_spans_mapped"] == len(spans)
    before, after = _snapshot(original), _snapshot(run)
    assert after[0] == before[0]  # tenant, SLO class, status, counts, finish and first content of every request
    assert sum(before[1].values()) == original.num_rows(SPANS.name)
    assert after[1] == before[1]  # every stage span: instance, token, offset, duration, step, bytes, tier, batch
    assert after[2] == before[2]  # every token time of every instance
    b, a = original.analyze().stage_breakdown(), run.analyze().stage_breakdown()
    assert a.round(6).equals(b.round(6))
    # the client lane (its own requests rows and receive times) comes back too: agreement is unchanged
    assert run.analyze().agreement().round(9).equals(original.analyze().agreement().round(9))
    roles = sorted(i[col.ROLE] for i in tokentrace.clock.latest_instances(run.table(INSTANCES.name)).to_pylist())
    assert roles.count(4) == 1  # the bench client is an instance again


def test_export_command_to_a_running_ingest_otlp_reproduces_the_run(tmp_path: Path):
    """`tokentrace export --format otlp` into `tokentrace ingest-otlp`, both as commands."""
    import os
    import select
    import signal
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo))
    cli = [sys.executable, "-c", "from tokentrace.app.cli import main; main()"]
    receiver = subprocess.Popen([*cli, "ingest-otlp", "--listen", "127.0.0.1:0", "--store", str(tmp_path),
                                 "--run", "otlp"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=repo, env=env)
    try:
        ready, _, _ = select.select([receiver.stdout], [], [], 60)
        line = receiver.stdout.readline() if ready else ""
        assert "listening on " in line, line
        url = line.split("listening on ", 1)[1].split(" (store ", 1)[0]
        sent = subprocess.run([*cli, "export", str(REAL_RUN), "--format", "otlp", "--endpoint", url],
                              capture_output=True, text=True, cwd=repo, env=env, timeout=120)
        assert sent.returncode == 0, sent.stderr
        assert "sent " in sent.stderr
        receiver.send_signal(signal.SIGINT)
        out, err = receiver.communicate(timeout=60)
        assert receiver.returncode == 0, err
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait(timeout=30)
    original, run = tokentrace.open(REAL_RUN), tokentrace.open(tmp_path, run="otlp")
    assert _snapshot(run) == _snapshot(original)
    assert run.analyze().stage_breakdown().round(6).equals(original.analyze().stage_breakdown().round(6))


def test_the_receivers_dependencies_are_in_the_extras_the_docs_name():
    import re
    import tomllib

    repo = Path(__file__).resolve().parents[2]
    extras = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def names(extra: str) -> set[str]:
        return {re.split(r"[<>=\[ ]", d, maxsplit=1)[0].lower() for d in extras[extra]}

    docs = (repo / "docs" / "instrument-otel.md").read_text()
    assert "pip install 'tokentrace[otlp]'" in docs and "pip install 'tokentrace[otlp-grpc]'" in docs
    assert "pip install 'tokentrace[metrics]'" in docs
    assert {"starlette", "uvicorn"} <= names("otlp")  # what instrument.otlp_server imports to serve HTTP
    assert {"starlette", "uvicorn", "grpcio"} <= names("otlp-grpc")  # the HTTP receiver runs beside gRPC
    assert "prometheus-client" in names("metrics")


def test_tenant_and_slo_class_come_from_the_configured_attributes_and_headers(tmp_path: Path):
    t0 = tokentrace.clock.take_anchor().wall_ns
    provider, exporter = _provider({sc.SERVICE_NAME: "vllm", "deployment.tenant": "from-resource"})
    tracer = provider.get_tracer("vllm.tracing")
    for key, extra in (("a", {"customer.id": "acme", header_attribute("X-Priority"): ("interactive",)}),
                       ("b", {})):
        _vllm_request(tracer, arrival_ns=t0, key=key, ttft=0.01, e2e=0.02, queue=0.001, prefill=0.005,
                      decode=0.005, prompt=5, completion=2, extra=extra)
    provider.shutdown()
    options = IngestOptions(tenant_keys=("customer.id", "deployment.tenant"),
                            slo_class_keys=(header_attribute("X-Priority"),))
    run, _ = _ingest(tmp_path, [list(exporter.get_finished_spans())], options)
    rows = {r[col.REQUEST_KEY]: (r[col.TENANT], r[col.SLO_CLASS]) for r in run.table(REQUESTS.name).to_pylist()}
    # the span's own attribute first, then the resource's; an absent class stays empty
    assert rows == {"a": ("acme", "interactive"), "b": ("from-resource", "")}
