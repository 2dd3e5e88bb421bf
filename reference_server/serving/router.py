"""Routing policies: which worker of a role gets a request.

* ``round_robin`` (the baseline): live candidates in turn.
* ``load_aware``: the lowest load score, ``num_inflight + num_waiting / 2 +
  blocks_used / blocks_total`` (requests the cluster has in flight there right now, the
  worker's queue from its last heartbeat, and its device KV occupancy as a tie breaker).
* ``prefix_aware``: where the request's prompt prefix is most likely cached. The router
  computes the prompt's block-hash chain from its token ids with the engine's own hash
  (:func:`~reference_server.engine.prefix_cache.extend_block_hashes`, stable across
  processes) and keeps, per instance, an LRU set of the chains of the requests it sent
  there (``max_tracked_blocks`` per instance; an approximation of that worker's prefix
  cache, which may have evicted them since). The candidate with the longest matching
  prefix wins unless its load exceeds the least loaded candidate's by more than
  ``balance_slack`` (then load wins, as in SGLang's cache-aware router); no match at all
  falls back to load-aware.

A router is used on one thread (the backend's event loop). ``choose`` returns the
chosen name and every candidate's score (lower is better) for the routing event.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from reference_server.engine.prefix_cache import extend_block_hashes

__all__ = ["POLICIES", "Candidate", "Router"]

POLICIES = ("round_robin", "load_aware", "prefix_aware")
_ALIASES = {"load": "load_aware", "prefix": "prefix_aware", "rr": "round_robin"}


@dataclass(frozen=True, slots=True)
class Candidate:
    """A live worker as the router sees it."""

    name: str
    num_inflight: int  # requests the cluster has outstanding on it now
    num_waiting: int = 0  # its engine's queue at the last heartbeat
    num_blocks_used: int = 0  # device blocks, last heartbeat
    num_blocks_total: int = 1

    @property
    def load(self) -> float:
        return self.num_inflight + self.num_waiting / 2 + self.num_blocks_used / max(1, self.num_blocks_total)


class Router:
    """One routing policy with its state (round-robin position, prefix sets)."""

    def __init__(self, policy: str = "prefix_aware", *, block_size: int = 16, max_tracked_blocks: int = 8192,
                 balance_slack: float = 4.0) -> None:
        policy = _ALIASES.get(policy, policy)
        if policy not in POLICIES:
            raise ValueError(f"unknown router policy {policy!r}; known: {', '.join(POLICIES)} (or load, prefix)")
        if block_size < 1 or max_tracked_blocks < 1:
            raise ValueError("block_size and max_tracked_blocks must be >= 1")
        self.policy = policy
        self.block_size = block_size
        self.max_tracked_blocks = max_tracked_blocks
        self.balance_slack = balance_slack
        self._next = 0
        self._prefixes: dict[str, OrderedDict[int, None]] = {}  # instance -> LRU set of block hashes

    def choose(self, candidates: Seq[Candidate], token_ids: Seq[int] = (), *,
               use_prefix: bool = True) -> tuple[str, tuple[tuple[str, float], ...]]:
        """Pick one of ``candidates`` (non-empty; ``ValueError`` otherwise) for a request
        with prompt ``token_ids``; ``use_prefix=False`` ignores prefixes (decode role)."""
        if not candidates:
            raise ValueError("no candidates to route to")
        if self.policy == "round_robin":
            chosen = candidates[self._next % len(candidates)]
            self._next += 1
            return chosen.name, tuple((c.name, 0.0 if c is chosen else 1.0) for c in candidates)
        loads = tuple((c.name, c.load) for c in candidates)
        least = min(candidates, key=lambda c: (c.load, c.name))
        if self.policy == "load_aware" or not use_prefix:
            return least.name, loads
        hashes = self.block_hashes(token_ids)
        matches = {c.name: self._match(c.name, hashes) for c in candidates}
        best = max(candidates, key=lambda c: (matches[c.name], -c.load))
        scores = tuple((c.name, -float(matches[c.name])) for c in candidates)
        if matches[best.name] == 0 or best.load > least.load + self.balance_slack:
            return least.name, scores
        return best.name, scores

    def record(self, instance: str, token_ids: Seq[int]) -> None:
        """Remember that ``instance`` now holds the prompt's prefix blocks."""
        if self.policy != "prefix_aware":
            return
        tracked = self._prefixes.setdefault(instance, OrderedDict())
        for h in self.block_hashes(token_ids):
            tracked[h] = None
            tracked.move_to_end(h)
        while len(tracked) > self.max_tracked_blocks:
            tracked.popitem(last=False)

    def forget(self, instance: str) -> None:
        """The instance lost its cache (it died or restarted)."""
        self._prefixes.pop(instance, None)

    def block_hashes(self, token_ids: Seq[int]) -> list[int]:
        return extend_block_hashes([], list(token_ids), self.block_size)

    def _match(self, instance: str, hashes: list[int]) -> int:
        tracked = self._prefixes.get(instance)
        if not tracked:
            return 0
        n = 0
        for h in hashes:
            if h not in tracked:
                break
            n += 1
        return n
