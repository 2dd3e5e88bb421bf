"""Simulated serving runs with a known truth, for held-out style analyzer tests.

:func:`simulate` plays a deterministic first-come-first-served queueing model of a
deployment and writes what a traced server would record into a :class:`HandMade`
(times in ms on one clock):

* ``disagg``: a prefill pool (instances 1..) feeding a decode pool (instances 101..).
  A request waits for a free prefill instance (``schedule.queue``), is looked up in
  the cache (``cache.lookup``, 0.05 ms), loaded if it hit (``cache.load``,
  ``load_ms_per_cached_token``), prefilled at ``prefill_ms_per_token`` per uncached
  prompt token (``prefill.compute``), which emits token 0; then it waits for a free
  decode instance (``decode.queue`` of token 1) and decodes one token per
  ``decode_step_ms`` step (``decode.compute``).
* ``colocated``: one pool (instances 1..) that prefills and decodes each request to
  completion.

Every instance serves one request at a time, so capacities are known exactly:
a prefill instance serves 1000 / (prompt x prefill_ms_per_token) requests/s and a
decode instance 1000 / ((output - 1) x decode_step_ms). Each step records its pool's
queue (requests arrived at the pool and not started) and one running request.
Spans tile every token's interval; ``per_token=False`` drops every token after the
first (what OTLP spans without per-token events give).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

from handmade import HandMade, ns

from tokentrace.schema import CacheEventKind, RequestStatus, Role, Stage, Tier, col

__all__ = ["Sim", "simulate", "PREFILL_BASE", "DECODE_BASE"]

PREFILL_BASE = 1  # first prefill (or colocated) instance id
DECODE_BASE = 101  # first decode instance id
LOOKUP_MS = 0.05


@dataclass
class Sim:
    """What :func:`simulate` planted, per request in the order of ``arrivals_ms``."""

    first_token: list[float] = field(default_factory=list)
    finish: list[float] = field(default_factory=list)
    prefill_wait_ms: list[float] = field(default_factory=list)
    decode_wait_ms: list[float] = field(default_factory=list)  # 0 when colocated or failed


@dataclass
class _Pool:
    """One pool's servers (heap of (free at, index)) and the (arrival, start) of every request it took."""

    size: int
    free: list[tuple[float, int]] = field(init=False)
    visits: list[tuple[float, float]] = field(default_factory=list)
    steps: list[tuple[int, float, float, int, int]] = field(default_factory=list)  # inst, start, end, prefill, decode

    def __post_init__(self) -> None:
        self.free = [(0.0, i) for i in range(self.size)]

    def take(self, at: float, busy_ms: float) -> tuple[float, int]:
        """(start, server index) of work arriving ``at`` and occupying a server ``busy_ms``."""
        free_at, idx = heapq.heappop(self.free)
        start = max(free_at, at)
        heapq.heappush(self.free, (start + busy_ms, idx))
        self.visits.append((at, start))
        return start, idx

    def waiting_at(self, t: float) -> int:
        return sum(1 for a, s in self.visits if a <= t < s)


