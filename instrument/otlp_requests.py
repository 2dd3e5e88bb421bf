"""Requests built from received OTLP spans, and the instances (replicas) that record them.

The emitter mappings (:mod:`instrument.otlp_mapping`) turn a request's spans into one
:class:`RequestBuild` (times already on the receiver's monotonic clock, ns);
:func:`record_request` writes it through the recorder of the instance that served it.
:class:`Replicas` gives each traced process its own instance: its identity comes from the
OTLP resource attributes (``service.name``, ``service.instance.id``, ``host.name``,
``process.pid`` or vLLM's ``vllm.process_id``, and ours from an export), so replicas of one
service stay apart. Stage intervals that belong to no single token (a decode phase, a
preemption) are split at the request's token boundaries, so they reach the per-token
breakdown the way the reference engine's spans do.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from instrument import semconv as sc
from tokentrace.recorder import Recorder
from tokentrace.schema import REQUESTS, SPANS, TOKENS, RequestStatus, Role, cap_label, request_id_of

__all__ = ["IngestOptions", "InstanceIdentity", "Replicas", "StageInterval", "TokenRow", "RequestRow", "RequestBuild",
           "record_request", "split_interval", "Room", "TraceBook", "first_str", "header_attribute", "span_bytes",
           "MAX_INSTANCES", "MAX_PENDING_BYTES"]

MAX_INSTANCES = 64
"""Traced processes one receiver records by default, each its own instance (a writer, a recorder and
its flush thread); spans of more are refused (``ingest-otlp --max-instances`` raises it)."""
MAX_PENDING_BYTES = 64 << 20
"""Bytes (estimated) of child spans held for roots that have not come yet; past it the oldest trace's go."""


def header_attribute(header: str) -> str:
    """The OTel HTTP semantic-convention attribute that carries a request header (``http.request.header.<name>``)."""
    return f"http.request.header.{header.strip().lower()}"


@dataclass(frozen=True, slots=True)
class IngestOptions:
    """What the mappings read beyond the emitters' own conventions."""

    tenant_keys: tuple[str, ...] = (sc.TT_TENANT, header_attribute("X-Tenant"))
    """Span (then resource) attributes holding the tenant, first present wins."""
    slo_class_keys: tuple[str, ...] = (sc.TT_SLO_CLASS, header_attribute("X-SLO-Class"))
    """Likewise for the SLO class."""
    session_keys: tuple[str, ...] = (sc.TT_SESSION, sc.GEN_AI_CONVERSATION_ID, header_attribute("X-Session-Id"))
    """Likewise for the session a request is a turn of (``instrument.sessions``)."""
    session_turn_keys: tuple[str, ...] = (sc.TT_SESSION_TURN, header_attribute("X-Session-Turn"))
    """Attributes holding the turn's number in its session (an int, or digits)."""
    role: Role = Role.COLOCATED
    """Role of instances whose spans do not say theirs."""
    max_instances: int = MAX_INSTANCES
    """Traced processes recorded as instances of their own; spans naming one more are refused."""


def first_str(attrs: Mapping[str, Any], keys: tuple[str, ...], *more: Mapping[str, Any]) -> str:
    """The first non-empty string (or first element of a string array) under ``keys`` in ``attrs``, then ``more``."""
    for source in (attrs, *more):
        for key in keys:
            v = source.get(key)
            if isinstance(v, tuple) and v:
                v = v[0]
            if isinstance(v, str) and v:
                return cap_label(v)
    return ""


@dataclass(frozen=True, slots=True)
class InstanceIdentity:
    """Who a traced process is, from a span's resource."""

    name: str
    host: str
    pid: int
    role: Role

    @classmethod
    def of(cls, resource: Mapping[str, Any], default_role: Role) -> InstanceIdentity | None:
        """The identity a resource names; None when it names no process (no service or instance)."""
        service = first_str(resource, (sc.TT_INSTANCE_NAME, sc.SERVICE_INSTANCE_ID, sc.SERVICE_NAME))
        if not service:
            return None
        pid = resource.get(sc.PROCESS_PID, resource.get(sc.VLLM_PROCESS_ID))
        pid = pid if isinstance(pid, int) and not isinstance(pid, bool) and pid >= 0 else 0
        role = default_role
        label = resource.get(sc.TT_INSTANCE_ROLE)
        if isinstance(label, str):
            try:
                role = Role.from_label(label)
            except ValueError:
                pass
        return cls(service, first_str(resource, (sc.HOST_NAME,)), pid, role)


