"""A stalled engine, planted in a real traced deployment: its worker process is stopped (SIGSTOP) for 0.6 s while
streams are in flight, then continued.

The truth comes from the test and the client, never from the analyzers under test: the test stopped the process
(so the engine ran nothing for that long) and the client saw, for each stream in flight, one gap between chunks
that spans the stop. The diagnosis must give each such stream's longest gap to the stop: ``engine_stall`` (the
engine ran no step, or a step of its usual batch took many times its usual time), or ``cpu_starved`` where the
stop caught the worker's event loop relaying a token (a late loop whose process used no CPU: it was stopped).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from planted_runs import traced_deployment

import tokentrace
from tokentrace.schema import col

pytestmark = pytest.mark.timeout(300)
STOP_S = 0.6
ITL_TARGET_MS = 300.0  # half the stop: a gap the stop spans misses it, the run's ordinary gaps do not
STOPPED_CAUSES = {"engine_stall", "cpu_starved"}  # both say the process got no CPU: it was stopped
BODY = {"model": "tiny", "prompt": "the engine will stop for a moment", "max_tokens": 120, "ignore_eos": True,
        "stream": True}


def _worker_pid(store: Path, name: str) -> int:
    """The traced process named ``name`` of this deployment (its environment names this test's store)."""
    marker = f"TOKENTRACE_STORE={store}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--name" in argv and argv[argv.index(b"--name") + 1] == name.encode() and marker in env:
            return int(entry.name)
    raise AssertionError(f"no process named {name} serves {store}")


def _stream(url: str, key: str, chunks: list[int], started: threading.Event) -> None:
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/completions", json=BODY,
                                                       headers={"X-Request-Id": key}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(time.monotonic_ns())
                if len(chunks) == 10:
                    started.set()


def test_a_stopped_engine_is_named_the_cause_of_the_gap_it_made(tmp_path):
    keys = [f"stall-{i}" for i in range(3)]
    chunks: dict[str, list[int]] = {k: [] for k in keys}
    with traced_deployment(tmp_path, "stall", ["--mode", "colocated", "--instances", "1",
                                               "--delay", "decode_step=4ms"]) as url:
        pid = _worker_pid(tmp_path, "colocated-0")
        started = [threading.Event() for _ in keys]
        threads = [threading.Thread(target=_stream, args=(url, k, chunks[k], e), daemon=True)
                   for k, e in zip(keys, started)]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started), {k: len(v) for k, v in chunks.items()}
        stopped = time.monotonic_ns()
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(STOP_S)
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic_ns()
        for t in threads:
            t.join(60)
    # The client's truth: the streams with a gap between chunks that spans the stop (chunks before and after it).
    hit = {k for k, times in chunks.items()
           if any(a <= stopped and b >= resumed for a, b in zip(times, times[1:]))}
    assert hit, {k: len(v) for k, v in chunks.items()}
    d = tokentrace.open(tmp_path, "stall").analyze().diagnosis(itl_ms=ITL_TARGET_MS)
    by_key = dict(zip(d.requests[col.REQUEST_ID], d.requests[col.REQUEST_KEY]))
    gaps = d.gaps.assign(key=d.gaps[col.REQUEST_ID].map(by_key))
    for key in sorted(hit):
        mine = gaps[gaps["key"] == key]
        assert len(mine), (key, d.requests[[col.REQUEST_KEY, "missed", "max_gap_ms"]].to_dict("records"))
        longest = mine.sort_values("gap_ms").iloc[-1]
        assert longest["gap_ms"] >= STOP_S * 1e3 * 0.9, (key, mine.to_dict("records"))
        assert longest["cause"] in STOPPED_CAUSES, (key, longest.to_dict(),
                                                    d.causes[d.causes[col.REQUEST_KEY] == key].to_dict("records"))
