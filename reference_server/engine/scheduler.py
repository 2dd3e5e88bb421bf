"""Continuous-batching scheduler: which tokens of which requests run in the next step.

Each step spends a token budget (``max_num_batched_tokens``) over at most
``max_num_seqs`` sequences, in this order:

1. running requests in decode (one token each), then running requests still in
   prefill (the next chunk of a long prompt: chunked prefill), both in policy order;
2. if nothing was preempted in this step, waiting requests in policy order (new ones,
   and preempted ones: swapped-out requests are swapped back in, recompute ones go
   through the prefix cache again). Admission stops at the first request that does not
   fit (head-of-line blocking keeps the policy's order honest); a request whose tenant
   is at its concurrency cap or out of tokens is skipped instead.

When a running request needs a block and none is free, the running request the policy
ranks last (``victim_key``: FCFS latest arrival; SLO lowest class priority then latest
deadline; fair the tenant furthest ahead) among those not yet scheduled in this step is
preempted, by swap (if the lower tier has room) or by recompute; possibly the request
itself. Engine thread only; nothing here blocks.

The plan carries what happened while it was made (cache lookups, preemptions,
resumptions, evictions) as the observer events of :mod:`reference_server.engine.hooks`,
stamped with the step number the engine passes in; the engine hands them to its
observers as they are.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

from reference_server.engine.block_manager import BlockManager, CopyOp
from reference_server.engine.cache_policies import NoPrefetch, PrefetchWaitingPrefixes
from reference_server.engine.config import TenantConfig
from reference_server.engine.hooks import CacheLookup, Evicted, RequestPreempted, RequestResumed
from reference_server.engine.retention import SessionRetention
from reference_server.engine.scheduling_policies import SchedulingPolicy
from reference_server.engine.sequence import FinishReason, PreemptionMode, Sequence, SequenceStatus

__all__ = ["ScheduledChunk", "Scheduler", "SchedulerOutput", "TenantState"]


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Compute ``num_tokens`` tokens of a request from position ``start_pos``.
    ``samples``: the chunk reaches the last known token, so its logits give a new token."""

    request_id: str
    start_pos: int
    num_tokens: int
    is_prefill: bool
    samples: bool


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's plan and the events of making it, in the order they happened within
    each kind. Queue lengths are after scheduling."""

    chunks: tuple[ScheduledChunk, ...]
    copy_ops: tuple[CopyOp, ...]
    evictions: tuple[Evicted, ...]
    cache_lookups: tuple[CacheLookup, ...]  # one per request admitted through the prefix cache
    preempted: tuple[RequestPreempted, ...]
    resumed: tuple[RequestResumed, ...]
    num_waiting: int
    num_running: int
    num_preempted: int

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if c.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if not c.is_prefill)


class TenantState:
    """A tenant's live counters and token bucket (tokens; refilled on the engine clock)."""

    __slots__ = ("config", "num_running", "num_active", "tokens", "last_refill_ns")

    def __init__(self, config: TenantConfig) -> None:
        self.config = config
        self.num_running = 0  # admitted and holding device blocks
        self.num_active = 0  # waiting or running
        cap = config.bucket_capacity
        self.tokens = math.inf if cap is None else cap
        self.last_refill_ns: int | None = None  # engine monotonic clock, ns

    def refill(self, now_ns: int) -> None:
        cap, rate = self.config.bucket_capacity, self.config.max_tokens_per_s
        if cap is None or rate is None:
            return
        if self.last_refill_ns is not None and now_ns > self.last_refill_ns:
            self.tokens = min(cap, self.tokens + rate * (now_ns - self.last_refill_ns) / 1e9)
        if self.last_refill_ns is None or now_ns > self.last_refill_ns:
            self.last_refill_ns = now_ns

    @property
    def allowance(self) -> float:
        """Whole tokens the tenant may be scheduled now (inf = unlimited)."""
        return math.inf if math.isinf(self.tokens) else math.floor(max(self.tokens, 0.0))

    @property
    def can_admit(self) -> bool:
        cap = self.config.max_concurrency
        return cap is None or self.num_running < cap