class Replicas:
    """One recorder per traced process seen, made by ``factory(identity)`` on first sight.

    Spans whose resource names no process go to ``default``. At most ``max_instances``
    processes get a recorder: :meth:`admit` says whether a resource's spans can be
    recorded (the receiver refuses the others, so that one export naming thousands of
    ``service.instance.id`` values cannot cost it thousands of writers and threads). Any thread.
    """

    def __init__(self, default: Recorder, factory: Callable[[InstanceIdentity], Recorder] | None,
                 default_role: Role, max_instances: int = MAX_INSTANCES) -> None:
        self.default = default
        self._factory = factory
        self._role = default_role
        self.max_instances = max_instances
        self._by_identity: dict[InstanceIdentity, Recorder] = {}
        self._by_tt_id: dict[int, Recorder] = {}  # tokentrace.instance_id of an exported resource -> recorder
        self._lock = threading.Lock()

    def admit(self, resource: Mapping[str, Any]) -> bool:
        """Whether ``resource``'s spans can be recorded (making its recorder on first sight): False
        when it names a process not yet recorded and ``max_instances`` are."""
        if self._factory is None:
            return True
        identity = InstanceIdentity.of(resource, self._role)
        with self._lock:
            if identity is not None and identity not in self._by_identity \
                    and len(self._by_identity) >= self.max_instances:
                return False
        self.for_resource(resource)
        return True

    def for_resource(self, resource: Mapping[str, Any]) -> Recorder:
        identity = InstanceIdentity.of(resource, self._role)
        if identity is None or self._factory is None:
            return self.default
        with self._lock:
            rec = self._by_identity.get(identity)
            if rec is None:
                if len(self._by_identity) >= self.max_instances:  # callers check admit() first
                    return self.default
                rec = self._by_identity[identity] = self._factory(identity)
                tt_id = resource.get(sc.TT_INSTANCE_ID)
                if isinstance(tt_id, int) and not isinstance(tt_id, bool):
                    self._by_tt_id[tt_id] = rec
            return rec

    def by_instance_id(self, instance_id: int) -> Recorder | None:
        """The recorder made for the resource that carried ``tokentrace.instance_id`` = ``instance_id``."""
        with self._lock:
            return self._by_tt_id.get(instance_id)

    def all(self) -> list[Recorder]:
        with self._lock:
            return [self.default, *self._by_identity.values()]


@dataclass(slots=True)
class StageInterval:
    """One stage interval of a request (receiver clock, ns); ``token`` None = split at token boundaries."""

    stage: int
    start_ns: int
    end_ns: int
    token: int | None = None
    step: int = -1
    num_bytes: int = -1
    tier: int = -1
    batch_size: int = -1
    recorder: Recorder | None = None
    """The instance that did the work; None = the request's."""


@dataclass(frozen=True, slots=True)
class TokenRow:
    """A ``tokens`` row as one instance saw it (receiver clock, ns; -1 = not seen)."""

    index: int
    emit_ns: int = -1
    sent_ns: int = -1
    recv_ns: int = -1
    step: int = -1
    recorder: Recorder | None = None


@dataclass(frozen=True, slots=True)
class RequestRow:
    """One instance's ``requests`` row, when the spans carry each instance's (our own export)."""

    recorder: Recorder | None
    arrival_ns: int
    finish_ns: int
    first_token_ns: int = -1
    first_content_ns: int = -1
    tenant: str = ""
    slo_class: str = ""
    status: int = RequestStatus.OK
    error: str = ""
    num_prompt_tokens: int = -1
    num_output_tokens: int = -1
    num_cached_tokens: int = -1
    session: str = ""
    session_turn: int = -1


@dataclass(slots=True)
class RequestBuild:
    """Everything the spans of one request say (receiver clock, ns; -1 = not reported)."""

    key: str
    recorder: Recorder
    arrival_ns: int
    finish_ns: int
    first_token_ns: int = -1
    first_content_ns: int = -1
    trace_id: str = ""
    tenant: str = ""
    slo_class: str = ""
    status: int = RequestStatus.OK
    error: str = ""
    num_prompt_tokens: int = -1
    num_output_tokens: int = -1
    num_cached_tokens: int = -1
    session: str = ""
    session_turn: int = -1
    token_times: list[int] = field(default_factory=list)
    """Emit time of token i (the engine's view) when no :attr:`token_rows` give them."""
    token_rows: list[TokenRow] = field(default_factory=list)
    stages: list[StageInterval] = field(default_factory=list)
    rows: list[RequestRow] = field(default_factory=list)
    """Every instance's ``requests`` row; empty: one row from the fields above."""

    def boundaries(self) -> list[int]:
        """Token i's interval ends at ``boundaries()[i]`` (delivery, else emit), for splitting."""
        if not self.token_rows:
            return self.token_times
        best: dict[int, int] = {}
        for row in self.token_rows:
            t = row.sent_ns if row.sent_ns >= 0 else row.emit_ns
            if t >= 0:
                best[row.index] = min(best.get(row.index, t), t)
        return [best[i] for i in sorted(best)]


