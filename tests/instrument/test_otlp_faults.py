"""Faults of a real ``tokentrace ingest-otlp`` process, over real sockets: values out of range
in one span never cost its neighbours, and what each traced process costs the receiver is bounded."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from instrument import semconv as sc
from instrument.otlp_decode import PROTOBUF
from instrument.otlp_mapping import SPANS_REJECTED
from tokentrace.clock import now_ns
from tokentrace.schema import REQUESTS, SPANS, TOKENS, Stage, col
from tokentrace.store import open_run

REPO = Path(__file__).resolve().parents[2]
MS = 1_000_000
pytestmark = pytest.mark.timeout(240)


@contextlib.contextmanager
def receiver(store: Path, *args: str) -> Iterator[tuple[subprocess.Popen, list[str]]]:
    """``tokentrace ingest-otlp`` into run ``otlp`` of ``store`` (a child process) and its endpoints."""
    cmd = [sys.executable, "-c", "from tokentrace.app.cli import main; main()", "ingest-otlp", "--listen", "127.0.0.1:0",
           "--store", str(store), "--run", "otlp", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else ""  # type: ignore[union-attr]
        assert "listening on " in line, (line, proc.stderr.read() if proc.poll() is not None else "")  # type: ignore[union-attr]
        yield proc, line.split("listening on ", 1)[1].split(" (store ", 1)[0].split(" and ")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err


def _value(v: object) -> common_pb2.AnyValue:
    if isinstance(v, (list, tuple)):
        return common_pb2.AnyValue(array_value=common_pb2.ArrayValue(values=[_value(x) for x in v]))
    if isinstance(v, bool):
        return common_pb2.AnyValue(bool_value=v)
    if isinstance(v, int):
        return common_pb2.AnyValue(int_value=v)
    if isinstance(v, float):
        return common_pb2.AnyValue(double_value=v)
    return common_pb2.AnyValue(string_value=str(v))


def span(name: str, trace: int, span_id: int, start: int, end: int, attrs: dict | None = None,
         parent: int = 0) -> trace_pb2.Span:
    return trace_pb2.Span(name=name, trace_id=trace.to_bytes(16, "big"), span_id=span_id.to_bytes(8, "big"),
                          parent_span_id=parent.to_bytes(8, "big") if parent else b"", start_time_unix_nano=start,
                          end_time_unix_nano=end,
                          attributes=[common_pb2.KeyValue(key=k, value=_value(v)) for k, v in (attrs or {}).items()])


def export(spans: list[trace_pb2.Span], resource: dict | None = None) -> bytes:
    res = resource_pb2.Resource(attributes=[common_pb2.KeyValue(key=k, value=_value(v))
                                            for k, v in (resource or {}).items()])
    return trace_service_pb2.ExportTraceServiceRequest(resource_spans=[trace_pb2.ResourceSpans(
        resource=res, scope_spans=[trace_pb2.ScopeSpans(spans=spans)])]).SerializeToString()


def llm_request(key: str, trace: int, t0: int, **attrs: object) -> trace_pb2.Span:
    base = {sc.GEN_AI_REQUEST_ID: key, sc.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: 0.02, sc.GEN_AI_LATENCY_E2E: 0.05,
            sc.GEN_AI_USAGE_COMPLETION_TOKENS: 3}
    return span(sc.LLM_REQUEST_SPAN, trace, 1, t0, t0 + 50 * MS, base | attrs)


POISONS = {  # each one made the receiver answer 500 (HTTP) / UNKNOWN (gRPC) and lose the spans after it
    "generation-1e300": {sc.GEN_AI_LATENCY_PER_TOKEN_GENERATION_TIME: [0.02, 1e300, 0.04]},
    "scheduled-1e300": {sc.GEN_AI_LATENCY_PER_TOKEN_GENERATION_TIME: [0.02, 0.03, 0.04],
                        sc.GEN_AI_LATENCY_PER_TOKEN_SCHEDULED_TIME: [0.0, 1e300, 0.035]},
    "nan-negative": {sc.GEN_AI_LATENCY_PER_TOKEN_GENERATION_TIME: [float("nan"), -0.5, 0.04],
                     sc.GEN_AI_LATENCY_TIME_IN_QUEUE: float("nan")},
    "huge-ints": {sc.GEN_AI_USAGE_PROMPT_TOKENS: 2**63 - 1, sc.GEN_AI_USAGE_COMPLETION_TOKENS: 2**63 - 1,
                  sc.GEN_AI_ITERATION_PER_TOKEN_BATCH_SIZE: [1e300, 2.0, 3.0]},
}


def test_values_out_of_range_are_absent_and_cost_no_neighbour_over_http_and_grpc(tmp_path):
    grpc = pytest.importorskip("grpc")
    from instrument.otlp_grpc import METHOD, SERVICE

    t0 = now_ns() // 1000 * 1000
    with receiver(tmp_path, "--grpc-listen", "127.0.0.1:0") as (proc, (http_url, grpc_url)):
        with httpx.Client(timeout=30) as client, grpc.insecure_channel(grpc_url.removeprefix("grpc://")) as channel:
            grpc_export = channel.unary_unary(f"/{SERVICE}/{METHOD}")
            for n, (name, poison) in enumerate(POISONS.items()):
                trace = 100 + 10 * n
                # The poisoned request's queue span comes first and waits for its root.
                early = span("vllm_queue", trace + 1, 7, t0, t0 + 5 * MS, parent=1)
                payload = [llm_request(f"{name}-A", trace, t0), llm_request(f"{name}-P", trace + 1, t0, **poison),
                           llm_request(f"{name}-B", trace + 2, t0)]
                if n % 2:
                    assert grpc_export(export([early]), timeout=30) == b""
                    answer = trace_service_pb2.ExportTraceServiceResponse.FromString(
                        grpc_export(export(payload), timeout=30))
                else:
                    head = {"Content-Type": PROTOBUF}
                    assert client.post(http_url, content=export([early]), headers=head).status_code == 200
                    r = client.post(http_url, content=export(payload), headers=head)
                    assert r.status_code == 200, r.text
                    answer = trace_service_pb2.ExportTraceServiceResponse.FromString(r.content)
                assert answer.partial_success.rejected_spans == 0
            # A root whose times no int64 nanosecond column can hold is rejected, and said so; its neighbours stay.
            bad_time = span(sc.LLM_REQUEST_SPAN, 999, 1, 2**64 - 2, 2**64 - 1, {sc.GEN_AI_REQUEST_ID: "never"})
            r = client.post(http_url, content=export([llm_request("before", 998, t0), bad_time,
                                                      llm_request("after", 997, t0)]),
                            headers={"Content-Type": PROTOBUF})
            assert r.status_code == 200
            partial = trace_service_pb2.ExportTraceServiceResponse.FromString(r.content).partial_success
            assert partial.rejected_spans == 1 and "out of range" in partial.error_message
        stop(proc)
    run = open_run(tmp_path, "otlp")
    reqs = {r[col.REQUEST_KEY]: r for r in run.table(REQUESTS.name).to_pylist()}
    assert set(reqs) == {f"{name}-{x}" for name in POISONS for x in "APB"} | {"before", "after"}
    queued = {(r[col.REQUEST_ID], r[col.STAGE]) for r in run.table(SPANS.name).to_pylist()}
    for name in POISONS:  # the child that waited for the poisoned root was recorded with it
        assert (reqs[f"{name}-P"][col.REQUEST_ID], int(Stage.SCHEDULE_QUEUE)) in queued
    p = reqs["huge-ints-P"]
    assert p[col.NUM_PROMPT_TOKENS] is None or p[col.NUM_PROMPT_TOKENS] < 0  # read as absent
    assert run.counters()[SPANS_REJECTED] == 1


def _proc_status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_an_export_naming_256_processes_costs_at_most_the_instance_cap(tmp_path):
    t0 = now_ns() // 1000 * 1000
    with receiver(tmp_path, "--max-instances", "8") as (proc, (url,)):
        with httpx.Client(timeout=60) as client:
            first = client.post(url, content=export([llm_request("warm", 1, t0)]), headers={"Content-Type": PROTOBUF})
            assert first.status_code == 200
            threads, fds = _proc_status(proc.pid, "Threads"), _num_fds(proc.pid)
            body = trace_service_pb2.ExportTraceServiceRequest(resource_spans=[trace_pb2.ResourceSpans(
                resource=resource_pb2.Resource(attributes=[common_pb2.KeyValue(
                    key=sc.SERVICE_INSTANCE_ID, value=_value(f"replica-{i}"))]),
                scope_spans=[trace_pb2.ScopeSpans(spans=[llm_request(f"r{i}", 1000 + i, t0)])]) for i in range(256)])
            r = client.post(url, content=body.SerializeToString(), headers={"Content-Type": PROTOBUF})
            assert r.status_code == 200
            partial = trace_service_pb2.ExportTraceServiceResponse.FromString(r.content).partial_success
            assert partial.rejected_spans == 256 - 8 and "--max-instances" in partial.error_message
            # eight more instances at most: a writer and a flush thread each, never one per process named
            assert _proc_status(proc.pid, "Threads") <= threads + 8 * 2
            assert _num_fds(proc.pid) <= fds + 8 * 8
        stop(proc)
    run = open_run(tmp_path, "otlp")
    keys = {r[col.REQUEST_KEY] for r in run.table(REQUESTS.name).to_pylist()}
    assert keys == {"warm"} | {f"r{i}" for i in range(8)}
    assert run.counters()[SPANS_REJECTED] == 256 - 8


def test_children_waiting_for_their_root_are_bounded_in_bytes():
    from instrument.otlp_decode import OtlpSpan
    from instrument.otlp_requests import MAX_PENDING_BYTES, TraceBook, span_bytes

    book = TraceBook()
    big = [OtlpSpan("vllm_queue", f"{i:032x}", f"{i:016x}", 1, 2, {"payload": "p" * (20 << 20)}) for i in range(10)]
    for span in big:  # ten 20 MB children whose roots never come
        book.hold(span.trace_id, span)
    held = [s for s in big if book.take(s.trace_id)]
    assert sum(span_bytes(s) for s in held) <= MAX_PENDING_BYTES
    assert book.dropped == len(big) - len(held) >= 10 - MAX_PENDING_BYTES // (20 << 20)
    small = OtlpSpan("vllm_queue", "f" * 32, "f" * 16, 1, 2, {"k": "v"})
    book.hold(small.trace_id, small)  # the bound leaves room for ordinary spans
    assert book.take(small.trace_id) == [small]


def test_one_big_export_does_not_hold_up_another_clients_small_one(tmp_path):
    t0 = now_ns() // 1000 * 1000
    n = 50_000
    big = export([llm_request(f"big-{i}", 10_000 + i, t0) for i in range(n)])
    small = export([llm_request("small", 7, t0)])
    done: list[str] = []
    with receiver(tmp_path) as (proc, (url,)):
        def post(name: str, body: bytes) -> None:
            r = httpx.post(url, content=body, headers={"Content-Type": PROTOBUF}, timeout=240)
            assert r.status_code == 200
            done.append(name)

        big_client = threading.Thread(target=post, args=("big", big))
        big_client.start()
        time.sleep(1.0)  # the big body is in: the receiver is decoding and mapping it
        post("small", small)
        big_client.join(240)
        stop(proc)
    assert done == ["small", "big"], done  # answered while the big one was still being mapped
    run = open_run(tmp_path, "otlp")
    assert run.table(REQUESTS.name).num_rows == n + 1, {k: v for k, v in run.counters().items() if v}


@pytest.mark.parametrize(
    ("memory_cap_bytes", "num_requests", "tokens_per_request"),
    [
        (64 << 20, None, 0),  # the default cap: more request rows than it holds at once
        (1 << 20, None, 0),  # a small cap: its requests table holds a few hundred rows
        (4 << 20, 12, 2_500),  # long per-token arrays: one slice's token rows are several times the table's
        (1 << 20, 3, 9_000),  # one request's per-token array alone is longer than its table holds
    ],
    ids=["default-cap", "small-cap", "long-token-arrays", "one-request-over-the-table"],
)
def test_a_big_export_is_written_out_as_it_goes_never_dropped_over_the_recorders_cap(memory_cap_bytes, num_requests,
                                                                                    tokens_per_request):
    from instrument.otlp_ingest import OtlpIngestor
    from tokentrace.clock import Anchor
    from tokentrace.recorder import BufferedRecorder
    from tokentrace.recorder.sink import InMemorySink

    sink = InMemorySink()
    # A flush thread that never writes on its own: only the ingest path's writes keep the recorder under its cap.
    rec = BufferedRecorder(sink, instance_id=3, memory_cap_bytes=memory_cap_bytes, flush_interval_s=3600.0)
    requests_capacity = rec.headroom()[REQUESTS.name][1]
    tokens_capacity = rec.headroom()[TOKENS.name][1]
    n = num_requests or 2 * requests_capacity + 1
    assert n * max(tokens_per_request, 1) > min(requests_capacity, tokens_capacity)
    t0 = now_ns() // 1000 * 1000
    extra = {sc.GEN_AI_LATENCY_PER_TOKEN_GENERATION_TIME: [0.02 + i * 1e-5 for i in range(tokens_per_request)],
             sc.GEN_AI_USAGE_COMPLETION_TOKENS: tokens_per_request} if tokens_per_request else {}
    body = export([llm_request(f"big-{i}", 10_000 + i, t0, **extra) for i in range(n)])
    try:
        done = OtlpIngestor(rec, anchor=Anchor(mono_ns=time.monotonic_ns(), wall_ns=time.time_ns())).ingest(body, PROTOBUF)
        assert done.num_mapped == n
        assert rec.counters["dropped"] == 0, {k: v for k, v in rec.counters.items() if v}
    finally:
        rec.close()
    assert sink.table(REQUESTS.name).num_rows == n
    if tokens_per_request:
        assert sink.table(TOKENS.name).num_rows == n * tokens_per_request