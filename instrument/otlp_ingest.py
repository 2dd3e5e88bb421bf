"""OTLP trace receiver: vLLM (or any OTLP source) spans -> a tokentrace store.

:class:`OtlpIngestor` takes ``ExportTraceServiceRequest`` bodies (protobuf or
JSON, ``instrument.otlp_decode``) and records what they say; :func:`create_app`
is its Starlette app answering ``POST /v1/traces``. ``tokentrace ingest-otlp``
serves it (:func:`instrument.otlp_server.serve_otlp`), with OTLP/gRPC's
``TraceService/Export`` beside it (``instrument.otlp_grpc``), both into one run.
A malformed body gets HTTP 400 with a ``google.rpc.Status`` message (gRPC:
``INVALID_ARGUMENT``) and the receiver keeps serving.

Mapping of vLLM's ``llm_request`` span (:class:`LlmRequestMapper`)
------------------------------------------------------------------
vLLM reports, per finished request, one span starting at the request's
arrival with latencies in seconds. Times are placed on one timeline from the
arrival ``A`` (the span's start):

* first token ``F = A + time_to_first_token``; finish ``E = A + e2e`` (else
  the span's end);
* ``prefill.compute`` (token 0) = ``[F - time_in_model_prefill, F)``;
* ``schedule.queue`` (token 0) = the ``time_in_queue`` just before it;
  both are clamped to start no earlier than ``A``. What is left of token 0's
  interval, ``[A, queue start)``, stays unattributed: vLLM does not say how it
  splits into tokenization, routing and IPC;
* ``decode.compute`` (request-level, token ``-1``) = ``[F, F + time_in_model_decode)``
  clipped to ``E``: vLLM gives one decode total, not per-token intervals;
* without ``time_to_first_token``, queue then prefill are laid from ``A``
  and ``F`` is the end of prefill (if prefill is known);
* a ``tokens`` row for token 0 with ``emit_ns = F`` (later tokens' times are
  not reported, so no row is invented for them);
* the ``requests`` row: key ``gen_ai.request.id`` (else the span id), trace id,
  arrival ``A``, first token ``F``, finish ``E``, prompt and output tokens
  (``gen_ai.usage.prompt_tokens`` / ``completion_tokens``, or the newer
  ``input_tokens`` / ``output_tokens``), status ``error`` if the span's
  status is ERROR.

Clocks: spans carry Unix (wall-clock) nanoseconds; each is mapped onto this
process's monotonic clock with the anchor of its ``instances`` row
(``tokentrace.clock.Anchor.to_mono_ns``: ``mono = unix - wall_anchor + mono_anchor``). This assumes the sender's wall
clock agrees with the receiver's (same host, or NTP-synchronized hosts: the
error is their wall-clock difference). Durations inside one span are exact.

Other spans are counted (``otlp_spans_ignored``) and otherwise ignored;
mapped ones are counted as ``otlp_spans_mapped``, rejected payloads as
``otlp_payloads_rejected``; the counters reach the run manifest.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Mapping

from instrument import semconv as sc
from instrument.otlp_decode import (
    JSON,
    PROTOBUF,
    OtlpSpan,
    PayloadError,
    decode_request,
    decompress,
    error_body,
    response_body,
)
from tokentrace.clock import Anchor
from tokentrace.recorder import CounterSink, Recorder
from tokentrace.schema import RequestStatus, Stage, request_id_of

_log = logging.getLogger("tokentrace")

__all__ = ["LlmRequestMapper", "OtlpIngestor", "create_app", "listen_error",
           "SPANS_MAPPED", "SPANS_IGNORED", "PAYLOADS_REJECTED", "MAX_BODY_BYTES"]

SPANS_MAPPED = "otlp_spans_mapped"
SPANS_IGNORED = "otlp_spans_ignored"
PAYLOADS_REJECTED = "otlp_payloads_rejected"
MAX_BODY_BYTES = 64 << 20
"""Largest request body accepted, after decompression (bytes); larger ones get 413."""
_COUNTERS_INTERVAL_S = 1.0  # longest time between counter pushes while receiving


def _ns(attrs: Mapping[str, Any], key: str) -> int | None:
    """A latency attribute in seconds as non-negative integer ns, or None if absent or not a number."""
    v = attrs.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        return None
    return max(0, round(v * 1e9))


def _count(attrs: Mapping[str, Any], *keys: str) -> int:
    for key in keys:
        v = attrs.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return v
    return -1


class LlmRequestMapper:
    """Turns ``llm_request`` spans into recorder rows (see the module docstring).

    ``anchor``: the recorder's instance anchor, used to map Unix ns onto its
    monotonic clock. Any thread; never raises for odd attribute values (they
    count as absent).
    """

    def __init__(self, recorder: Recorder, anchor: Anchor) -> None:
        self._rec = recorder
        self._anchor = anchor

    def map(self, span: OtlpSpan) -> bool:
        """Record ``span`` if it is an ``llm_request``; True if it was mapped."""
        if span.name != sc.LLM_REQUEST_SPAN:
            return False
        a = span.attributes
        arrival = self._anchor.to_mono_ns(span.start_unix_ns)
        ttft, e2e = _ns(a, sc.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN), _ns(a, sc.GEN_AI_LATENCY_E2E)
        queue, prefill = _ns(a, sc.GEN_AI_LATENCY_TIME_IN_QUEUE), _ns(a, sc.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL)
        decode = _ns(a, sc.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE)
        finish = arrival + e2e if e2e is not None else max(arrival, self._anchor.to_mono_ns(span.end_unix_ns))
        key = a.get(sc.GEN_AI_REQUEST_ID)
        key = str(key) if isinstance(key, (str, int)) and str(key) else span.span_id
        rid = request_id_of(key)
        first = self._token0_stages(rid, arrival, ttft, queue, prefill)
        rec = self._rec
        if decode is not None and first is not None and min(first + decode, finish) > first:
            rec.span(rid, Stage.DECODE_COMPUTE, first, min(first + decode, finish), -1)
        if first is not None:
            rec.token(rid, 0, emit_ns=first)
        rec.request_begin(key, arrival_ns=arrival, trace_id=span.trace_id if any(span.trace_id.strip("0")) else "",
                          num_prompt_tokens=_count(a, sc.GEN_AI_USAGE_PROMPT_TOKENS, sc.GEN_AI_USAGE_INPUT_TOKENS))
        error = ""
        if span.is_error:
            kind = a.get(sc.ERROR_TYPE)
            error = str(kind)[:64] if isinstance(kind, str) and kind else "span_error"
        rec.request_end(rid, finish_ns=finish, first_token_ns=-1 if first is None else first,
                        status=RequestStatus.ERROR if span.is_error else RequestStatus.OK,
                        num_output_tokens=_count(a, sc.GEN_AI_USAGE_COMPLETION_TOKENS, sc.GEN_AI_USAGE_OUTPUT_TOKENS),
                        error=error)
        return True

    def _token0_stages(self, rid: int, arrival: int, ttft: int | None, queue: int | None,
                       prefill: int | None) -> int | None:
        """Record queue and prefill (token 0); returns the first token's time, None if unknown."""
        if ttft is not None:
            first = arrival + ttft
            prefill_start = max(arrival, first - (prefill or 0))
            queue_start = max(arrival, prefill_start - (queue or 0))
        else:
            queue_start = arrival
            prefill_start = arrival + (queue or 0)
            first = prefill_start + prefill if prefill is not None else None
        if queue is not None and prefill_start > queue_start:
            self._rec.span(rid, Stage.SCHEDULE_QUEUE, queue_start, prefill_start, 0)
        if prefill is not None and first is not None and first > prefill_start:
            self._rec.span(rid, Stage.PREFILL_COMPUTE, prefill_start, first, 0)
        return first


