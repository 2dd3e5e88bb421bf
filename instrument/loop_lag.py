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
"""

from __future__ import annotations

import asyncio
import logging

from tokentrace.recorder import Recorder

__all__ = ["LoopLagSampler", "PERIOD_NS", "MIN_LAG_NS"]

log = logging.getLogger("tokentrace")

PERIOD_NS = 10_000_000
"""How often the loop is sampled (ns): 100 timer callbacks a second."""
MIN_LAG_NS = 2_000_000
"""Ticks later than this are recorded (ns); idle timers wake up to ~1 ms late."""


class LoopLagSampler:
    """Samples one asyncio loop's lateness into ``recorder`` (see the module docstring)."""

    def __init__(self, recorder: Recorder, *, period_ns: int = PERIOD_NS, min_lag_ns: int = MIN_LAG_NS) -> None:
        if period_ns <= 0 or min_lag_ns < 0:
            raise ValueError(f"period_ns must be > 0 and min_lag_ns >= 0, got {period_ns}, {min_lag_ns}")
        self._rec = recorder
        self._period_ns = period_ns
        self._min_lag_ns = min_lag_ns
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._closed = False
        self.num_ticks = 0
        self.num_late = 0

    def ensure_running(self) -> None:
        """Start sampling the running loop, once (loop thread; a no-op after the first call)."""
        if self._loop is not None or self._closed:
            return
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:  # not on a loop: nothing to sample
            return
        self._schedule()

    def _schedule(self) -> None:
        loop = self._loop
        due = self._rec.clock() + self._period_ns
        self._handle = loop.call_later(self._period_ns / 1e9, self._tick, due)

    def _tick(self, due: int) -> None:
        if self._closed:
            return
        try:
            ran = self._rec.clock()
            self.num_ticks += 1
            if ran - due >= self._min_lag_ns:
                self.num_late += 1
                self._rec.loop_lag(due, ran)
            self._schedule()
        except Exception as err:  # never into the loop; sampling stops
            log.warning("tokentrace: event-loop lag sampling stopped (%s)", err)

    def close(self) -> None:
        """Stop sampling (any thread; idempotent)."""
        self._closed = True
        handle, loop = self._handle, self._loop
        if handle is None or loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(handle.cancel)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def __repr__(self) -> str:
        return f"LoopLagSampler(ticks={self.num_ticks}, late={self.num_late})"
