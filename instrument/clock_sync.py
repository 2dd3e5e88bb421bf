"""Clock alignment between the processes of one traced deployment.

The gateway's process is the run's reference clock (its ``instances`` row has
offset 0). It serves its monotonic clock on a loopback UDP socket
(:class:`ClockServer`) whose address travels to every worker it spawns in the
environment (:data:`CLOCK_ADDR_ENV`). Each worker runs NTP-style pings against
it with :func:`tokentrace.clock.ping_exchange` (the sample with the smallest
round trip wins) and writes ``clock_offset_ns`` / ``clock_rtt_ns`` into its own
``instances`` row, so ``t_ref = t_worker + clock_offset_ns`` holds within
``clock_rtt_ns / 2``. It then reports that same offset back to the clock
server, whose :class:`~tokentrace.clock.OffsetBook` the gateway's tracer reads
to put worker-clock times (a token's hand-out, a KV chunk's arrival) on its own
clock: one estimate per instance, live and in the store.

Why a side channel and not the cluster's heartbeat: the heartbeat's four
timestamps are complete only in the gateway's process (``ClockSample``), but the
offset belongs in the worker's own row, which only the worker writes; a second
estimate from the heartbeat would disagree with the stored one by tens of
microseconds.

Tests only: ``TOKENTRACE_TEST_CLOCK_SKEW_NS="decode-0=5000000000,..."`` makes the
tracer of the named instance add that many ns to every time it records and to
its clock as seen by the pings (:class:`SkewedRecorder`, :func:`skew_for`),
simulating a process on another host whose clock disagrees. Never set it in
production: it falsifies that process's trace on purpose.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from typing import Any, Callable

from tokentrace.clock import Anchor, ClockEstimate, OffsetBook, ping_exchange, take_anchor
from tokentrace.recorder import ForwardingRecorder, Recorder

__all__ = [
    "CLOCK_ADDR_ENV", "SKEW_ENV", "ClockServer", "skew_for", "SkewedRecorder", "ClockSync",
]

log = logging.getLogger("tokentrace")

CLOCK_ADDR_ENV = "TOKENTRACE_CLOCK_ADDR"
"""``host:port`` of the reference process's clock server."""
SKEW_ENV = "TOKENTRACE_TEST_CLOCK_SKEW_NS"
"""Tests only: ``name=ns[,name=ns]`` clock skews per instance name."""

_PING = struct.Struct("!q")  # t0, requester's clock (echoed back)
_PONG = struct.Struct("!qqq")  # t0 echoed, t1 receive, t2 send (server clock, ns)
_REPORT = struct.Struct("!4sqqq")  # magic, offset_ns, rtt_ns, num_samples; then the instance name (UTF-8)
_REPORT_MAGIC = b"TTOF"
_MAX_DATAGRAM = 512
_RESYNC_S = 10.0  # re-estimate period: monotonic clocks of two hosts drift apart slowly


class ClockServer:
    """Answers clock pings on a loopback UDP socket from a daemon thread, and keeps the
    offsets the workers report in :attr:`book`.

    ``clock``: the process's recording clock (``time.monotonic_ns`` plus any
    test skew). After each exchange a worker sends back the offset it wrote
    into its ``instances`` row (for its monotonic clock), so the live tracers
    of this process (the gateway's hand-over timing) use the same estimate
    the analyzers will. :meth:`close` stops it. Never blocks the caller.
    """

    def __init__(self, *, host: str = "127.0.0.1", clock: Callable[[], int] = time.monotonic_ns) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((host, 0))
        self._clock = clock
        self.book = OffsetBook()
        """instance name -> its offset to this (reference) clock, as written in its ``instances`` row."""
        self.address = "%s:%d" % self._sock.getsockname()[:2]
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="tokentrace-clock", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sock, clock = self._sock, self._clock
        while not self._closed:
            try:
                data, peer = sock.recvfrom(_MAX_DATAGRAM)
                t1 = clock()
                if data[:len(_REPORT_MAGIC)] == _REPORT_MAGIC:
                    self._take_report(data)
                    continue
                (t0,) = _PING.unpack(data[:_PING.size])
                sock.sendto(_PONG.pack(t0, t1, clock()), peer)
            except (OSError, struct.error, UnicodeDecodeError):
                if self._closed:
                    return

    def _take_report(self, data: bytes) -> None:
        _, offset_ns, rtt_ns, num_samples = _REPORT.unpack(data[:_REPORT.size])
        name = data[_REPORT.size:].decode()
        if name:
            self.book.update(name, ClockEstimate(offset_ns, rtt_ns, num_samples))

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass


