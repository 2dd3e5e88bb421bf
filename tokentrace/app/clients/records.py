"""What every client-result parser returns: one :class:`ClientRecord` per request sent."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from tokentrace.schema import RequestStatus

__all__ = ["TimeBase", "ClientRecord", "ClientExport", "to_ns", "as_count"]


class TimeBase(enum.Enum):
    """The clock a tool's absolute times are on."""

    WALL = "wall"
    """Unix time (``time.time_ns``): placed on the run's reference clock through its wall-clock anchor."""
    MONOTONIC = "monotonic"
    """This host's ``CLOCK_MONOTONIC`` (Python's ``perf_counter`` on Linux): the clock the traced
    processes record on, so a client on the same host needs no conversion."""


@dataclass(frozen=True, slots=True)
class ClientRecord:
    """One request as a client saw it; times are ns on the export's :class:`TimeBase`."""

    index: int
    """Position in the file (the tool's own order)."""
    key: str
    """The request id the tool sent (``X-Request-Id``); empty when it sends none or does not save it."""
    send_ns: int
    """When the request was sent."""
    chunks: tuple[tuple[int, int], ...] = ()
    """(chunk index, receipt time) of each streamed chunk with content whose time the tool reports,
    in order; chunk 0 is the first one (the tool's time to first token). A tool that reports only
    some chunks (guidellm: the first and the last) leaves the others out: none is invented."""
    finish_ns: int = -1
    """When the response ended (-1: not reported)."""
    status: RequestStatus = RequestStatus.OK
    error: str = ""
    num_prompt_tokens: int = -1
    num_output_tokens: int = -1
    num_cached_tokens: int = -1
    session: str = ""
    """The conversation the request is a turn of, when the tool says (AIPerf's ``conversation_id``)."""
    session_turn: int = -1
    """Its 0-based turn in that conversation (AIPerf's ``turn_index``); -1 when not said."""


@dataclass(frozen=True, slots=True)
class ClientExport:
    """A parsed results file: the tool, its version when the file names it, the clock, the records."""

    tool: str
    version: str
    time_base: TimeBase
    records: tuple[ClientRecord, ...]
    notes: tuple[str, ...] = ()
    """What the file did not carry (said once per import, never filled with zeros)."""


_UNIT_NS = {"ns": 1, "us": 1_000, "µs": 1_000, "ms": 1_000_000, "s": 1_000_000_000, "sec": 1_000_000_000}


def to_ns(value: Any, unit: str, what: str) -> int:
    """A finite non-negative duration in ``unit`` as integer ns; ``ValueError`` naming ``what`` otherwise."""
    scale = _UNIT_NS.get(unit)
    if scale is None:
        raise ValueError(f"{what}: unknown time unit {unit!r}; known: {', '.join(_UNIT_NS)}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what}: expected a non-negative number of {unit}, got {value!r}")
    return round(value * scale)


def as_count(value: Any) -> int:
    """A token count, or -1 when absent or not a non-negative integer."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < 0:
        return -1
    return int(value)
