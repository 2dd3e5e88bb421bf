"""A continuous-batching engine as a state machine over simulated time: the reference scheduler's policy.

:class:`SimEngine` mirrors ``reference_server/engine/scheduler.py`` and its block manager step by step:

1. running requests in decode (one token each), then running requests still in prefill (the next chunk
   under the token budget: chunked prefill), in policy order, at most ``max_num_seqs`` of them;
2. when a running request needs a KV block and none is free, the running request the policy ranks last
   among those not yet scheduled this step is preempted by recompute (its blocks freed, its computed
   tokens forgotten), possibly the request itself;
3. if nothing was preempted, waiting requests in policy order (``fcfs``: arrival; ``slo``: TTFT deadline;
   ``fair``: the tenant with the least service per weight, weight 1), each through the prefix cache (the
   prompt tokens the run found cached are found cached again); admission stops at the first request that
   does not fit (no budget, no sequence slot, or not enough free blocks: head-of-line blocking).

KV blocks: a request holds ``ceil(tokens it has computed / block_size)`` device blocks (prefix blocks it
shares with another request are counted for each: the pool is a bound, the cache's own sharing saves
blocks the simulator does not). Without chunked prefill a prompt runs whole or waits. As in the reference
block manager, a request that leaves the engine or is preempted frees its blocks tail first, and those full
of computed tokens stay cached until a later allocation evicts them (plain free blocks are taken first,
then the least recently freed cached one): a request preempted by recompute finds the leading blocks of its
own that are still cached when it is admitted again, and recomputes only the rest (the reference engine's
prefix cache does this; recomputing the whole sequence put hundreds of extra prefill tokens into the one
step that readmitted it, and its time on every request decoding in that step).

Plain Python over small state: no clock, no I/O. A step is planned by :meth:`SimEngine.plan` and completed
by :meth:`SimEngine.complete` at its end time, which samples one token for every chunk that reaches the
end of its sequence.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

__all__ = ["SimRequest", "SimStep", "SimEngine", "POLICIES"]

POLICIES = ("fcfs", "slo", "fair")


@dataclass(slots=True)
class SimRequest:
    """One request inside a simulated engine (times: ns)."""

    rid: int
    arrival_ns: int  # when it reached this engine
    num_prompt_tokens: int
    num_output_tokens: int  # tokens this engine generates before the request leaves it
    num_cached_tokens: int = 0  # prompt tokens the prefix cache holds when it is admitted
    deadline_ns: int = 0  # arrival + its class's TTFT target (policy "slo")
    priority: int = 0  # its class's priority (larger: preempted last)
    tenant: str = ""
    seq_no: int = 0
    num_generated: int = 0  # tokens sampled so far (by any engine)
    num_computed: int = 0  # tokens whose KV is computed on this engine
    prefill_end: int = 0  # the position prefill runs to (prompt + tokens generated before a preemption)
    num_blocks: int = 0
    num_preemptions: int = 0
    emit_ns: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_generated

    @property
    def done(self) -> bool:
        return self.num_generated >= self.num_output_tokens


@dataclass(frozen=True, slots=True)
class SimStep:
    """One planned step: (request, tokens) chunks and whether each samples a token."""

    chunks: tuple[tuple[SimRequest, int, bool], ...]
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int
    decode_context: int = 0  # summed length of the sequences that decode in the step

    @property
    def num_seqs(self) -> int:
        return len(self.chunks)


class SimEngine:
    """One engine instance: waiting and running requests, the KV pool, the step planner."""

    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, block_size: int, num_device_blocks: int,
                 scheduling_policy: str = "fcfs", chunked_prefill: bool = True) -> None:
        if scheduling_policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {scheduling_policy!r}; known: {', '.join(POLICIES)}")
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("block_size", block_size), ("num_device_blocks", num_device_blocks)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.num_device_blocks = num_device_blocks
        self.policy = scheduling_policy
        self.chunked_prefill = chunked_prefill
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.num_used_blocks = 0
        self.cached: OrderedDict[tuple[int, int], None] = OrderedDict()  # free blocks still holding computed
        # tokens, (request seq_no, block index), least recently freed first: counted in free_blocks
        self.service: dict[str, float] = {}  # policy "fair": tokens scheduled per tenant
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue

    def add(self, req: SimRequest) -> None:
        """Queue a request that reached the engine."""
        if self.policy == "fair" and req.tenant not in self.service:
            active = [self.service[r.tenant] for r in self.waiting + self.running if r.tenant in self.service]
            self.service[req.tenant] = min(active) if active else 0.0
        req.prefill_end = req.num_tokens
        self.waiting.append(req)

    def add_running(self, req: SimRequest) -> bool:
        """Start a request whose KV was computed elsewhere (a prefill engine's hand-over) as running, if its
        blocks fit; False (it waits and recomputes its prompt) otherwise."""
        need = self._blocks_for(req.num_tokens - 1)
        if need > self.free_blocks:
            self.add(req)
            return False
        req.num_computed = req.num_tokens - 1
        req.prefill_end = req.num_computed
        req.num_blocks = need
        self._take_blocks(need)
        self.running.append(req)
        return True

    @property
    def free_blocks(self) -> int:
        return self.num_device_blocks - self.num_used_blocks

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def num_in_system(self) -> int:
        return len(self.waiting) + len(self.running)

    def _key(self, r: SimRequest) -> tuple:
        if self.policy == "slo":
            return (r.deadline_ns, r.seq_no)
        if self.policy == "fair":
            return (self.service.get(r.tenant, 0.0), r.arrival_ns, r.seq_no)
        return (r.arrival_ns, r.seq_no)

    def _victim_key(self, r: SimRequest) -> tuple:
        if self.policy == "slo":
            return (-r.priority, r.deadline_ns, r.seq_no)
        return self._key(r)

    def _blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def _take_blocks(self, num: int) -> None:
        """Allocate ``num`` free blocks (the caller checked :attr:`free_blocks`): plain free ones first, then
        cached ones, the least recently freed first (evicting what they held)."""
        for _ in range(num - (self.free_blocks - len(self.cached))):
            self.cached.popitem(last=False)
        self.num_used_blocks += num

    def _free_blocks(self, r: SimRequest) -> None:
        """Free every block ``r`` holds, tail first; those full of computed tokens stay cached (evictable)."""
        for i in reversed(range(min(r.num_computed // self.block_size, r.num_blocks))):
            self.cached[(r.seq_no, i)] = None
        self.num_used_blocks -= r.num_blocks
        r.num_blocks = 0

    def _own_cached_blocks(self, r: SimRequest) -> int:
        """Leading blocks of ``r``'s own (from before a preemption) still cached, at most those of all but its last
        token (whose logits give the next token)."""
        num = 0
        while num < (r.num_tokens - 1) // self.block_size and (r.seq_no, num) in self.cached:
            num += 1
        return num

    # ------------------------------------------------------------------ planning

    def plan(self) -> SimStep:
        """The next step's chunks (the scheduler's order; see the module doc)."""
        budget = self.max_num_batched_tokens
        chunks: list[tuple[SimRequest, int, bool]] = []
        scheduled: set[int] = set()
        preempted: set[int] = set()
        order = sorted(self.running, key=self._key)
        decodes = [r for r in order if r.num_computed >= r.prefill_end]
        prefills = [r for r in order if r.num_computed < r.prefill_end]
        for r in decodes + prefills:
            if len(chunks) >= self.max_num_seqs or budget == 0:
                break
            if id(r) in preempted:
                continue
            n = self._chunk(r.num_tokens - r.num_computed, budget)
            if n == 0:
                continue
            while self._blocks_for(r.num_computed + n) - r.num_blocks > self.free_blocks:
                victim = max((s for s in self.running if id(s) not in scheduled), key=self._victim_key)
                self._preempt(victim)
                preempted.add(id(victim))
                if victim is r:
                    break
            else:
                budget -= self._take(chunks, scheduled, r, n)
        if not preempted:
            budget = self._admit(chunks, scheduled, budget)
        num_prefill = sum(n for r, n, _ in chunks if r.num_computed < r.prefill_end)
        num_decode = sum(n for r, n, _ in chunks) - num_prefill
        context = sum(r.num_tokens for r, n, _ in chunks if r.num_computed >= r.prefill_end)
        return SimStep(tuple(chunks), num_prefill, num_decode, len(preempted), context)

    def _admit(self, chunks: list, scheduled: set[int], budget: int) -> int:
        for r in sorted(self.waiting, key=self._key):
            if len(chunks) >= self.max_num_seqs or budget == 0:
                break
            own = self._own_cached_blocks(r) if r.num_preemptions else 0
            cached = min(r.num_cached_tokens, r.num_prompt_tokens - 1)
            cached = max(cached - cached % self.block_size, own * self.block_size)  # whole blocks match
            n = self._chunk(r.num_tokens - cached, budget)
            if n == 0:
                break
            need = self._blocks_for(cached + n)
            if need > self.free_blocks:
                break
            self.waiting.remove(r)
            for i in range(own):  # its own cached blocks are in use again, not evicted by the rest
                del self.cached[(r.seq_no, i)]
            self.num_used_blocks += own
            self._take_blocks(need - own)
            r.num_computed = cached
            r.prefill_end = r.num_tokens
            r.num_blocks = need
            self.running.append(r)
            budget -= self._take(chunks, scheduled, r, n, allocated=True)
        return budget

    def _chunk(self, remaining: int, budget: int) -> int:
        if not self.chunked_prefill:
            return remaining if remaining <= budget else 0
        return min(remaining, budget)

    def _take(self, chunks: list, scheduled: set[int], r: SimRequest, n: int, *, allocated: bool = False) -> int:
        if not allocated:
            need = self._blocks_for(r.num_computed + n) - r.num_blocks
            self._take_blocks(need)
            r.num_blocks += need
        samples = r.num_computed + n == r.num_tokens
        chunks.append((r, n, samples))
        scheduled.add(id(r))
        if self.policy == "fair":
            self.service[r.tenant] = self.service.get(r.tenant, 0.0) + n
        return n

    def _preempt(self, r: SimRequest) -> None:
        self.running.remove(r)
        self._free_blocks(r)
        r.num_computed = 0
        r.num_preemptions += 1
        r.prefill_end = r.num_tokens
        self.num_preemptions += 1
        self.waiting.append(r)

    # ------------------------------------------------------------------ completion

    def complete(self, step: SimStep, end_ns: int) -> list[SimRequest]:
        """Apply a step that ended at ``end_ns``: computed tokens, sampled tokens (emitted at ``end_ns``);
        returns the requests that left the engine (their last token sampled), their blocks freed."""
        left = []
        for r, n, samples in step.chunks:
            r.num_computed += n
            if samples:
                r.num_generated += 1
                r.emit_ns.append(end_ns)
                if r.done:
                    left.append(r)
        for r in left:
            self.release(r)
        return left

    def release(self, r: SimRequest) -> None:
        """The request leaves the engine (finished, or handed to a decode engine): its blocks are freed."""
        if r in self.running:
            self.running.remove(r)
        self._free_blocks(r)
