"""Findings for time a request spent while a serving event loop ran late, one per reason it ran late.

A late interval (``loop_lags``) is split by the CPU its loop's thread and its process used
(:func:`analyzers.loop_lag.late_intervals_sql`): the loop's own thread running is ``event_loop_lag``
(a blocking callback), another thread of the process running is ``gil_contention`` (the GIL held
away from the loop: an engine thread in the same process), neither running is ``cpu_starved`` (the
host's CPUs ran other processes). Rows without CPU times (stores of schema version 5 and older) stay
``event_loop_lag``, undivided, and their evidence says so.
"""

from __future__ import annotations

from analyzers.diagnosis.causes import CPU_STARVED, EVENT_LOOP_LAG, GIL_CONTENTION, Finding
from analyzers.diagnosis.run_context import RunContext
from analyzers.loop_lag import BLOCKING, OTHER_THREADS, STARVED

__all__ = ["loop_lag_findings"]

_CAUSE = {BLOCKING: EVENT_LOOP_LAG, OTHER_THREADS: GIL_CONTENTION, STARVED: CPU_STARVED, None: EVENT_LOOP_LAG}
_WHY = {
    BLOCKING: "its own thread was running (a blocking callback on the loop)",
    OTHER_THREADS: "another thread of its process was running (the GIL held away from the loop)",
    STARVED: "neither its thread nor its process was running (the host's CPUs ran other processes, or the loop "
             "waited off the CPU: a sleep, synchronous I/O, a lock)",
    None: "the run recorded no CPU times for it, so a blocking callback, another thread holding the GIL and a "
          "starved host cannot be told apart",
}


def loop_lag_findings(ctx: RunContext, lo: int, hi: int, held: str, *, stage: str = "",
                      limit_ms: float | None = None) -> list[Finding]:
    """Findings for the late-loop time inside ``[lo, hi)``: "was held N ms by ``held``: <why>" per cause.

    ``limit_ms``: the most they may explain together (scaled down to it)."""
    split = ctx.lag_overlap_by_cause(lo, hi)
    total_ms = sum(split.values()) / 1e6
    if not total_ms > 0:
        return []
    k = min(1.0, limit_ms / total_ms) if limit_ms is not None else 1.0
    merged: dict[str, list[tuple[str | None, float]]] = {}
    for why, ns in split.items():
        merged.setdefault(_CAUSE[why], []).append((why, ns / 1e6 * k))
    out = []
    for cause, parts in merged.items():
        ms = sum(p for _, p in parts)
        reasons = "; and ".join(_WHY[why] for why, _ in parts)
        of_all = f" ({ms / (total_ms * k):.0%} of the {total_ms * k:,.1f} ms the loop ran late there)" if len(merged) > 1 else ""
        out.append(Finding(cause, ms, f"was held {ms:,.1f} ms by {held}{of_all}, while {reasons}", stage=stage))
    return out
