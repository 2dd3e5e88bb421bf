"""Scheduling policies: the order in which requests are admitted and preempted.

Each policy gives two keys per sequence: ``waiting_key`` (smaller is admitted first)
and ``victim_key`` (larger is preempted first when KV blocks run out), and may keep
per-tenant accounts through the ``on_*`` callbacks the scheduler makes. The KV cache
policies are in :mod:`reference_server.engine.cache_policies`. All methods run on the
engine thread, never block and never raise on valid state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from reference_server.engine.sequence import Sequence

__all__ = [
    "FAIR_SHARE_MEASURES",
    "FCFSPolicy",
    "SLODeadlinePolicy",
    "SchedulingPolicy",
    "WeightedFairPolicy",
    "make_scheduling_policy",
]


FAIR_SHARE_MEASURES = ("tokens", "requests", "compute_time")
"""What :class:`WeightedFairPolicy` counts as a tenant's service."""


class SchedulingPolicy(Protocol):
    """Orders waiting requests and picks preemption victims."""

    name: str

    def waiting_key(self, seq: Sequence) -> tuple: ...
    def victim_key(self, seq: Sequence) -> tuple: ...
    def on_scheduled(self, seq: Sequence, num_tokens: int, *, is_new: bool) -> None: ...
    def on_computed(self, seq: Sequence, compute_ns: float) -> None: ...
    def on_tenant_active(self, tenant: str, active_tenants: Iterable[str]) -> None: ...


class _OrderOnly:
    """A policy that only orders requests: it keeps no state, so its hooks do nothing."""

    def on_scheduled(self, seq: Sequence, num_tokens: int, *, is_new: bool) -> None:
        return None

    def on_computed(self, seq: Sequence, compute_ns: float) -> None:
        return None

    def on_tenant_active(self, tenant: str, active_tenants: Iterable[str]) -> None:
        return None


class FCFSPolicy(_OrderOnly):
    """First come, first served: admit by arrival; preempt the latest arrival."""

    name = "fcfs"

    def waiting_key(self, seq: Sequence) -> tuple:
        return (seq.arrival_ns, seq.seq_no)

    def victim_key(self, seq: Sequence) -> tuple:
        return (seq.arrival_ns, seq.seq_no)


class SLODeadlinePolicy(_OrderOnly):
    """Earliest TTFT deadline (arrival + class ttft_ms) first; preempt the lowest class
    priority first, and among equals the latest deadline."""

    name = "slo"

    def waiting_key(self, seq: Sequence) -> tuple:
        deadline_ns = seq.arrival_ns + int(seq.slo_class.ttft_ms * 1_000_000)
        return (deadline_ns, seq.seq_no)

    def victim_key(self, seq: Sequence) -> tuple:
        deadline_ns = seq.arrival_ns + int(seq.slo_class.ttft_ms * 1_000_000)
        return (-seq.slo_class.priority, deadline_ns, seq.seq_no)


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
