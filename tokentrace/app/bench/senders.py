"""Sender processes: one run's requests sent and timed by several processes, merged into one.

One event loop stamps every chunk of every stream it reads; while it is busy with one
read, the next waits, and its stamp is late by that much. At a few hundred requests per
second on a small machine that wait dominates the client's timing error. With
``processes=N`` the plan's requests are dealt to N child processes (request ``i`` to
process ``i mod N``), each running :func:`~tokentrace.app.bench.dispatch.dispatch` on its
share, on its own event loop and its own CPU time, against one start time chosen here.
Every process stamps with ``time.monotonic_ns()``, which on Linux is one clock for the
whole host (``CLOCK_MONOTONIC``), so their stamps compare with each other and with the
server's.

This process sends nothing: it records each outcome as it comes back (one ``client``
instance in the run, exactly as a single process would write it), feeds the live
progress, and returns the merged outcomes. It also keeps the recorder's flush thread
and the progress display away from the processes that stamp.

A closed-loop bound (``concurrency``) is split between the processes (each holds at
most its share in flight), so it must be at least ``processes``.

Messages, one pipe per child (``multiprocessing`` with the ``spawn`` start method):
the child sends ``("ready",)``, then ``("batch", sent indices, outcomes)`` every 50 ms
while it runs, then ``("end",)``; this process sends ``("go", start_ns)`` once every
child is ready, and ``("stop",)`` to end a run early (Ctrl-C here: in-flight requests
are cancelled and reported, as at the duration bound). A child ignores SIGINT: a Ctrl-C
reaches the whole process group, and only this process decides.
"""

from __future__ import annotations

import asyncio
import collections
import multiprocessing
import signal
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from typing import Any, Sequence

from tokentrace.app.bench.client import RequestOptions
from tokentrace.app.bench.dispatch import Listener, RunLimits, dispatch
from tokentrace.app.bench.requests import Outcome, PlannedRequest

__all__ = ["SenderFailed", "shard_limits", "run_in_processes", "sender_main"]

_START_LEAD_S = 0.25  # the shared start is this far after the last child said ready
_READY_TIMEOUT_S = 120.0  # a child that is not ready by then (spawn, imports) is a failure
_BATCH_S = 0.05  # a child sends what it has every 50 ms
_STOP_GRACE_S = 10.0  # after ("stop",), the children get this long to report before they are killed
_LATE_S = 30.0  # a run not over this long after start + duration + drain is stopped


class SenderFailed(RuntimeError):
    """A sender process died or never started; the outcomes it had not reported are missing."""


def shard_limits(limits: RunLimits, processes: int) -> list[RunLimits]:
    """Each process's limits: the same bounds, the closed-loop bound split as evenly as possible.

    ``ValueError`` if ``processes`` < 1, or ``concurrency`` is set and smaller than ``processes``.
    """
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    if limits.concurrency and limits.concurrency < processes:
        raise ValueError(f"--concurrency {limits.concurrency} is split between the sender processes: it must be "
                         f"at least --processes ({processes})")
    if not limits.concurrency:
        return [limits] * processes
    share, extra = divmod(limits.concurrency, processes)
    return [replace(limits, concurrency=share + (i < extra)) for i in range(processes)]


@dataclass
class _Child:
    process: Any  # multiprocessing's SpawnProcess
    conn: Connection
    ready: bool = False
    ended: bool = False  # sent "end", or died
    died: bool = False  # its pipe closed without "end"


class _Merger:
    """This process's side of the batches: passes each report to the listener, keeps the outcomes.

    A batch is queued first and handed on one item at a time, so that a Ctrl-C in the middle of
    one (raised from the listener or the loop) loses nothing: :meth:`deliver` resumes it.
    """

    def __init__(self, requests: Sequence[PlannedRequest], listener: Listener) -> None:
        self.by_index = {r.index: r for r in requests}
        self.listener = listener
        self.pending: collections.deque[int | Outcome] = collections.deque()  # sent indices, then outcomes
        self.outcomes: list[Outcome] = []

    def take(self, sent: list[int], done: list[Outcome]) -> None:
        self.pending.extend(sent)
        self.pending.extend(done)
        self.deliver()

    def deliver(self) -> None:
        while self.pending:
            item = self.pending.popleft()
            if isinstance(item, int):
                self.listener.on_sent(self.by_index[item])
            else:
                self.outcomes.append(item)
                self.listener.on_done(self.by_index[item.index], item)


def run_in_processes(requests: Sequence[PlannedRequest], opts: RequestOptions, limits: RunLimits, *,
                     processes: int, listener: Listener) -> tuple[list[Outcome], int]:
    """Send ``requests`` from ``processes`` child processes (see module doc); the merged outcomes
    in send order and the shared start (monotonic ns). Blocks; ``listener`` is called on this
    thread as batches come back. ``SenderFailed`` if a child dies before the end of the run (the
    others are stopped first and what they report is passed on); ``KeyboardInterrupt`` is
    re-raised once the children reported what they had."""
    per_process = shard_limits(limits, processes)
    merger = _Merger(requests, listener)
    children: list[_Child] = []
    try:
        for i in range(processes):
            shard = tuple(requests[i::processes])
            if shard:
                children.append(_start(i, shard, opts, per_process[i]))
        _wait_ready(children)
        start_ns = time.monotonic_ns() + int(_START_LEAD_S * 1e9)
        for child in children:
            child.conn.send(("go", start_ns))
        late_ns = start_ns + int((limits.duration_s + limits.drain_s + _LATE_S) * 1e9)
        try:
            _collect(children, merger, until_ns=late_ns, until_death=True)
        except KeyboardInterrupt:
            _stop(children, merger)
            raise
        if not all(c.ended for c in children):  # one died, or past the late bound: stop the others
            _stop(children, merger)
        _check_ended(children)
    finally:
        _reap(children)
    outcomes = sorted(merger.outcomes, key=lambda o: (o.send_ns, o.index))
    return outcomes, start_ns


