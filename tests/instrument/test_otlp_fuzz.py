"""Fault and fuzz tests of the OTLP receivers: whatever a sender posts, the answer is a span
list or a ``PayloadError`` (HTTP 4xx, gRPC ``INVALID_ARGUMENT``), never a crash, and the
receiver keeps serving. Bounded: each property runs a fixed number of examples."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from starlette.testclient import TestClient

from instrument import semconv as sc
from instrument.otlp_decode import JSON, PROTOBUF, PayloadError, decode_request
from instrument.otlp_ingest import PAYLOADS_REJECTED, SPANS_MAPPED, LlmRequestMapper, OtlpIngestor, create_app
from tokentrace.clock import Anchor
from tokentrace.recorder import BufferedRecorder
from tokentrace.recorder.sink import InMemorySink
from tokentrace.schema import REQUESTS, SPANS, col

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ANCHOR = Anchor(mono_ns=5_000_000_000, wall_ns=1_700_000_000_000_000_000)
LATENCY_KEYS = (sc.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN, sc.GEN_AI_LATENCY_E2E, sc.GEN_AI_LATENCY_TIME_IN_QUEUE,
                sc.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL, sc.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=25)
# Keys the decoder looks at, so generated documents reach past the first type check.
otlp_keys = st.sampled_from(["resourceSpans", "scopeSpans", "spans", "traceId", "spanId", "parentSpanId",
                             "links", "name", "attributes", "startTimeUnixNano", "endTimeUnixNano", "status"])
otlp_like = st.recursive(
    json_values,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(otlp_keys, inner, max_size=5),
    max_leaves=30)
attr_values = (st.floats() | st.integers(min_value=-(2**63), max_value=2**63 - 1) | st.text(max_size=10)
               | st.booleans() | st.sampled_from([1e300, -1e300, 1e-300, float("inf"), float("nan"), 2**63 - 1]))


def _recorder() -> tuple[BufferedRecorder, InMemorySink]:
    sink = InMemorySink()
    return BufferedRecorder(sink, instance_id=3), sink


def _decode_or_refuse(body: bytes, content_type: str) -> list:
    try:
        return decode_request(body, content_type)
    except PayloadError as err:
        assert str(err)  # one sentence, never empty
        return []


def _pb_span(attrs: dict, start: int, end: int) -> bytes:
    span = trace_pb2.Span(name=sc.LLM_REQUEST_SPAN, trace_id=b"\x01" * 16, span_id=b"\x02" * 8,
                          start_time_unix_nano=start, end_time_unix_nano=end)
    for key, value in attrs.items():
        v = common_pb2.AnyValue()
        if isinstance(value, bool):
            v.bool_value = value
        elif isinstance(value, int):
            v.int_value = value
        elif isinstance(value, float):
            v.double_value = value
        else:
            v.string_value = value
        span.attributes.append(common_pb2.KeyValue(key=key, value=v))
    req = trace_service_pb2.ExportTraceServiceRequest(
        resource_spans=[trace_pb2.ResourceSpans(scope_spans=[trace_pb2.ScopeSpans(spans=[span])])])
    return req.SerializeToString()


# --------------------------------------------------------------------------- decoders


@FUZZ
@given(doc=otlp_like)
def test_any_json_document_decodes_or_is_refused(doc) -> None:
    _decode_or_refuse(json.dumps(doc).encode(), JSON)


@FUZZ
@given(body=st.binary(max_size=300))
def test_any_bytes_decode_or_are_refused(body: bytes) -> None:
    _decode_or_refuse(body, PROTOBUF)
    _decode_or_refuse(body, JSON)


@FUZZ
@given(attrs=st.dictionaries(st.sampled_from(LATENCY_KEYS + (sc.GEN_AI_REQUEST_ID, sc.GEN_AI_USAGE_PROMPT_TOKENS,
                                                            sc.GEN_AI_USAGE_COMPLETION_TOKENS, sc.ERROR_TYPE)),
                             attr_values, max_size=8),
       start=st.integers(min_value=0, max_value=2**64 - 1), length=st.integers(min_value=0, max_value=2**64 - 1),
       flips=st.lists(st.integers(min_value=0, max_value=10_000), max_size=3))
def test_llm_request_spans_with_any_attributes_map_without_raising(attrs, start, length, flips) -> None:
    body = bytearray(_pb_span(attrs, start, min(start + length, 2**64 - 1)))
    for i in flips:  # a few corrupted bytes: still decoded or refused, never a crash
        body[i % len(body)] ^= 0x5A
    rec, sink = _recorder()
    mapper = LlmRequestMapper(rec, ANCHOR)
    for span in _decode_or_refuse(bytes(body), PROTOBUF):
        mapper.map(span)
    rec.close()
    for row in sink.table(SPANS.name).to_pylist():
        assert row[col.START_NS] <= row[col.END_NS]


def test_json_nested_thousands_deep_is_a_payload_error_not_a_recursion_error() -> None:
    for depth in (1_000, 100_000):
        body = b'{"resourceSpans": ' + b"[" * depth + b"]" * depth + b"}"
        with pytest.raises(PayloadError, match="nested too deeply|not valid JSON|must be"):
            decode_request(body, JSON)
        deep_attr = b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "x", "attributes": ' + \
            b'[{"key": "k", "value": ' + b'{"arrayValue": {"values": [' * depth + b"]}}" * depth + b"}]}]}]}]}"
        with pytest.raises(PayloadError):
            decode_request(deep_attr, JSON)


def test_a_latency_of_1e300_seconds_is_read_as_absent() -> None:
    rec, sink = _recorder()
    body = _pb_span({sc.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: 1e300, sc.GEN_AI_LATENCY_E2E: float("inf"),
                     sc.GEN_AI_LATENCY_TIME_IN_QUEUE: -1e300, sc.GEN_AI_REQUEST_ID: "big"},
                    ANCHOR.wall_ns + 1_000, ANCHOR.wall_ns + 5_000)
    (span,) = decode_request(body, PROTOBUF)
    assert LlmRequestMapper(rec, ANCHOR).map(span)
    rec.close()
    (row,) = sink.table(REQUESTS.name).to_pylist()
    assert row[col.FIRST_TOKEN_NS] is None
    assert row[col.FINISH_NS] == ANCHOR.mono_ns + 5_000  # the span's end, e2e being unusable
    assert row[col.ARRIVAL_NS] == ANCHOR.mono_ns + 1_000


# --------------------------------------------------------------------------- receivers


@pytest.fixture(scope="module")
def http_receiver():
    rec, sink = _recorder()
    ingestor = OtlpIngestor(rec, anchor=ANCHOR, max_body_bytes=1 << 16, body_timeout_s=5.0)
    with TestClient(create_app(ingestor), raise_server_exceptions=True) as client:
        yield client, ingestor
    rec.close()


@FUZZ
@given(body=st.one_of(st.binary(max_size=200), otlp_like.map(lambda d: json.dumps(d).encode())),
       content_type=st.sampled_from([PROTOBUF, JSON, "text/plain", "application/json; charset=utf-8", ""]),
       encoding=st.sampled_from(["", "gzip", "deflate", "br", "identity"]))
def test_the_http_receiver_answers_2xx_or_4xx_to_anything(http_receiver, body, content_type, encoding) -> None:
    client, _ = http_receiver
    headers = {"content-type": content_type} | ({"content-encoding": encoding} if encoding else {})
    r = client.post("/v1/traces", content=body, headers=headers)
    assert r.status_code in (200, 400, 413, 415), r.text


def test_the_http_receiver_refuses_deep_json_and_keeps_serving(http_receiver) -> None:
    client, ingestor = http_receiver
    rejected = ingestor.counts[PAYLOADS_REJECTED]
    deep = b'{"resourceSpans": ' + b"[" * 5_000 + b"]" * 5_000 + b"}"
    r = client.post("/v1/traces", content=deep, headers={"content-type": JSON})
    assert r.status_code == 400 and ingestor.counts[PAYLOADS_REJECTED] == rejected + 1
    mapped = ingestor.counts[SPANS_MAPPED]
    ok = client.post("/v1/traces", content=_pb_span({sc.GEN_AI_REQUEST_ID: "after"}, ANCHOR.wall_ns,
                                                    ANCHOR.wall_ns + 10), headers={"content-type": PROTOBUF})
    assert ok.status_code == 200 and ingestor.counts[SPANS_MAPPED] == mapped + 1


def test_the_grpc_receiver_answers_ok_or_invalid_argument_to_anything() -> None:
    grpc = pytest.importorskip("grpc")
    from instrument.otlp_grpc import METHOD, SERVICE, GrpcReceiver

    rec, _ = _recorder()
    ingestor = OtlpIngestor(rec, anchor=ANCHOR)
    receiver = GrpcReceiver("127.0.0.1", 0, max_message_bytes=1 << 16)
    receiver.start(ingestor)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{receiver.port}") as channel:
            export = channel.unary_unary(f"/{SERVICE}/{METHOD}")
            bodies = [b"", b"\xff" * 40, b"\x0a\x05garbage", _pb_span({sc.GEN_AI_LATENCY_E2E: 1e300}, 1, 2),
                      b"\x0a" + b"\x0a\x80\x01" * 200]  # nested length prefixes: deep, truncated
            bodies += [bytes((i * 37 + k) % 256 for k in range(i % 97)) for i in range(60)]
            codes = []
            for body in bodies:
                try:
                    export(body, timeout=30)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as err:
                    codes.append(err.code())
            assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}, codes
            assert grpc.StatusCode.INVALID_ARGUMENT in codes
            export(_pb_span({sc.GEN_AI_REQUEST_ID: "still"}, 1, 2), timeout=30)  # still serving
    finally:
        receiver.stop()
        rec.close()
