"""Offsets between the clocks of two processes: NTP-style pings, and the live book of them.

Sign convention (used by ``instances.clock_offset_ns`` too): an offset is what
you **add to the remote's clock to get the local (reference) clock**::

    t_local = t_remote + offset_ns

A worker that pings the run's reference process computes the offset of the
reference's clock seen from its own, so its ``instances`` row stores
``-offset_ns`` of that estimate (:meth:`ClockEstimate.reversed`). The same
number goes to the reference process's :class:`OffsetBook`, so the live
tracers that time a hand-over between processes and the analyzers use one
estimate per instance. Every function here is pure or reads clocks only; none
blocks except :func:`ping_exchange`, which blocks as long as the caller's
transport does.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Iterable

from tokentrace.clock.local import now_ns

__all__ = ["PingSample", "ClockEstimate", "estimate_offset", "ping_exchange", "OffsetBook"]


@dataclass(frozen=True, slots=True)
class PingSample:
    """One ping: four timestamps, two on each clock (all ns).

    ``t0``: local send, ``t1``: remote receive, ``t2``: remote send,
    ``t3``: local receive. ``t0``/``t3`` are on the local clock, ``t1``/``t2``
    on the remote one.
    """

    t0: int
    t1: int
    t2: int
    t3: int

    @property
    def offset_ns(self) -> int:
        """Estimated ``t_local - t_remote`` (add it to remote times to get local ones).

        NTP formula with the sign flipped to this module's convention:
        ``((t0 - t1) + (t3 - t2)) / 2``. If the one-way delays are ``d_out`` and
        ``d_back`` the error is ``(d_back - d_out) / 2``, at most ``rtt_ns / 2``
        in magnitude (plus half a nanosecond of integer rounding).
        """
        return ((self.t0 - self.t1) + (self.t3 - self.t2)) // 2

    @property
    def rtt_ns(self) -> int:
        """Round trip minus the remote's processing time: ``(t3 - t0) - (t2 - t1)``."""
        return (self.t3 - self.t0) - (self.t2 - self.t1)


@dataclass(frozen=True, slots=True)
class ClockEstimate:
    """The offset chosen from a set of pings and its uncertainty."""

    offset_ns: int
    """Add to the remote's clock to get the local clock (ns)."""
    rtt_ns: int
    """Round trip of the chosen sample; the offset is within ``rtt_ns / 2`` (ns)."""
    num_samples: int
    """How many pings the estimate was chosen from."""

    def reversed(self) -> ClockEstimate:
        """The same estimate seen from the other side (local and remote swapped)."""
        return ClockEstimate(offset_ns=-self.offset_ns, rtt_ns=self.rtt_ns, num_samples=self.num_samples)


def estimate_offset(samples: Iterable[PingSample]) -> ClockEstimate:
    """Keep the sample with the smallest round trip (its error bound is tightest).

    Raises ``ValueError`` when ``samples`` is empty or a sample's round trip is
    negative (timestamps out of order: a transport or clock bug).
    """
    best: PingSample | None = None
    count = 0
    for s in samples:
        count += 1
        if s.rtt_ns < 0:
            raise ValueError(f"ping sample with negative round trip ({s.rtt_ns} ns): {s}")
        if best is None or s.rtt_ns < best.rtt_ns:
            best = s
    if best is None:
        raise ValueError("estimate_offset needs at least one ping sample")
    return ClockEstimate(offset_ns=best.offset_ns, rtt_ns=best.rtt_ns, num_samples=count)


def ping_exchange(send_recv: Callable[[int], tuple[int, int]], n: int = 16, *,
                  clock: Callable[[], int] = now_ns) -> ClockEstimate:
    """Run ``n`` pings through a caller-supplied transport and estimate the offset.

    ``send_recv(t0)`` must send a ping to the remote process and return the
    remote's ``(t1, t2)``: its clock readings when the ping arrived and when the
    reply left. ``t0`` and ``t3`` are read here with :func:`now_ns` right around
    the call on ``clock`` (this process's recording clock). The result's offset
    maps the remote's clock onto that clock (``t_local = t_remote + offset_ns``).

    Blocks while ``send_recv`` does; exceptions from ``send_recv`` propagate.
    Raises ``ValueError`` if ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"ping_exchange needs n >= 1, got {n}")
    samples = []
    for _ in range(n):
        t0 = clock()
        t1, t2 = send_recv(t0)
        t3 = clock()
        samples.append(PingSample(t0, int(t1), int(t2), t3))
    return estimate_offset(samples)


class OffsetBook:
    """The reference process's live copy of each instance's clock offset.

    Keyed by instance name; a value maps that instance's monotonic clock onto
    the reference clock (``t_ref = t_instance + offset_ns``), the very estimate
    the instance writes into its ``instances`` row. Fed by whatever carries the
    estimates to the reference process (``instrument.clock_sync.ClockServer``);
    read by live tracers. Any thread; never blocks for long (one lock).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._estimates: dict[str, ClockEstimate] = {}

    def update(self, name: str, estimate: ClockEstimate) -> None:
        """Replace ``name``'s estimate (a later exchange supersedes an earlier one)."""
        with self._lock:
            self._estimates[name] = estimate

    def get(self, name: str) -> ClockEstimate | None:
        """``name``'s latest estimate, or None before its first report."""
        with self._lock:
            return self._estimates.get(name)

    def to_reference(self, name: str, t_ns: int) -> int:
        """``t_ns`` (clock of instance ``name``) on the reference clock; -1 if unknown or ``t_ns < 0``."""
        est = self.get(name)
        return -1 if est is None or t_ns < 0 else t_ns + est.offset_ns

    def __len__(self) -> int:
        with self._lock:
            return len(self._estimates)