class OtlpIngestor:
    """The receiver's state: recorder, mapper and counters.

    Any thread: the HTTP receiver calls it on its event loop, the gRPC receiver on its
    worker threads. A lock keeps the counters exact and one payload's rows together.
    """

    def __init__(self, recorder: Recorder, *, anchor: Anchor, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.recorder = recorder
        self.mapper = LlmRequestMapper(recorder, anchor)
        self.max_body_bytes = max_body_bytes
        self.counts = {SPANS_MAPPED: 0, SPANS_IGNORED: 0, PAYLOADS_REJECTED: 0}
        self._pushed_at = 0.0
        self._push_warned = False  # a failed counter push is logged once
        self._lock = threading.Lock()

    def ingest(self, body: bytes, content_type: str, content_encoding: str = "") -> int:
        """Decode and map one payload; returns the spans mapped. Raises ``PayloadError``."""
        try:
            spans = decode_request(decompress(body, content_encoding, max_bytes=self.max_body_bytes),
                                   content_type)
        except PayloadError:
            with self._lock:
                self.counts[PAYLOADS_REJECTED] += 1
            raise
        with self._lock:
            mapped = sum(1 for s in spans if self.mapper.map(s))
            self.counts[SPANS_MAPPED] += mapped
            self.counts[SPANS_IGNORED] += len(spans) - mapped
        return mapped

    def push_counters(self, *, force: bool = False) -> None:
        """Send the counters to the store's manifest (blocks on the file write); never raises."""
        with self._lock:
            now = time.monotonic()
            if not force and now - self._pushed_at < _COUNTERS_INTERVAL_S:
                return
            self._pushed_at = now
            counts = dict(self.counts)
        sink = self.recorder.sink
        if isinstance(sink, CounterSink):
            try:
                sink.update_counters(counts)
            except Exception as err:  # retried at the next push; said once
                if not self._push_warned:
                    self._push_warned = True
                    _log.warning("tokentrace: could not write ingest counters to the manifest (%s); will retry", err)

    def close(self) -> None:
        """Flush everything to the store and close it."""
        self.recorder.flush()
        self.push_counters(force=True)
        self.recorder.close()


def create_app(ingestor: OtlpIngestor) -> Any:
    """The Starlette app: ``POST /v1/traces`` (protobuf or JSON)."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def traces(request: Request) -> Response:
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        reply = media if media in (PROTOBUF, JSON) else JSON
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > ingestor.max_body_bytes:
            return _error(reply, f"body of {length} bytes is over the limit of {ingestor.max_body_bytes}", 413)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > ingestor.max_body_bytes:
                return _error(reply, f"body is over the limit of {ingestor.max_body_bytes} bytes", 413)
        try:
            ingestor.ingest(bytes(body), request.headers.get("content-type", ""),
                            request.headers.get("content-encoding", ""))
        except PayloadError as e:
            status = 415 if str(e).startswith("unsupported Content-Type") else 400
            return _error(reply, str(e), status)
        await run_in_threadpool(ingestor.push_counters)
        return Response(response_body(reply), media_type=reply)

    return Starlette(routes=[Route("/v1/traces", traces, methods=["POST"])])


def _error(media: str, message: str, status: int) -> Any:
    from starlette.responses import Response

    body, content_type = error_body(media, message)
    return Response(body, status_code=status, media_type=content_type)


def listen_error(err: OSError, protocol: str, address: str) -> OSError:
    """``err`` from binding ``address`` as one sentence naming the protocol and address."""
    reason = os.strerror(err.errno) if err.errno else str(err)
    return OSError(err.errno, f"cannot listen for {protocol} on {address}: {reason}")