def split_interval(iv: StageInterval, arrival: int, bounds: list[int]) -> list[tuple[int, int, int]]:
    """(token, start, end) pieces of ``iv`` cut at token boundaries: token 0 = [arrival, b0],
    token i = (b[i-1], b[i]]; time after the last boundary goes to request-level (-1)."""
    out = []
    lo = iv.start_ns
    edges = [arrival, *bounds]
    for i in range(len(bounds)):
        a, b = max(lo, edges[i]), min(iv.end_ns, edges[i + 1])
        if b > a:
            out.append((i, a, b))
    tail = max(lo, bounds[-1] if bounds else lo)
    if bounds and iv.end_ns > tail:
        out.append((-1, tail, iv.end_ns))
    if not bounds and iv.end_ns > iv.start_ns:
        out.append((-1, iv.start_ns, iv.end_ns))
    return out


class Room:
    """Keeps a bulk producer (the OTLP receiver) under its recorders' memory caps: before each row,
    :meth:`take` makes sure the row's table has a free place, flushing the recorder (a synchronous
    write: the producer waits instead of the row being dropped) when its table is full.

    The free places of each (recorder, table) are read from the recorder's ``headroom()`` once and
    counted down locally, so a table's own capacity counts (its share of the memory cap, its row
    size), whatever one span carries (a long per-token array becomes as many rows). A recorder
    without ``headroom()`` (a forwarding one) is never flushed here. One producer thread at a time;
    :meth:`refresh` forgets the counts (the flush thread may have written rows since).
    """

    __slots__ = ("_left",)

    def __init__(self) -> None:
        self._left: dict[tuple[int, str], int] = {}

    def refresh(self) -> None:
        self._left.clear()

    def take(self, rec: Recorder, table: str) -> None:
        """One row of ``table`` is about to be recorded through ``rec``."""
        key = (id(rec), table)
        left = self._left.get(key, 0)
        if left <= 0:
            left = self._refill(rec, table)
        self._left[key] = left - 1

    @staticmethod
    def _refill(rec: Recorder, table: str) -> int:
        headroom = getattr(rec, "headroom", None)
        if not callable(headroom):
            return 1 << 62
        free, capacity = headroom().get(table, (1 << 62, 1 << 62))
        if free > 0:
            return free
        rec.flush()
        free, capacity = headroom().get(table, (1 << 62, 1 << 62))
        return free if free > 0 else max(1, capacity)  # a closed recorder (no place at all) counts its drops


def record_request(b: RequestBuild, room: Room | None = None) -> None:
    """Write ``b``: its stage spans, tokens rows and the ``requests`` row (never raises into the caller).
    Its id is ``request_id_of(key, tenant)``, the tenant being the request's (every instance's row carries it).
    With ``room``, a recorder whose table is full is flushed before the row that would not fit."""
    room = room or Room()
    take = room.take
    rec = b.recorder
    if not b.tenant:  # the request's tenant scopes its id: every row and span of it uses the same
        b.tenant = next((row.tenant for row in b.rows if row.tenant), "")
    rid = request_id_of(b.key, b.tenant)
    bounds = b.boundaries()
    for iv in b.stages:
        target = iv.recorder or rec
        pieces = [(iv.token, iv.start_ns, iv.end_ns)] if iv.token is not None else split_interval(iv, b.arrival_ns, bounds)
        for token, start, end in pieces:
            if end > start:
                take(target, SPANS.name)
                target.span(rid, iv.stage, start, end, token, step=iv.step, num_bytes=iv.num_bytes, tier=iv.tier,
                            batch_size=iv.batch_size)
    if b.token_rows:
        for row in b.token_rows:
            take(row.recorder or rec, TOKENS.name)
            (row.recorder or rec).token(rid, row.index, emit_ns=row.emit_ns, sent_ns=row.sent_ns,
                                        recv_ns=row.recv_ns, step=row.step)
    else:
        for i, t in enumerate(b.token_times):
            take(rec, TOKENS.name)
            rec.token(rid, i, emit_ns=t)
    rows = b.rows or [RequestRow(rec, b.arrival_ns, b.finish_ns, b.first_token_ns, b.first_content_ns, b.tenant,
                                 b.slo_class, b.status, b.error, b.num_prompt_tokens, b.num_output_tokens,
                                 b.num_cached_tokens, b.session, b.session_turn)]
    for row in rows:
        target = row.recorder or rec
        take(target, REQUESTS.name)
        target.request_begin(b.key, tenant=b.tenant, slo_class=row.slo_class, arrival_ns=row.arrival_ns,
                             num_prompt_tokens=row.num_prompt_tokens, trace_id=b.trace_id,
                             session=row.session or b.session,
                             session_turn=row.session_turn if row.session_turn >= 0 else b.session_turn)
        target.request_end(rid, finish_ns=row.finish_ns, status=row.status, first_token_ns=row.first_token_ns,
                           num_output_tokens=row.num_output_tokens, num_cached_tokens=row.num_cached_tokens,
                           error=row.error, first_content_ns=row.first_content_ns)


