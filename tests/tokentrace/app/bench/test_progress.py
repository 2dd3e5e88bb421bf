"""Live progress: counters, the current rate, running percentiles, and drawing with rich."""

from __future__ import annotations

import io
import time

from rich.console import Console

from tokentrace.app.bench.client import FailureKind, Outcome
from tokentrace.app.bench.progress import LiveProgress, ProgressState
from tokentrace.app.bench.requests import PlannedRequest, TextRequest

MS = 1_000_000


def _req(i: int) -> PlannedRequest:
    return PlannedRequest(i, f"k{i}", TextRequest("", "x", 2), 0.0)


def test_counts_and_running_percentiles():
    s = ProgressState(total=4)
    for i in range(3):
        s.on_sent(_req(i))
    s.on_done(Outcome(0, "k0", 0, (10 * MS, 12 * MS, 15 * MS), 15 * MS, 200, None))
    s.on_done(Outcome(1, "k1", 0, (), 1 * MS, 500, FailureKind.HTTP_5XX))
    s.on_done(Outcome(2, "k2", 0, (), 1 * MS, 0, None, cancelled=True))
    assert (s.sent, s.completed, s.failed) == (3, 1, 1)
    assert list(s.ttft_ms) == [10.0] and list(s.itl_ms) == [2.0, 3.0]
    assert s.percentiles(s.itl_ms).startswith("p50 2.5")
    assert s.percentiles(s.ttft_ms.__class__()) == "-"


def test_rate_counts_recent_sends():
    s = ProgressState(total=100)
    for i in range(20):
        s.on_sent(_req(i))
        time.sleep(0.005)
    assert 0 < s.rate() < 20 / 0.09  # 20 sends over at least ~0.1 s


def test_live_progress_draws_the_table():
    buf = io.StringIO()
    p = LiveProgress(2, console=Console(file=buf, force_terminal=True, width=100), refresh_per_s=20)
    p.on_sent(_req(0))
    p.on_done(Outcome(0, "k0", 0, (5 * MS, 7 * MS), 7 * MS, 200, None))
    p.close()
    out = buf.getvalue()
    for label in ("sent", "completed", "failed", "current rate", "TTFT (ms)", "ITL (ms)", "1 / 2"):
        assert label in out
