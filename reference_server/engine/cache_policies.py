"""KV cache policies: eviction order, offload on evict, admission watermark, prefetch.

Each policy is a small object with one job, so a block manager configuration reads as
a sentence (``LRUEviction`` + ``OffloadOnEvict`` + ``WatermarkAdmission`` +
``PrefetchWaitingPrefixes``) and tests can swap one without touching the rest. The
request-ordering policies are in :mod:`reference_server.engine.scheduling_policies`.
All methods run on the engine thread, never block and never raise on valid state.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from reference_server.engine.sequence import Sequence

__all__ = [
    "DropOnEvict",
    "EvictionPolicy",
    "LRUEviction",
    "NoPrefetch",
    "OffloadOnEvict",
    "PrefetchTarget",
    "PrefetchWaitingPrefixes",
    "WatermarkAdmission",
]


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


class PrefetchTarget(Protocol):
    """What a prefetch policy drives: the block manager's ``prefetch`` (a protocol, so
    this module needs no import of the block manager, which imports it)."""

    def prefetch(self, seq: Sequence, *, max_blocks: int, evict: bool = True) -> int: ...


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

    def run(self, block_manager: PrefetchTarget, waiting: Iterable[Sequence]) -> int:
        """Issue prefetch copies; return the number of blocks prefetched."""
        done = 0
        for n, seq in enumerate(waiting):
            if n >= self.max_requests_per_step or done >= self.max_blocks_per_step:
                break
            if not seq.is_swapped:
                done += block_manager.prefetch(seq, max_blocks=self.max_blocks_per_step - done, evict=self.evict)
        return done


class NoPrefetch:
    """Prefetch nothing: lower-tier prefix hits are loaded when their request is admitted."""

    name = "no_prefetch"

    def run(self, block_manager: PrefetchTarget, waiting: Iterable[Sequence]) -> int:
        return 0
