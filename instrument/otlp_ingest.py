"""OTLP trace receiver: vLLM (or any OTLP source) spans -> a tokentrace store.

:class:`OtlpIngestor` takes ``ExportTraceServiceRequest`` bodies (protobuf or
JSON, ``instrument.otlp_decode``) and records what they say; :func:`create_app`
is its Starlette app answering ``POST /v1/traces``. ``tokentrace ingest-otlp``
serves it (:func:`instrument.otlp_server.serve_otlp`), with OTLP/gRPC's
``TraceService/Export`` beside it (``instrument.otlp_grpc``), both into one run.
A malformed body gets HTTP 400 with a ``google.rpc.Status`` message (gRPC:
``INVALID_ARGUMENT``) and the receiver keeps serving.

Mapping
-------
:class:`~instrument.otlp_mapping.OtlpMapper` maps each emitter's spans (vLLM's
``llm_request`` and request-lifecycle spans, SGLang's request trace, tokentrace's own
export); the table in ``docs/instrument-otel.md`` says what each attribute becomes. Each
traced process named by a span's resource becomes its own instance
(:class:`~instrument.otlp_requests.Replicas`, when a ``replica_factory`` is given).

Clocks: spans carry Unix (wall-clock) nanoseconds; each is mapped onto this
process's monotonic clock with the receiver's anchor
(``tokentrace.clock.Anchor.to_mono_ns``: ``mono = unix - wall_anchor + mono_anchor``). This assumes the sender's wall
clock agrees with the receiver's (same host, or NTP-synchronized hosts: the
error is their wall-clock difference). Durations inside one span are exact.

Other spans are counted (``otlp_spans_ignored``) and otherwise ignored;
mapped ones are counted as ``otlp_spans_mapped``, rejected payloads as
``otlp_payloads_rejected``; the counters reach the run manifest.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

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
from instrument.otlp_mapping import (
    MAX_LATENCY_S,
    SPANS_IGNORED,
    SPANS_MAPPED,
    SPANS_REJECTED,
    SPANS_UNMATCHED,
    OtlpMapper,
)
from instrument.otlp_requests import IngestOptions, InstanceIdentity, Replicas
from tokentrace.clock import Anchor
from tokentrace.recorder import CounterSink, Recorder

_log = logging.getLogger("tokentrace")

__all__ = ["LlmRequestMapper", "OtlpIngestor", "Ingested", "create_app", "listen_error", "ReplicaFactory",
           "SPANS_MAPPED", "SPANS_IGNORED", "SPANS_UNMATCHED", "SPANS_REJECTED", "PAYLOADS_REJECTED", "MAX_BODY_BYTES",
           "MAX_LATENCY_S"]

PAYLOADS_REJECTED = "otlp_payloads_rejected"
MAX_BODY_BYTES = 64 << 20
"""Largest request body accepted, after decompression (bytes); larger ones get 413."""
BODY_TIMEOUT_S = 30.0
"""A request body must arrive within this long of its headers; a slower one gets 408."""
_COUNTERS_INTERVAL_S = 1.0  # longest time between counter pushes while receiving
MAP_SLICE_SPANS = 2_000  # spans mapped per hold of the ingestor's lock (a few ms each)
KEEP_UP_FILL = 0.5  # between two slices of one export, a recorder with a table this full is written out


ReplicaFactory = Callable[[InstanceIdentity], Recorder]
"""Makes the recorder of a newly seen traced process (its own instance in the run)."""


class LlmRequestMapper:
    """One recorder's :class:`~instrument.otlp_mapping.OtlpMapper`, span by span (tests, embedding).

    ``map(span)`` is True when the span was used (a request's root, or a child held for it).
    Any thread; never raises for odd attribute values (they count as absent).
    """

    def __init__(self, recorder: Recorder, anchor: Anchor, options: IngestOptions | None = None) -> None:
        self._mapper = OtlpMapper(Replicas(recorder, None, (options or IngestOptions()).role), anchor, options)

    def map(self, span: OtlpSpan) -> bool:
        return self._mapper.map_spans([span]) > 0


@dataclass(frozen=True, slots=True)
class Ingested:
    """What one payload came to: spans mapped (or held for their request), root spans rejected."""

    num_mapped: int
    num_rejected: int
    reasons: tuple[str, ...] = ()

    @property
    def message(self) -> str:
        """The partial-success message of an export response ("" when nothing was rejected)."""
        if not self.num_rejected:
            return ""
        return f"{self.num_rejected} span(s) rejected ({'; '.join(self.reasons)}); the other spans were stored"


def slices(spans: list[OtlpSpan], size: int) -> Iterator[list[OtlpSpan]]:
    """``spans`` in slices of at most ``size``, every child before any root, so that a root
    finds the children of its payload whichever slice they are in."""
    ordered = sorted(spans, key=OtlpMapper.is_root)  # stable: False (children, others) first
    for i in range(0, len(ordered), size):
        yield ordered[i:i + size]


class OtlpIngestor:
    """The receiver's state: recorder, mapper and counters.

    Any thread: the HTTP receiver calls it on its event loop, the gRPC receiver on its
    worker threads. A lock keeps the counters exact and one payload's rows together.
    """

    def __init__(self, recorder: Recorder, *, anchor: Anchor, max_body_bytes: int = MAX_BODY_BYTES,
                 body_timeout_s: float = BODY_TIMEOUT_S, replica_factory: ReplicaFactory | None = None,
                 options: IngestOptions | None = None) -> None:
        self.recorder = recorder
        options = options or IngestOptions()
        self.replicas = Replicas(recorder, replica_factory, options.role, options.max_instances)
        self.mapper = OtlpMapper(self.replicas, anchor, options)
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.counts = {**self.mapper.counts, PAYLOADS_REJECTED: 0}
        self._pushed_at = 0.0
        self._push_warned = False  # a failed counter push is logged once
        self._lock = threading.Lock()

    def ingest(self, body: bytes, content_type: str, content_encoding: str = "") -> Ingested:
        """Decode and map one payload. Raises ``PayloadError``. Blocks for as long as the
        payload takes (call it off an event loop); other payloads are mapped between its slices."""
        try:
            spans = decode_request(decompress(body, content_encoding, max_bytes=self.max_body_bytes),
                                   content_type)
        except PayloadError:
            with self._lock:
                self.counts[PAYLOADS_REJECTED] += 1
            raise
        mapped = rejected = 0
        reasons: dict[str, None] = {}
        for piece in slices(spans, MAP_SLICE_SPANS):
            with self._lock:
                before = self.mapper.counts[SPANS_REJECTED]
                mapped += self.mapper.map_spans(piece)
                rejected += self.mapper.counts[SPANS_REJECTED] - before
                reasons.update(dict.fromkeys(self.mapper.take_reasons()))
                self.counts.update(self.mapper.counts)
            self._keep_up()
            time.sleep(0)  # let a receiver thread waiting for the lock take it between slices
        return Ingested(mapped, rejected, tuple(reasons))

    def _keep_up(self) -> None:
        """Write out a recorder with a table at least half full (its own share of its own memory cap, in
        rows of that table's size) before mapping on: a big export maps rows faster than a flush thread
        sharing the interpreter writes them, and past its cap a recorder drops rows. The flush is synchronous
        (this thread waits for the sink, outside the lock), so ingest slows down instead of dropping. A slice
        that fills a table anyway (long per-token arrays) is flushed row by row as needed by the mapper's
        :class:`~instrument.otlp_requests.Room`, under the lock."""
        for rec in self.replicas.all():
            headroom = getattr(rec, "headroom", None)  # a forwarding recorder holds nothing
            if callable(headroom) and any(free < capacity * (1 - KEEP_UP_FILL)
                                          for free, capacity in headroom().values()):
                rec.flush()

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
        """Flush everything to the store and close it (every instance's recorder)."""
        with self._lock:
            self.mapper.close()
            self.counts.update(self.mapper.counts)
        recorders = self.replicas.all()
        for rec in recorders:
            rec.flush()
        self.push_counters(force=True)
        for rec in recorders:
            rec.close()


def create_app(ingestor: OtlpIngestor) -> Any:
    """The Starlette app: ``POST /v1/traces`` (protobuf or JSON)."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def traces(request: Request) -> Response:
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        reply = media if media in (PROTOBUF, JSON) else JSON
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > ingestor.max_body_bytes:
            return _error(reply, f"body of {length} bytes is over the limit of {ingestor.max_body_bytes}", 413)
        body = bytearray()
        try:
            async with asyncio.timeout(ingestor.body_timeout_s):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > ingestor.max_body_bytes:
                        return _error(reply, f"body is over the limit of {ingestor.max_body_bytes} bytes", 413)
        except TimeoutError:
            return _error(reply, f"the body did not arrive within {ingestor.body_timeout_s:g} s", 408)
        except ClientDisconnect:
            return Response(status_code=400)  # nobody is left to read it
        try:  # on a worker thread: a big export never holds up the loop (nor other clients' exports)
            done = await run_in_threadpool(ingestor.ingest, bytes(body), request.headers.get("content-type", ""),
                                           request.headers.get("content-encoding", ""))
        except PayloadError as e:
            status = 415 if str(e).startswith("unsupported Content-Type") else 400
            return _error(reply, str(e), status)
        await run_in_threadpool(ingestor.push_counters)
        return Response(response_body(reply, rejected_spans=done.num_rejected, message=done.message),
                        media_type=reply)

    return Starlette(routes=[Route("/v1/traces", traces, methods=["POST"])])


def _error(media: str, message: str, status: int) -> Any:
    from starlette.responses import Response

    body, content_type = error_body(media, message)
    return Response(body, status_code=status, media_type=content_type)


def listen_error(err: OSError, protocol: str, address: str) -> OSError:
    """``err`` from binding ``address`` as one sentence naming the protocol and address."""
    reason = os.strerror(err.errno) if err.errno else str(err)
    return OSError(err.errno, f"cannot listen for {protocol} on {address}: {reason}")
