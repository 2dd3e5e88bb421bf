"""Export a store run to OpenTelemetry: one span tree per request.

``export_run_to_otel(run, exporter)`` reads a run (``tokentrace.open(...)``)
and hands every request to an OpenTelemetry ``SpanExporter`` (the OTLP/HTTP
or gRPC exporters, the console exporter, the SDK's ``InMemorySpanExporter``)
as finished spans, without a tracer provider and without touching the global
OpenTelemetry state. :func:`otlp_exporter` builds the OTLP/HTTP exporter for
an endpoint.

The tree of one request
-----------------------
* ``llm_request`` (kind SERVER): ``[arrival, finish]``; attributes: GenAI
  semantic conventions (``gen_ai.request.id`` = the request key,
  ``gen_ai.usage.input_tokens`` / ``output_tokens`` /
  ``cache_read_input_tokens``, ``gen_ai.server.time_to_first_token`` and
  ``gen_ai.server.request.duration`` in seconds), vLLM's latency names
  (``gen_ai.latency.time_in_queue`` = sum of ``schedule.queue``,
  ``time_in_model_prefill`` = sum of ``prefill.compute``,
  ``time_in_model_decode`` = sum of ``decode.compute``, ``decode.draft`` and ``decode.verify``,
  ``time_to_first_token``, ``e2e``; so ``tokentrace ingest-otlp`` reads our export back) and ours
  (tenant, SLO class, status). Status ERROR with ``error.type`` unless ``ok``.
* one child span (kind INTERNAL) per stage interval of the ``spans`` table,
  named by the stage label (``prefill.compute``), with the token index,
  engine step, instance, bytes, tier and batch size as attributes
  (``include_token_stages=False`` keeps only request-level intervals);
* optionally (``token_events=True``, the lossless form ``tokentrace export --format otlp``
  sends) one ``tokentrace.token`` event per time of every ``tokens`` row (``tokentrace.token_time``:
  ``emit``, ``sent`` or ``recv``; its instance and step), one ``tokentrace.request`` event per
  ``requests`` row (every instance's view of the request), and first one zero-length
  ``tokentrace.instance`` span per instance, so that an instance with no stage span (a load
  generator) is known to the receiver before its rows come. ``tokentrace ingest-otlp``
  (:mod:`instrument.otlp_mapping`) reproduces the run from these.

Every span's resource is its instance's: ``service.name``, ``host.name``, ``process.pid``,
``tokentrace.run_id``, ``tokentrace.instance_id``, ``tokentrace.instance_name`` and
``tokentrace.instance_role``; the request span's is the server instance the request arrived at.

Ids and times
-------------
The trace id is the request's own W3C trace id (``requests.otel_trace_id``,
from the ``traceparent`` the request came with) when it has one, so the tree
joins the caller's trace; otherwise it is derived from (run id, request id).
Span ids are derived from the trace id and the span's position: exporting a
run twice produces the same ids. Times: each instance's monotonic times are
moved onto the run's reference clock (``instances.clock_offset_ns``), then to
Unix time with the wall-clock anchor of the reference instance (the first
with offset 0); a run without ``instances`` rows uses the exporting process's
own anchor (right for a run recorded on this host since its last boot).

Live export is deliberately not a sink wrapper: a request's rows reach the
sink over several flushes, so a live tree would need an unbounded buffer or
broken trees. Export finished runs (or a run periodically) instead.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import pyarrow as pa
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from instrument import semconv as sc
from tokentrace.clock import RunClocks, latest_instances
from tokentrace.schema import INSTANCES, REQUESTS, SPANS, TOKENS, RequestStatus, Role, Stage, Tier, col

__all__ = ["ExportSummary", "RequestTree", "TokenTime", "export_run_to_otel", "build_request_spans", "otlp_exporter"]

# requests count column -> the span attributes that carry it
_COUNTS = {
    col.NUM_PROMPT_TOKENS: (sc.GEN_AI_USAGE_INPUT_TOKENS, sc.GEN_AI_USAGE_PROMPT_TOKENS),
    col.NUM_OUTPUT_TOKENS: (sc.GEN_AI_USAGE_OUTPUT_TOKENS, sc.GEN_AI_USAGE_COMPLETION_TOKENS),
    col.NUM_CACHED_TOKENS: (sc.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS,),
}
_SCOPE = InstrumentationScope("tokentrace.tokentrace.app.export.otlp", "1")
_NS_PER_S = 1e9


@dataclass(frozen=True, slots=True)
class ExportSummary:
    """What :func:`export_run_to_otel` did."""

    num_requests: int
    num_spans: int
    num_failed_batches: int


@dataclass(slots=True)
class RequestTree:
    """One request's facts, merged over the instances that saw it (reference clock, ns)."""

    request_id: int
    key: str = ""
    tenant: str = ""
    slo_class: str = ""
    session: str = ""
    session_turn: int | None = None
    trace_id: str = ""
    arrival_ns: int | None = None
    first_token_ns: int | None = None
    finish_ns: int | None = None
    counts: dict[str, int] = field(default_factory=dict)
    """Prompt, output and cached token counts by their ``requests`` column name (largest seen)."""
    status: int = RequestStatus.OK
    error: str = ""
    first_content_ns: int | None = None
    instance_id: int | None = None
    """The instance of the request's earliest-arriving server row: the resource of its ``llm_request`` span."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    """Its ``requests`` rows, times on the reference clock (one ``tokentrace.request`` event each)."""


def _rows(t: pa.Table) -> list[dict[str, Any]]:
    return t.to_pylist()


def _merge(tree: RequestTree, row: dict[str, Any], shift: int) -> None:
    def first_str(old: str, new: str | None) -> str:
        return old or (new or "")

    def lo(old: int | None, new: int | None) -> int | None:
        return old if new is None else (new + shift if old is None else min(old, new + shift))

    tree.key = first_str(tree.key, row[col.REQUEST_KEY])
    tree.tenant = first_str(tree.tenant, row[col.TENANT])
    tree.slo_class = first_str(tree.slo_class, row[col.SLO_CLASS])
    tree.session = first_str(tree.session, row.get(col.SESSION))
    if tree.session_turn is None:
        tree.session_turn = row.get(col.SESSION_TURN)
    tree.trace_id = first_str(tree.trace_id, row[col.TRACE_ID])
    tree.rows.append({**row, **{c: (row[c] + shift if row[c] is not None else None) for c in _ROW_TIMES}})
    tree.arrival_ns = lo(tree.arrival_ns, row[col.ARRIVAL_NS])
    tree.first_content_ns = lo(tree.first_content_ns, row.get(col.FIRST_CONTENT_NS))
    tree.first_token_ns = lo(tree.first_token_ns, row[col.FIRST_TOKEN_NS])
    if row[col.FINISH_NS] is not None:
        f = row[col.FINISH_NS] + shift
        tree.finish_ns = f if tree.finish_ns is None else max(tree.finish_ns, f)
    for column in _COUNTS:
        v = row[column]
        if v is not None and v >= 0:
            tree.counts[column] = max(tree.counts.get(column, v), v)
    if row[col.STATUS] is not None and row[col.STATUS] > tree.status:
        tree.status, tree.error = row[col.STATUS], row[col.ERROR] or ""


_ROW_TIMES = (col.ARRIVAL_NS, col.FIRST_TOKEN_NS, col.FIRST_CONTENT_NS, col.FINISH_NS)
_ROW_TIME_KEYS = {col.ARRIVAL_NS: sc.TT_ARRIVAL_UNIX_NS, col.FIRST_TOKEN_NS: sc.TT_FIRST_TOKEN_UNIX_NS,
                  col.FIRST_CONTENT_NS: sc.TT_FIRST_CONTENT_UNIX_NS, col.FINISH_NS: sc.TT_FINISH_UNIX_NS}


def _root_instance(tree: RequestTree, roles: Mapping[int, int]) -> int | None:
    """The instance of the earliest-arriving row of a server process (a client's send comes first)."""
    server = [r for r in tree.rows if roles.get(r[col.INSTANCE_ID]) != Role.CLIENT] or tree.rows
    timed = [r for r in server if r[col.ARRIVAL_NS] is not None]
    best = min(timed, key=lambda r: r[col.ARRIVAL_NS]) if timed else (server[0] if server else None)
    return None if best is None else best[col.INSTANCE_ID]


def _request_event(row: dict[str, Any], to_wall: int) -> Event:
    """One ``requests`` row as an event on the request span (its time: the row's arrival, else finish)."""
    attrs: dict[str, Any] = {sc.TT_INSTANCE_ID: row[col.INSTANCE_ID], sc.TT_STATUS: RequestStatus(row[col.STATUS]).label}
    for column, key in _ROW_TIME_KEYS.items():
        if row[column] is not None:
            attrs[key] = row[column] + to_wall
    for key, column in ((sc.TT_TENANT, col.TENANT), (sc.TT_SLO_CLASS, col.SLO_CLASS), (sc.ERROR_TYPE, col.ERROR),
                        (sc.TT_SESSION, col.SESSION)):
        if row.get(column):
            attrs[key] = row[column]
    if row.get(col.SESSION_TURN) is not None:
        attrs[sc.TT_SESSION_TURN] = row[col.SESSION_TURN]
    for column, keys in _COUNTS.items():
        if row[column] is not None and row[column] >= 0:
            attrs[keys[0]] = row[column]
    t = row[col.ARRIVAL_NS] if row[col.ARRIVAL_NS] is not None else row[col.FINISH_NS]
    return Event(sc.TT_REQUEST_EVENT, attrs, timestamp=(t or 0) + to_wall)


def _ids(run_id: str, tree: RequestTree) -> int:
    if len(tree.trace_id) == 32:
        try:
            value = int(tree.trace_id, 16)
            if value:
                return value
        except ValueError:
            pass
    digest = hashlib.blake2b(f"{run_id}/{tree.request_id}".encode(), digest_size=16).digest()
    return int.from_bytes(digest, "big") or 1


def _span_id(trace_id: int, n: int) -> int:
    digest = hashlib.blake2b(trace_id.to_bytes(16, "big") + n.to_bytes(8, "big"), digest_size=8).digest()
    return int.from_bytes(digest, "big") or 1


def _ctx(trace_id: int, span_id: int) -> SpanContext:
    return SpanContext(trace_id, span_id, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))


