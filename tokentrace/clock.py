"""Clocks: the monotonic time source, wall-clock anchors and cross-process offsets.

Within one process every tokentrace time is ``time.monotonic_ns()``: immune to
NTP steps, comparable only inside the process (and, on Linux, across processes
of one host, since all use ``CLOCK_MONOTONIC``). Two things tie such times to
the outside world:

* an :class:`Anchor`, a (monotonic, wall) pair read at one instant, so a local
  monotonic time can be shown as a wall-clock date;
* a :class:`ClockEstimate` from an NTP-style ping exchange with the run's
  reference process, so times of several processes (possibly on several hosts)
  can be put on one clock.

Sign convention (used by ``instances.clock_offset_ns`` too): the offset is what
you **add to the remote's clock to get the local (reference) clock**::

    t_local = t_remote + offset_ns

A worker that pings the run's reference process and wants its own row in
``instances`` must therefore store ``-offset_ns`` of the estimate it computed
(its own clock is the "remote" one when seen from the reference), or have the
reference process run the exchange against the worker. Every function here is
pure or reads clocks only; none blocks except :func:`ping_exchange`, which
blocks for as long as the caller's transport does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

__all__ = [
    "now_ns",
    "Anchor",
    "take_anchor",
    "PingSample",
    "ClockEstimate",
    "estimate_offset",
    "ping_exchange",
]

now_ns: Callable[[], int] = time.monotonic_ns
"""The recording clock: ``time.monotonic_ns`` itself (no wrapper, no extra call)."""


@dataclass(frozen=True, slots=True)
class Anchor:
    """One instant read on both clocks of this process."""

    mono_ns: int
    """``time.monotonic_ns()`` at the instant (local monotonic clock, ns)."""
    wall_ns: int
    """``time.time_ns()`` at the same instant (wall clock, ns since the Unix epoch)."""

    def to_wall_ns(self, mono_ns: int) -> int:
        """Wall-clock time (ns since the epoch) of a local monotonic time."""
        return self.wall_ns + (mono_ns - self.mono_ns)


def take_anchor(*, tries: int = 5) -> Anchor:
    """Read the wall clock between two monotonic reads, keeping the tightest try.

    The monotonic side of the anchor is the midpoint of the two monotonic reads
    of the try whose bracket was shortest, so its uncertainty is half that
    bracket (typically well under a microsecond). Any thread; never blocks.
    """
    if tries < 1:
        raise ValueError(f"tries must be >= 1, got {tries}")
    mono, wall = time.monotonic_ns, time.time_ns
    best_width = -1
    best = Anchor(0, 0)
    for _ in range(tries):
        m0 = mono()
        w = wall()
        m1 = mono()
        width = m1 - m0
        if best_width < 0 or width < best_width:
            best_width = width
            best = Anchor(m0 + width // 2, w)
    return best


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


def ping_exchange(send_recv: Callable[[int], tuple[int, int]], n: int = 16) -> ClockEstimate:
    """Run ``n`` pings through a caller-supplied transport and estimate the offset.

    ``send_recv(t0)`` must send a ping to the remote process and return the
    remote's ``(t1, t2)``: its clock readings when the ping arrived and when the
    reply left. ``t0`` and ``t3`` are read here with :func:`now_ns` right around
    the call. The result's offset maps the remote's clock onto this process's
    clock (``t_local = t_remote + offset_ns``).

    Blocks while ``send_recv`` does; exceptions from ``send_recv`` propagate.
    Raises ``ValueError`` if ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"ping_exchange needs n >= 1, got {n}")
    samples = []
    for _ in range(n):
        t0 = now_ns()
        t1, t2 = send_recv(t0)
        t3 = now_ns()
        samples.append(PingSample(t0, int(t1), int(t2), t3))
    return estimate_offset(samples)
