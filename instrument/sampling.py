"""Sampling: keep a fraction of requests, plus every slow or failed one.

:class:`SamplingRecorder` sits in front of a :class:`~tokentrace.recorder.Recorder`
and has the same event methods, so any adapter (the engine tracer, the ASGI
middleware, the manual API's callers) records through it unchanged.

Decisions
---------
* **Head sampling by rate.** A request is *head-kept* when its ``request_id``
  (already a 63-bit blake2b hash of the request's id string,
  ``schema.request_id_of``) is below ``rate * 2**63``. The decision is a pure
  function of the id: every process (gateway, prefill, decode workers) keeps
  the same requests without coordination, and re-running a workload keeps the
  same ones. Head-kept events go straight to the recorder (one integer
  comparison per event, nothing buffered).
* **Tail keeping.** Every other request's events are buffered until its
  ``request_end``; the request is then kept (buffer forwarded to the recorder)
  if it failed (status not ``ok``, when ``keep_failed``) or was slow: time to
  first token ``first_token - arrival`` over ``slow_ttft_ns``, or end-to-end
  ``finish - arrival`` over ``slow_e2e_ns``. A request that never produced a
  token counts as slow once ``finish - arrival`` exceeds ``slow_ttft_ns``.
  Otherwise its events are dropped and counted. These decisions are made per
  process, on what that process saw of the request: a request slow at the
  gateway may be dropped by a decode worker where its part was fast.
  With neither thresholds nor ``keep_failed``, nothing is buffered: events of
  requests that are not head-kept are dropped (and counted) at once.
* Engine steps and cache events not tied to a request are never sampled.

Counters (``counters`` and, through ``sink.update_counters``, the run manifest)
------------------------------------------------------------------------------
``sampled_out`` (``tokentrace.store.manifest.SAMPLED_OUT``): events not recorded
because of sampling (spans, tokens, cache events and request rows);
``sampled_out_requests``; ``sampled_tail_kept`` (requests kept only because
slow or failed); ``sampled_promoted`` (requests forwarded early by the memory
bound). A small daemon thread pushes them to the sink every
``counters_interval_s`` seconds if they changed, and ``flush``/``close`` push
them too, so the hot path never does file I/O.

Memory bound
------------
Buffered events are packed integers (8 bytes each: a span is 64 bytes, a
token 40) plus about ``PENDING_BYTES`` per open request. When the total
exceeds ``max_buffered_bytes`` the *oldest* open request is promoted: its
buffer is forwarded to the recorder and its later events pass straight
through (it is treated as kept; the oldest open request is the one most
likely to end up slow anyway). Up to ``MAX_PROMOTED`` promoted ids are
remembered; requests still open at ``close`` are forwarded (kept) too.

Thread contract: every event method may be called from any thread; none
raises and none does I/O. Requests that are not head-kept take an internal
lock held for O(1) dictionary work only; forwarding a request's buffer
(at its end or on promotion) runs outside the lock. Not fork-aware: create the
sampler in the process that records (after any fork).
"""

from __future__ import annotations

import atexit
import logging
import struct
import threading
from typing import Any

from instrument.sampling_policy import SamplingPolicy
from tokentrace.recorder import CounterSink, ForwardingRecorder, Recorder
from tokentrace.schema import RequestStatus, request_id_of
from tokentrace.store.manifest import SAMPLED_OUT

_log = logging.getLogger("tokentrace")

__all__ = ["SamplingPolicy", "SamplingRecorder", "SAMPLED_OUT_REQUESTS", "SAMPLED_TAIL_KEPT",
           "SAMPLED_PROMOTED", "PENDING_BYTES", "MAX_PROMOTED"]

SAMPLED_OUT_REQUESTS = "sampled_out_requests"
SAMPLED_TAIL_KEPT = "sampled_tail_kept"
SAMPLED_PROMOTED = "sampled_promoted"

PENDING_BYTES = 512
"""Accounted bytes of one open request's state (object, dict entry, begin fields)."""
MAX_PROMOTED = 4096
"""Promoted request ids remembered so their later events pass straight through."""

# stage, start, end, token_index, step, num_bytes, tier, batch_size
_SPAN = struct.Struct("<8q")
# token_index, emit_ns, sent_ns, recv_ns, step
_TOKEN = struct.Struct("<5q")
# kind, tier, num_blocks, start, end, num_tokens, num_bytes, step
_CACHE = struct.Struct("<8q")
# step, draft_source, num_proposed, num_accepted, first_token_index, draft start/end, verify start/end,
# batch_size, num_spec_seqs
_SPEC = struct.Struct("<11q")
_SPANS, _TOKENS, _CACHES, _SPECS = 0, 1, 2, 3
_STRUCTS = (_SPAN, _TOKEN, _CACHE, _SPEC)


