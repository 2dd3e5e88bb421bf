"""Event-loop lag: how late a serving process's asyncio loop runs what is due.

A gateway's loop reads requests, relays tokens and writes chunks; when it is busy
(a long callback, the GIL held by another thread, a starved CPU) all of that waits,
and the time shows up in ``gateway.accept`` and ``stream.relay``. The
:class:`LoopLagSampler` schedules a tick every ``period_ns`` on the loop with
``call_later`` and records, for each tick that ran at least ``min_lag_ns`` late, the
interval ``[due, ran)`` in the ``loop_lags`` table. ``analyzers.loop_lag`` says how
much of each stage's time fell inside those intervals.

The loop's timers wake up to about a millisecond late even when idle (epoll waits in
whole milliseconds), hence the 2 ms default threshold. A tick is a plain timer
callback (no task), so a loop that closes while sampling leaves nothing pending.
All methods but :meth:`close` run on the loop's thread; none raises into the loop.

Cost. A tick that wakes an otherwise waiting loop costs a whole loop iteration and
an ``epoll_wait`` (40 to 65 us of CPU on a small VM, and a GIL hand-over from the
engine thread in a serving process): at 100 ticks a second, more than all of the
tracer's per-token work on a busy gateway. So the tracer's own callbacks stand in for
ticks that would have run on time: :meth:`LoopLagSampler.poke`, called by a traced
callback (a token written to its client) within ``DEFER_WINDOW_NS`` before the next
tick is due, while nothing else is waiting in the loop's ready queue, is a tick taken
early: the loop is running and would run a callback due now at once, so that tick
could only have found it on time. The pending tick is moved a period on instead of
waking the loop. A loop that is late (a long callback, a backlog of ready callbacks)
is never poked in that state, and its ticks run and are recorded as before; a loop
without a ready queue to look at (uvloop) is only ever sampled by ticks.

With ``is_idle`` (the tracer's "no traced request in flight"), a tick that finds the
server idle is the last one until the next request calls :meth:`LoopLagSampler.ensure_running`:
an idle server's loop is not woken at all. Lateness is what the stages of requests in
flight are held by; a loop busy while no request is in flight is not sampled (the first
request after it shows the wait in its ``gateway.accept``, from the kernel's arrival time).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sized

from tokentrace.recorder import Recorder

__all__ = ["LoopLagSampler", "PERIOD_NS", "MIN_LAG_NS", "DEFER_WINDOW_NS"]

log = logging.getLogger("tokentrace")

PERIOD_NS = 10_000_000
"""How often the loop is sampled (ns): 100 timer callbacks a second."""
MIN_LAG_NS = 2_000_000
"""Ticks later than this are recorded (ns); idle timers wake up to ~1 ms late."""
DEFER_WINDOW_NS = 3_000_000
"""A poke this long or less before the next tick is due takes that tick's place (ns): about one
poke per period when tokens are streaming, so the pending tick is moved ~100 times a second
(a timer handle each, on a loop that is awake anyway) instead of waking the loop as often."""


class LoopLagSampler:
    """Samples one asyncio loop's lateness into ``recorder`` (see the module docstring).

    ``poke_from_ns``: monotonic ns from which :meth:`poke` may stand in for the pending tick
    (callers compare before calling, to keep the usual case to one comparison).
    """

    def __init__(self, recorder: Recorder, *, period_ns: int = PERIOD_NS, min_lag_ns: int = MIN_LAG_NS,
                 defer_window_ns: int | None = None, is_idle: Callable[[], bool] | None = None) -> None:
        if defer_window_ns is None:  # DEFER_WINDOW_NS, at most half the period
            defer_window_ns = min(DEFER_WINDOW_NS, period_ns // 2)
        if period_ns <= 0 or min_lag_ns < 0 or not 0 <= defer_window_ns < period_ns:
            raise ValueError(f"period_ns must be > 0, min_lag_ns >= 0 and 0 <= defer_window_ns < period_ns, "
                             f"got {period_ns}, {min_lag_ns}, {defer_window_ns}")
        self._rec = recorder
        self._period_ns = period_ns
        self._min_lag_ns = min_lag_ns
        self._defer_window_ns = defer_window_ns
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: Sized | None = None  # the loop's queue of ready callbacks, when it has one
        self._handle: asyncio.TimerHandle | None = None
        self._closed = False
        self._is_idle = is_idle
        self._paused = False  # the last tick found the server idle: none is pending
        self._due_mono_ns = 0  # when the pending tick is due, time.monotonic_ns()
        self.poke_from_ns = 1 << 62  # no poke until a tick is pending
        self.num_ticks = 0
        self.num_late = 0
        self.num_deferred = 0  # ticks a poke stood in for

    def ensure_running(self) -> None:
        """Start sampling the running loop, or resume it after an idle pause (loop thread; a
        no-op while sampling)."""
        if self._closed:
            return
        if self._loop is not None:
            if self._paused:
                self._paused = False
                try:
                    self._schedule()
                except Exception as err:  # never into the loop; sampling stops
                    log.warning("tokentrace: event-loop lag sampling stopped (%s)", err)
            return
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:  # not on a loop: nothing to sample
            return
        ready = getattr(self._loop, "_ready", None)  # asyncio's BaseEventLoop; absent on uvloop
        self._ready = ready if isinstance(ready, Sized) and not isinstance(ready, (str, bytes)) else None
        self._schedule()

    def _schedule(self) -> None:
        loop = self._loop
        due = self._rec.clock() + self._period_ns
        self._handle = loop.call_later(self._period_ns / 1e9, self._tick, due)
        if self._ready is not None:
            self._due_mono_ns = time.monotonic_ns() + self._period_ns
            self.poke_from_ns = self._due_mono_ns - self._defer_window_ns

    def _tick(self, due: int) -> None:
        if self._closed:
            return
        try:
            ran = self._rec.clock()
            self.num_ticks += 1
            if ran - due >= self._min_lag_ns:
                self.num_late += 1
                self._rec.loop_lag(due, ran)
            if self._is_idle is not None and self._is_idle():  # no request in flight: wait for the next
                self._paused, self._handle, self.poke_from_ns = True, None, 1 << 62
                return
            self._schedule()
        except Exception as err:  # never into the loop; sampling stops
            log.warning("tokentrace: event-loop lag sampling stopped (%s)", err)

    def poke(self, t_ns: int) -> None:
        """A traced callback ran on the loop at ``t_ns`` (``time.monotonic_ns()``, read by the caller):
        if the pending tick is due within ``defer_window_ns`` and no other callback is waiting, this
        stands in for it and the tick moves a period on (loop thread; never raises)."""
        ready = self._ready
        if (ready is None or len(ready) or self._closed or not self.poke_from_ns <= t_ns < self._due_mono_ns
                or time.monotonic_ns() >= self._due_mono_ns):  # (the caller's time may be a little old)
            return
        handle = self._handle
        try:
            if handle is not None:
                handle.cancel()
            self.num_deferred += 1
            self._schedule()
        except Exception as err:  # never into the loop; sampling stops
            self.poke_from_ns = 1 << 62
            log.warning("tokentrace: event-loop lag sampling stopped (%s)", err)

    def close(self) -> None:
        """Stop sampling (any thread; idempotent)."""
        self._closed = True
        self.poke_from_ns = 1 << 62
        handle, loop = self._handle, self._loop
        if handle is None or loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(handle.cancel)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def __repr__(self) -> str:
        return (f"LoopLagSampler(ticks={self.num_ticks}, late={self.num_late}, deferred={self.num_deferred}, "
                f"paused={self._paused})")