def _stage_attributes(row: dict[str, Any]) -> dict[str, Any]:
    stage = Stage(row[col.STAGE])
    attrs: dict[str, Any] = {sc.TT_STAGE: stage.label, sc.TT_TOKEN_INDEX: row[col.TOKEN_INDEX],
                             sc.TT_INSTANCE_ID: row[col.INSTANCE_ID]}
    for key, column in ((sc.TT_ENGINE_STEP, col.STEP), (sc.TT_BYTES, col.NUM_BYTES),
                        (sc.TT_BATCH_SIZE, col.BATCH_SIZE)):
        if row[column] is not None and row[column] >= 0:
            attrs[key] = row[column]
    if row[col.TIER] is not None and row[col.TIER] >= 0:
        attrs[sc.TT_KV_TIER] = Tier(row[col.TIER]).label
    return attrs


def _request_attributes(tree: RequestTree, stage_sums: dict[Stage, int], first_ns: int | None,
                        end_ns: int, to_wall: int = 0) -> dict[str, Any]:
    attrs: dict[str, Any] = {sc.GEN_AI_SYSTEM: "tokentrace", sc.GEN_AI_REQUEST_ID: tree.key,
                             sc.TT_STATUS: RequestStatus(tree.status).label}
    if tree.first_content_ns is not None:
        attrs[sc.TT_FIRST_CONTENT_UNIX_NS] = tree.first_content_ns + to_wall
    for key, value in ((sc.TT_TENANT, tree.tenant), (sc.TT_SLO_CLASS, tree.slo_class), (sc.TT_SESSION, tree.session)):
        if value:
            attrs[key] = value
    if tree.session_turn is not None:
        attrs[sc.TT_SESSION_TURN] = tree.session_turn
    for column, keys in _COUNTS.items():
        if column in tree.counts:
            for key in keys:
                attrs[key] = tree.counts[column]
    if tree.arrival_ns is not None:
        if first_ns is not None:
            ttft = (first_ns - tree.arrival_ns) / _NS_PER_S
            attrs[sc.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN] = attrs[sc.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = ttft
        e2e = (end_ns - tree.arrival_ns) / _NS_PER_S
        attrs[sc.GEN_AI_SERVER_REQUEST_DURATION] = attrs[sc.GEN_AI_LATENCY_E2E] = e2e
    # the model's decode time: plain decode steps, and a speculative step's draft and verify phases
    for key, stages in ((sc.GEN_AI_LATENCY_TIME_IN_QUEUE, (Stage.SCHEDULE_QUEUE,)),
                        (sc.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL, (Stage.PREFILL_COMPUTE,)),
                        (sc.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE,
                         (Stage.DECODE_COMPUTE, Stage.DECODE_DRAFT, Stage.DECODE_VERIFY))):
        if any(stage in stage_sums for stage in stages):
            attrs[key] = sum(stage_sums.get(stage, 0) for stage in stages) / _NS_PER_S
    if tree.status != RequestStatus.OK:
        attrs[sc.ERROR_TYPE] = tree.error or RequestStatus(tree.status).label
    return attrs


def build_request_spans(tree: RequestTree, stage_rows: Sequence[dict[str, Any]],
                        token_times: Sequence[tuple[int, int]], *, run_id: str, to_wall: int,
                        resource: Resource, token_events: bool = False,
                        resources: Mapping[int, Resource] | None = None,
                        token_rows: Sequence[TokenTime] = ()) -> list[ReadableSpan]:
    """The finished spans of one request: the request span first, then its stage spans.

    ``stage_rows``: its ``spans`` rows (reference clock, ns); ``token_times``:
    (token index, delivery time) pairs (reference clock, ns); ``to_wall``:
    add to a reference-clock time to get Unix ns. ``resources``: the resource of each
    instance (each span gets its instance's; ``resource`` otherwise). ``token_rows``: the
    token events to attach (every ``tokens`` time, one event each) when ``token_events``;
    without them, one event per token at its delivery time.
    """
    resources = resources or {}
    trace_id = _ids(run_id, tree)
    root = _ctx(trace_id, _span_id(trace_id, 0))
    starts = [r[col.START_NS] for r in stage_rows]
    ends = [r[col.END_NS] for r in stage_rows]
    begin = min([t for t in [tree.arrival_ns, *starts] if t is not None], default=None)
    end = max([t for t in [tree.finish_ns, *ends, *(t for _, t in token_times)] if t is not None], default=begin)
    if begin is None or end is None:
        return []
    first_ns = min((t for _, t in token_times), default=tree.first_token_ns)
    sums: dict[Stage, int] = defaultdict(int)
    children = []
    for n, row in enumerate(stage_rows, start=1):
        sums[Stage(row[col.STAGE])] += row[col.END_NS] - row[col.START_NS]
        children.append(ReadableSpan(
            Stage(row[col.STAGE]).label, _ctx(trace_id, _span_id(trace_id, n)), root,
            resources.get(row[col.INSTANCE_ID], resource),
            _stage_attributes(row), kind=SpanKind.INTERNAL, start_time=row[col.START_NS] + to_wall,
            end_time=row[col.END_NS] + to_wall, instrumentation_scope=_SCOPE))
    if token_events and token_rows:
        events = [Event(sc.TOKEN_EVENT, _token_attributes(r), timestamp=r.time_ns + to_wall) for r in token_rows]
        events += [_request_event(row, to_wall) for row in tree.rows]
    elif token_events:
        events = [Event(sc.TOKEN_EVENT, {sc.TT_TOKEN_INDEX: i}, timestamp=t + to_wall) for i, t in token_times]
    else:
        events = []
    status = Status(StatusCode.UNSET) if tree.status == RequestStatus.OK else \
        Status(StatusCode.ERROR, tree.error or RequestStatus(tree.status).label)
    request = ReadableSpan(sc.LLM_REQUEST_SPAN, root, None, resources.get(tree.instance_id, resource),
                           _request_attributes(tree, sums, first_ns, end, to_wall), events, kind=SpanKind.SERVER,
                           status=status, start_time=begin + to_wall, end_time=end + to_wall,
                           instrumentation_scope=_SCOPE)
    return [request, *children]


@dataclass(frozen=True, slots=True)
class TokenTime:
    """One time of one ``tokens`` row (reference clock, ns): which column, which instance."""

    index: int
    kind: str  # "emit", "sent" or "recv"
    time_ns: int
    instance_id: int
    step: int | None


def _token_attributes(r: TokenTime) -> dict[str, Any]:
    attrs: dict[str, Any] = {sc.TT_TOKEN_INDEX: r.index, sc.TT_TOKEN_TIME: r.kind, sc.TT_INSTANCE_ID: r.instance_id}
    if r.step is not None and r.step >= 0:
        attrs[sc.TT_ENGINE_STEP] = r.step
    return attrs


def _token_rows(tokens: pa.Table, clocks: RunClocks) -> dict[int, list[TokenTime]]:
    """request id -> every time of its ``tokens`` rows, in (index, time) order (reference clock)."""
    out: dict[int, list[TokenTime]] = defaultdict(list)
    for row in _rows(tokens):
        shift = clocks.offset(row[col.INSTANCE_ID])
        for kind, column in (("emit", col.EMIT_NS), ("sent", col.SENT_NS), ("recv", col.RECV_NS)):
            if row[column] is not None:
                out[row[col.REQUEST_ID]].append(TokenTime(row[col.TOKEN_INDEX], kind, row[column] + shift,
                                                          row[col.INSTANCE_ID], row[col.STEP]))
    for rows in out.values():
        rows.sort(key=lambda r: (r.index, r.time_ns))
    return out


def _instance_resources(instances: pa.Table, *, service_name: str, run_id: str) -> dict[int, Resource]:
    """A resource per instance (latest row wins): role, name, host and pid as resource attributes."""
    out: dict[int, Resource] = {}
    for row in _rows(latest_instances(instances)):
        out[row[col.INSTANCE_ID]] = Resource.create({
            sc.SERVICE_NAME: service_name, sc.TT_RUN_ID: run_id, sc.TT_INSTANCE_ID: row[col.INSTANCE_ID],
            sc.TT_INSTANCE_NAME: row[col.NAME] or f"instance-{row[col.INSTANCE_ID]}",
            sc.TT_INSTANCE_ROLE: Role(row[col.ROLE]).label, sc.HOST_NAME: row[col.HOST] or "",
            sc.PROCESS_PID: int(row[col.PID] or 0)})
    return out


def _token_times(tokens: pa.Table, clocks: RunClocks) -> dict[int, dict[int, int]]:
    """request id -> token index -> delivery time (earliest sent, else earliest emit; reference clock)."""
    sent: dict[int, dict[int, int]] = defaultdict(dict)
    emit: dict[int, dict[int, int]] = defaultdict(dict)
    for row in _rows(tokens):
        shift = clocks.offset(row[col.INSTANCE_ID])
        for times, column in ((sent, col.SENT_NS), (emit, col.EMIT_NS)):
            t = row[column]
            if t is not None:
                per = times[row[col.REQUEST_ID]]
                i = row[col.TOKEN_INDEX]
                per[i] = min(per.get(i, t + shift), t + shift)
    return {rid: {**emit.get(rid, {}), **sent.get(rid, {})} for rid in set(sent) | set(emit)}


def _batches(items: Iterable[ReadableSpan], size: int) -> Iterable[list[ReadableSpan]]:
    batch: list[ReadableSpan] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def export_run_to_otel(run: Any, exporter: SpanExporter, *, token_events: bool = False,
                       include_token_stages: bool = True, service_name: str = "tokentrace",
                       batch_size: int = 512) -> ExportSummary:
    """Export every request of ``run`` (a ``tokentrace.store.Run``) to ``exporter``.

    Blocks while the exporter sends; does not shut the exporter down (the
    caller owns it). Requests without any time are skipped. A batch the
    exporter reports as failed is counted, not retried (exporters retry
    themselves). Raises ``ValueError`` if ``batch_size < 1``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    clocks = RunClocks.from_instances(run.table(INSTANCES.name))
    to_wall = clocks.to_wall_ns(0)  # reference clock -> Unix ns is a constant shift
    trees: dict[int, RequestTree] = {}
    for row in _rows(run.table(REQUESTS.name)):
        rid = row[col.REQUEST_ID]
        _merge(trees.setdefault(rid, RequestTree(rid)), row, clocks.offset(row[col.INSTANCE_ID]))
    roles = {r[col.INSTANCE_ID]: r[col.ROLE] for r in _rows(latest_instances(run.table(INSTANCES.name)))}
    for tree in trees.values():
        tree.instance_id = _root_instance(tree, roles)
    stage_rows: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in _rows(run.table(SPANS.name)):
        if not include_token_stages and row[col.TOKEN_INDEX] >= 0:
            continue
        shift = clocks.offset(row[col.INSTANCE_ID])
        row[col.START_NS] += shift
        row[col.END_NS] += shift
        stage_rows[row[col.REQUEST_ID]].append(row)
        trees.setdefault(row[col.REQUEST_ID], RequestTree(row[col.REQUEST_ID]))
    token_table = run.table(TOKENS.name)
    tokens = _token_times(token_table, clocks)
    rows_of = _token_rows(token_table, clocks) if token_events else {}
    resource = Resource.create({sc.SERVICE_NAME: service_name, sc.TT_RUN_ID: run.run_id})
    resources = _instance_resources(run.table(INSTANCES.name), service_name=service_name, run_id=run.run_id)
    num_spans = num_requests = failed = 0

    def spans() -> Iterable[ReadableSpan]:
        nonlocal num_spans, num_requests
        if token_events:  # every instance first, those that own no stage span (a client) included
            start = min((t.arrival_ns for t in trees.values() if t.arrival_ns is not None), default=0) + to_wall
            for iid, res in resources.items():
                trace = _ids(run.run_id, RequestTree(-1 - (iid % (1 << 62))))
                num_spans += 1
                yield ReadableSpan(sc.TT_INSTANCE_SPAN, _ctx(trace, _span_id(trace, 0)), None, res, {},
                                   kind=SpanKind.INTERNAL, start_time=start, end_time=start,
                                   instrumentation_scope=_SCOPE)
        for rid, tree in trees.items():
            rows = sorted(stage_rows.get(rid, []), key=lambda r: (r[col.START_NS], r[col.END_NS]))
            times = sorted(tokens.get(rid, {}).items())
            built = build_request_spans(tree, rows, times, run_id=run.run_id, to_wall=to_wall,
                                        resource=resource, token_events=token_events, resources=resources,
                                        token_rows=rows_of.get(rid, ()))
            num_requests += bool(built)
            num_spans += len(built)
            yield from built

    for batch in _batches(spans(), batch_size):
        if exporter.export(batch) != SpanExportResult.SUCCESS:
            failed += 1
    return ExportSummary(num_requests, num_spans, failed)


def otlp_exporter(endpoint: str, *, timeout_s: float = 10.0) -> SpanExporter:
    """An OTLP/HTTP protobuf span exporter for ``endpoint`` (``http://host:4318/v1/traces``).

    Needs the ``opentelemetry-exporter-otlp-proto-http`` package; raises
    ``ImportError`` naming it when it is missing.
    """
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as e:
        raise ImportError("exporting over OTLP needs: pip install opentelemetry-exporter-otlp-proto-http") from e
    return OTLPSpanExporter(endpoint=endpoint, timeout=timeout_s)
