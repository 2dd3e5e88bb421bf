"""Adapter for the engines of the reference serving stack and its worker processes.

An engine behind the gateway (a ``LocalBackend`` in the gateway's process, or a
worker process of a ``ClusterBackend``) is traced by :class:`ServingEngineTracer`,
an :class:`~instrument.reference_engine.EngineTracer` whose tiling starts when
the engine *accepted* the request (``RequestAdded.added_ns``, this process's
monotonic clock) instead of the caller's arrival stamp: the time before that
belongs to the gateway's stages (``gateway.receive``, ``gateway.tokenize``,
``gateway.route``), recorded by :mod:`instrument.reference_gateway`, and the
caller's stamp is on the gateway's clock anyway. Per request the engine side
tiles ``[added, last emit)``; per token ``(emit_{i-1}, emit_i]``.

Requests that arrive with output tokens already made elsewhere (a decode worker
importing a prefilled request, a request resumed after a worker died) start
their token numbering at the first index the engine emits.

In a worker the token leaves the engine only when its step ends (the worker
stamps the hand-out for the gateway then), so ``[emit_i, step end)`` is recorded
as ``stream.send`` of token i and the worker tiles ``(step end_{i-1}, step end_i]``;
the gateway's relay span starts at the worker's hand-out, mapped onto its clock.

Disaggregated prefill -> decode KV transfer (``transfer.kv`` of the first token
the decode worker produces, token k = 1 normally), in three pieces, each recorded
by the process whose time it is: the prefill worker records ``[its engine emitted
token k-1, its first KV chunk went into the socket)`` on its own clock, with the
bytes: the export, the hand-over from its engine thread to its event loop and the
wait for that loop's turn, any planted ``kv_transfer`` delay, connecting (the
sender's own waiting, so that a busy or stalled prefill worker shows as its own
``transfer.kv`` time); the gateway, which alone knows both workers' clock
offsets, records ``[first chunk sent, first chunk arrived)`` (the wire, and the
decode worker's wait before it read the chunk; see
:mod:`instrument.reference_gateway`); the decode worker records
``[first chunk arrived, last chunk arrived)`` on its own clock, with the bytes,
and then, as ``decode.queue``, ``[last chunk arrived, its engine imported the
blocks)``: the wait for room in a full decode pool is back-pressure, not transfer; plus a ``cache_events`` ``load`` row of tier ``remote`` for the
receipt (blocks, bytes, ``[first chunk, last chunk)``).

:class:`WorkerTracer` is the worker-process half: it attaches a
:class:`ServingEngineTracer` to ``worker.engine`` and observes the worker's KV
transfer events. Contracts: engine events on the engine thread, worker events
on the worker's event-loop thread; the two share per-request dicts whose single
get/set/pop operations are atomic under the GIL. Nothing here blocks or raises
into the server.
"""

from __future__ import annotations

from typing import Any

from instrument.engine_config import record_engine_config
from instrument.reference_engine import EngineTracer, _Req
from reference_server.engine import hooks
from reference_server.engine.handoff import HANDOFF_FINISH_REASON
from tokentrace.recorder import Recorder
from tokentrace.schema import CacheEventKind, RequestStatus, Role, Stage, Tier, request_id_of

__all__ = ["ServingEngineTracer", "WorkerTracer", "TokenRelay"]

_MAX_HANDED_OFF = 4096  # prefill side: handed-off requests whose KV send has not ended yet, at most
_WORKER_ROLES = {"colocated": Role.COLOCATED, "prefill": Role.PREFILL, "decode": Role.DECODE}
"""A worker's ``role`` string -> the role its engine's configuration row carries."""


class TokenRelay:
    """Engine -> gateway facts shared by tracers of one process (same clock).

    ``added[key]``: when the engine accepted the request; ``emits[key][i]``: when
    it emitted token i. The in-process gateway tracer pops them to start its own
    spans exactly where the engine's end. Written on the engine thread, read on
    the event loop; entries are dropped when the gateway is done with a request.
    """

    __slots__ = ("added", "emits")

    def __init__(self) -> None:
        self.added: dict[str, int] = {}  # engine monotonic clock, ns
        self.emits: dict[str, dict[int, int]] = {}  # engine monotonic clock, ns

    def forget(self, key: str) -> None:
        self.added.pop(key, None)
        self.emits.pop(key, None)