class Scheduler:
    """Holds the waiting and running requests and plans each step. Engine thread only."""

    def __init__(
        self,
        *,
        block_manager: BlockManager,
        policy: SchedulingPolicy,
        tenants: Mapping[str, TenantConfig],
        max_num_batched_tokens: int,
        max_num_seqs: int,
        enable_chunked_prefill: bool = True,
        preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE,
        prefetch: PrefetchWaitingPrefixes | NoPrefetch | None = None,
        retention: SessionRetention | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.policy = policy
        self.tenants = {name: TenantState(cfg) for name, cfg in tenants.items()}
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_chunked_prefill = enable_chunked_prefill
        self.preemption_mode = PreemptionMode(preemption_mode)
        self.prefetch = prefetch if prefetch is not None else NoPrefetch()
        self.retention = retention if retention is not None else SessionRetention(block_manager)
        self.waiting: dict[str, Sequence] = {}  # insertion ordered; sorted by policy per step
        self.running: dict[str, Sequence] = {}
        self.num_preempted = 0  # waiting requests that were preempted
        self.num_preemptions = {PreemptionMode.RECOMPUTE: 0, PreemptionMode.SWAP: 0}  # counters

    # ------------------------------------------------------------------ queue changes

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def get(self, request_id: str) -> Sequence | None:
        return self.running.get(request_id) or self.waiting.get(request_id)

    def add(self, seq: Sequence) -> None:
        """Queue a new request (validated by the engine: known tenant, unique id)."""
        tenant = self.tenants[seq.tenant]
        if tenant.num_active == 0:
            active = [name for name, t in self.tenants.items() if t.num_active > 0]
            self.policy.on_tenant_active(seq.tenant, active)
        tenant.num_active += 1
        self.waiting[seq.request_id] = seq

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a request (running or waiting): free its blocks in every tier (the session
        retention policy decides what becomes of a session turn's cached blocks)."""
        self.retention.end_turn(seq, self._remove, time.monotonic_ns())
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, request_id: str) -> Sequence | None:
        """Finish ``request_id`` as aborted; ``None`` if it is not queued or running."""
        seq = self.get(request_id)
        if seq is None:
            return None
        self.finish(seq, FinishReason.ABORT)
        return seq

    def start_running(self, seq: Sequence) -> None:
        """Move queued ``seq`` to running now, outside ``schedule``: for a request whose KV
        was computed elsewhere (a prefill engine's transfer), so its next chunk is a decode.
        ``KeyError`` if it is not waiting."""
        del self.waiting[seq.request_id]
        seq.status = SequenceStatus.RUNNING
        seq.preempt_mode = None
        self.running[seq.request_id] = seq
        self.tenants[seq.tenant].num_running += 1

    def preempt(self, request_id: str, mode: PreemptionMode | None = None) -> PreemptionMode:
        """Preempt a running request (swap falls back to recompute when the lower tier
        is full). Returns the mode used; ``ValueError`` if it is not running."""
        seq = self.running.get(request_id)
        if seq is None:
            raise ValueError(f"request {request_id!r} is not running")
        return self._preempt(seq, self.preemption_mode if mode is None else PreemptionMode(mode))

    # ------------------------------------------------------------------ planning

    def schedule(self, now_ns: int, *, step: int) -> SchedulerOutput:
        """Plan engine step number ``step`` at engine time ``now_ns`` (monotonic, ns)."""
        for tenant in self.tenants.values():
            tenant.refill(now_ns)
        self.retention.step = step
        self.retention.expire(now_ns)
        plan = _StepPlan(self.max_num_batched_tokens, step)
        self._schedule_running(plan)
        order = sorted(self.waiting.values(), key=self.policy.waiting_key)
        if not plan.preempted:
            self._schedule_waiting(plan, order)
        if self.waiting:
            self.prefetch.run(self.block_manager, (s for s in order if s.request_id in self.waiting))
        bm = self.block_manager
        return SchedulerOutput(
            chunks=tuple(plan.chunks), copy_ops=bm.take_ops(),
            evictions=bm.take_evictions(step=step, ns=time.monotonic_ns()),
            cache_lookups=tuple(plan.lookups), preempted=tuple(plan.preempted), resumed=tuple(plan.resumed),
            num_waiting=len(self.waiting), num_running=len(self.running), num_preempted=self.num_preempted,
        )

    def update(self, output: SchedulerOutput, sampled: Mapping[str, int], *, compute_ns: int = 0) -> None:
        """Record that the planned chunks were computed (taking ``compute_ns`` of forward
        time, shared by tokens); append sampled tokens. ``sampled`` maps the request id
        of every ``samples`` chunk to its new token."""
        num_tokens = sum(c.num_tokens for c in output.chunks)
        for chunk in output.chunks:
            seq = self.running.get(chunk.request_id)
            if seq is None:  # finished or aborted in between (not in the engine's own loop)
                continue
            seq.num_computed_tokens += chunk.num_tokens
            self.block_manager.commit(seq)
            if chunk.samples:
                seq.token_ids.append(sampled[chunk.request_id])
            if compute_ns:
                self.policy.on_computed(seq, compute_ns * chunk.num_tokens / num_tokens)

    def _schedule_running(self, plan: _StepPlan) -> None:
        order = sorted(self.running.values(), key=self.policy.waiting_key)
        decodes = [s for s in order if s.num_computed_tokens >= s.prefill_end]
        prefills = [s for s in order if s.num_computed_tokens < s.prefill_end]
        for seq in decodes + prefills:
            if len(plan.chunks) >= self.max_num_seqs or plan.budget == 0:
                break
            if seq.request_id in plan.preempted_ids:
                continue
            n = self._chunk_size(seq, plan.budget)
            if n == 0:
                continue
            while not self.block_manager.allocate_slots(seq, n):
                if self.retention.may_release_oldest(time.monotonic_ns()):
                    continue  # a session's pinned blocks yield before any running request is preempted
                victim = max(
                    (s for s in self.running.values() if s.request_id not in plan.scheduled_ids),
                    key=self.policy.victim_key,
                )
                mode = self._preempt(victim, self.preemption_mode)
                plan.preempted.append(RequestPreempted(victim.request_id, plan.step, mode.value,
                                                       time.monotonic_ns()))
                plan.preempted_ids.add(victim.request_id)
                if victim is seq:
                    break
            else:
                self._add_chunk(plan, seq, n)

    def _schedule_waiting(self, plan: _StepPlan, order: list[Sequence]) -> None:
        bm = self.block_manager
        for seq in order:
            if len(plan.chunks) >= self.max_num_seqs or plan.budget == 0:
                break
            tenant = self.tenants[seq.tenant]
            if not tenant.can_admit or tenant.allowance < 1:
                continue
            if seq.is_swapped:
                if not bm.swap_in(seq):
                    break
                self._to_running(seq, plan, PreemptionMode.SWAP)
                n = self._chunk_size(seq, plan.budget)
                if n and bm.allocate_slots(seq, n):
                    self._add_chunk(plan, seq, n)
                continue
            start_ns = time.monotonic_ns()  # engine monotonic clock, ns
            match = bm.match_prefix(seq)
            n = self._chunk_size(seq, plan.budget, num_computed=match.num_tokens)
            if n == 0:
                break
            admitted = bm.allocate_new(seq, match, n)
            while admitted is None and self.retention.may_release_oldest(time.monotonic_ns()):
                admitted = bm.allocate_new(seq, match, n)  # releasing a pin evicts nothing: the match holds
            if admitted is None:
                break
            plan.lookups.append(CacheLookup(
                seq.request_id, plan.step, start_ns, time.monotonic_ns(), seq.num_tokens, match.num_tokens,
                match.num_blocks_per_tier, match.num_evicted_blocks, match.num_evicted_tokens,
            ))
            is_new = seq.status is SequenceStatus.WAITING
            if is_new:
                seq.num_cached_tokens = match.num_tokens
                self.retention.admitted(seq, match, time.monotonic_ns())
            self._to_running(seq, plan, None if is_new else PreemptionMode.RECOMPUTE)
            seq.prefill_end = seq.num_tokens
            self._add_chunk(plan, seq, n, is_new=is_new)

    def _chunk_size(self, seq: Sequence, budget: int, *, num_computed: int | None = None) -> int:
        """Tokens of ``seq`` to compute this step (0 = none fit), under the step budget
        and the tenant's token bucket. Without chunked prefill a prompt runs whole."""
        remaining = seq.num_tokens - (seq.num_computed_tokens if num_computed is None else num_computed)
        allowance = self.tenants[seq.tenant].allowance
        if allowance < 1:
            return 0
        if not self.enable_chunked_prefill:
            return remaining if remaining <= budget else 0
        return int(min(remaining, budget, allowance))

    def _add_chunk(self, plan: _StepPlan, seq: Sequence, n: int, *, is_new: bool = False) -> None:
        plan.add_chunk(seq, n)
        self.tenants[seq.tenant].tokens -= n  # may go into debt without chunked prefill
        self.policy.on_scheduled(seq, n, is_new=is_new)

    def _to_running(self, seq: Sequence, plan: _StepPlan, resumed: PreemptionMode | None) -> None:
        if resumed is not None:
            self.num_preempted -= 1
            plan.resumed.append(RequestResumed(seq.request_id, plan.step, resumed.value, time.monotonic_ns()))
        self.start_running(seq)

    def _preempt(self, seq: Sequence, mode: PreemptionMode) -> PreemptionMode:
        if mode is PreemptionMode.SWAP and not self.block_manager.swap_out(seq):
            mode = PreemptionMode.RECOMPUTE
        if mode is PreemptionMode.RECOMPUTE:
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
        del self.running[seq.request_id]
        self.tenants[seq.tenant].num_running -= 1
        seq.status = SequenceStatus.PREEMPTED
        seq.preempt_mode = mode
        self.waiting[seq.request_id] = seq
        self.num_preempted += 1
        self.num_preemptions[mode] += 1
        return mode

    def _remove(self, seq: Sequence) -> None:
        rid = seq.request_id
        if self.running.pop(rid, None) is not None:
            self.tenants[seq.tenant].num_running -= 1
        elif self.waiting.pop(rid, None) is not None:
            if seq.status is SequenceStatus.PREEMPTED:
                self.num_preempted -= 1
        else:
            return
        self.tenants[seq.tenant].num_active -= 1
        self.block_manager.free(seq)


class _StepPlan:
    """Scratch state of one ``schedule`` call."""

    __slots__ = ("budget", "step", "chunks", "scheduled_ids", "preempted", "preempted_ids", "resumed", "lookups")

    def __init__(self, budget: int, step: int) -> None:
        self.budget = budget
        self.step = step  # the engine's step number, stamped on the plan's events
        self.chunks: list[ScheduledChunk] = []
        self.scheduled_ids: set[str] = set()
        self.preempted: list[RequestPreempted] = []
        self.preempted_ids: set[str] = set()
        self.resumed: list[RequestResumed] = []
        self.lookups: list[CacheLookup] = []

    def add_chunk(self, seq: Sequence, n: int) -> None:
        start = seq.num_computed_tokens
        self.chunks.append(ScheduledChunk(
            seq.request_id, start, n, is_prefill=start < seq.prefill_end, samples=start + n == seq.num_tokens,
        ))
        self.scheduled_ids.add(seq.request_id)
        self.budget -= n
