"""Clocks: the one place tokentrace converts between clocks.

Three clocks meet in a run:

* each process's **monotonic clock** (``time.monotonic_ns``), on which it
  records (:mod:`~tokentrace.clock.local`: :data:`now_ns`, :class:`Anchor`);
* the run's **reference clock**, the monotonic clock of one process (the
  gateway) that every other process's offset maps onto
  (:mod:`~tokentrace.clock.sync`: ping exchanges, :class:`ClockEstimate`, and
  the live :class:`OffsetBook` the reference process keeps of them);
* **wall time** (Unix ns), through an instance's (monotonic, wall) anchor
  (:mod:`~tokentrace.clock.alignment`: :class:`RunClocks`).

Conversions done anywhere else are a bug: analyzers, exporters, OTLP ingest
and live tracers all call into this package. See ``docs/architecture.md``.
"""

from __future__ import annotations

from tokentrace.clock.alignment import (
    OFFSET_COLUMN,
    RunClocks,
    align,
    aligned_time_sql,
    latest_instances,
    time_columns,
)
from tokentrace.clock.local import Anchor, now_ns, take_anchor
from tokentrace.clock.sync import ClockEstimate, OffsetBook, PingSample, estimate_offset, ping_exchange

__all__ = [
    "now_ns",
    "Anchor",
    "take_anchor",
    "PingSample",
    "ClockEstimate",
    "estimate_offset",
    "ping_exchange",
    "OffsetBook",
    "RunClocks",
    "OFFSET_COLUMN",
    "align",
    "aligned_time_sql",
    "latest_instances",
    "time_columns",
]
