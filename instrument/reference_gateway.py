"""Adapter: the reference gateway's observer hooks -> gateway stages, sent tokens, requests.

:class:`GatewayTracer` subscribes to ``reference_server.serving.gateway_hooks``
events (all on the gateway's event loop, gateway monotonic clock, ns) and
records, per request (``request_id_of`` of the gateway's request id, the same
key the engines use, so rows of every process join):

Token 0 (all spans carry ``token_index`` 0), before the engine:

* ``gateway.accept``   ``[first byte read, received)``: from the moment uvicorn's
  protocol read the request's first bytes (:mod:`instrument.transport`) until the
  app saw the request (parsing, the event loop's queue); the request's arrival is
  the first byte when known, else the app's receipt;
* ``gateway.receive``  ``[received, tokenize start)``: headers, body, validation;
* ``gateway.tokenize`` ``[tokenize start, tokenize end)``;
* ``gateway.route``    ``[tokenize end, handed over)``: building the request,
  choosing the instance and handing it to the backend: until the engine took it
  (an in-process engine's acceptance; a worker's ``Routed.accepted_ns``, mapped
  onto this clock), else until the backend's own route decision ended.

Each streamed token i, after the engine emitted it:

* ``stream.relay`` ``[max(hand-out_i, sent_{i-1}), detok start)``: the relay from
  the engine to the gateway (a thread hand-off in one process, a socket frame from
  a worker) and the wait on the gateway's loop. The hand-out is
  the in-process engine's emit time (:class:`TokenRelay`), or the worker's
  ``ChunkWritten.emitted_ns`` mapped onto this clock with the worker's offset
  (the estimate it wrote into its ``instances`` row and reported to this
  process's clock server: ``clocks``, a :class:`~tokentrace.clock.OffsetBook`);
  failing both, the gateway's receipt;
* ``detokenize`` ``[detok start, detok end)``: token -> SSE chunk;
* ``stream.send`` ``[write start, write end)``: the write to the client;
* a ``tokens`` row with ``sent_ns`` = write end: the token's delivery time,
  which analyzers prefer over the engine's emit time.

A token whose text is empty (part of a UTF-8 character) is not written on its
own: it goes out with the next chunk, so it has no gateway ``tokens`` row and its
interval ends at the engine's emit. The ``requests`` row's ``first_content_ns``
is the first chunk with visible text (the TTFT of AIPerf and ``vllm bench``).

While requests are in flight, the gateway's event loop is sampled for lateness
(:class:`~instrument.loop_lag.LoopLagSampler`, ``loop_lags`` rows): what delays
``gateway.accept`` and ``stream.relay`` when the loop is busy.

Disaggregated serving: ``transfer.kv`` of the decode worker's first token k,
``[the prefill worker's first KV chunk went into its socket, that chunk reached
the decode worker)`` with the bytes, from the relayed ``KVTransferEnd`` ("send",
``first_sent_ns``) and ``KVTransferStart`` ("recv") events: the wire, and the
decode worker's wait before it read the chunk; only this process knows both
workers' clocks. The prefill worker records the time before its first chunk
left, the decode worker the rest of the move (:mod:`instrument.reference_cluster`).
The sender reports its send only once the receiver acknowledged the last chunk, on
its own link, so the report may come after the decode worker's tokens or after the
request finished: the piece waits for it (a finished request, among at most
``_MAX_AWAITING_SEND``). When the sender never reports its first chunk, the piece
starts at its hand-out of token k-1 instead (recorded when the tracer closes, or
when the oldest waiting request makes room).

A non-streamed answer gets one request-level ``stream.send`` span (token index
-1) for its body write. The ``requests`` row (gateway view: arrival = headers
received, first token = first chunk written, finish, status, prompt and output
token counts, tenant, SLO class, W3C trace id of the ``traceparent`` header) is
written when the request finishes.

Per-token spans of the engine and of the gateway overlap in time when the
engine runs ahead of the stream (it computes token i while the gateway still
sends token i-1); the token interval ``(sent_{i-1}, sent_i]`` then contains
only the part after ``sent_{i-1}``: analyzers clip spans to token intervals.

Contract: every method runs on the gateway's event-loop thread, never blocks
and never raises into the gateway (the gateway also counts observer errors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from instrument import transport
from instrument.loop_lag import LoopLagSampler
from instrument.reference_cluster import TokenRelay
from instrument.sessions import SessionSource, parse_turn, session_source
from reference_server.serving import gateway_hooks as gh
from tokentrace.clock import OffsetBook
from tokentrace.recorder import Recorder
from tokentrace.schema import RequestStatus, Stage, Tier, request_id_of

__all__ = ["GatewayTracer", "trace_id_of"]

_OUTCOME_STATUS = {
    "stop": RequestStatus.OK,
    "length": RequestStatus.OK,
    "aborted": RequestStatus.ABORTED,
    "error": RequestStatus.ERROR,
    "rejected": RequestStatus.REJECTED,
}
_HEX = frozenset("0123456789abcdef")

# Stages of the per-token path, bound once (an enum class attribute costs a lookup each time).
_STREAM_RELAY, _DETOKENIZE, _STREAM_SEND = Stage.STREAM_RELAY, Stage.DETOKENIZE, Stage.STREAM_SEND
_MAX_AWAITING_SEND = 4096  # finished requests whose transfer.kv waits for the prefill worker's send report, at most


def trace_id_of(traceparent: str | None) -> str:
    """The 32-hex-digit trace id of a W3C ``traceparent`` header; "" if absent or malformed."""
    if not traceparent:
        return ""
    parts = traceparent.strip().lower().split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or not set(parts[1]) <= _HEX or parts[1] == "0" * 32:
        return ""
    return parts[1]


@dataclass(slots=True)
class _Handoff:
    """The decode worker's receipt of a request's KV (disaggregated), gateway clock."""

    decode: str  # the decode worker
    end_ns: int  # the first KV chunk reached it (it records the rest of the move itself)
    num_bytes: int


@dataclass(slots=True)
class _GReq:
    """What the gateway tracer keeps per in-flight request."""

    rid: int
    arrival_ns: int  # the first byte was read (else the app received it); gateway monotonic clock, ns
    received_ns: int  # the app received the request
    trace_id: str
    tenant: str = ""
    slo_class: str = ""
    session: str = ""
    session_turn: int = -1
    cursor_ns: int = -1  # end of the last gateway span (route end, then the last token's send)
    tokenized: bool = False
    first_sent_ns: int = -1
    first_content_ns: int = -1
    handoff: _Handoff | None = None  # until transfer.kv is recorded
    kv_sent_ns: int = -1  # the prefill worker's first KV chunk went into its socket (gateway clock), -1 = unknown
    out_ns: int = -1  # the worker handed out the latest token (gateway clock), -1 = unknown
    out_index: int = -1
    out_instance: str = ""
    # the latest hand-out of the instance before out_instance (ns, index, instance): the prefill worker's last
    # token once the decode worker's tokens arrive, which can be before the prefill worker reports its KV send
    before: tuple[int, int, str] | None = None


class GatewayTracer(gh.GatewayObserver):
    """Records a reference gateway's activity on ``recorder``.

    Attach with ``app.state.gateway.add_observer(GatewayTracer(recorder))``; usually
    done by ``tokentrace.instrument(app, ...)``. ``relay``: the in-process engine's
    emit times (``LocalBackend``), else None. ``clocks``: the workers' offsets to
    this clock (the clock server's book); without one, worker-clock times are
    unknown and the gateway's receipt stands in for them.
    """

    def __init__(self, recorder: Recorder, *, relay: TokenRelay | None = None,
                 clocks: OffsetBook | None = None, sessions: SessionSource | str | None = None) -> None:
        self._rec = recorder
        self.sessions = session_source(sessions)
        """Where a request's session id is read (``instrument.sessions``)."""
        self._relay = relay
        self._reqs: dict[str, _GReq] = {}
        # finished requests whose transfer.kv waits for the prefill worker's report of its send (oldest first)
        self._awaiting_send: dict[str, _GReq] = {}
        self.clocks = clocks if clocks is not None else OffsetBook()
        self.loop_lag = LoopLagSampler(recorder, is_idle=self._is_idle)
        """Samples this gateway's event loop while requests are in flight (``loop_lags`` rows)."""

    def on_kv_transfer_start(self, event: Any) -> None:
        """Relayed worker event: the decode worker got the first KV chunk (on its clock)."""
        g = self._reqs.get(event.request_id)
        if g is None or event.direction != "recv":
            return
        end_ns = self.clocks.to_reference(event.instance, event.t_ns)
        if end_ns >= 0:
            g.handoff = _Handoff(event.instance, end_ns, event.num_bytes)
            self._record_handoff(g)

    def on_kv_transfer_end(self, event: Any) -> None:
        """Relayed worker event: the prefill worker's send ended; when its first chunk left (its clock)."""
        first_sent_ns = getattr(event, "first_sent_ns", -1)
        if event.direction != "send" or first_sent_ns < 0:
            return
        g = self._reqs.get(event.request_id)
        if g is None:  # the request may have finished first (the send's report comes on the other worker's link)
            g = self._awaiting_send.pop(event.request_id, None)
            if g is None:
                return
        sent_ns = self.clocks.to_reference(event.instance, first_sent_ns)
        if sent_ns >= 0:
            g.kv_sent_ns = sent_ns
            self._record_handoff(g)

    def _record_handoff(self, g: _GReq, *, final: bool = False) -> None:
        """``transfer.kv`` of the decode worker's first token: from the prefill worker's first
        KV chunk leaving (``final``, with that unknown: its hand-out of the token before)
        until the first KV chunk reached the decode worker."""
        h = g.handoff
        if h is None:
            return
        if g.out_instance != h.decode:
            out_ns, out_index = g.out_ns, g.out_index
        elif g.before is not None and g.before[2] != h.decode:
            out_ns, out_index, _ = g.before
        else:
            out_ns = out_index = -1
        if out_ns < 0:
            return  # wait for the prefill worker's token
        if g.kv_sent_ns < 0 and not final:
            return  # wait for the prefill worker's send
        g.handoff = None
        start_ns = max(out_ns, g.kv_sent_ns)
        if h.end_ns > start_ns:
            self._rec.span(g.rid, Stage.TRANSFER_KV, start_ns, h.end_ns, out_index + 1, -1, h.num_bytes,
                           Tier.REMOTE)

    def _finish_handoff(self, key: str, g: _GReq) -> None:
        """The request finished: its ``transfer.kv`` piece, now or, when the prefill worker's report of its
        send is still on its way, once it comes (at most ``_MAX_AWAITING_SEND`` wait; the oldest, and any
        left at :meth:`close`, are recorded from the prefill worker's hand-out instead)."""
        if g.handoff is None or g.kv_sent_ns >= 0:
            self._record_handoff(g, final=True)
            return
        waiting = self._awaiting_send
        waiting[key] = g
        while len(waiting) > _MAX_AWAITING_SEND:
            self._record_handoff(waiting.pop(next(iter(waiting))), final=True)

    def close(self) -> None:
        """Record every ``transfer.kv`` piece still waiting for a send report (from the hand-out), stop sampling."""
        waiting = self._awaiting_send
        while waiting:
            self._record_handoff(waiting.pop(next(iter(waiting))), final=True)
        self.loop_lag.close()

    def _from_worker(self, instance: str, worker_ns: int) -> int:
        """A worker-clock time carried by a serving event, on this clock; -1 if unknown."""
        if worker_ns < 0 or self._relay is not None:
            return -1
        return self.clocks.to_reference(instance, worker_ns)

    @property
    def num_in_flight(self) -> int:
        return len(self._reqs)

    def _is_idle(self) -> bool:
        return not self._reqs

    def on_request_received(self, event: gh.RequestReceived) -> None:
        self.loop_lag.ensure_running()  # on the gateway's loop: sample it from now on
        first_byte = transport.first_byte_ns()  # this runs in the request's task: its context
        arrival = first_byte if 0 <= first_byte <= event.t_ns else event.t_ns
        tenant = event.tenant or ""  # the request's id is scoped by it: fixed from here on
        g = _GReq(request_id_of(event.request_id, tenant), arrival, event.t_ns, trace_id_of(event.traceparent),
                  tenant)
        self._reqs[event.request_id] = g
        if self.sessions.kind != "user":  # the gateway reports the X-Session-Id header (the user field: parsed)
            g.session = self.sessions.from_headers({"x-session-id": event.session_header or ""})
        g.session_turn = parse_turn(event.session_turn_header)
        if arrival < event.t_ns:
            self._rec.span(g.rid, Stage.GATEWAY_ACCEPT, arrival, event.t_ns, 0)

    def on_request_parsed(self, event: gh.RequestParsed) -> None:
        g = self._reqs.get(event.request_id)
        if g is not None:
            g.slo_class = event.slo_class  # the tenant is the one of the request's id (the same, from its key)
            if self.sessions.kind == "user":
                g.session = self.sessions.from_headers({}, user=event.user)

    def on_tokenized(self, event: gh.Tokenized) -> None:
        g = self._reqs.get(event.request_id)
        if g is None:
            return
        rec = self._rec
        if event.start_ns > g.received_ns:
            rec.span(g.rid, Stage.GATEWAY_RECEIVE, g.received_ns, event.start_ns, 0)
        rec.span(g.rid, Stage.GATEWAY_TOKENIZE, event.start_ns, event.end_ns, 0)
        g.cursor_ns = event.end_ns
        g.tokenized = True

    def on_routed(self, event: gh.Routed) -> None:
        g = self._reqs.get(event.request_id)
        if g is None or g.cursor_ns < 0:
            return
        end_ns = event.end_ns
        accepted = self._from_worker(event.instance, getattr(event, "accepted_ns", -1))
        if accepted > g.cursor_ns:  # the worker's own tiling starts when it accepted the request
            end_ns = accepted
        relay = self._relay
        if relay is not None:
            added = relay.added.pop(event.request_id, -1)
            if added >= 0:
                end_ns = added  # handed over = the in-process engine accepted it (same clock)
        if end_ns > g.cursor_ns:
            self._rec.span(g.rid, Stage.GATEWAY_ROUTE, g.cursor_ns, end_ns, 0)
        g.cursor_ns = -1  # the engine's spans cover the rest of token 0 up to its emit

    def on_token_held(self, event: gh.TokenHeld) -> None:
        """A token without text yet: its interval ends when it reached this process (it is
        delivered with the next chunk, whose interval holds the rest of the wait)."""
        g = self._reqs.get(event.request_id)
        if g is None:
            return
        relay_start = self._relay_start(g, event.request_id, event.index, event.instance, event.emitted_ns,
                                        event.received_ns)
        if event.received_ns > relay_start:
            self._rec.span(g.rid, Stage.STREAM_RELAY, relay_start, event.received_ns, event.index)
        self._rec.token(g.rid, event.index, recv_ns=event.received_ns)
        g.cursor_ns = max(g.cursor_ns, event.received_ns)

    def _relay_start(self, g: _GReq, key: str, i: int, instance: str, emitted_ns: int, received_ns: int) -> int:
        """Where token i's relay to this process starts: its hand-out (this clock), not before the
        previous token's end; the gateway's receipt when the hand-out is unknown."""
        relay_start = received_ns
        emitted = self._from_worker(instance, emitted_ns)
        if emitted >= 0:
            if instance != g.out_instance and g.out_ns >= 0:
                g.before = (g.out_ns, g.out_index, g.out_instance)
            g.out_ns, g.out_index, g.out_instance = emitted, i, instance
            if g.handoff is not None:
                self._record_handoff(g)
        if 0 <= emitted < relay_start:  # the relay from the worker, on this clock (+- rtt/2)
            relay_start = emitted
        relay = self._relay
        if relay is not None:
            emits = relay.emits.get(key)
            emit_ns = emits.pop(i, -1) if emits is not None else -1
            if emit_ns >= 0:
                relay_start = emit_ns
        if g.cursor_ns > relay_start:  # token i's interval starts when token i-1 was sent
            relay_start = g.cursor_ns
        return relay_start

    def on_chunk_written(self, event: gh.ChunkWritten) -> None:
        g = self._reqs.get(event.request_id)
        if g is None:
            return
        rec, i, rid, detok_start_ns, sent_ns = self._rec, event.index, g.rid, event.detok_start_ns, event.write_end_ns
        relay_start = self._relay_start(g, event.request_id, i, event.instance, event.emitted_ns, event.received_ns)
        if detok_start_ns > relay_start:
            rec.span(rid, _STREAM_RELAY, relay_start, detok_start_ns, i)
        rec.span(rid, _DETOKENIZE, detok_start_ns, event.detok_end_ns, i)
        rec.span(rid, _STREAM_SEND, event.write_start_ns, sent_ns, i, -1, event.num_bytes)
        rec.token(rid, i, sent_ns=sent_ns)
        g.cursor_ns = sent_ns
        lag = self.loop_lag
        if sent_ns >= lag.poke_from_ns:  # on the loop, which just wrote: it may stand in for a tick
            lag.poke(sent_ns)
        if g.first_sent_ns < 0:
            g.first_sent_ns = sent_ns
        if g.first_content_ns < 0 and event.has_content:
            g.first_content_ns = sent_ns

    def on_response_written(self, event: gh.ResponseWritten) -> None:
        g = self._reqs.get(event.request_id)
        if g is not None:
            self._rec.span(g.rid, Stage.STREAM_SEND, event.write_start_ns, event.write_end_ns, -1, -1,
                           event.num_bytes)

    def on_request_finished(self, event: gh.GatewayRequestFinished) -> None:
        g = self._reqs.pop(event.request_id, None)
        if self._relay is not None:
            self._relay.forget(event.request_id)
        if g is None:
            return
        self._finish_handoff(event.request_id, g)
        rec = self._rec
        if not g.tokenized and event.t_ns > g.received_ns:  # refused while reading or validating
            rec.span(g.rid, Stage.GATEWAY_RECEIVE, g.received_ns, event.t_ns, -1)
        rec.request_begin(event.request_id, tenant=g.tenant, slo_class=g.slo_class, arrival_ns=g.arrival_ns,
                          num_prompt_tokens=event.num_prompt_tokens, trace_id=g.trace_id, session=g.session,
                          session_turn=g.session_turn)
        rec.request_end(g.rid, finish_ns=event.t_ns, status=_OUTCOME_STATUS.get(event.outcome, RequestStatus.ERROR),
                        first_token_ns=g.first_sent_ns, num_output_tokens=event.num_output_tokens,
                        error=event.error or "", first_content_ns=g.first_content_ns)