class ServingEngineTracer(EngineTracer):
    """Engine tracer for an engine serving requests routed by a gateway.

    ``relay``: shared with an in-process gateway tracer (``LocalBackend``), else
    None. ``accepted`` / ``kv_imports``: filled by :class:`WorkerTracer` in a
    worker process (request key -> when the worker took it; KV receipt), else unused.
    A worker's token frames carry the engine's own emit time, so the gateway times the
    hand-over from there: the engine's tiling of a token ends at its emit.
    """

    def __init__(self, recorder: Recorder, *, relay: TokenRelay | None = None) -> None:
        super().__init__(recorder)
        self.relay = relay
        # decode side: key -> [recv_start_ns, recv_end_ns or -1, num_bytes], worker clock
        self.kv_imports: dict[str, list[int]] = {}
        self._added: dict[str, int] = {}  # key -> added_ns, until its first token
        # key -> when the worker read the generate frame (worker clock), if the worker reports it
        self.accepted: dict[str, int] = {}
        # decode side: key -> (num_blocks, start_ns, end_ns, num_bytes) of a KV receipt whose request the
        # engine has not begun yet: its cache event waits for the request's (tenant-scoped) id
        self.kv_loads: dict[str, tuple[int, int, int, int]] = {}
        # prefill side: key -> (request id, emit of its last token here, index of the next token) of a request
        # handed to a decode worker, until its KV send reports when the first chunk left
        self.handed_off: dict[str, tuple[int, int, int]] = {}

    def load_received(self, key: str, num_blocks: int, start_ns: int, end_ns: int, num_bytes: int) -> None:
        """A KV receipt's ``cache_events`` row, written with the request's id once it is known (any thread)."""
        self.kv_loads[key] = (num_blocks, start_ns, end_ns, num_bytes)
        if key in self._reqs:  # begun already (engine thread): whoever pops the entry writes it
            self._record_kv_load(key)

    def _record_kv_load(self, key: str) -> None:
        load = self.kv_loads.pop(key, None)  # atomic under the GIL: written once
        r = self._reqs.get(key)
        if load is not None:
            num_blocks, start_ns, end_ns, num_bytes = load
            self._rec.cache_event(CacheEventKind.LOAD, Tier.REMOTE, num_blocks, start_ns, end_ns,
                                  r.rid if r is not None else self.request_id(key), -1, num_bytes)

    def on_request_added(self, event: hooks.RequestAdded) -> None:
        start_ns = self.accepted.pop(event.request_id, event.added_ns)
        if not 0 <= start_ns <= event.added_ns:
            start_ns = event.added_ns
        rid = self._rec.request_begin(
            event.request_id, tenant=event.tenant, slo_class=event.slo_class,
            arrival_ns=start_ns, num_prompt_tokens=event.num_prompt_tokens, session=event.session,
        )
        self.remember_tenant(event.request_id, event.tenant)
        self._reqs[event.request_id] = _Req(rid=rid, cursor_ns=start_ns)
        self._record_kv_load(event.request_id)
        self._added[event.request_id] = event.added_ns
        relay = self.relay
        if relay is not None:
            relay.added[event.request_id] = event.added_ns
            relay.emits[event.request_id] = {}

    def on_token_emitted(self, event: hooks.TokenEmitted) -> None:
        r = self._reqs.get(event.request_id)
        if r is None:
            return
        if r.first_token_ns < 0 and not r.pending_tokens and event.index > r.next_token:
            # Imported or resumed: earlier tokens were produced by another engine.
            r.next_token = event.index
            self._kv_tail(event.request_id, r)
        r.pending_tokens.append(event)
        relay = self.relay
        if relay is not None:
            emits = relay.emits.get(event.request_id)
            if emits is not None:
                emits[event.index] = event.emit_ns

    def _kv_tail(self, key: str, r: _Req) -> None:
        """Decode side: from the first KV chunk's arrival until the last one (``transfer.kv``), then until the
        engine imported the blocks, which waits for room in a full decode pool (``decode.queue``: back-pressure,
        not transfer)."""
        added_ns = self._added.pop(key, -1)
        kv = self.kv_imports.pop(key, None)
        if kv is None:
            return
        start_ns, recv_end_ns, num_bytes = kv
        if not 0 <= start_ns < added_ns:
            return
        moved_ns = added_ns if not start_ns <= recv_end_ns < added_ns else recv_end_ns
        self._rec.span(r.rid, Stage.TRANSFER_KV, start_ns, moved_ns, r.next_token, -1, num_bytes, Tier.REMOTE)
        if moved_ns < added_ns:
            self._rec.span(r.rid, Stage.DECODE_QUEUE, moved_ns, added_ns, r.next_token)

    def on_request_finished(self, event: hooks.RequestFinished) -> None:
        if event.reason != HANDOFF_FINISH_REASON:
            self._pending_finish.append(event)
            return
        # Prefill side: the request left for a decode worker right after its step.
        r = self._reqs.pop(event.request_id, None)
        if r is None:
            return
        self._added.pop(event.request_id, None)
        handed = self.handed_off
        handed[event.request_id] = (r.rid, r.cursor_ns, event.num_output_tokens)
        if len(handed) > _MAX_HANDED_OFF:  # sends cancelled by an abort never report: forget the oldest
            try:
                handed.pop(next(iter(handed)), None)
            except (RuntimeError, StopIteration):  # the event loop popped one meanwhile
                pass
        self._rec.request_end(
            r.rid, finish_ns=event.finish_ns, status=RequestStatus.OK, first_token_ns=r.first_token_ns,
            num_output_tokens=event.num_output_tokens, num_cached_tokens=event.num_cached_tokens,
        )

    def kv_sent(self, key: str, first_sent_ns: int, end_ns: int, num_bytes: int) -> None:
        """Prefill side: the KV send of a handed-off request ended; its ``transfer.kv`` piece here runs from
        the last token's emit until the first chunk went out (until the send ended, if none did)."""
        handed = self.handed_off.pop(key, None)
        if handed is None:
            return
        rid, from_ns, index = handed
        to_ns = first_sent_ns if first_sent_ns >= 0 else end_ns
        if 0 <= from_ns < to_ns:
            self._rec.span(rid, Stage.TRANSFER_KV, from_ns, to_ns, index, -1, num_bytes, Tier.REMOTE)

    def _finish(self, event: hooks.RequestFinished) -> None:
        self._added.pop(event.request_id, None)
        super()._finish(event)

    def on_request_aborted(self, event: hooks.RequestAborted) -> None:
        self._added.pop(event.request_id, None)
        self.kv_imports.pop(event.request_id, None)
        self._record_kv_load(event.request_id)
        super().on_request_aborted(event)


