"""Adapter: the reference engine's observer hooks -> tokentrace stage intervals.

:class:`EngineTracer` subscribes to ``reference_server.engine.hooks`` events and
turns them into ``spans``, ``tokens``, ``steps``, ``cache_events`` and
``requests`` rows on a :class:`~tokentrace.recorder.Recorder`.

How a request's time is tiled (engine monotonic clock, ns)
---------------------------------------------------------
Per request the tracer keeps a cursor: the end of the last attributed interval.
Events that *do* something for the request become explicit intervals:

* ``cache.lookup``  - the prefix-cache lookup at admission;
* ``cache.load``    - blocks brought up from the host or disk tier (load,
  swap-in, prefetch copies made for this request);
* ``prefill.compute`` - ``[compute_start, compute_end)`` of each step that ran a
  prefill chunk of the request (the final chunk ends when its token is sampled);
* ``decode.compute`` - ``[compute_start, sampled)`` of the step that produced a
  decode token;
* ``decode.draft`` and ``decode.verify`` - instead of ``decode.compute``, for the
  first token of a speculative step (``SpeculativeStep``): the step's draft phase, then
  ``[verify_start, sampled)``; the step's further tokens carry only their own
  ``detokenize`` (they were produced at the same instant). One ``spec_steps`` row per
  request per speculative step;
* ``detokenize``    - ``[sampled, emitted)``: the token id became a text delta;
* ``schedule.preempted`` - preempted until resumed.

The gaps between them are time the request spent waiting for the engine:
``schedule.queue`` before its first token, ``decode.queue`` after it. Every span
carries the index of the output token whose interval contains it (token 0's
interval starts at arrival), so both tilings of the attribution invariant hold
by construction: per request, ``[arrival, last emit)`` is covered without gaps
or overlap; per token, ``(emit_{i-1}, emit_i]``.

Events of one step arrive in the engine's order (scheduling, tier copies,
tokens, finishes, then ``StepEnd``); compute intervals are only known at
``StepEnd``, so token and finish events of the step are held until then.

Contract: methods run on the engine thread (they are engine time), never raise
into the engine (the engine also counts observer errors) and never block.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from reference_server.engine import hooks
from tokentrace.recorder import Recorder
from tokentrace.schema import CacheEventKind, DraftSource, RequestStatus, Stage, Tier, request_id_of

__all__ = ["EngineTracer"]

_TRANSFER_KINDS: dict[str, CacheEventKind] = {
    "load": CacheEventKind.LOAD,
    "swap_out": CacheEventKind.SWAP_OUT,
    "swap_in": CacheEventKind.SWAP_IN,
    "offload": CacheEventKind.OFFLOAD,
    "prefetch": CacheEventKind.PREFETCH,
}
_LOADS_FOR_REQUEST = frozenset({"load", "swap_in", "prefetch"})
_RETENTION_KINDS: dict[str, CacheEventKind] = {
    "retain": CacheEventKind.RETAIN,
    "drop": CacheEventKind.DROP,
    "carry": CacheEventKind.CARRY,
}
# Stages of the per-token path, bound once (an enum class attribute costs a lookup each time).
_SCHEDULE_QUEUE, _DECODE_QUEUE, _PREFILL_COMPUTE, _DECODE_COMPUTE, _DETOKENIZE = (
    Stage.SCHEDULE_QUEUE, Stage.DECODE_QUEUE, Stage.PREFILL_COMPUTE, Stage.DECODE_COMPUTE, Stage.DETOKENIZE)
_MAX_REMEMBERED = 1 << 16  # finished requests whose tenant a tracer keeps (a session's later retention events)
_FINISH_STATUS = {"stop": RequestStatus.OK, "length": RequestStatus.OK}
_DRAFT_SOURCES: dict[str, DraftSource] = {
    "model": DraftSource.MODEL,
    "ngram": DraftSource.NGRAM,
    "early_exit": DraftSource.EARLY_EXIT,
}


@dataclass(slots=True)
class _Req:
    """Tiling state of one in-flight request."""

    rid: int  # tokentrace request_id
    cursor_ns: int  # end of the last attributed interval
    next_token: int = 0  # index of the token whose interval is open
    first_token_ns: int = -1
    preempted_ns: int = -1  # start of the current preemption, -1 if running
    pending_tokens: list[hooks.TokenEmitted] = field(default_factory=list)
    pending_spec: hooks.SpeculativeStep | None = None  # this step's speculation, if any


class EngineTracer(hooks.EngineObserver):
    """Records a reference engine's activity on ``recorder``.

    Attach with ``engine.add_observer(EngineTracer(recorder))``; usually done by
    ``tokentrace.instrument(engine, ...)``. Holds a small state object per
    in-flight request, dropped when the request finishes or is aborted.
    """

    def __init__(self, recorder: Recorder) -> None:
        self._rec = recorder
        self._reqs: dict[str, _Req] = {}
        self._pending_finish: list[hooks.RequestFinished] = []
        self._tenants: OrderedDict[str, str] = OrderedDict()  # key -> tenant of recent requests (their ids' scope)

    def remember_tenant(self, key: str, tenant: str) -> None:
        """Note the tenant of request ``key``, for events that name it after it finished."""
        self._tenants[key] = tenant
        if len(self._tenants) > _MAX_REMEMBERED:
            self._tenants.popitem(last=False)

    def request_id(self, key: str) -> int:
        """The id of request ``key`` (scoped by its tenant when this tracer saw it begin)."""
        r = self._reqs.get(key)
        return r.rid if r is not None else request_id_of(key, self._tenants.get(key, ""))

    # -------------------------------------------------------------- tiling

    def _fill_to(self, r: _Req, t_ns: int, step: int = -1) -> None:
        """Attribute ``[cursor, t_ns)`` to waiting (queue) time of the open token."""
        if t_ns > r.cursor_ns:
            stage = Stage.SCHEDULE_QUEUE if r.next_token == 0 else Stage.DECODE_QUEUE
            self._rec.span(r.rid, stage, r.cursor_ns, t_ns, r.next_token, step)
            r.cursor_ns = t_ns

    def _interval(self, r: _Req, stage: Stage, start_ns: int, end_ns: int, step: int = -1,
                  num_bytes: int = -1, tier: int = -1, batch_size: int = -1) -> None:
        """An explicit interval; the part before the cursor (already attributed) is cut."""
        self._fill_to(r, start_ns, step)
        start_ns = max(start_ns, r.cursor_ns)
        if end_ns > start_ns:
            self._rec.span(r.rid, stage, start_ns, end_ns, r.next_token, step, num_bytes, tier, batch_size)
            r.cursor_ns = end_ns

    # -------------------------------------------------------------- requests

    def on_request_added(self, event: hooks.RequestAdded) -> None:
        rid = self._rec.request_begin(
            event.request_id, tenant=event.tenant, slo_class=event.slo_class,
            arrival_ns=event.arrival_ns, num_prompt_tokens=event.num_prompt_tokens, session=event.session,
        )
        self.remember_tenant(event.request_id, event.tenant)
        self._reqs[event.request_id] = _Req(rid=rid, cursor_ns=event.arrival_ns)

    def on_cache_lookup(self, event: hooks.CacheLookup) -> None:
        r = self._reqs.get(event.request_id)
        if r is None:
            return
        self._interval(r, Stage.CACHE_LOOKUP, event.start_ns, event.end_ns, event.step)
        rec = self._rec
        hit_blocks = sum(event.hit_blocks_per_tier)
        for tier, num_blocks in enumerate(event.hit_blocks_per_tier):
            if num_blocks:
                tokens = event.num_hit_tokens if hit_blocks == num_blocks else -1
                rec.cache_event(CacheEventKind.HIT, tier, num_blocks, event.start_ns, event.end_ns,
                                r.rid, tokens, -1, event.step)
        missed = event.num_query_tokens - event.num_hit_tokens
        if missed > 0:
            rec.cache_event(CacheEventKind.MISS, Tier.DEVICE, 0, event.start_ns, event.end_ns,
                            r.rid, missed, -1, event.step)
        if event.num_evicted_blocks > 0:
            rec.cache_event(CacheEventKind.MISS_EVICTED, Tier.DEVICE, event.num_evicted_blocks, event.start_ns,
                            event.end_ns, r.rid, event.num_evicted_tokens, -1, event.step)

    def on_tier_transfer(self, event: hooks.TierTransfer) -> None:
        r = self._reqs.get(event.request_id) if event.request_id is not None else None
        rid = r.rid if r is not None else -1
        kind = _TRANSFER_KINDS.get(event.kind)
        if kind is not None:
            # Loads and swap-ins land in the destination tier; swap-outs and
            # offloads leave the source tier.
            tier = event.dst_tier if event.kind in _LOADS_FOR_REQUEST else event.src_tier
            self._rec.cache_event(kind, tier, event.num_blocks, event.start_ns, event.end_ns,
                                  rid, -1, event.num_bytes, event.step)
        if r is not None and event.kind in _LOADS_FOR_REQUEST and r.preempted_ns < 0:
            self._interval(r, Stage.CACHE_LOAD, event.start_ns, event.end_ns, event.step,
                           event.num_bytes, event.src_tier)

    def on_retention(self, event: hooks.RetentionEvent) -> None:
        """A session retention decision: a ``retain``, ``drop`` or ``carry`` cache event of the
        turn it concerns (finished turns are no longer in flight, so the id is derived from the key)."""
        kind = _RETENTION_KINDS.get(event.kind)
        if kind is not None:
            self._rec.cache_event(kind, event.tier, event.num_blocks, event.start_ns, event.end_ns,
                                  self.request_id(event.request_id), event.num_tokens, -1, event.step)

    def on_evicted(self, event: hooks.Evicted) -> None:
        self._rec.cache_event(CacheEventKind.EVICT, event.tier, event.num_blocks, event.ns, event.ns,
                              -1, -1, -1, event.step)

    def on_request_preempted(self, event: hooks.RequestPreempted) -> None:
        r = self._reqs.get(event.request_id)
        if r is None:
            return
        self._fill_to(r, event.ns, event.step)
        r.preempted_ns = max(event.ns, r.cursor_ns)

    def on_request_resumed(self, event: hooks.RequestResumed) -> None:
        r = self._reqs.get(event.request_id)
        if r is None or r.preempted_ns < 0:
            return
        start, r.preempted_ns = r.preempted_ns, -1
        self._interval(r, Stage.SCHEDULE_PREEMPTED, start, event.ns, event.step)

    def on_token_emitted(self, event: hooks.TokenEmitted) -> None:
        r = self._reqs.get(event.request_id)
        if r is not None:
            r.pending_tokens.append(event)

    def on_speculative_step(self, event: hooks.SpeculativeStep) -> None:
        r = self._reqs.get(event.request_id)
        if r is not None:
            r.pending_spec = event

    def on_request_finished(self, event: hooks.RequestFinished) -> None:
        self._pending_finish.append(event)

    def on_request_aborted(self, event: hooks.RequestAborted) -> None:
        r = self._reqs.pop(event.request_id, None)
        if r is None:
            return
        if r.preempted_ns >= 0:
            self._interval(r, Stage.SCHEDULE_PREEMPTED, r.preempted_ns, event.ns)
        self._rec.request_end(r.rid, finish_ns=event.ns, status=RequestStatus.ABORTED,
                              first_token_ns=r.first_token_ns, num_output_tokens=event.num_output_tokens)

    # -------------------------------------------------------------- steps

    def on_step_end(self, event: hooks.StepEnd) -> None:
        batch_size = len(event.batch)
        for entry in event.batch:
            r = self._reqs.get(entry.request_id)
            if r is not None:
                self._step_for_request(r, entry, event, batch_size)
        used, total = event.num_blocks_used, event.num_blocks_total
        self._rec.step(
            event.step, event.start_ns, event.end_ns, batch_size, event.num_prefill_tokens,
            event.num_decode_tokens, event.num_waiting, event.num_running, event.num_preempted,
            used[0], total[0],
            used[1] if total[1] else -1, total[1] if total[1] else -1,
            used[2] if total[2] else -1, total[2] if total[2] else -1,
        )
        if self._pending_finish:
            finished, self._pending_finish = self._pending_finish, []
            for f in finished:
                self._finish(f)

    def _step_for_request(self, r: _Req, entry: hooks.BatchEntry, step: hooks.StepEnd,
                          batch_size: int) -> None:
        stage = _PREFILL_COMPUTE if entry.num_prefill_tokens else _DECODE_COMPUTE
        tokens = r.pending_tokens
        if tokens:
            r.pending_tokens = []
        spec, r.pending_spec = r.pending_spec, None
        if spec is not None and tokens:
            self._speculative_step(r, spec, tokens, step)
            return
        if not tokens:  # a non-final prefill chunk: no token sampled this step
            self._interval(r, stage, step.compute_start_ns, step.compute_end_ns, step.step,
                           batch_size=batch_size)
            return
        # Per token, inline (this runs for every token of every request): the wait up to the step's
        # compute (queue), [compute start, sampled) (compute), [sampled, emit) (detokenize), each cut at
        # the cursor as _interval cuts it; after the compute the cursor is at or past ``sampled``, after
        # the detokenize at or past ``emit``, so neither needs a wait before it.
        span, rid, step_no, compute_start_ns = self._rec.span, r.rid, step.step, step.compute_start_ns
        cursor, index = r.cursor_ns, r.next_token
        for tok in tokens:
            sampled_ns, emit_ns = tok.sampled_ns, tok.emit_ns
            if compute_start_ns > cursor:
                span(rid, _SCHEDULE_QUEUE if index == 0 else _DECODE_QUEUE, cursor, compute_start_ns, index,
                     step_no)
                cursor = compute_start_ns
            if sampled_ns > cursor:
                span(rid, stage, cursor, sampled_ns, index, step_no, -1, -1, batch_size)
                cursor = sampled_ns
            if emit_ns > cursor:
                span(rid, _DETOKENIZE, cursor, emit_ns, index, step_no)
                cursor = emit_ns
            self._rec.token(rid, tok.index, emit_ns=emit_ns, step=step_no)
            if r.first_token_ns < 0:
                r.first_token_ns = emit_ns
            index = tok.index + 1
        r.cursor_ns, r.next_token = cursor, index

    def _speculative_step(self, r: _Req, spec: hooks.SpeculativeStep, tokens: list[hooks.TokenEmitted],
                          step: hooks.StepEnd) -> None:
        """The tokens of one speculative step: the first carries the draft and verify phases,
        each its own detokenize; plus the request's ``spec_steps`` row."""
        self._interval(r, Stage.DECODE_DRAFT, spec.draft_start_ns, spec.draft_end_ns, step.step,
                       batch_size=spec.num_spec_seqs)
        self._interval(r, Stage.DECODE_VERIFY, spec.verify_start_ns, tokens[0].sampled_ns, step.step,
                       batch_size=spec.batch_size)
        for tok in tokens:
            self._interval(r, Stage.DETOKENIZE, tok.sampled_ns, tok.emit_ns, step.step)
            self._fill_to(r, tok.emit_ns, step.step)
            self._rec.token(r.rid, tok.index, emit_ns=tok.emit_ns, step=step.step)
            if r.first_token_ns < 0:
                r.first_token_ns = tok.emit_ns
            r.next_token = tok.index + 1
        self._rec.spec_step(
            r.rid, step.step, _DRAFT_SOURCES.get(spec.source, DraftSource.MODEL), spec.num_proposed,
            spec.num_accepted, spec.first_token_index, spec.draft_start_ns, spec.draft_end_ns,
            spec.verify_start_ns, spec.verify_end_ns, spec.batch_size, spec.num_spec_seqs)

    def _finish(self, event: hooks.RequestFinished) -> None:
        r = self._reqs.pop(event.request_id, None)
        if r is None:
            return
        self._rec.request_end(
            r.rid, finish_ns=event.finish_ns, status=_FINISH_STATUS.get(event.reason, RequestStatus.OK),
            first_token_ns=r.first_token_ns, num_output_tokens=event.num_output_tokens,
            num_cached_tokens=event.num_cached_tokens,
        )

    @property
    def num_in_flight(self) -> int:
        """Requests the tracer currently holds state for."""
        return len(self._reqs)