def simulate(h: HandMade, arrivals_ms: Sequence[float], *, mode: str = "disagg", prompt: int = 100,
             output: int = 10, cached: Sequence[int] | None = None, prefill_ms_per_token: float = 0.2,
             load_ms_per_cached_token: float = 0.01, decode_step_ms: float = 40.0, num_prefill: int = 1,
             num_decode: int = 1, tenants: Sequence[str] | None = None, classes: Sequence[str] | None = None,
             statuses: Sequence[int] | None = None, per_token: bool = True,
             extra_wait_ms: Sequence[float] | None = None, first_id: int = 1) -> Sim:
    """Play the model (module doc) over ``arrivals_ms`` into ``h``; returns the planted facts.

    ``statuses``: per request; a request that is not ok fails right after its first token.
    ``extra_wait_ms``: per request, waiting added inside its ``schedule.queue`` without occupying
    a server (a slowdown planted on that request alone, e.g. a noisy neighbour's).
    """
    if mode not in ("disagg", "colocated"):
        raise ValueError(f"mode must be disagg or colocated, got {mode!r}")
    n = len(arrivals_ms)
    cached = list(cached) if cached is not None else [0] * n
    tenants = list(tenants) if tenants is not None else ["a"] * n
    classes = list(classes) if classes is not None else ["interactive"] * n
    statuses = list(statuses) if statuses is not None else [int(RequestStatus.OK)] * n
    extra = list(extra_wait_ms) if extra_wait_ms is not None else [0.0] * n
    for i in range(num_prefill):
        h.instance(PREFILL_BASE + i, Role.PREFILL if mode == "disagg" else Role.COLOCATED)
    for i in range(num_decode if mode == "disagg" else 0):
        h.instance(DECODE_BASE + i, Role.DECODE)
    pre, dec = _Pool(num_prefill), _Pool(num_decode)
    sim = Sim([0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n)
    decodes: list[tuple[float, int]] = []  # (token 0 time, k) of requests that go on to a decode instance
    for k in sorted(range(n), key=lambda j: arrivals_ms[j]):
        rid, arrival, hit = first_id + k, float(arrivals_ms[k]), cached[k]
        ok = statuses[k] == int(RequestStatus.OK)
        load_ms = hit * load_ms_per_cached_token if hit else 0.0
        prefill_ms = max(prompt - hit, 1) * prefill_ms_per_token
        busy = LOOKUP_MS + load_ms + prefill_ms + ((output - 1) * decode_step_ms if mode == "colocated" and ok else 0.0)
        start, idx = pre.take(arrival, busy)
        inst = PREFILL_BASE + idx
        t = start + extra[k]
        lookup_end, load_end = t + LOOKUP_MS, t + LOOKUP_MS + load_ms
        first = load_end + prefill_ms
        h.span(rid, Stage.SCHEDULE_QUEUE, arrival, t, 0, inst=inst)
        h.span(rid, Stage.CACHE_LOOKUP, t, lookup_end, 0, inst=inst)
        h.cache(CacheEventKind.HIT if hit else CacheEventKind.MISS, Tier.DEVICE, max(hit, prompt - hit) // 16, t,
                lookup_end, rid=rid, tokens=hit or prompt - hit, inst=inst)
        if hit:
            h.span(rid, Stage.CACHE_LOAD, lookup_end, load_end, 0, inst=inst)
        pre.steps.append((inst, load_end, first, prompt - hit, 0))
        h.span(rid, Stage.PREFILL_COMPUTE, load_end, first, 0, inst=inst)
        h.tokens(rid, [first], inst=inst)
        sim.first_token[k], sim.prefill_wait_ms[k] = first, t - arrival
        if not ok:
            h.request(rid, arrival, first + 1.0, tenant=tenants[k], cls=classes[k], prompt=prompt, cached=hit,
                      inst=inst, status=statuses[k], output=1)
            sim.finish[k] = first + 1.0
        elif mode == "colocated":
            _decode(h, sim, pre, k, rid, inst, first, first, output, decode_step_ms, per_token)
            h.request(rid, arrival, sim.finish[k], tenant=tenants[k], cls=classes[k], prompt=prompt, cached=hit,
                      inst=inst, output=output)
        else:
            decodes.append((first, k))
            h.request(rid, arrival, None, tenant=tenants[k], cls=classes[k], prompt=prompt, cached=hit, inst=inst,
                      output=output)
    for first, k in sorted(decodes):
        start, idx = dec.take(first, (output - 1) * decode_step_ms)
        rid = first_id + k
        h.span(rid, Stage.DECODE_QUEUE, first, start, 1, inst=DECODE_BASE + idx)
        _decode(h, sim, dec, k, rid, DECODE_BASE + idx, first, start, output, decode_step_ms, per_token)
        sim.decode_wait_ms[k] = start - first
        row = next(r for r in h.rows["requests"] if r[col.REQUEST_ID] == rid)
        row[col.FINISH_NS] = ns(sim.finish[k])
    for pool in (pre, dec):
        for i, (inst, s, e, prefill, decode) in enumerate(pool.steps):
            h.step(i + 1, s, e, prefill=prefill, decode=decode, running=1, waiting=pool.waiting_at(s), inst=inst)
    return sim


def _decode(h: HandMade, sim: Sim, pool: _Pool, k: int, rid: int, inst: int, first: float, start: float, output: int,
            step_ms: float, per_token: bool) -> None:
    """Tokens 1..output-1 of request ``k``, one ``step_ms`` step each from ``start`` on ``inst``."""
    times, t = [], start
    for i in range(1, output):
        pool.steps.append((inst, t, t + step_ms, 0, 1))
        h.span(rid, Stage.DECODE_COMPUTE, t, t + step_ms, i, inst=inst)
        t += step_ms
        times.append(t)
    if per_token and times:
        h.tokens(rid, times, inst=inst, first=1)
    sim.finish[k] = times[-1] if times else first
