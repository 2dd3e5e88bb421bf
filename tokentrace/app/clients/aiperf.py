"""AIPerf's per-request export, ``profile_export.jsonl`` (AIPerf 0.13).

Format, as AIPerf 0.13's writer produces it (``aiperf/common/models/record_models.py``:
``MetricRecordInfo`` / ``MetricRecordMetadata``; ``aiperf/metrics/types/``): one JSON object
per line with

* ``metadata``: ``x_request_id`` (the ``X-Request-ID`` header sent), ``request_start_ns`` and
  ``request_end_ns`` (wall clock, ``time.time_ns``), ``was_cancelled``, ``benchmark_phase``;
* ``metrics``: ``{name: {"value": ..., "unit": ...}}``. ``time_to_first_token`` is the first
  *content* response minus the request start and ``inter_chunk_latency`` the gaps between
  consecutive content responses (``ParsedResponseRecord.content_responses``: responses whose
  data is not empty; usage-only and ``[DONE]`` chunks are not counted), both measured with
  ``perf_counter_ns``; ``usage_prompt_tokens``, ``usage_completion_tokens`` and
  ``usage_prompt_cache_read_tokens`` are the server's usage, ``input_sequence_length`` /
  ``output_sequence_length`` AIPerf's own counts;
* ``error`` (``ErrorDetails``: ``code``, ``type``, ``message``) when the request failed.

Chunk ``i``'s receipt is ``request_start_ns + TTFT + sum(ICL[:i])``: durations AIPerf measured
on its monotonic clock, added to the wall-clock start it recorded for the same request.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokentrace.app.clients.records import ClientExport, ClientRecord, TimeBase, as_count, to_ns
from tokentrace.schema import RequestStatus

__all__ = ["read_aiperf"]

SUMMARY_FILE = "profile_export_aiperf.json"  # written beside the jsonl; names the AIPerf version


def _metric(metrics: dict[str, Any], name: str) -> tuple[Any, str] | None:
    m = metrics.get(name)
    if not isinstance(m, dict) or "value" not in m:
        return None
    return m["value"], str(m.get("unit", ""))


def _status(meta: dict[str, Any], error: Any) -> tuple[RequestStatus, str]:
    if meta.get("was_cancelled"):
        return RequestStatus.ABORTED, "cancelled"
    if not isinstance(error, dict):
        return RequestStatus.OK, ""
    code = error.get("code")
    kind = str(error.get("type") or error.get("message") or "error")[:64]
    if isinstance(code, int) and code in (408, 504):
        return RequestStatus.TIMEOUT, kind
    if isinstance(code, int) and 400 <= code < 500:
        return RequestStatus.REJECTED, kind
    return RequestStatus.ERROR, kind


def _record(n: int, line: str, where: str) -> ClientRecord:
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), dict) or not isinstance(obj.get("metrics"), dict):
        raise ValueError(f"{where}: not an AIPerf record (an object with 'metadata' and 'metrics')")
    meta, metrics = obj["metadata"], obj["metrics"]
    start = meta.get("request_start_ns")
    if isinstance(start, bool) or not isinstance(start, int):
        raise ValueError(f"{where}: metadata.request_start_ns is missing or not an integer")
    end = meta.get("request_end_ns")
    chunks: list[tuple[int, int]] = []
    ttft = _metric(metrics, "time_to_first_token")
    if ttft is not None:
        t = start + to_ns(ttft[0], ttft[1], f"{where}: time_to_first_token")
        chunks.append((0, t))
        icl = _metric(metrics, "inter_chunk_latency")
        if icl is not None:
            if not isinstance(icl[0], list):
                raise ValueError(f"{where}: inter_chunk_latency must be a list")
            for i, gap in enumerate(icl[0], start=1):
                t += to_ns(gap, icl[1], f"{where}: inter_chunk_latency[{i - 1}]")
                chunks.append((i, t))
    status, error = _status(meta, obj.get("error"))

    def count(*names: str) -> int:
        for name in names:
            m = _metric(metrics, name)
            if m is not None and as_count(m[0]) >= 0:
                return as_count(m[0])
        return -1

    return ClientRecord(
        index=n, key=str(meta.get("x_request_id") or ""), send_ns=start, chunks=tuple(chunks),
        finish_ns=end if isinstance(end, int) and not isinstance(end, bool) else -1, status=status, error=error,
        num_prompt_tokens=count("usage_prompt_tokens", "input_sequence_length"),
        num_output_tokens=count("usage_completion_tokens", "output_sequence_length", "output_token_count"),
        num_cached_tokens=count("usage_prompt_cache_read_tokens"), session=_session(meta),
        session_turn=_turn(meta))


def _session(meta: dict) -> str:
    """The conversation of a multi-turn record (``conversation_id``), else "" ."""
    conversation = meta.get("conversation_id")
    return conversation[:256] if isinstance(conversation, str) else ""


def _turn(meta: dict) -> int:
    turn = meta.get("turn_index")
    return turn if isinstance(turn, int) and not isinstance(turn, bool) and 0 <= turn < 2**31 else -1


def _version(path: Path) -> str:
    summary = path.with_name(SUMMARY_FILE)
    try:
        version = json.loads(summary.read_text(encoding="utf-8")).get("aiperf_version", "")
    except (OSError, ValueError, AttributeError):
        return ""
    return str(version) if isinstance(version, str) else ""


def read_aiperf(path: Path) -> ClientExport:
    """Parse ``profile_export.jsonl``; ``ValueError`` naming the line for a malformed record."""
    records = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                records.append(_record(len(records), line, f"{path}:{lineno}"))
    if not records:
        raise ValueError(f"{path} holds no AIPerf records")
    return ClientExport("aiperf", _version(path), TimeBase.WALL, tuple(records))
