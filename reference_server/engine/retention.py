"""KV retention between the turns of a session: what happens to a finished turn's blocks.

A session (a chat, an agent loop) sends turn after turn; each turn's prompt is the
previous turn's prompt and answer plus new input, so the previous turn's KV is the next
turn's prefix, if it is still there when the next turn arrives after the think (or tool
call) time. Four policies, chosen by name (``EngineConfig.kv_retention``):

* ``lru``: nothing special: the finished turn's full blocks stay in the prefix cache as
  cached free blocks and compete with everything else under LRU eviction (the default,
  and the behaviour of an engine that knows nothing of sessions).
* ``keep``: pin the finished turn's device blocks for the session (an extra reference,
  so eviction cannot take them) until the session's next turn is admitted, ``ttl_s``
  passes, or the pinned blocks would exceed ``max_pinned_blocks`` (oldest session first).
  Pins yield under pressure: when a running request needs a block, or a waiting one cannot
  be admitted, the scheduler releases the oldest pin first (:meth:`SessionRetention.may_release_oldest`),
  before preempting anyone; released blocks stay cached under LRU like any other.
* ``offload``: copy the finished turn's device blocks one tier down (host, else disk) and
  free the device copies at once: the device tier stays free for running requests and the
  next turn loads its prefix instead of recomputing it. Blocks the lower tier has no room for
  (or all of them, without a lower tier) stay cached on the device as under ``lru``.
* ``drop``: forget the finished turn's cached device blocks at once (the next turn
  recomputes its whole prompt): the lower bound that the other policies are measured against.

Whatever the policy, the session's previous turn's block keys are remembered, so that at
the next turn's admission the engine can say how many of its leading prompt blocks the
previous turn had computed (*carried*), whichever policy kept them or not; the cache
lookup says how many were found. Decisions are reported as :class:`RetentionEvent`
(``retain`` intervals, ``drop``, ``carry``); the copies an offload plans are ordinary
``offload`` tier transfers. Engine thread only; nothing here blocks or raises on valid state.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from reference_server.engine.config import RETENTION_POLICIES
from reference_server.engine.hooks import RetentionEvent
from reference_server.engine.tiers import DEVICE

if TYPE_CHECKING:
    from collections.abc import Callable

    from reference_server.engine.block_manager import BlockManager
    from reference_server.engine.prefix_cache import PrefixMatch
    from reference_server.engine.sequence import Sequence

__all__ = ["RETENTION_POLICIES", "SessionRetention"]

MAX_REMEMBERED_SESSIONS = 4096  # previous-turn block keys kept for this many sessions (least recent dropped)


@dataclass(slots=True)
class _Pinned:
    request_id: str  # the finished turn whose blocks are pinned
    block_ids: list[int]  # device blocks holding one extra reference each
    since_ns: int  # turn end, engine monotonic clock


class SessionRetention:
    """Applies one retention policy to the turns of every session (see module doc).

    ``ttl_s``: the longest a ``keep`` pin lasts (``None``: until the next turn or the
    capacity bound); ``max_pinned_blocks``: the most device blocks pinned at once.
    """

    def __init__(self, block_manager: BlockManager, policy: str = "lru", *, ttl_s: float | None = None,
                 max_pinned_blocks: int | None = None) -> None:
        if policy not in RETENTION_POLICIES:
            raise ValueError(f"unknown KV retention policy {policy!r}; choose one of {', '.join(RETENTION_POLICIES)}")
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"retention TTL must be positive seconds, got {ttl_s!r}")
        self.bm = block_manager
        self.policy = policy
        self.ttl_ns = None if ttl_s is None else int(ttl_s * 1e9)
        n_device = block_manager.device.num_blocks
        self.max_pinned_blocks = n_device // 2 if max_pinned_blocks is None else max_pinned_blocks
        if self.max_pinned_blocks < 0:
            raise ValueError("max_pinned_blocks must be >= 0")
        self._pinned: OrderedDict[str, _Pinned] = OrderedDict()  # session -> pin, oldest first
        self._num_pinned = 0
        self._previous: OrderedDict[str, list[int]] = OrderedDict()  # session -> last turn's block keys
        self._admitted: set[str] = set()  # session turns admitted here through the prefix cache, not yet ended
        self._events: list[RetentionEvent] = []
        self.step = 0  # the engine step events are stamped with (set by the scheduler)

    # ------------------------------------------------------------------ queries

    @property
    def num_pinned_blocks(self) -> int:
        return self._num_pinned

    def take_events(self) -> list[RetentionEvent]:
        """The decisions made since the last call, in order."""
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ turn end

    def end_turn(self, seq: Sequence, free: Callable[[Sequence], None], now_ns: int) -> None:
        """``seq`` finished: remember its block keys, apply the policy around ``free(seq)``
        (which releases its blocks). Only turns admitted here (:meth:`admitted`) are retained: a
        turn whose KV was computed elsewhere (a decode worker's) is freed as usual, since the
        session's next turn is prefilled where this one was."""
        session = seq.session
        if not session or seq.request_id not in self._admitted:  # e.g. a decode worker's: prefilled elsewhere
            free(seq)
            return
        self._admitted.discard(seq.request_id)
        blocks = self.bm.committed_blocks(seq.request_id)  # [(device block id, key)]
        self._previous[session] = [key for _, key in blocks]
        self._previous.move_to_end(session)
        while len(self._previous) > MAX_REMEMBERED_SESSIONS:
            self._previous.popitem(last=False)
        if self.policy == "keep" and blocks:
            self._release(session, now_ns)  # an earlier turn's pin (its blocks are a prefix of these)
            ids = [b for b, _ in blocks][: self.max_pinned_blocks]
            for block_id in ids:
                self.bm.device.acquire(block_id)
            self._pinned[session] = _Pinned(seq.request_id, ids, now_ns)
            self._num_pinned += len(ids)
            while self._num_pinned > self.max_pinned_blocks and self._pinned:
                self._release(next(iter(self._pinned)), now_ns)
        forget: list[int] = [b for b, _ in blocks] if self.policy == "drop" else []
        if self.policy == "offload" and blocks:
            forget = self.bm.offload_blocks(blocks, seq.request_id)  # what the lower tier holds now
        free(seq)
        if forget:
            num = self.bm.forget_cached(forget)
            if num:
                self._events.append(RetentionEvent("drop", session, seq.request_id, self.step, DEVICE, num,
                                                   num * self.bm.block_size, now_ns, now_ns))

    # ------------------------------------------------------------------ next turn

    def admitted(self, seq: Sequence, match: PrefixMatch, now_ns: int) -> None:
        """A new turn was admitted with prefix ``match``: report what it carried over from the
        session's previous turn, then end the session's pin (its blocks are now in use)."""
        session = seq.session
        if not session:
            return
        self._admitted.add(seq.request_id)
        previous = self._previous.get(session)
        if previous is not None:
            max_blocks = (seq.num_tokens - 1) // self.bm.block_size  # as the prefix match: one token computed
            carried = 0
            for mine, theirs in zip(seq.block_hashes[:max_blocks], previous):
                if mine != theirs:
                    break
                carried += 1
            self._events.append(RetentionEvent("carry", session, seq.request_id, self.step, DEVICE, carried,
                                               carried * self.bm.block_size, now_ns, now_ns))
        self._release(session, now_ns)

    def may_release_oldest(self, now_ns: int) -> bool:
        """End the oldest session's pin (device blocks are short); False when nothing is pinned."""
        if not self._pinned:
            return False
        self._release(next(iter(self._pinned)), now_ns)
        return True

    def expire(self, now_ns: int) -> None:
        """End the pins older than the TTL (called once per scheduling pass)."""
        if self.ttl_ns is None:
            return
        while self._pinned:
            session, pin = next(iter(self._pinned.items()))
            if now_ns - pin.since_ns < self.ttl_ns:
                break
            self._release(session, pin.since_ns + self.ttl_ns)

    def _release(self, session: str, end_ns: int) -> None:
        pin = self._pinned.pop(session, None)
        if pin is None:
            return
        for block_id in reversed(pin.block_ids):
            self.bm.device.release(block_id)
        self._num_pinned -= len(pin.block_ids)
        self._events.append(RetentionEvent("retain", session, pin.request_id, self.step, DEVICE, len(pin.block_ids),
                                           len(pin.block_ids) * self.bm.block_size, pin.since_ns, end_ns))