def _start(i: int, shard: tuple[PlannedRequest, ...], opts: RequestOptions, limits: RunLimits) -> _Child:
    ctx = multiprocessing.get_context("spawn")  # no fork: this process may hold threads (recorder, progress)
    here, there = ctx.Pipe()
    process = ctx.Process(target=sender_main, args=(there, shard, opts, limits), daemon=True,
                          name=f"tokentrace-bench-sender-{i}")
    process.start()
    there.close()
    return _Child(process, here)


def _wait_ready(children: list[_Child]) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while not all(c.ready for c in children):
        waiting = {c.conn: c for c in children if not c.ready}
        readable = wait(list(waiting), timeout=max(deadline - time.monotonic(), 0))
        if not readable:
            raise SenderFailed(f"{len(waiting)} sender process(es) not ready within {_READY_TIMEOUT_S:g} s")
        for conn in readable:
            child = waiting[conn]  # type: ignore[index]
            msg = _recv(child)
            if msg is None:
                raise SenderFailed(f"sender process {child.process.name} exited before it was ready "
                                   f"(exit code {child.process.exitcode})")
            child.ready = msg[0] == "ready"


def _recv(child: _Child) -> tuple[Any, ...] | None:
    """The child's next message; None when its pipe is closed (the child ended or died)."""
    try:
        return child.conn.recv()
    except (EOFError, OSError):
        child.process.join(timeout=5)
        return None


def _collect(children: list[_Child], merger: _Merger, *, until_ns: int, until_death: bool = False) -> None:
    """Take the children's batches until every child ended, ``until_ns`` passed, or (``until_death``)
    a child died."""
    merger.deliver()  # what an interrupted delivery left
    while not all(c.ended for c in children) and not (until_death and any(c.died for c in children)):
        left_s = (until_ns - time.monotonic_ns()) / 1e9
        if left_s <= 0:
            return
        running = {c.conn: c for c in children if not c.ended}
        for conn in wait(list(running), timeout=min(left_s, 1.0)):
            child = running[conn]  # type: ignore[index]
            msg = _recv(child)
            if msg is None or msg[0] == "end":
                child.ended, child.died = True, msg is None
            elif msg[0] == "batch":
                merger.take(msg[1], msg[2])


def _stop(children: list[_Child], merger: _Merger) -> None:
    """Ask every running child to stop, and take what they report for at most a few seconds."""
    for child in children:
        if not child.ended:
            try:
                child.conn.send(("stop",))
            except OSError:
                pass
    _collect(children, merger, until_ns=time.monotonic_ns() + int(_STOP_GRACE_S * 1e9))


def _check_ended(children: list[_Child]) -> None:
    for child in children:
        if child.died or not child.ended:
            child.process.join(timeout=5)
            raise SenderFailed(f"sender process {child.process.name} ended before the end of the run "
                               f"(exit code {child.process.exitcode}); its unreported requests are missing")


def _reap(children: list[_Child]) -> None:
    """Close the pipes (a child still waiting for "go" or running then stops) and end the processes."""
    for child in children:
        child.conn.close()
    for child in children:
        child.process.join(timeout=5)
        if child.process.is_alive():
            child.process.kill()
            child.process.join(timeout=5)


# --------------------------------------------------------------------------- the child's side


class _Batcher:
    """The child's listener: keeps what was sent and done, and sends it to the parent every 50 ms."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.sent: list[int] = []
        self.done: list[Outcome] = []

    def on_sent(self, req: PlannedRequest) -> None:
        self.sent.append(req.index)

    def on_done(self, req: PlannedRequest, outcome: Outcome) -> None:
        self.done.append(outcome)

    def flush(self) -> None:
        if self.sent or self.done:
            self.send(("batch", self.sent, self.done))
            self.sent, self.done = [], []

    def send(self, msg: tuple[Any, ...]) -> None:
        try:
            self.conn.send(msg)
        except OSError:  # the parent is gone; its pipe's end also stops the run (see _send_share)
            pass

    async def every(self, seconds: float) -> None:
        while True:
            await asyncio.sleep(seconds)
            self.flush()


def sender_main(conn: Connection, requests: tuple[PlannedRequest, ...], opts: RequestOptions,
                limits: RunLimits) -> None:
    """A sender process's entry point (the ``multiprocessing`` target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what a Ctrl-C does
    try:
        asyncio.run(_send_share(conn, requests, opts, limits))
    finally:
        conn.close()


async def _send_share(conn: Connection, requests: tuple[PlannedRequest, ...], opts: RequestOptions,
                      limits: RunLimits) -> None:
    conn.send(("ready",))
    try:
        msg = conn.recv()
    except EOFError:  # the parent gave up before the start
        return
    if msg[0] != "go":
        return
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def from_parent() -> None:  # "stop", or the pipe closed: the parent is gone
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            msg = ("stop",)
        if msg[0] == "stop":
            loop.remove_reader(conn.fileno())
            stop.set()

    loop.add_reader(conn.fileno(), from_parent)
    batcher = _Batcher(conn)
    flusher = asyncio.create_task(batcher.every(_BATCH_S))
    try:
        await dispatch(requests, opts, limits, listener=batcher, start_ns=msg[1], stop=stop)
    finally:
        flusher.cancel()
        if not stop.is_set():
            loop.remove_reader(conn.fileno())
    batcher.flush()
    batcher.send(("end",))
