"""This process's clocks: the recording clock and a (monotonic, wall) anchor.

Within one process every tokentrace time is ``time.monotonic_ns()``: immune to
NTP steps, comparable only inside the process (and, on Linux, across processes
of one host, since all use ``CLOCK_MONOTONIC``). An :class:`Anchor`, a
(monotonic, wall) pair read at one instant, ties such times to wall-clock dates.
Every function here reads clocks only and never blocks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

__all__ = ["now_ns", "Anchor", "take_anchor"]

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

    def to_mono_ns(self, wall_ns: int) -> int:
        """The local monotonic time of a wall-clock time (ns since the epoch); inverse of :meth:`to_wall_ns`."""
        return self.mono_ns + (wall_ns - self.wall_ns)


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