class WorkerTracer:
    """Traces one worker process: its engine and its KV transfers.

    Attach with :meth:`attach` (``worker.engine.add_observer`` and
    ``worker.add_observer``); :meth:`detach` undoes it. The worker's
    ``WorkerObserver`` events arrive on its event-loop thread.
    """

    def __init__(self, recorder: Recorder, worker: Any) -> None:
        self._rec = recorder
        self.worker = worker
        self.engine_tracer = ServingEngineTracer(recorder)

    def attach(self) -> None:
        role = _WORKER_ROLES.get(getattr(self.worker, "role", ""), Role.COLOCATED)
        record_engine_config(self._rec, self.worker.engine, role=role)
        self.worker.engine.add_observer(self.engine_tracer)
        self.worker.add_observer(self)

    def detach(self) -> None:
        for remove, obs in ((self.worker.engine.remove_observer, self.engine_tracer),
                            (self.worker.remove_observer, self)):
            try:
                remove(obs)
            except ValueError:
                pass

    # WorkerObserver events (worker event-loop thread, worker clock)

    def on_worker_request_received(self, event: Any) -> None:
        """The worker took a generate request: its engine-side tiling starts here, where the
        gateway's ``gateway.route`` ends (the gateway gets the same instant, ``accepted_ns``)."""
        if event.kind == "generate":
            self.engine_tracer.accepted[event.request_id] = event.t_ns

    def on_kv_transfer_start(self, event: Any) -> None:
        if event.direction == "recv":
            self.engine_tracer.kv_imports[event.request_id] = [event.t_ns, -1, event.num_bytes]

    def on_kv_transfer_end(self, event: Any) -> None:
        if event.direction != "recv":
            self.engine_tracer.kv_sent(event.request_id, getattr(event, "first_sent_ns", -1), event.end_ns,
                                       event.num_bytes)
            return
        kv = self.engine_tracer.kv_imports.get(event.request_id)
        if kv is not None and event.ok:
            kv[1], kv[2] = event.end_ns, event.num_bytes
        if event.ok:  # the request goes to the engine next: its row takes the request's id then
            self.engine_tracer.load_received(event.request_id, event.num_blocks, event.start_ns, event.end_ns,
                                             event.num_bytes)
        else:  # no request follows on this worker: the key's id (its tenant unknown here)
            self._rec.cache_event(CacheEventKind.LOAD, Tier.REMOTE, event.num_blocks, event.start_ns,
                                  event.end_ns, request_id_of(event.request_id), -1, event.num_bytes)

    def on_worker_started(self, event: Any) -> None:
        return None

    def on_worker_stopped(self, event: Any) -> None:
        return None

