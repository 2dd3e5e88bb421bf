"""Rules for time a request spent waiting for admission (``schedule.queue``): who held the capacity.

In order, each taking what the previous left of the wait:

0. ``engine_stall``: the part of the wait during which its instance ran no engine step at all, counting only
   stretches without one of at least ``STALL_MS`` and ``STALL_STEPS`` x the instance's median step (a waiting
   request is work: an engine that runs no step for that long was not scheduled on a CPU, throttled, paused or
   blocked between steps; nobody else's work held the request).
1. ``head_of_line``: the part of the wait during which the instance was prefilling another request's
   long prompt (at least ``LONG_PROMPT_FACTOR`` x the run's median prompt and
   ``LONG_PROMPT_MIN_TOKENS``), from that prompt's first prefill chunk to its last; the evidence
   names those requests, their prompt lengths and the largest step's prefill tokens (the budget).
2. ``prefix_miss``: the part of the wait during which the instance recomputed other requests' prompt tokens
   that had been cached and evicted (their prefill spans, each by the lost tokens' share of what it
   computed, divided among the requests prefilling in the same step; only when the store records
   evicted prefixes): with them still cached, those prefills would have been short.
3. ``noisy_neighbour``: of the batch seats (a request in an engine step) of the instance's steps during
   the wait, one other tenant holds the most, at least ``NEIGHBOUR_SHARE`` x an even share (1 / the run's
   tenants), with at least ``NEIGHBOUR_MIN_REQUESTS``
   requests, which arrived (from the first of them to the last) at ``NEIGHBOUR_RATE_FACTOR`` x an even
   share of the run's offered rate (offered rate / tenants) or faster, and were at least
   ``NEIGHBOUR_OWN_FACTOR`` x the tenant's share of the run's requests among all arrivals while they came
   (its own burst, not its part of one every tenant sent): that tenant's share of the seats, of the rest
   of the wait. Without step ids on the spans, the requests in the system when the wait
   began stand for the seats, one each.
4. ``overload``: the load analysis called the run saturated (arrivals outran service for a
   sustained period): the rest of the wait, naming the pool it waited in (its instance's role; the pool
   the load analysis finds saturating when the store does not say, and that one too when it differs).
5. ``burst``: the requests in the system when it arrived (at least ``BURST_MIN_REQUESTS`` with it)
   arrived at ``BURST_RATE_FACTOR`` x the run's mean offered rate or faster: the rest of the wait,
   with the burst's start, size and rate.
6. Otherwise the rest is ``unknown``.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from analyzers.diagnosis.causes import (
    BURST,
    ENGINE_STALL,
    HEAD_OF_LINE,
    NOISY_NEIGHBOUR,
    OVERLOAD,
    PREFIX_MISS,
    Finding,
)
from analyzers.diagnosis.run_context import RunContext
from tokentrace.schema import col

__all__ = ["queue_findings", "NEIGHBOUR_SHARE", "NEIGHBOUR_RATE_FACTOR", "NEIGHBOUR_MIN_REQUESTS", "NEIGHBOUR_OWN_FACTOR",
           "BURST_MIN_REQUESTS", "BURST_RATE_FACTOR", "MIN_WAIT_MS", "AT_ONCE_S", "STALL_MS", "STALL_STEPS",
           "arrival_share", "stall_finding"]

NEIGHBOUR_SHARE = 1.25  # one other tenant holds the most batch seats, at least 1.25x an even share (1 / tenants) ...
NEIGHBOUR_RATE_FACTOR = 2.0  # ... and arrived at twice an even share of the offered rate ...
NEIGHBOUR_MIN_REQUESTS = 4  # ... with at least this many of its requests ahead ...
NEIGHBOUR_OWN_FACTOR = 1.5  # ... that were 1.5x its run-wide share of the arrivals while they came
BURST_MIN_REQUESTS = 4  # a burst: at least 4 requests in the system, this one included ...
BURST_RATE_FACTOR = 1.5  # ... that arrived at 1.5x the mean offered rate or faster
MIN_WAIT_MS = 0.5  # waits shorter than this are not worth a cause
AT_ONCE_S = 0.05  # arrivals closer together than this are told as "within N ms", not as a rate
STALL_MS = 20.0  # an engine that runs no step for this long ...
STALL_STEPS = 4.0  # ... and this many of its median steps, while a request waits for one, stalled


def queue_findings(ctx: RunContext, rid: int, arrival: int, start: int, end: int, instance: int,
                   stage: str = "schedule.queue") -> list[Finding]:
    """The causes of the wait ``[start, end)`` of request ``rid`` (arrived at ``arrival``) on ``instance``, spent in
    ``stage`` (``schedule.queue``, or ``decode.queue`` for a wait for a place in a batch)."""
    wait = end - start
    if wait <= MIN_WAIT_MS * 1e6:
        return []
    rules = (  # in order, each taking what the previous left of the wait (module doc)
        lambda rest: stall_finding(ctx, start, end, instance, stage),
        lambda rest: _head_of_line(ctx, rid, start, end, instance, stage),
        lambda rest: _recomputed_prefixes(ctx, rid, start, end, instance, rest, stage),
        lambda rest: _noisy_neighbour(ctx, rid, start, end, instance, rest, stage),
        lambda rest: _load_finding(ctx, arrival, ctx.ahead_of(rid, arrival), rest, stage, instance),
    )
    out: list[Finding] = []
    rest = float(wait)
    for rule in rules:
        if rest <= MIN_WAIT_MS * 1e6:
            break
        finding = rule(rest)
        if finding is not None:
            out.append(finding)
            rest -= finding.ms * 1e6
    return out


def _head_of_line(ctx: RunContext, rid: int, start: int, end: int, instance: int, stage: str) -> Finding | None:
    if ctx.prompts.get(rid, 0) >= ctx.long_prompt:
        return None  # a long prompt waiting behind another long prompt is the load, not head-of-line blocking
    held_ns, holders = ctx.long_prefill_windows(instance, start, end, rid)
    if held_ns <= 0:
        return None
    steps = ctx.steps_in(instance, start, end)
    budget = int(steps[col.NUM_PREFILL_TOKENS].max()) if len(steps) else 0
    names = [ctx.key(o) for o in holders]
    which = ", ".join(f"{ctx.key(o)}'s {p:,.0f}-token" for o, p in list(holders.items())[:3])
    more = f" (and {len(holders) - 3} more)" if len(holders) > 3 else ""
    evidence = (f"waited {held_ns / 1e6:,.1f} ms in {stage} while {which} prefill{more} held the "
                f"{budget:,}-token step budget")
    return Finding(HEAD_OF_LINE, held_ns / 1e6, evidence, stage=stage, requests=tuple(names))


def _recomputed_prefixes(ctx: RunContext, rid: int, start: int, end: int, instance: int, rest_ns: float,
                         stage: str) -> Finding | None:
    ns, who = ctx.recomputes_in(instance, start, end, rid)
    ns = min(ns, rest_ns)
    if ns <= MIN_WAIT_MS * 1e6:
        return None
    which = ", ".join(f"{ctx.key(o)}'s {n:,.0f}" for o, n in list(who.items())[:3])
    more = f" (and {len(who) - 3} more)" if len(who) > 3 else ""
    evidence = (f"waited {ns / 1e6:,.1f} ms in {stage} while the engine recomputed prompt tokens that had been "
                f"cached and evicted ({which} tokens{more}): with them still cached, those prefills would have been "
                f"short")
    return Finding(PREFIX_MISS, ns / 1e6, evidence, stage=stage, requests=tuple(ctx.key(o) for o in who))


def _noisy_neighbour(ctx: RunContext, rid: int, start: int, end: int, instance: int, rest_ns: float,
                     stage: str) -> Finding | None:
    if len(ctx.tenant_rps) < 2:
        return None
    mine = ctx.tenants.get(rid, "")
    seats = ctx.seats_in(instance, start, end)
    seats = seats[seats[col.REQUEST_ID] != rid]
    if not len(seats):  # no step ids on the spans: the requests in the system when the wait began, one seat each
        ahead = ctx.ahead_of(rid, start)
        seats = pd.DataFrame({col.REQUEST_ID: ctx.ids_of(ahead), "tenant": ctx.tenants_of(ahead)})
    if not len(seats):
        return None
    even = ctx.offered_rps / len(ctx.tenant_rps)  # an even share of the run's offered load
    if not math.isfinite(even):
        return None
    share = seats["tenant"].value_counts(normalize=True).sort_index().sort_values(ascending=False, kind="stable")
    tenant, held = str(share.index[0]), float(share.iloc[0])  # ties by name: whatever order the seats came in
    theirs = seats[seats["tenant"] == tenant][col.REQUEST_ID].unique()
    if tenant != mine and held >= NEIGHBOUR_SHARE / len(ctx.tenant_rps) and len(theirs) >= NEIGHBOUR_MIN_REQUESTS:
        arrivals = [ctx.arrival_of(int(r)) for r in theirs]
        window_s = (max(arrivals) - min(arrivals)) / 1e9
        rate = (len(theirs) - 1) / window_s if window_s > 0 else math.inf
        during, usual = arrival_share(ctx, tenant, min(arrivals), max(arrivals))
        if rate >= NEIGHBOUR_RATE_FACTOR * even and during >= NEIGHBOUR_OWN_FACTOR * usual:
            ms = rest_ns * held / 1e6
            return Finding(NOISY_NEIGHBOUR, ms, f"waited {ms:,.1f} ms while tenant {tenant or '(none)'}'s requests "
                           f"held {held * 100:.0f}% of the engine's batch seats ({len(theirs)} requests, "
                           f"{_arriving(len(theirs), window_s)} against an even share of {even:,.2f} req/s per tenant; "
                           f"{during * 100:.0f}% of the arrivals while they came, against {usual * 100:.0f}% of the "
                           f"run's)", stage=stage, tenant=tenant)
    return _backlog(ctx, seats, mine, start, rest_ns, stage, even)


def _backlog(ctx: RunContext, seats: pd.DataFrame, mine: str, start: int, rest_ns: float, stage: str,
             even: float) -> Finding | None:
    """The seats' holders queued behind another tenant's burst of its own (:func:`tenant_bursts`): a seat counts
    for that tenant by the share of the requests ahead of its holder (transitively) that were the burst's
    (:func:`displaced_shares`); only while that burst's backlog had not drained when the wait began
    (:func:`drained_after` its requests' finish)."""
    best: tuple[float, str, Burst] | None = None
    for tenant in ctx.tenant_rps:
        if tenant == mine:
            continue
        bursts = [b for b in tenant_bursts(ctx, tenant, NEIGHBOUR_RATE_FACTOR * even)
                  if b.first_ns < start < drained_after(ctx, b.last_end_ns)]
        if not bursts:
            continue
        shares, members = displaced_shares(ctx, tenant, NEIGHBOUR_RATE_FACTOR * even)
        weight = np.array([1.0 if int(r) in members else shares.get(int(r), 0.0) for r in seats[col.REQUEST_ID]])
        held = math.fsum(weight) / len(weight)  # exactly rounded: the same whatever order the seats came in
        if best is None or held > best[0]:
            best = (held, tenant, max(bursts, key=lambda b: b.first_ns))
    if best is None or best[0] < NEIGHBOUR_SHARE / len(ctx.tenant_rps):
        return None
    held, tenant, b = best
    ms = rest_ns * held / 1e6
    evidence = (f"waited {ms:,.1f} ms behind the backlog tenant {tenant or '(none)'}'s burst built: "
                f"{held * 100:.0f}% of the engine's batch seats during its wait went to its requests or to requests "
                f"that had queued behind them ({b.size} requests, {_arriving(b.size, b.window_s)} against an even "
                f"share of {even:,.2f} req/s per tenant; {b.share * 100:.0f}% of the arrivals while they came, "
                f"against {b.usual_share * 100:.0f}% of the run's)")
    return Finding(NOISY_NEIGHBOUR, ms, evidence, stage=stage, tenant=tenant)


@dataclass(frozen=True, slots=True)
class Burst:
    """A tenant's burst of its own: its requests (row positions in the run's requests), how many, how fast and
    over how long, their share of the arrivals while they came and the tenant's share of the run's; when the first arrived
    and the last of them finished (ns)."""

    rows: np.ndarray
    size: int
    rps: float
    window_s: float
    share: float
    usual_share: float
    first_ns: int
    last_end_ns: float


def tenant_bursts(ctx: RunContext, tenant: str, min_rps: float) -> list[Burst]:
    """The tenant's bursts of its own: ``NEIGHBOUR_MIN_REQUESTS`` or more of its requests arriving one after
    another at ``min_rps`` or faster (each in such a run of ``NEIGHBOUR_MIN_REQUESTS``, :func:`dense_runs`), that
    were at least ``NEIGHBOUR_OWN_FACTOR`` x its usual share of the arrivals while they came
    (:func:`arrival_share`); in arrival order."""
    key = ("bursts", tenant, min_rps)
    if key not in ctx.memo:
        theirs = np.flatnonzero(ctx.tenants_of(np.arange(len(ctx.ev.requests))) == tenant)
        theirs = theirs[np.argsort(ctx.arrivals_of(theirs), kind="stable")]
        a = ctx.arrivals_of(theirs)
        out = []
        for lo, hi in dense_runs(a, NEIGHBOUR_MIN_REQUESTS, min_rps):
            window_s = (a[hi - 1] - a[lo]) / 1e9
            rate = (hi - lo - 1) / window_s if window_s > 0 else math.inf
            during, usual = arrival_share(ctx, tenant, int(a[lo]), int(a[hi - 1]))
            if during >= NEIGHBOUR_OWN_FACTOR * usual:
                rows = theirs[lo:hi]
                out.append(Burst(rows, int(hi - lo), rate, window_s, during, usual, int(a[lo]),
                                 float(ctx.ends_of(rows).max())))
        ctx.memo[key] = out
    return ctx.memo[key]


def dense_runs(arrivals: np.ndarray, k: int, min_rps: float) -> list[tuple[int, int]]:
    """The runs ``[lo, hi)`` of sorted ``arrivals`` (ns) that came ``k`` at a time at ``min_rps`` or faster: windows
    of ``k`` consecutive arrivals that fast, joined where they share an arrival (two dense stretches one after
    the other, with no such window across their border, stay two)."""
    a = np.asarray(arrivals)
    if len(a) < k or k < 2:
        return []
    starts = np.flatnonzero(k - 1 >= min_rps * (a[k - 1:] - a[:len(a) - k + 1]) / 1e9)
    runs: list[tuple[int, int]] = []
    for s0 in starts.tolist():
        if runs and s0 < runs[-1][1]:  # overlaps the run so far
            runs[-1] = (runs[-1][0], s0 + k)
        else:
            runs.append((s0, s0 + k))
    return runs


def arrival_share(ctx: RunContext, tenant: str, lo: int, hi: int) -> tuple[float, float]:
    """The tenant's share of the run's arrivals from ``lo`` to ``hi`` (ns), widened to the whole run-wide burst
    around them, and its share of the run's requests.

    The run's bursts are its arrivals that came ``BURST_MIN_REQUESTS`` at a time at ``BURST_RATE_FACTOR`` x the
    mean offered rate or faster (as ``burst`` counts them). A tenant's requests packed into a burst every tenant
    sent (a replayed trace whose requests come at one instant) are about its usual share of that burst, however
    a few of them bunch inside it: the burst is the run's, not the tenant's."""
    if "arrival_order" not in ctx.memo:
        every = np.arange(len(ctx.ev.requests))
        order = np.argsort(ctx.arrivals_of(every), kind="stable")
        a, t = ctx.arrivals_of(every)[order], ctx.tenants_of(every)[order]
        cluster = np.full(len(a), -1)  # each arrival's run-wide burst (-1: none)
        if math.isfinite(ctx.offered_rps):
            for n, (start, stop) in enumerate(dense_runs(a, BURST_MIN_REQUESTS, BURST_RATE_FACTOR * ctx.offered_rps)):
                cluster[start:stop] = n
        ctx.memo["arrival_order"] = (a, t, cluster)
    arrivals, tenants, cluster = ctx.memo["arrival_order"]
    i, j = int(np.searchsorted(arrivals, lo, side="left")), int(np.searchsorted(arrivals, hi, side="right"))
    if j > i:
        if cluster[i] >= 0:
            i = int(np.flatnonzero(cluster == cluster[i])[0])
        if cluster[j - 1] >= 0:
            j = int(np.flatnonzero(cluster == cluster[j - 1])[-1]) + 1
    usual = float(np.mean(tenants == tenant)) if len(tenants) else 0.0
    during = float(np.mean(tenants[i:j] == tenant)) if j > i else 0.0
    return during, usual


def displaced_shares(ctx: RunContext, tenant: str, min_rps: float) -> tuple[dict[int, float], set[int]]:
    """Per request, the share of the requests in the system when it arrived that were of ``tenant``'s bursts of
    its own (:func:`tenant_bursts` at ``min_rps``), counting each other request ahead of it by its own share (it
    queued behind them in turn): one sweep in arrival order; and the ids of those bursts' requests. The tenant's
    other requests count like anyone's: its part of a burst every tenant sent is not its burst.

    A backlog ends when it drains: once every burst request that had arrived has finished and then every
    instance's waiting queue has been empty (:func:`drained_after`), the other requests in the system stop
    counting for the tenant; a request arriving later waits behind what came after."""
    key = ("displaced", tenant, min_rps)
    if key not in ctx.memo:
        n = len(ctx.ev.requests)
        arrivals, ends = ctx.arrivals_of(np.arange(n)), ctx.ends_of(np.arange(n))
        is_theirs = np.zeros(n, dtype=bool)
        for b in tenant_bursts(ctx, tenant, min_rps):
            is_theirs[b.rows] = True
        weight, share = np.zeros(n), np.zeros(n)
        active: list[tuple[float, int]] = []
        total, theirs_end, cleared = 0.0, None, True
        for i in np.argsort(arrivals, kind="stable"):
            while active and active[0][0] <= arrivals[i]:
                total -= weight[heapq.heappop(active)[1]]
            if not cleared and arrivals[i] >= drained_after(ctx, theirs_end):
                for _, j in active:
                    if not is_theirs[j]:
                        total -= weight[j]
                        weight[j] = 0.0
                cleared = True
            share[i] = total / len(active) if active else 0.0
            weight[i] = 1.0 if is_theirs[i] else share[i]
            heapq.heappush(active, (float(ends[i]), int(i)))
            total += weight[i]
            if is_theirs[i]:
                theirs_end, cleared = max(theirs_end or 0.0, float(ends[i])), False
        ids = ctx.ids_of(np.arange(n))
        ctx.memo[key] = (dict(zip(ids.tolist(), share.tolist())), set(ids[is_theirs].tolist()))
    return ctx.memo[key]


def drained_after(ctx: RunContext, t_ns: float) -> float:
    """When every instance's waiting queue was first empty at or after ``t_ns``: the latest of each instance's
    first step ending then with no request waiting (``t_ns`` for an instance with none)."""
    if "empty_queue_ends" not in ctx.memo:
        steps = ctx.ev.steps
        empty = steps[steps[col.NUM_WAITING] <= 0] if len(steps) and col.NUM_WAITING in steps else steps.iloc[:0]
        ctx.memo["empty_queue_ends"] = [np.sort(g[col.END_NS].to_numpy("int64"))
                                        for _, g in empty.groupby(col.INSTANCE_ID)]
    out = float(t_ns)
    for ends in ctx.memo["empty_queue_ends"]:
        k = int(np.searchsorted(ends, t_ns, side="left"))
        if k < len(ends):
            out = max(out, float(ends[k]))
    return out


def stall_finding(ctx: RunContext, start: int, end: int, instance: int, stage: str) -> Finding | None:
    """``engine_stall``: the stretches of ``[start, end)`` in which ``instance`` ran no step (module doc, rule 0)."""
    typical = ctx.step_ns(instance)
    if not math.isfinite(typical):
        return None
    idle, longest = ctx.idle_in(instance, start, end, max(STALL_MS * 1e6, STALL_STEPS * typical))
    if idle <= 0:
        return None
    pool = ctx.pool_of(instance)
    evidence = (f"waited {idle / 1e6:,.1f} ms in {stage} while its {pool + ' ' if pool else ''}instance ran no "
                f"engine step (the longest stretch {longest / 1e6:,.1f} ms; its steps take {typical / 1e6:,.1f} ms, "
                f"median)")
    return Finding(ENGINE_STALL, idle / 1e6, evidence, stage=stage)


def _load_finding(ctx: RunContext, arrival: int, ahead: np.ndarray, rest_ns: float, stage: str,
                  instance: int) -> Finding | None:
    load = ctx.load
    if load.get("saturated") is True:
        saturating = load.get("saturated_pool")
        pool = ctx.pool_of(instance) or saturating or "unknown"  # the pool it waited for room in
        where = (f" in the {pool} pool; the {saturating} pool saturates" if saturating and saturating != pool
                 else f"; the {pool} pool saturates")
        evidence = (f"waited {rest_ns / 1e6:,.1f} ms in {stage} with {len(ahead)} requests ahead while arrivals "
                    f"outran service ({_f(load.get('offered_rps'))} req/s offered, {_f(load.get('served_rps'))} "
                    f"served){where}")
        return Finding(OVERLOAD, rest_ns / 1e6, evidence, stage=stage)
    size = len(ahead) + 1
    if size < BURST_MIN_REQUESTS or not math.isfinite(ctx.offered_rps):
        return None
    first = int(ctx.arrivals_of(ahead).min())
    span_s = (arrival - first) / 1e9
    rate = (size - 1) / span_s if span_s > 0 else math.inf
    if rate < BURST_RATE_FACTOR * ctx.offered_rps:
        return None
    start_s = (first - int(ctx.arrivals_of(np.arange(len(ctx.ev.requests))).min())) / 1e9
    came = (f"arrived within {span_s * 1e3:,.1f} ms at t={start_s:,.1f} s (" if span_s < AT_ONCE_S else
            f"arrived in {span_s:,.2f} s from t={start_s:,.1f} s ({rate:,.1f} req/s ")
    evidence = (f"waited {rest_ns / 1e6:,.1f} ms in {stage} behind a burst: {size} requests {came}against a mean of "
                f"{ctx.offered_rps:,.1f} req/s{_mostly_one_tenant(ctx, ahead, arrival)})")
    return Finding(BURST, rest_ns / 1e6, evidence, stage=stage)


def _mostly_one_tenant(ctx: RunContext, ahead: np.ndarray, arrival: int) -> str:
    """"; N of them tenant T's" when one tenant of a run with several sent most of a burst, else ""."""
    if len(ctx.tenant_rps) < 2 or not len(ahead):
        return ""
    tenants = pd.Series(ctx.tenants_of(ahead)).value_counts()
    tenant, n = str(tenants.index[0]), int(tenants.iloc[0])
    size = len(ahead) + 1
    return f"; {n} of them tenant {tenant or '(none)'}'s" if n > size / 2 else ""


def _arriving(n: int, window_s: float) -> str:
    """How ``n`` requests arrived over ``window_s``: a rate, or, over a window under ``AT_ONCE_S``, the window
    itself (a rate over a few microseconds says nothing a reader can use)."""
    if window_s < AT_ONCE_S:
        return f"arriving within {window_s * 1e3:,.1f} ms,"
    return f"arriving at {(n - 1) / window_s:,.1f} req/s"


def _f(value: object) -> str:
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "?"
    return f"{v:,.2f}" if math.isfinite(v) else "?"
