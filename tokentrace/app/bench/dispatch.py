"""Sending a list of planned requests on time, on one event loop, bounded.

:func:`dispatch` sends each request at ``start_ns + offset`` (open loop) and, with
``concurrency``, only while fewer than that many are in flight (closed loop). The run
is bounded twice: by the list's length and by ``duration_s``: no request is sent after
it, and requests still in flight ``drain_s`` later are cancelled and reported as
cancelled (what arrived of them is kept).

What keeps the timestamps honest at high rates (the receive stamps themselves are
taken in the connection's protocol callback, :mod:`~tokentrace.app.bench.connections`):

* each request's bytes are built while waiting for its due time, so sending is a write;
* the objects alive at the start are frozen out of the garbage collector (``gc.freeze``)
  for the run: a full collection over a process's imported modules (pandas, pyarrow)
  stalls the loop for tens of ms, and every chunk arriving meanwhile gets a late stamp.

The caller hears of each request through a :class:`Listener` as it is sent and done.
"""

from __future__ import annotations

import asyncio
import gc
import math
import time
from dataclasses import dataclass
from typing import Protocol, Sequence

from tokentrace.app.bench.client import RequestOptions, encode_request, new_pool, send_request
from tokentrace.app.bench.connections import ConnectionPool
from tokentrace.app.bench.requests import Outcome, PlannedRequest

__all__ = ["RunLimits", "Listener", "dispatch"]


@dataclass(frozen=True, slots=True)
class RunLimits:
    """Bounds of a run. ``concurrency`` 0 = no closed-loop bound."""

    duration_s: float = 600.0  # no request is sent later than this after the start
    drain_s: float = 30.0  # in-flight requests get this long after duration_s, then are cancelled
    concurrency: int = 0

    def __post_init__(self) -> None:
        if not (self.duration_s > 0 and math.isfinite(self.duration_s)):
            raise ValueError(f"duration must be a positive number of seconds, got {self.duration_s}")
        if not self.drain_s >= 0:
            raise ValueError(f"drain must be >= 0 s, got {self.drain_s}")
        if self.concurrency < 0:
            raise ValueError(f"concurrency must be >= 0, got {self.concurrency}")


class Listener(Protocol):
    """Told about each request on the dispatching event loop; must not block."""

    def on_sent(self, req: PlannedRequest) -> None: ...

    def on_done(self, req: PlannedRequest, outcome: Outcome) -> None: ...


async def dispatch(requests: Sequence[PlannedRequest], opts: RequestOptions, limits: RunLimits, *,
                   listener: Listener, start_ns: int | None = None,
                   stop: asyncio.Event | None = None) -> tuple[list[Outcome], int]:
    """Send ``requests`` (see module doc); the outcomes of those sent, in send order, and the
    run's start (monotonic ns; request ``i`` was due at ``start + offset_i``).

    ``start_ns``: a start chosen by the caller (several processes share one); default: now,
    once the connection pool exists. ``stop``: setting it ends the run early, as if the
    duration bound and the drain had passed (in-flight requests are cancelled).
    """
    sem = asyncio.Semaphore(limits.concurrency) if limits.concurrency else None
    tasks: list[tuple[PlannedRequest, asyncio.Task[Outcome]]] = []

    async def one(req: PlannedRequest, encoded: bytes | None) -> Outcome:
        try:
            outcome = await send_request(pool, req, opts, encoded=encoded)
        finally:
            if sem is not None:
                sem.release()
        listener.on_done(req, outcome)
        return outcome

    stopped = asyncio.ensure_future((stop or asyncio.Event()).wait())
    gc.freeze()
    try:
        async with new_pool(opts) as pool:
            start_ns = time.monotonic_ns() if start_ns is None else start_ns
            send_deadline_ns = start_ns + int(limits.duration_s * 1e9)
            for req in requests:
                due_ns = start_ns + round(req.offset_s * 1e9)
                if due_ns > send_deadline_ns:
                    break
                encoded = _encode(pool, req, opts)
                if await _stopped_within(stopped, (due_ns - time.monotonic_ns()) / 1e9):
                    break
                if sem is not None and not await _acquire(sem, stopped,
                                                          (send_deadline_ns - time.monotonic_ns()) / 1e9):
                    break
                if time.monotonic_ns() > send_deadline_ns:
                    if sem is not None:
                        sem.release()
                    break
                listener.on_sent(req)
                tasks.append((req, asyncio.create_task(one(req, encoded))))
            if tasks:
                all_done = asyncio.gather(*(t for _, t in tasks), return_exceptions=True)
                drain_s = (send_deadline_ns - time.monotonic_ns()) / 1e9 + limits.drain_s
                await asyncio.wait([all_done, stopped], timeout=max(drain_s, 0),
                                   return_when=asyncio.FIRST_COMPLETED)
                for _, task in tasks:
                    task.cancel()  # (no effect on a finished task)
                await all_done
    finally:
        stopped.cancel()
        gc.unfreeze()
    return [_result(req, task, listener) for req, task in tasks], start_ns


def _encode(pool: ConnectionPool, req: PlannedRequest, opts: RequestOptions) -> bytes | None:
    """The request's bytes, or None to let :func:`send_request` report why they cannot be built."""
    try:
        return encode_request(pool, req, opts)
    except ValueError:
        return None


async def _stopped_within(stopped: asyncio.Future[bool], seconds: float) -> bool:
    """Wait ``seconds`` (until the next request is due) unless the run is stopped; whether it was."""
    if seconds > 0 and not stopped.done():
        await asyncio.wait([stopped], timeout=seconds)
    return stopped.done()


async def _acquire(sem: asyncio.Semaphore, stopped: asyncio.Future[bool], timeout_s: float) -> bool:
    """Take a closed-loop slot within ``timeout_s``; False if none came or the run stopped."""
    if stopped.done():
        return False
    if not sem.locked():
        await sem.acquire()  # a free slot: no wait
        return True
    acquire = asyncio.ensure_future(sem.acquire())
    await asyncio.wait([acquire, stopped], timeout=max(timeout_s, 0), return_when=asyncio.FIRST_COMPLETED)
    if not acquire.done():
        acquire.cancel()
        return False
    if stopped.done():
        sem.release()
        return False
    return True


def _result(req: PlannedRequest, task: asyncio.Task[Outcome], listener: Listener) -> Outcome:
    """The task's outcome; a task cancelled before it could send becomes an empty cancelled outcome."""
    if not task.cancelled():
        return task.result()
    now = time.monotonic_ns()
    outcome = Outcome(req.index, req.key, now, (), now, 0, None, cancelled=True)
    listener.on_done(req, outcome)
    return outcome