class _Pending:
    """One buffered request: its begin fields and packed events."""

    __slots__ = ("begin", "t_arrival", "bufs", "num_bytes", "num_events", "first_out_ns")

    def __init__(self) -> None:
        self.begin: dict[str, Any] | None = None  # request_begin's arguments
        self.t_arrival = -1  # local monotonic ns
        self.bufs = (bytearray(), bytearray(), bytearray(), bytearray())
        self.num_bytes = PENDING_BYTES
        self.num_events = 0
        self.first_out_ns = -1  # earliest token emit/sent seen, local monotonic ns


class SamplingRecorder(ForwardingRecorder):
    """A :class:`Recorder` front that samples requests (see the module docstring).

    ``recorder``: where kept events go. Options are those of
    :class:`SamplingPolicy` (or pass ``policy=``), plus ``max_buffered_bytes``
    (the memory bound) and ``counters_interval_s``. Raises ``ValueError`` for
    bad options. Engine steps, loop lag and the instance row pass through unchanged
    (:class:`ForwardingRecorder`): they are process-level, never sampled out.
    """

    def __init__(self, recorder: Recorder, *, rate: float = 1.0, slow_ttft_ns: int | None = None,
                 slow_e2e_ns: int | None = None, keep_failed: bool = True,
                 policy: SamplingPolicy | None = None, max_buffered_bytes: int = 16 << 20,
                 counters_interval_s: float = 1.0) -> None:
        if max_buffered_bytes <= 0:
            raise ValueError(f"max_buffered_bytes must be positive, got {max_buffered_bytes}")
        if not counters_interval_s > 0:
            raise ValueError(f"counters_interval_s must be positive, got {counters_interval_s}")
        self.policy = policy or SamplingPolicy(rate, slow_ttft_ns, slow_e2e_ns, keep_failed)
        super().__init__(recorder)
        self._threshold = self.policy.threshold
        self._tail = self.policy.needs_tail
        self._cap = int(max_buffered_bytes)
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}  # insertion order = age
        self._promoted: dict[int, None] = {}  # ordered set, oldest first
        self._open_stages: dict[tuple[int, int, int], int] = {}
        self._bytes = 0
        self._out_events = 0
        self._out_requests = 0
        self._tail_kept = 0
        self._promotions = 0
        self._pushed: dict[str, int] = {}
        self._push_warned = False  # a failed counter push is logged once
        self._stop = threading.Event()
        self._pusher = threading.Thread(target=self._push_loop, args=(float(counters_interval_s),),
                                        name="tokentrace-sampling-counters", daemon=True)
        self._pusher.start()
        atexit.register(self.close)  # runs before the recorders' own exit flush (LIFO)

    # ------------------------------------------------------------------ events

    def span(self, request_id: int, stage: int, start_ns: int, end_ns: int, token_index: int = -1,
             step: int = -1, num_bytes: int = -1, tier: int = -1, batch_size: int = -1) -> None:
        """As ``Recorder.span``; buffered unless the request is head-kept."""
        if self._passes(request_id) or not self._buffer(
                request_id, _SPANS, (stage, start_ns, end_ns, token_index, step, num_bytes, tier, batch_size)):
            self.inner.span(request_id, stage, start_ns, end_ns, token_index, step, num_bytes, tier, batch_size)

    def token(self, request_id: int, token_index: int, *, emit_ns: int = -1, sent_ns: int = -1,
              recv_ns: int = -1, step: int = -1) -> None:
        """As ``Recorder.token``; buffered unless the request is head-kept."""
        if self._passes(request_id) or not self._buffer(
                request_id, _TOKENS, (token_index, emit_ns, sent_ns, recv_ns, step)):
            self.inner.token(request_id, token_index, emit_ns=emit_ns, sent_ns=sent_ns, recv_ns=recv_ns, step=step)

    def cache_event(self, kind: int, tier: int, num_blocks: int, start_ns: int, end_ns: int,
                    request_id: int = -1, num_tokens: int = -1, num_bytes: int = -1, step: int = -1) -> None:
        """As ``Recorder.cache_event``; events of a request are sampled with it."""
        if self._passes(request_id) or not self._buffer(
                request_id, _CACHES, (kind, tier, num_blocks, start_ns, end_ns, num_tokens, num_bytes, step)):
            self.inner.cache_event(kind, tier, num_blocks, start_ns, end_ns, request_id, num_tokens, num_bytes, step)

    def spec_step(self, request_id: int, step: int, draft_source: int, num_proposed: int, num_accepted: int,
                  first_token_index: int, draft_start_ns: int, draft_end_ns: int, verify_start_ns: int,
                  verify_end_ns: int, batch_size: int, num_spec_seqs: int) -> None:
        """As ``Recorder.spec_step``; sampled with its request."""
        values = (step, draft_source, num_proposed, num_accepted, first_token_index, draft_start_ns, draft_end_ns,
                  verify_start_ns, verify_end_ns, batch_size, num_spec_seqs)
        if self._passes(request_id) or not self._buffer(request_id, _SPECS, values):
            self.inner.spec_step(request_id, *values)

    def stage_begin(self, request_id: int, stage: int, t_ns: int, token_index: int = -1) -> None:
        """As ``Recorder.stage_begin``."""
        if self._passes(request_id):
            self.inner.stage_begin(request_id, stage, t_ns, token_index)
            return
        try:
            if len(self._open_stages) < 65536:  # same order as the recorder's open-interval bound
                self._open_stages[(request_id, stage, token_index)] = t_ns
        except TypeError:  # unhashable: let the recorder count it
            self.inner.stage_begin(request_id, stage, t_ns, token_index)

    def stage_end(self, request_id: int, stage: int, t_ns: int, token_index: int = -1, step: int = -1,
                  num_bytes: int = -1, tier: int = -1, batch_size: int = -1) -> None:
        """As ``Recorder.stage_end``."""
        if self._passes(request_id):
            self.inner.stage_end(request_id, stage, t_ns, token_index, step, num_bytes, tier, batch_size)
            return
        try:
            start = self._open_stages.pop((request_id, stage, token_index), None)
        except TypeError:
            start = None
        if start is None:  # the recorder counts the unmatched end as invalid
            self.inner.stage_end(request_id, stage, t_ns, token_index, step, num_bytes, tier, batch_size)
            return
        self.span(request_id, stage, start, t_ns, token_index, step, num_bytes, tier, batch_size)

    # ------------------------------------------------------------------ requests

    def request_begin(self, key: str, *, tenant: str = "", slo_class: str = "", arrival_ns: int,
                      num_prompt_tokens: int = -1, trace_id: str = "", session: str = "",
                      session_turn: int = -1) -> int:
        """As ``Recorder.request_begin``; returns ``request_id_of(key, tenant)``."""
        begin = dict(tenant=tenant, slo_class=slo_class, arrival_ns=arrival_ns,
                     num_prompt_tokens=num_prompt_tokens, trace_id=trace_id, session=session,
                     session_turn=session_turn)
        try:
            rid = request_id_of(key, tenant)
        except Exception:  # the recorder counts the bad key
            return self.inner.request_begin(key, **begin)
        if self._passes(rid):
            return self.inner.request_begin(key, **begin)
        begin["key"] = key
        with self._lock:
            p = self._pending_locked(rid)
            if p is not None:
                p.begin = begin
                p.t_arrival = arrival_ns
        if p is None:  # promoted: passes through
            self.inner.request_begin(key, **{k: v for k, v in begin.items() if k != "key"})
        return rid

    def request_end(self, request_id: int, *, finish_ns: int, status: int = RequestStatus.OK,
                    first_token_ns: int = -1, num_output_tokens: int = -1, num_cached_tokens: int = -1,
                    error: str = "", first_content_ns: int = -1) -> None:
        """As ``Recorder.request_end``; decides a buffered request's fate and forwards or drops it."""
        end = dict(finish_ns=finish_ns, status=status, first_token_ns=first_token_ns,
                   num_output_tokens=num_output_tokens, num_cached_tokens=num_cached_tokens, error=error,
                   first_content_ns=first_content_ns)
        if self._passes(request_id):
            self.inner.request_end(request_id, **end)
            return
        with self._lock:
            p = self._pending.pop(request_id, None)
            # _promoted maps ids to None, so pop returns None exactly when the id was there
            promoted = p is None and self._promoted.pop(request_id, 0) is None
            if p is not None:
                self._bytes -= p.num_bytes
        if promoted:
            self.inner.request_end(request_id, **end)
            return
        arrival = -1 if p is None else p.t_arrival
        first = first_token_ns if first_token_ns >= 0 or p is None else p.first_out_ns
        try:
            keep = self.policy.keeps_end(arrival, first, finish_ns, status)
        except TypeError:  # bad arguments: let the recorder count them
            keep = True
        with self._lock:
            if keep:
                self._tail_kept += 1
            else:
                self._out_requests += 1
                self._out_events += 1 + (0 if p is None else p.num_events)
        if keep:
            if p is not None:
                self._replay(request_id, p)
            self.inner.request_end(request_id, **end)

    # ------------------------------------------------------------------ internals

    def _passes(self, request_id: int) -> bool:
        """Head-kept (or not a valid id: the recorder deals with it)."""
        try:
            return request_id < self._threshold
        except TypeError:
            return True

    def _pending_locked(self, rid: int) -> _Pending | None:
        """The request's buffer, created if new; None if it was promoted. Caller holds the lock."""
        p = self._pending.get(rid)
        if p is None:
            if rid in self._promoted:
                return None
            p = self._pending[rid] = _Pending()
            self._bytes += PENDING_BYTES
        return p

    def _buffer(self, rid: int, which: int, values: tuple[int, ...]) -> bool:
        """Buffer one event; False if it must go straight to the recorder."""
        try:
            packed = _STRUCTS[which].pack(*values)
        except (struct.error, TypeError):
            return False  # the recorder counts it as invalid
        if not self._tail:
            with self._lock:
                self._out_events += 1
            return True
        evicted = None
        with self._lock:
            p = self._pending_locked(rid)
            if p is None:
                return False
            p.bufs[which].extend(packed)
            p.num_bytes += len(packed)
            p.num_events += 1
            self._bytes += len(packed)
            if which == _TOKENS:
                t = values[2] if values[2] >= 0 else values[1]  # sent, else emit
                if t >= 0 and (p.first_out_ns < 0 or t < p.first_out_ns):
                    p.first_out_ns = t
            if self._bytes > self._cap:
                evicted = self._promote_oldest_locked()
        if evicted is not None:
            self._replay(*evicted)
        return True

    def _promote_oldest_locked(self) -> tuple[int, _Pending]:
        rid = next(iter(self._pending))
        p = self._pending.pop(rid)
        self._bytes -= p.num_bytes
        self._promoted[rid] = None
        if len(self._promoted) > MAX_PROMOTED:
            del self._promoted[next(iter(self._promoted))]
        self._promotions += 1
        return rid, p

    def _replay(self, rid: int, p: _Pending) -> None:
        """Forward a buffered request's events to the recorder (outside the lock)."""
        rec = self.inner
        if p.begin is not None:
            b = dict(p.begin)
            rec.request_begin(b.pop("key"), **b)
        spans, tokens, caches, specs = p.bufs
        for stage, start, end, ti, step, nb, tier, bs in _SPAN.iter_unpack(spans):
            rec.span(rid, stage, start, end, ti, step, nb, tier, bs)
        for ti, emit, sent, recv, step in _TOKEN.iter_unpack(tokens):
            rec.token(rid, ti, emit_ns=emit, sent_ns=sent, recv_ns=recv, step=step)
        for kind, tier, nblocks, start, end, ntok, nb, step in _CACHE.iter_unpack(caches):
            rec.cache_event(kind, tier, nblocks, start, end, rid, ntok, nb, step)
        for values in _SPEC.iter_unpack(specs):
            rec.spec_step(rid, *values)

    # ------------------------------------------------------------------ counters and control

    @property
    def sampling_counters(self) -> dict[str, int]:
        """The sampler's own counters (see the module docstring)."""
        return {SAMPLED_OUT: self._out_events, SAMPLED_OUT_REQUESTS: self._out_requests,
                SAMPLED_TAIL_KEPT: self._tail_kept, SAMPLED_PROMOTED: self._promotions}

    @property
    def counters(self) -> dict[str, int]:
        """The recorder's counters plus :attr:`sampling_counters`."""
        return {**self.inner.counters, **self.sampling_counters}

    @property
    def num_buffered_bytes(self) -> int:
        """Bytes accounted to buffered requests now (at most ``max_buffered_bytes`` + one event)."""
        return self._bytes

    @property
    def num_pending(self) -> int:
        """Requests whose events are buffered now."""
        return len(self._pending)

    def push_counters(self) -> None:
        """Send :attr:`sampling_counters` to the sink's ``update_counters`` if they changed.

        Any thread; blocks while the sink writes; never raises (a failure is
        left to the next push).
        """
        counters = self.sampling_counters
        sink = self.inner.sink
        if counters == self._pushed or not isinstance(sink, CounterSink):
            return
        try:
            sink.update_counters(counters)
            self._pushed = counters
        except Exception as err:  # retried at the next push; said once
            if not self._push_warned:
                self._push_warned = True
                _log.warning("tokentrace: could not write sampling counters to the manifest (%s); will retry", err)

    def _push_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s) and not self.inner.closed:
            self.push_counters()

    @property
    def recorder(self) -> Recorder:
        return self.inner

    def flush(self) -> None:
        """Flush the recorder and push the sampling counters (blocks on the sink)."""
        self.inner.flush()
        self.push_counters()

    def close(self) -> None:
        """Forward requests still open (kept), push counters, close the recorder. Idempotent.

        Also run at interpreter exit. Closing only the recorder (e.g. through a
        ``Handle``) instead loses the buffered requests and the last counters.
        """
        self._stop.set()
        atexit.unregister(self.close)
        with self._lock:
            pending, self._pending = self._pending, {}
            self._bytes = 0
        for rid, p in pending.items():
            self._promotions += 1
            self._replay(rid, p)
        self.push_counters()
        self.inner.close()

    def __enter__(self) -> SamplingRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
