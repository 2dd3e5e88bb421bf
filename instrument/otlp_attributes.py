"""Typed values read from OTLP span attributes, as the emitter mappings (:mod:`instrument.otlp_mapping`) read them.

Every reader returns "absent" (None, or -1 for counts and ids: not reported, never 0) for a missing attribute, a
value of the wrong type, or one outside what a store column can hold after clock arithmetic; a received payload
never raises here.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

from instrument import semconv as sc
from tokentrace.schema import RequestStatus

__all__ = ["MAX_LATENCY_S", "MAX_INT", "MAX_BATCH_SIZE", "seconds_ns", "count", "int64", "unix_ns", "numbers",
           "finish_status"]

MAX_LATENCY_S = 1e7
"""Latency attributes above this (about 116 days) are not latencies of a request: read as absent."""
MAX_INT = (1 << 62) - 1
"""Integer attributes (counts, indices, Unix ns) past this cannot be stored in an int64 column
after clock arithmetic: read as absent."""
MAX_BATCH_SIZE = float(1 << 31)
"""Per-token batch sizes above this are not batch sizes: the array is read as absent."""


def seconds_ns(attrs: Mapping[str, Any], key: str) -> int | None:
    """A latency attribute in seconds as non-negative integer ns; None if absent or not a finite number."""
    v = attrs.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or abs(v) > MAX_LATENCY_S:
        return None
    return max(0, round(v * 1e9))


def count(attrs: Mapping[str, Any], *keys: str) -> int:
    """The first of ``keys`` holding a count (an int in [0, MAX_INT]); -1 if none does."""
    for key in keys:
        v = attrs.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_INT:
            return v
    return -1


def int64(attrs: Mapping[str, Any], key: str) -> int:
    """An int64 attribute (an index, an id); -1 if absent or not one."""
    v = attrs.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and -(1 << 63) <= v < (1 << 63) else -1  # int64


def unix_ns(v: Any) -> int | None:
    """A Unix-ns timestamp attribute; None if absent, not an int or out of a column's range."""
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_INT else None


def numbers(attrs: Mapping[str, Any], key: str, *, high: float = MAX_LATENCY_S) -> list[float] | None:
    """A per-token array attribute (an array, or its JSON text) of values in [0, ``high``];
    None if absent or malformed, or if any value is out of range (NaN, negative, 1e300)."""
    v = attrs.get(key)
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except (ValueError, RecursionError):
            return None
    if not isinstance(v, (list, tuple)) or not v:
        return None
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= high for x in v):
        return None  # `0 <= x <= high` is False for NaN too
    return [float(x) for x in v]


def finish_status(attrs: Mapping[str, Any]) -> tuple[int, str] | None:
    """(status, error) from the finish reasons, when one says the request was aborted or failed."""
    reasons: Any = attrs.get(sc.GEN_AI_RESPONSE_FINISH_REASONS)
    raw = attrs.get(sc.GEN_AI_RESPONSE_FINISH_REASON)
    if reasons is None and isinstance(raw, str):
        try:
            reasons = json.loads(raw)
        except ValueError:
            reasons = [raw]
    if isinstance(reasons, str):
        reasons = [reasons]
    if not isinstance(reasons, (list, tuple)):
        return None
    labels = {str(r).lower() for r in reasons}
    if "abort" in labels or "aborted" in labels:
        return RequestStatus.ABORTED, "abort"
    if "error" in labels:
        return RequestStatus.ERROR, "error"
    return None