def skew_for(name: str, environ: Any = os.environ) -> int:
    """The test clock skew (ns) for instance ``name`` from :data:`SKEW_ENV`; 0 if none.

    ``ValueError`` on a malformed value (the variable is set by tests only).
    """
    spec = environ.get(SKEW_ENV, "")
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        who, sep, value = entry.partition("=")
        if not sep:
            raise ValueError(f"{SKEW_ENV} entries look like name=ns, got {entry!r}")
        if who.strip() == name:
            return int(value)
    return 0


class SkewedRecorder(ForwardingRecorder):
    """A :class:`Recorder` proxy that adds ``skew_ns`` to every time recorded (tests only)."""

    def __init__(self, recorder: Recorder, skew_ns: int) -> None:
        super().__init__(recorder)
        self.skew_ns = skew_ns

    def clock(self) -> int:
        return self.inner.clock() + self.skew_ns

    def stage_begin(self, request_id: int, stage: int, t_ns: int, token_index: int = -1) -> None:
        self.inner.stage_begin(request_id, stage, t_ns + self.skew_ns, token_index)

    def loop_lag(self, start_ns: int, end_ns: int, armed_ns: int = -1, loop_cpu_ns: int = -1,
                 process_cpu_ns: int = -1) -> None:
        k = self.skew_ns  # times move with the clock; the CPU durations do not
        self.inner.loop_lag(start_ns + k, end_ns + k, armed_ns + k if armed_ns >= 0 else armed_ns, loop_cpu_ns,
                            process_cpu_ns)

    def spec_step(self, request_id: int, step: int, draft_source: int, num_proposed: int, num_accepted: int,
                  first_token_index: int, draft_start_ns: int, draft_end_ns: int, verify_start_ns: int,
                  verify_end_ns: int, batch_size: int, num_spec_seqs: int) -> None:
        k = self.skew_ns
        super().spec_step(request_id, step, draft_source, num_proposed, num_accepted, first_token_index,
                          draft_start_ns + k, draft_end_ns + k, verify_start_ns + k, verify_end_ns + k, batch_size,
                          num_spec_seqs)

    def stage_end(self, request_id: int, stage: int, t_ns: int, token_index: int = -1,
                  step: int = -1, num_bytes: int = -1, tier: int = -1, batch_size: int = -1) -> None:
        super().stage_end(request_id, stage, t_ns + self.skew_ns, token_index, step, num_bytes, tier, batch_size)

    def span(self, request_id: int, stage: int, start_ns: int, end_ns: int, token_index: int = -1,
             step: int = -1, num_bytes: int = -1, tier: int = -1, batch_size: int = -1) -> None:
        k = self.skew_ns
        super().span(request_id, stage, start_ns + k, end_ns + k, token_index, step, num_bytes, tier, batch_size)

    def token(self, request_id: int, token_index: int, *, emit_ns: int = -1, sent_ns: int = -1,
              recv_ns: int = -1, step: int = -1) -> None:
        k = self.skew_ns
        super().token(request_id, token_index, emit_ns=emit_ns + k if emit_ns >= 0 else -1,
                      sent_ns=sent_ns + k if sent_ns >= 0 else -1, recv_ns=recv_ns + k if recv_ns >= 0 else -1,
                      step=step)

    def step(self, step: int, start_ns: int, end_ns: int, *rest: int) -> None:
        self.inner.step(step, start_ns + self.skew_ns, end_ns + self.skew_ns, *rest)

    def cache_event(self, kind: int, tier: int, num_blocks: int, start_ns: int, end_ns: int,
                    request_id: int = -1, num_tokens: int = -1, num_bytes: int = -1, step: int = -1) -> None:
        k = self.skew_ns
        super().cache_event(kind, tier, num_blocks, start_ns + k, end_ns + k, request_id, num_tokens, num_bytes, step)

    def request_begin(self, key: str, *, arrival_ns: int, **kw: Any) -> int:
        return self.inner.request_begin(key, arrival_ns=arrival_ns + self.skew_ns, **kw)

    def request_end(self, request_id: int, *, finish_ns: int, first_token_ns: int = -1,
                    first_content_ns: int = -1, **kw: Any) -> None:
        k = self.skew_ns
        self.inner.request_end(request_id, finish_ns=finish_ns + k,
                               first_token_ns=first_token_ns + k if first_token_ns >= 0 else -1,
                               first_content_ns=first_content_ns + k if first_content_ns >= 0 else -1, **kw)

    def instance(self, *, anchor: Anchor | None = None, **kw: Any) -> None:
        a = anchor or take_anchor()
        self.inner.instance(anchor=Anchor(a.mono_ns + self.skew_ns, a.wall_ns), **kw)


