"""``vllm bench serve --save-result --save-detailed``'s result JSON.

Format, as vLLM's writer produces it (``vllm/benchmarks/serve.py``, the ``result`` dict;
timing in ``vllm/benchmarks/lib/endpoint_request_func.py``): parallel per-request lists
``start_times`` (``time.perf_counter()`` at the send, seconds), ``ttfts`` (first chunk with
``choices`` minus the start, s), ``itls`` (list per request: gaps between later ``choices``
chunks, s), ``input_lens``, ``output_lens`` (usage ``completion_tokens``) and ``errors``
(empty string when the request succeeded), in the dataset's order. ``--save-detailed`` keeps
these lists; without it they are dropped.

vLLM sends each request with an ``x-request-id`` header but does not save the ids, so records
are matched by send time and order. ``perf_counter`` is ``CLOCK_MONOTONIC`` on Linux, the clock
the traced processes record on: the bench must have run on the server's host.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokentrace.app.clients.records import ClientExport, ClientRecord, TimeBase, as_count, to_ns
from tokentrace.schema import RequestStatus

__all__ = ["read_vllm_bench"]

_REQUIRED = ("start_times", "ttfts", "itls")


def read_vllm_bench(path: Path) -> ClientExport:
    """Parse a ``vllm bench serve`` result; ``ValueError`` when the per-request lists are missing."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: not a vllm bench result (a JSON object)")
    missing = [k for k in _REQUIRED if not isinstance(obj.get(k), list)]
    if missing:
        raise ValueError(f"{path} has no per-request {', '.join(missing)}: save it with "
                         "vllm bench serve --save-result --save-detailed")
    n = len(obj["start_times"])
    lists: dict[str, list[Any]] = {}
    for key in ("ttfts", "itls", "errors", "input_lens", "output_lens"):
        v = obj.get(key)
        lists[key] = v if isinstance(v, list) and len(v) == n else [None] * n
    records = []
    for i, start_s in enumerate(obj["start_times"]):
        where = f"{path}: request {i}"
        send = to_ns(start_s, "s", f"{where}: start_times")
        error = lists["errors"][i] or ""
        chunks: list[tuple[int, int]] = []
        ttft = lists["ttfts"][i]
        if not error and isinstance(ttft, (int, float)) and ttft > 0:
            t = send + to_ns(ttft, "s", f"{where}: ttfts")
            chunks.append((0, t))
            for k, gap in enumerate(lists["itls"][i] or [], start=1):
                t += to_ns(gap, "s", f"{where}: itls[{k - 1}]")
                chunks.append((k, t))
        records.append(ClientRecord(
            index=i, key="", send_ns=send, chunks=tuple(chunks), finish_ns=chunks[-1][1] if chunks else -1,
            status=RequestStatus.ERROR if error else RequestStatus.OK,
            error=str(error).strip().splitlines()[-1][:64] if str(error).strip() else "",  # a traceback's last line
            num_prompt_tokens=as_count(lists["input_lens"][i]), num_output_tokens=as_count(lists["output_lens"][i])))
    if not records:
        raise ValueError(f"{path} holds no requests")
    return ClientExport("vllm-bench", str(obj.get("vllm_version", "") or ""), TimeBase.MONOTONIC, tuple(records),
                        notes=("vllm bench counts its first chunk with choices (even an empty one) as TTFT",))
