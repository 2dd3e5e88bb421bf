"""Named policy objects: KV admission, eviction, offload and prefetch; request ordering.

Each policy is a small object with one job, so a configuration reads as a sentence
(``LRUEviction`` + ``OffloadOnEvict`` + ``PrefetchWaitingPrefixes`` + ``FCFSPolicy``)
and tests can swap one without touching the rest. All methods run on the engine
thread, never block and never raise on valid state.

Ordering policies give two keys per sequence: ``waiting_key`` (smaller is admitted
first) and ``victim_key`` (larger is preempted first when KV blocks run out).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from reference_server.engine.block_manager import BlockManager
    from reference_server.engine.sequence import Sequence

__all__ = [
    "FAIR_SHARE_MEASURES",
    "DropOnEvict",
    "EvictionPolicy",
    "FCFSPolicy",
    "LRUEviction",
    "NoPrefetch",
    "OffloadOnEvict",
    "PrefetchWaitingPrefixes",
    "SLODeadlinePolicy",
    "SchedulingPolicy",
    "WatermarkAdmission",
    "WeightedFairPolicy",
    "make_scheduling_policy",
]


FAIR_SHARE_MEASURES = ("tokens", "requests", "compute_time")
"""What :class:`WeightedFairPolicy` counts as a tenant's service."""

# ----------------------------------------------------------------------------- KV cache


class EvictionPolicy(Protocol):
    """Holds a tier's cached free blocks (ref count 0, content still valid) and picks
    the one to reuse when the tier has no plain free block left."""

    def add(self, block_id: int) -> None: ...
    def remove(self, block_id: int) -> None: ...
    def pop_victim(self) -> int: ...
    def __len__(self) -> int: ...


class LRUEviction:
    """Least recently freed first. O(1) add / remove / pop (an ordered dict)."""

    name = "lru"
    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def add(self, block_id: int) -> None:
        """Mark ``block_id`` freed just now (most recently used end)."""
        self._order[block_id] = None

    def remove(self, block_id: int) -> None:
        """Take ``block_id`` back into use (a prefix hit on a cached free block)."""
        del self._order[block_id]

    def pop_victim(self) -> int:
        """The least recently freed block; ``KeyError`` when empty (caller checks)."""
        return self._order.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._order

    def order(self) -> list[int]:
        """Eviction order, first victim first (for tests and stats)."""
        return list(self._order)


class OffloadOnEvict:
    """An evicted prefix block is copied to the next lower tier that has blocks (device
    -> host -> disk), keeping its hash, so a later request with that prefix loads it
    instead of recomputing it. Evictions from the lowest tier are dropped."""

    name = "offload_on_evict"

    def target_tier(self, src_tier: int, tier_sizes: tuple[int, ...]) -> int | None:
        for tier in range(src_tier + 1, len(tier_sizes)):
            if tier_sizes[tier] > 0:
                return tier
        return None


class DropOnEvict:
    """Evicted prefix blocks are forgotten (the vLLM single-tier behaviour)."""

    name = "drop_on_evict"

    def target_tier(self, src_tier: int, tier_sizes: tuple[int, ...]) -> int | None:
        return None


class WatermarkAdmission:
    """Admit a new (or recomputing) request only if, after its allocation, at least
    ``watermark_blocks`` device blocks stay free for running requests' decode growth;
    this trades a little utilisation for fewer preemptions. Running requests' own
    growth is not held to the watermark."""

    name = "watermark"
    __slots__ = ("watermark_blocks",)

    def __init__(self, watermark_blocks: int = 0) -> None:
        if watermark_blocks < 0:
            raise ValueError(f"watermark_blocks must be >= 0, got {watermark_blocks}")
        self.watermark_blocks = watermark_blocks

    def can_admit(self, num_needed_blocks: int, num_free_blocks: int) -> bool:
        return num_needed_blocks <= num_free_blocks - self.watermark_blocks


class PrefetchWaitingPrefixes:
    """After each scheduling pass, look at the first ``max_requests_per_step`` waiting
    requests (in admission order) and copy the prefix blocks they will hit in a lower
    tier up into the device tier, at most ``max_blocks_per_step`` blocks per step. When
    such a request is admitted, its prefix is then a device hit and costs no load on
    its critical path. ``evict``: prefetching may reuse cached free device blocks
    (least recently used first; they are offloaded as usual) rather than only plain
    free ones: a waiting request's prefix is a surer bet than an idle cached one."""

    name = "prefetch_waiting_prefixes"
    __slots__ = ("max_blocks_per_step", "max_requests_per_step", "evict")

    def __init__(self, max_blocks_per_step: int = 16, *, max_requests_per_step: int = 4, evict: bool = True) -> None:
        if max_blocks_per_step < 0 or max_requests_per_step < 0:
            raise ValueError("max_blocks_per_step and max_requests_per_step must be >= 0")
        self.max_blocks_per_step = max_blocks_per_step
        self.max_requests_per_step = max_requests_per_step
        self.evict = evict

    def run(self, block_manager: BlockManager, waiting: Iterable[Sequence]) -> int:
        """Issue prefetch copies; return the number of blocks prefetched."""
        done = 0
        for n, seq in enumerate(waiting):
            if n >= self.max_requests_per_step or done >= self.max_blocks_per_step:
                break
            if not seq.is_swapped:
                done += block_manager.prefetch(seq, max_blocks=self.max_blocks_per_step - done, evict=self.evict)
        return done


