"""The attribution promise, judged by a client that is not ours.

A raw-socket client (``deployments.raw_stream``: no HTTP library, nothing of tokentrace)
streams completions from a reference deployment traced by ``tokentrace run``, colocated
and disaggregated, on an idle machine and with both cores oversubscribed by busy loops.
For each request the client's window is [its send, the last chunk's arrival] (and, for
TTFT, [its send, the first chunk's arrival]); the union of every server-side span of the
request (all processes, on the run's reference clock) must cover at least 99% of the
windows' total time. The send and the arrivals are the client kernel's transmit and receive
timestamps (each read stopping at an event's end), so the client's own scheduling on an
oversubscribed machine does not count against the server. What no server process can see (the
request's bytes in flight before the gateway's loop read them, the last chunk's bytes
after it wrote them) is all that may be missing.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tokentrace.clock import align
from tokentrace.schema import SPANS, col, request_id_of
from tokentrace.store import open_run

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the deployments helper
from deployments import RawResult, busy_cpus, raw_stream, traced_server  # noqa: E402

NUM_REQUESTS = 8
CONCURRENCY = 4
MAX_TOKENS = 48


def covered_ns(intervals: np.ndarray, lo: int, hi: int) -> int:
    """Length of the union of ``intervals`` (rows of [start, end)) inside [lo, hi]."""
    if len(intervals) == 0:
        return 0
    s = np.clip(intervals[:, 0], lo, hi)
    e = np.clip(intervals[:, 1], lo, hi)
    order = np.argsort(s, kind="stable")
    total, cur_s, cur_e = 0, None, None
    for a, b in zip(s[order], e[order]):
        if cur_e is None or a > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    return int(total + (cur_e - cur_s))


@pytest.mark.parametrize("intervals, lo, hi, expected", [
    ([[0, 10], [5, 20], [30, 40]], 0, 100, 30),
    ([[0, 10], [5, 20], [30, 40]], 8, 35, 17),
    ([], 0, 10, 0),
    ([[50, 60]], 0, 10, 0),
])
def test_covered_ns(intervals, lo, hi, expected):
    assert covered_ns(np.array(intervals, dtype=np.int64).reshape(-1, 2), lo, hi) == expected


def _serve_events(gap_s: float) -> tuple[str, list[int], threading.Thread, socket.socket]:
    """A bare HTTP server for one request: a head and an event, ``gap_s`` later a second event
    and [DONE]. Yields (url, [monotonic ns its read of the request returned], thread, socket)."""
    server = socket.create_server(("127.0.0.1", 0))
    received: list[int] = []
    events = [b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n\n', b"data: [DONE]\n\n"]

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.recv(65536)
            received.append(time.monotonic_ns())
            body = b"".join(events)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + events[0])
            time.sleep(gap_s)
            conn.sendall(events[1] + events[2])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{server.getsockname()[1]}", received, thread, server


@pytest.mark.parametrize("gap_s, first_read_after_s", [(0.5, 0.0), (0.05, 1.0)], ids=["prompt", "late"])
def test_the_raw_client_times_the_send_and_each_event_by_the_kernel(gap_s: float, first_read_after_s: float) -> None:
    """The send is the kernel's transmit time (between the call and the server's read of it);
    events are the kernel's receive times, apart as sent when read promptly, and before the
    read when the client reads late."""
    url, received, thread, server = _serve_events(gap_s)
    try:
        before = time.monotonic_ns()
        res = raw_stream(url, "k", {"prompt": "x"}, timeout_s=60, first_read_after_s=first_read_after_s)
    finally:
        thread.join(60)
        server.close()
    assert res.status == 200 and res.done and len(res.chunk_ns) == 2, res
    assert before <= res.send_ns <= received[0] < res.chunk_ns[0] <= res.chunk_ns[1], (before, received, res)
    if first_read_after_s:
        assert res.chunk_ns[1] < min(res.read_ns), res  # arrivals, not the late read's time
    else:
        assert res.chunk_ns[1] - res.chunk_ns[0] >= gap_s * 1e9, res


def run_clients(url: str, model: str = "tiny", *, num_requests: int = NUM_REQUESTS,
                max_tokens: int = MAX_TOKENS) -> list[RawResult]:
    def one(i: int) -> RawResult:
        body = {"model": model, "prompt": f"independent {i} " + "lorem ipsum " * (15 + 2 * i), "max_tokens": max_tokens,
                "stream": True, "ignore_eos": True, "temperature": 0}
        return raw_stream(url, f"raw-{i}", body)

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(one, range(num_requests)))


def coverage(store: Path, run: str, results: list[RawResult], *, ttft: bool = False) -> tuple[float, list[float]]:
    """(covered share of all windows together, covered share per request). The window is
    [send, last chunk], or [send, first chunk] with ``ttft``."""
    r = open_run(store, run)
    spans = align(r.table(SPANS.name), SPANS.name, r.table("instances")).to_pandas()
    by_request = {rid: g[[col.START_NS, col.END_NS]].to_numpy(np.int64) for rid, g in spans.groupby(col.REQUEST_ID)}
    covered = window = 0
    shares = []
    for res in results:
        lo, hi = res.send_ns, (res.chunk_ns[0] if ttft else res.last_ns)
        c = covered_ns(by_request.get(request_id_of(res.key), np.empty((0, 2), np.int64)), lo, hi)
        covered += c
        window += hi - lo
        shares.append(c / (hi - lo))
    return covered / window, shares


DEPLOYMENTS = {
    "colocated": ["--mode", "colocated", "--instances", "1"],
    "disaggregated": ["--mode", "disagg", "--prefill", "1", "--decode", "1"],
}


CASES = [  # (deployment, busy-loop processes, model); the small model's requests are shorter
    ("colocated", 0, "tiny"), ("colocated", 2, "tiny"), ("disaggregated", 0, "tiny"), ("disaggregated", 2, "tiny"),
    ("colocated", 2, "small"), ("disaggregated", 2, "small"),
]


@pytest.mark.parametrize("mode, busy, model", CASES,
                         ids=[f"{m}-{'idle' if b == 0 else 'busy'}-{model}" for m, b, model in CASES])
def test_server_spans_explain_what_an_independent_client_saw(mode: str, busy: int, model: str,
                                                            tmp_path: Path) -> None:
    small = model == "small"
    with busy_cpus(busy):
        with traced_server(tmp_path, "raw", DEPLOYMENTS[mode], model=model) as url:
            results = run_clients(url, model, num_requests=4 if small else NUM_REQUESTS,
                                  max_tokens=16 if small else MAX_TOKENS)
    assert all(r.status == 200 and r.done and len(r.chunk_ns) >= 1 for r in results)
    share, per_request = coverage(tmp_path, "raw", results)
    assert share >= 0.99, (share, [round(s, 4) for s in per_request])
    share, per_request = coverage(tmp_path, "raw", results, ttft=True)
    assert share >= 0.99, ("ttft", share, [round(s, 4) for s in per_request])