class ClockSync:
    """Worker side: estimate this process's offset to the reference clock and record it.

    Runs on a daemon thread: one exchange at start, then every ``resync_s``;
    each estimate is written with ``recorder.instance(role=..., name=...,
    clock_offset_ns=..., clock_rtt_ns=...)``. ``clock`` is this process's
    recording clock. Failures are logged once and retried at the next period.
    """

    def __init__(self, recorder: Recorder, address: str, *, role: int, name: str,
                 clock: Callable[[], int] = time.monotonic_ns, num_pings: int = 16,
                 resync_s: float = _RESYNC_S, timeout_s: float = 0.5, clock_skew_ns: int = 0) -> None:
        host, _, port = address.rpartition(":")
        self._target = (host, int(port))
        self._rec, self._role, self._name = recorder, role, name
        self._clock, self._num_pings, self._timeout_s = clock, num_pings, timeout_s
        self._resync_s = resync_s
        self._skew_ns = clock_skew_ns  # tests only: clock() minus this process's monotonic clock
        self._stop = threading.Event()
        self._warned = False
        self.estimate: ClockEstimate | None = None
        self.synced = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokentrace-clock-sync", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def sync_once(self) -> ClockEstimate:
        """One exchange (blocks up to ``num_pings`` round trips); records and returns it."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.settimeout(self._timeout_s)
        try:
            def send_recv(t0: int) -> tuple[int, int]:
                sock.sendto(_PING.pack(t0), self._target)
                while True:
                    echoed, t1, t2 = _PONG.unpack(sock.recv(64)[:_PONG.size])
                    if echoed == t0:  # ignore a late answer to an earlier ping
                        return t1, t2

            est = ping_exchange(send_recv, self._num_pings, clock=self._clock)
            # est maps the reference clock onto ours; our row needs ours -> reference.
            mine = est.reversed()
            self._rec.instance(role=self._role, name=self._name, clock_offset_ns=mine.offset_ns,
                               clock_rtt_ns=mine.rtt_ns)
            self._report(sock, mine)
        finally:
            sock.close()
        self.estimate = est
        self.synced.set()
        return est

    def _report(self, sock: socket.socket, mine: ClockEstimate) -> None:
        """Tell the reference process the offset just recorded, for this process's monotonic clock
        (the clock the server's own events are on: the recording clock minus any test skew)."""
        payload = _REPORT.pack(_REPORT_MAGIC, mine.offset_ns + self._skew_ns, mine.rtt_ns, mine.num_samples)
        sock.sendto(payload + self._name.encode()[:_MAX_DATAGRAM - _REPORT.size], self._target)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync_once()
            except (OSError, ValueError, struct.error) as e:
                if not self._warned:
                    self._warned = True
                    log.warning("tokentrace: clock sync with %s:%d failed (%s); retrying every %.0f s",
                                *self._target, e, self._resync_s)
            self._stop.wait(self._resync_s)