class NoPrefetch:
    name = "no_prefetch"

    def run(self, block_manager: BlockManager, waiting: Iterable[Sequence]) -> int:
        return 0


# ---------------------------------------------------------------------- request order


class SchedulingPolicy(Protocol):
    """Orders waiting requests and picks preemption victims."""

    name: str

    def waiting_key(self, seq: Sequence) -> tuple: ...
    def victim_key(self, seq: Sequence) -> tuple: ...
    def on_scheduled(self, seq: Sequence, num_tokens: int, *, is_new: bool) -> None: ...
    def on_computed(self, seq: Sequence, compute_ns: float) -> None: ...
    def on_tenant_active(self, tenant: str, active_tenants: Iterable[str]) -> None: ...


class FCFSPolicy:
    """First come, first served: admit by arrival; preempt the latest arrival."""

    name = "fcfs"

    def waiting_key(self, seq: Sequence) -> tuple:
        return (seq.arrival_ns, seq.seq_no)

    def victim_key(self, seq: Sequence) -> tuple:
        return (seq.arrival_ns, seq.seq_no)

    def on_scheduled(self, seq: Sequence, num_tokens: int, *, is_new: bool) -> None:
        return None

    def on_computed(self, seq: Sequence, compute_ns: float) -> None:
        return None

    def on_tenant_active(self, tenant: str, active_tenants: Iterable[str]) -> None:
        return None


class SLODeadlinePolicy:
    """Earliest TTFT deadline (arrival + class ttft_ms) first; preempt the lowest class
    priority first, and among equals the latest deadline."""

    name = "slo"

    def waiting_key(self, seq: Sequence) -> tuple:
        deadline_ns = seq.arrival_ns + int(seq.slo_class.ttft_ms * 1_000_000)
        return (deadline_ns, seq.seq_no)

    def victim_key(self, seq: Sequence) -> tuple:
        deadline_ns = seq.arrival_ns + int(seq.slo_class.ttft_ms * 1_000_000)
        return (-seq.slo_class.priority, deadline_ns, seq.seq_no)

    def on_scheduled(self, seq: Sequence, num_tokens: int, *, is_new: bool) -> None:
        return None

    def on_computed(self, seq: Sequence, compute_ns: float) -> None:
        return None

    def on_tenant_active(self, tenant: str, active_tenants: Iterable[str]) -> None:
        return None


class WeightedFairPolicy:
    """Weighted fair queueing by service: each tenant has a virtual time = service
    received / weight, where service is tokens computed (``by="tokens"``), requests
    admitted (``by="requests"``) or forward-pass time (``by="compute_time"``, ns: each
    step's compute time split over its chunks in proportion to their tokens, so a
    token computed in a small batch costs more than one in a large batch). The tenant
    with the smallest virtual time goes first (FCFS within a tenant); the running
    request of the tenant with the largest virtual time is preempted first. A tenant
    that (re)joins starts at the smallest virtual time among active tenants, so idle
    periods do not bank credit."""

    name = "fair"

    def __init__(self, weights: Mapping[str, float], *, by: str = "tokens") -> None:
        if by not in FAIR_SHARE_MEASURES:
            raise ValueError(f"by must be one of {FAIR_SHARE_MEASURES}, got {by!r}")
        self.by = by
        self._weights = dict(weights)
        self.virtual_time: dict[str, float] = {name: 0.0 for name in self._weights}
        self.service: dict[str, float] = {name: 0.0 for name in self._weights}

    def on_tenant_active(self, tenant: str, active_tenants: Iterable[str]) -> None:
        """Called when ``tenant`` goes from no active request to one."""
        others = [self.virtual_time[t] for t in active_tenants if t != tenant]
        if others:
            self.virtual_time[tenant] = max(self.virtual_time[tenant], min(others))

    def waiting_key(self, seq: Sequence) -> tuple:
        return (self.virtual_time[seq.tenant], seq.arrival_ns, seq.seq_no)

    def victim_key(self, seq: Sequence) -> tuple:
        return (self.virtual_time[seq.tenant], seq.arrival_ns, seq.seq_no)

    def on_scheduled(self, seq: Sequence, num_tokens: int, *, is_new: bool) -> None:
        if self.by == "tokens":
            self._charge(seq.tenant, float(num_tokens))
        elif self.by == "requests" and is_new:
            self._charge(seq.tenant, 1.0)

    def on_computed(self, seq: Sequence, compute_ns: float) -> None:
        if self.by == "compute_time":
            self._charge(seq.tenant, compute_ns)

    def _charge(self, tenant: str, cost: float) -> None:
        self.service[tenant] += cost
        self.virtual_time[tenant] += cost / self._weights[tenant]


def make_scheduling_policy(name: str, *, weights: Mapping[str, float], by: str = "tokens") -> SchedulingPolicy:
    """Build the ordering policy named in :class:`EngineConfig` (``ValueError`` if unknown)."""
    if name == "fcfs":
        return FCFSPolicy()
    if name == "slo":
        return SLODeadlinePolicy()
    if name == "fair":
        return WeightedFairPolicy(weights, by=by)
    raise ValueError(f"unknown scheduling policy {name!r}; known: fcfs, slo, fair")