class TraceBook:
    """Spans waiting for their request's root span, and the requests recently recorded, per trace id.

    A root span (vLLM's ``llm_request``, SGLang's ``Req``) is exported when its request ends,
    usually after its children; children that come first wait here, bounded by ``max_pending``
    spans in all (the oldest trace's are dropped and counted). Children that come after their
    root are looked up among the last ``max_done`` roots. Not thread-safe: the ingestor's lock
    serializes calls.
    """

    def __init__(self, *, max_pending: int = 200_000, max_pending_bytes: int = MAX_PENDING_BYTES,
                 max_done: int = 20_000) -> None:
        self._pending: OrderedDict[str, list[Any]] = OrderedDict()
        self._num_pending = 0
        self._pending_bytes = 0  # estimated (span_bytes) bytes of the spans held
        self._done: OrderedDict[str, Any] = OrderedDict()
        self._max_pending = max_pending
        self._max_pending_bytes = max_pending_bytes
        self._max_done = max_done
        self.dropped = 0

    def hold(self, trace_id: str, span: Any) -> None:
        self._pending.setdefault(trace_id, []).append(span)
        self._num_pending += 1
        self._pending_bytes += span_bytes(span)
        while (self._num_pending > self._max_pending or self._pending_bytes > self._max_pending_bytes) \
                and self._pending:
            _, spans = self._pending.popitem(last=False)
            self._forget(spans)
            self.dropped += len(spans)

    def _forget(self, spans: list[Any]) -> None:
        self._num_pending -= len(spans)
        self._pending_bytes -= sum(span_bytes(s) for s in spans)

    def take(self, trace_id: str) -> list[Any]:
        spans = self._pending.pop(trace_id, [])
        self._forget(spans)
        return spans

    def remember(self, trace_id: str, request: Any) -> None:
        self._done[trace_id] = request
        self._done.move_to_end(trace_id)
        while len(self._done) > self._max_done:
            self._done.popitem(last=False)

    def recorded(self, trace_id: str) -> Any:
        return self._done.get(trace_id)

    def drain(self) -> list[Any]:
        """Every span still waiting (their roots never came)."""
        spans = [s for group in self._pending.values() for s in group]
        self._pending.clear()
        self._num_pending = self._pending_bytes = 0
        return spans


_SPAN_OVERHEAD_BYTES = 200  # a held span's objects besides its attribute values (ids, names, tuples)


def span_bytes(span: Any) -> int:
    """Estimated bytes a held span keeps alive: its attribute keys and values, its events' (strings
    by length, arrays by element, numbers 8 bytes each). Its resource is shared by the spans of a
    payload and not counted."""
    total = _SPAN_OVERHEAD_BYTES + _mapping_bytes(getattr(span, "attributes", {}))
    for event in getattr(span, "events", ()):
        total += _SPAN_OVERHEAD_BYTES + _mapping_bytes(event.attributes)
    return total


def _mapping_bytes(attrs: Mapping[str, Any]) -> int:
    total = 0
    for key, value in attrs.items():
        total += len(key) + (len(value) if isinstance(value, (str, bytes)) else
                             sum(len(v) if isinstance(v, str) else 8 for v in value) if isinstance(value, tuple) else 8)
    return total
