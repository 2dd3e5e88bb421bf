"""guidellm's benchmarks report, ``benchmarks.json`` (guidellm 0.8).

Format, as guidellm 0.8's writer produces it (``GenerativeBenchmarksReport`` in
``guidellm/benchmark/schemas/report.py``; ``GenerativeRequestStats`` in
``guidellm/schemas/base/request_stats.py``; ``RequestInfo`` / ``RequestTimings`` in
``guidellm/schemas/base/info.py``): ``{"benchmarks": [{"requests": {"successful": [...],
"incomplete": [...], "errored": [...]}, ...}, ...]}``; each request has ``request_id``
(guidellm's own uuid: it is not sent to the server), ``info.timings`` with Unix-time floats in
seconds (``request_start``, ``first_token_iteration``, ``last_token_iteration``,
``request_end``) and the count ``token_iterations`` (streamed iterations that carried tokens),
``info.error``, and the computed ``prompt_tokens`` / ``output_tokens`` / ``cached_tokens``
(falling back to ``input_metrics.total_tokens`` / ``output_metrics.total_tokens``).

guidellm keeps only the first and the last streamed iteration's time, so the client lane gets
chunk 0 and chunk ``token_iterations - 1``; the chunks between are not reported and none is
invented (agreement compares TTFT only).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tokentrace.app.clients.records import ClientExport, ClientRecord, TimeBase, as_count
from tokentrace.schema import RequestStatus

__all__ = ["read_guidellm"]

_STATUS = {"successful": RequestStatus.OK, "errored": RequestStatus.ERROR, "incomplete": RequestStatus.ABORTED}


def _unix_ns(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return None
    return round(value * 1e9)


def _count(req: dict[str, Any], name: str, metrics: str) -> int:
    v = as_count(req.get(name))
    if v >= 0:
        return v
    m = req.get(metrics)
    return as_count(m.get("total_tokens")) if isinstance(m, dict) else -1


def _record(n: int, req: Any, status: RequestStatus, where: str) -> ClientRecord | None:
    if not isinstance(req, dict) or not isinstance(req.get("info"), dict):
        raise ValueError(f"{where}: not a guidellm request (an object with 'info')")
    timings = req["info"].get("timings")
    if not isinstance(timings, dict):
        raise ValueError(f"{where}: info.timings is missing")
    start = _unix_ns(timings.get("request_start"))
    if start is None:
        return None  # never sent (cancelled in the queue): no client time to place
    chunks = []
    first, last = _unix_ns(timings.get("first_token_iteration")), _unix_ns(timings.get("last_token_iteration"))
    iterations = as_count(timings.get("token_iterations"))
    if first is not None:
        chunks.append((0, first))
        if last is not None and iterations >= 2 and last >= first:
            chunks.append((iterations - 1, last))
    end = _unix_ns(timings.get("request_end"))
    error = req["info"].get("error") or ""
    return ClientRecord(
        index=n, key="", send_ns=start, chunks=tuple(chunks), finish_ns=-1 if end is None else end,
        status=status, error=str(error)[:64] if status != RequestStatus.OK else "",
        num_prompt_tokens=_count(req, "prompt_tokens", "input_metrics"),
        num_output_tokens=_count(req, "output_tokens", "output_metrics"),
        num_cached_tokens=as_count(req.get("cached_tokens")))


def read_guidellm(path: Path) -> ClientExport:
    """Parse a guidellm benchmarks JSON; every benchmark's requests, in start order."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("benchmarks"), list):
        raise ValueError(f"{path}: not a guidellm report (an object with a 'benchmarks' list)")
    found: list[tuple[Any, RequestStatus, str]] = []
    for b, bench in enumerate(obj["benchmarks"]):
        reqs = bench.get("requests") if isinstance(bench, dict) else None
        if not isinstance(reqs, dict):
            raise ValueError(f"{path}: benchmarks[{b}] has no 'requests' breakdown (save the full report)")
        for kind, status in _STATUS.items():
            for i, req in enumerate(reqs.get(kind) or []):
                found.append((req, status, f"{path}: benchmarks[{b}].requests.{kind}[{i}]"))
    records = [r for n, (req, status, where) in enumerate(found) if (r := _record(n, req, status, where))]
    if not records:
        raise ValueError(f"{path} holds no guidellm requests that were sent")
    records.sort(key=lambda r: r.send_ns)
    version = obj.get("metadata", {}).get("guidellm_version", "") if isinstance(obj.get("metadata"), dict) else ""
    return ClientExport("guidellm", str(version or ""), TimeBase.WALL, tuple(records),
                        notes=("guidellm keeps the first and last chunk times only",))
