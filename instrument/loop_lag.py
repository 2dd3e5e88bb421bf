"""Event-loop lag: how late a serving process's asyncio loop runs what is due.

A gateway's loop reads requests, relays tokens and writes chunks; when it is busy
(a long callback, the GIL held by another thread, a starved CPU) all of that waits,
and the time shows up in ``gateway.accept`` and ``stream.relay``. The
:class:`LoopLagSampler` keeps one tick pending on the loop (``call_later``) and records,
for each tick that ran at least ``min_lag_ns`` late, the interval ``[due, ran)`` in the
``loop_lags`` table. ``analyzers.loop_lag`` says how much of each stage's time fell
inside those intervals.

The loop's timers wake up to about a millisecond late even when idle (epoll waits in
whole milliseconds), hence the 2 ms default threshold. A tick is a plain timer
callback (no task), so a loop that closes while sampling leaves nothing pending.
All methods but :meth:`close` run on the loop's thread; none raises into the loop.

Cost: a tick must not wake a loop that has nothing else to do. A tick that wakes a
waiting loop costs a whole loop iteration and an ``epoll_wait`` (40 to 150 us of CPU
on a small VM, and a GIL hand-over from the engine thread in a serving process):
at 100 ticks a second, more than all of the tracer's per-token work on a busy gateway,
and with a decode step longer than the period, one or more wake-ups per step. So the
pending tick follows the loop's own work instead of a fixed clock:

* The tracer's own callbacks are the loop's activity: :meth:`LoopLagSampler.poke`,
  called by a traced callback (a token written to its client) while nothing else waits
  in the loop's ready queue and the pending tick is not yet due, shows the loop running
  on time, and moves the tick to a period after it: at most once per
  ``period_ns - defer_window_ns`` (the callers' gate, :attr:`~LoopLagSampler.poke_from_ns`),
  and by the first poke after a tick ran. While the loop works, the tick does not run.
* The period follows the loop's rhythm: each move sets it to 5/4 of the time since the
  previous one (the gap between the loop's activities), or to 7/8 of what it was if that
  is longer, at most ``max_period_ns``; to ``period_ns`` when the gap is no longer.
  The tick is due a little after the loop's next expected activity, which moves it again:
  a loop that waits for the engine's next step is not woken, however long the step.
* A tick that runs (late ones are recorded) found no activity of the loop's own for a
  period. If no other callback waits, the loop was waiting (or a block just ended; on a
  loaded machine most such wake-ups run late): the next tick is twice as far off, up to
  ``max_period_ns``, so a stretch with no activity (a long prefill, a stalled engine)
  costs a few ticks. If others wait (a backlog), the period goes back to ``period_ns``
  while it lasts. The period grows only on a sampler that is poked or paused with the
  server (``is_idle``), both the mark of a tracer that follows its requests' work: a
  loop whose activity the sampler cannot see (uvloop, with no ready queue to look at,
  or a sampler nothing pokes) is sampled every ``period_ns``, as before.

Why it ran late: a tick reads its thread's CPU clock (``time.thread_time_ns``) and its
process's (``time.process_time_ns``) when it is armed and when it runs, and records both
differences with the row (``loop_cpu_ns``, ``process_cpu_ns``, over ``[armed_ns, end_ns)``):
the loop's own thread busy (a blocking callback), another thread of the process busy (the
GIL held away from the loop), or neither (a host whose CPUs ran other processes).
``analyzers.loop_lag`` splits each row's time by those shares. Two clock reads each time the
tick is armed (a move included: at most one per period) and two when a late one runs; a poke
that does not move the tick reads none.

The rows keep their meaning: each is a stretch during which a callback due on the loop
(the tick) waited. A tick is never moved while it is due or overdue, nor while other
callbacks wait, and a blocked loop runs no poke, so a callback that holds the loop past
the pending tick's due time is recorded from that time on. What a longer period gives
up is resolution in the loop's quiet stretches: a block that starts after the loop's
last activity is recorded from one period after that activity on (a quarter of the
loop's own gap past its next expected activity; ``period_ns`` while it works at least
that often), and one that ends before then is not recorded: nothing of the loop's own
work was due yet, except what no traced callback shows (a new connection; its
``gateway.accept`` is still measured from the kernel's arrival time).

With ``is_idle`` (the tracer's "no traced request in flight"), a tick that finds the
server idle is the last one until the next request calls :meth:`LoopLagSampler.ensure_running`
(which resumes at ``period_ns``): an idle server's loop is not woken at all. Lateness is
what the stages of requests in flight are held by; a loop busy while no request is in
flight is not sampled (the first request after it shows the wait in its
``gateway.accept``, from the kernel's arrival time).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sized

from tokentrace.recorder import Recorder

__all__ = ["LoopLagSampler", "PERIOD_NS", "MAX_PERIOD_NS", "MIN_LAG_NS", "DEFER_WINDOW_NS"]

log = logging.getLogger("tokentrace")

PERIOD_NS = 10_000_000
"""The base sampling period (ns): while the loop runs late, or works without pause, it is
sampled at least this often."""
MAX_PERIOD_NS = 320_000_000
"""The longest period (ns): a loop waiting longer than this between its own activities is woken
about three times a second."""
MIN_LAG_NS = 2_000_000
"""Ticks later than this are recorded (ns); idle timers wake up to ~1 ms late."""
DEFER_WINDOW_NS = 3_000_000
"""At ``period_ns``, a poke this long or less before the pending tick is due moves it (ns); whatever
the period, the tick is moved at most once per ``period_ns - DEFER_WINDOW_NS`` (7 ms): about one move
per step when tokens are streaming (a timer handle each, on a loop that is awake anyway)."""

_NEVER = 1 << 62


class LoopLagSampler:
    """Samples one asyncio loop's lateness into ``recorder`` (see the module docstring).

    ``poke_from_ns``: monotonic ns from which :meth:`poke` may move the pending tick
    (callers compare before calling, to keep the usual case to one comparison).
    """

    def __init__(self, recorder: Recorder, *, period_ns: int = PERIOD_NS, max_period_ns: int | None = None,
                 min_lag_ns: int = MIN_LAG_NS, defer_window_ns: int | None = None,
                 is_idle: Callable[[], bool] | None = None) -> None:
        if defer_window_ns is None:  # DEFER_WINDOW_NS, at most half the period
            defer_window_ns = min(DEFER_WINDOW_NS, period_ns // 2)
        if max_period_ns is None:  # MAX_PERIOD_NS, or the period if that is longer
            max_period_ns = max(MAX_PERIOD_NS, period_ns)
        if period_ns <= 0 or min_lag_ns < 0 or not 0 <= defer_window_ns < period_ns or max_period_ns < period_ns:
            raise ValueError(f"period_ns must be > 0, min_lag_ns >= 0, 0 <= defer_window_ns < period_ns and "
                             f"max_period_ns >= period_ns, got {period_ns}, {min_lag_ns}, {defer_window_ns}, "
                             f"{max_period_ns}")
        self._rec = recorder
        self._base_ns = period_ns
        self._max_ns = max_period_ns
        self.period_ns = period_ns
        """The current period (ns): how long after the loop's last activity the pending tick is due."""
        self._min_lag_ns = min_lag_ns
        self._move_after_ns = period_ns - defer_window_ns  # a poke moves the tick this long after it was armed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: Sized | None = None  # the loop's queue of ready callbacks, when it has one
        self._handle: asyncio.TimerHandle | None = None
        self._closed = False
        self._is_idle = is_idle
        self._paused = False  # the last tick found the server idle: none is pending
        self._active_mono_ns = 0  # the loop's last activity seen (a move, a start), monotonic ns
        self._due_mono_ns = 0  # when it is due, time.monotonic_ns()
        self._armed_cpu = (0, 0)  # (thread, process) CPU time when the pending tick was armed, ns
        self.poke_from_ns = _NEVER  # no poke until a tick is pending
        self.num_ticks = 0
        self.num_late = 0
        self.num_deferred = 0  # times a poke moved the pending tick (the loop was working: no tick ran)

    def ensure_running(self) -> None:
        """Start sampling the running loop, or resume it at the base period after an idle pause
        (loop thread; a no-op while sampling)."""
        if self._closed:
            return
        if self._loop is not None:
            if self._paused:
                self._paused = False
                self.period_ns, self._active_mono_ns = self._base_ns, time.monotonic_ns()
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
        self._active_mono_ns = time.monotonic_ns()
        self._schedule()

    def _schedule(self, *, poke_after_ns: int | None = None) -> None:
        """Arm the tick a period from now; a poke may move it from ``poke_after_ns`` on (by default
        ``period_ns - defer_window_ns`` at the base period: at most one move per that time)."""
        period = self.period_ns
        self._armed_cpu = (time.thread_time_ns(), time.process_time_ns())
        due = self._rec.clock() + period
        self._handle = self._loop.call_later(period / 1e9, self._tick, due, due - period)
        if self._ready is not None:
            now = time.monotonic_ns()
            self._due_mono_ns = now + period
            self.poke_from_ns = now + (self._move_after_ns if poke_after_ns is None else poke_after_ns)

    def _tick(self, due: int, armed: int) -> None:
        if self._closed:
            return
        try:
            ran = self._rec.clock()
            self.num_ticks += 1
            if ran - due >= self._min_lag_ns:  # a late loop (or one slow to wake): record it, with who had the CPU
                loop_cpu, process_cpu = time.thread_time_ns(), time.process_time_ns()
                armed_loop, armed_process = self._armed_cpu
                self.num_late += 1
                self._rec.loop_lag(due, ran, armed, loop_cpu - armed_loop, process_cpu - armed_process)
            if self._ready:  # other callbacks wait too: a backlog, sampled at the base period while it lasts
                self.period_ns = self._base_ns
            elif self.num_deferred or self._is_idle is not None:  # no activity of its own for a period:
                self.period_ns = min(2 * self.period_ns, self._max_ns)  # the loop was waiting (or a block ended)
            if self._is_idle is not None and self._is_idle():  # no request in flight: wait for the next
                self._paused, self._handle, self.poke_from_ns = True, None, _NEVER
                return
            self._schedule(poke_after_ns=0)  # the loop's next activity moves it at once
        except Exception as err:  # never into the loop; sampling stops
            log.warning("tokentrace: event-loop lag sampling stopped (%s)", err)

    def poke(self, t_ns: int) -> None:
        """A traced callback ran on the loop at ``t_ns`` (``time.monotonic_ns()``, read by the caller):
        if no other callback is waiting and the pending tick is not yet due, the loop is working on
        time, and the tick moves to a period from now, the period following the loop's rhythm
        (loop thread; never raises)."""
        ready = self._ready
        if (ready is None or len(ready) or self._closed or not self.poke_from_ns <= t_ns < self._due_mono_ns
                or time.monotonic_ns() >= self._due_mono_ns):  # (the caller's time may be a little old)
            return
        gap, self._active_mono_ns = t_ns - self._active_mono_ns, t_ns  # since the loop's last activity
        if gap <= self._base_ns:  # working at least once a period: sample it at the base period
            self.period_ns = self._base_ns
        else:  # a little after the next activity, the longest recent gap fading slowly (steps vary)
            self.period_ns = min(self._max_ns, max(gap + gap // 4, self.period_ns - self.period_ns // 8))
        handle = self._handle
        try:
            if handle is not None:
                handle.cancel()
            self.num_deferred += 1
            self._schedule()
        except Exception as err:  # never into the loop; sampling stops
            self.poke_from_ns = _NEVER
            log.warning("tokentrace: event-loop lag sampling stopped (%s)", err)

    def close(self) -> None:
        """Stop sampling (any thread; idempotent)."""
        self._closed = True
        self.poke_from_ns = _NEVER
        handle, loop = self._handle, self._loop
        if handle is None or loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(handle.cancel)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def __repr__(self) -> str:
        return (f"LoopLagSampler(ticks={self.num_ticks}, late={self.num_late}, deferred={self.num_deferred}, "
                f"period_ns={self.period_ns}, paused={self._paused})")
