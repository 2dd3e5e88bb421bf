"""Live progress of a bench run: sent, completed, failed, current rate, running TTFT / ITL.

The runner calls a :class:`ProgressListener` from its event loop: ``on_sent`` when a
request goes out, ``on_done`` when its outcome is known. :class:`LiveProgress` draws
with rich (at most ``refresh_per_s`` times a second, from rich's own refresh thread,
reading counters that only the event loop writes); :class:`NullProgress` does nothing
(``--output json``, tests).
"""

from __future__ import annotations

import collections
import time
from typing import Protocol

import numpy as np
from rich.console import Console
from rich.live import Live
from rich.table import Table

from tokentrace.app.bench.requests import Outcome, PlannedRequest

__all__ = ["ProgressListener", "NullProgress", "LiveProgress", "ProgressState"]

_WINDOW = 10_000  # latest samples kept for the running percentiles
_RATE_WINDOW_S = 5.0  # the "current rate" is over the last 5 s of sends


class ProgressListener(Protocol):
    """Told about each request; called on the runner's event loop, must not block."""

    def on_sent(self, req: PlannedRequest) -> None: ...

    def on_done(self, outcome: Outcome) -> None: ...

    def close(self) -> None: ...


class NullProgress:
    """A listener that shows nothing."""

    def on_sent(self, req: PlannedRequest) -> None:
        pass

    def on_done(self, outcome: Outcome) -> None:
        pass

    def close(self) -> None:
        pass


class ProgressState:
    """Counters and running samples; what :class:`LiveProgress` shows. Event-loop thread only writes."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.sent = self.completed = self.failed = 0
        self.send_times: collections.deque[float] = collections.deque()  # monotonic seconds
        self.ttft_ms: collections.deque[float] = collections.deque(maxlen=_WINDOW)
        self.itl_ms: collections.deque[float] = collections.deque(maxlen=_WINDOW)

    def on_sent(self, req: PlannedRequest) -> None:
        self.sent += 1
        now = time.monotonic()
        self.send_times.append(now)
        while self.send_times and self.send_times[0] < now - _RATE_WINDOW_S:
            self.send_times.popleft()

    def on_done(self, outcome: Outcome) -> None:
        if outcome.ok:
            self.completed += 1
            if outcome.recv_ns:
                self.ttft_ms.append((outcome.recv_ns[0] - outcome.send_ns) / 1e6)
                self.itl_ms.extend(np.diff(np.asarray(outcome.recv_ns, dtype=np.int64)) / 1e6)
        elif not outcome.cancelled:
            self.failed += 1

    def rate(self) -> float:
        """Requests sent per second over the last few seconds."""
        times = list(self.send_times)
        if len(times) < 2:
            return 0.0
        span = max(time.monotonic() - times[0], 1e-9)
        return len(times) / span

    @staticmethod
    def percentiles(samples: collections.deque[float]) -> str:
        if not samples:
            return "-"
        p50, p90, p99 = np.percentile(np.fromiter(list(samples), dtype=float), (50, 90, 99))
        return f"p50 {p50:.1f}  p90 {p90:.1f}  p99 {p99:.1f}"

    def table(self) -> Table:
        t = Table(title="tokentrace bench", show_header=False, expand=False)
        t.add_row("sent", f"{self.sent} / {self.total}")
        t.add_row("completed", str(self.completed))
        t.add_row("failed", str(self.failed))
        t.add_row("in flight", str(self.sent - self.completed - self.failed))
        t.add_row("current rate", f"{self.rate():.1f} req/s")
        t.add_row("TTFT (ms)", self.percentiles(self.ttft_ms))
        t.add_row("ITL (ms)", self.percentiles(self.itl_ms))
        return t


class LiveProgress:
    """Draws :class:`ProgressState` live on ``console`` (stderr by default)."""

    def __init__(self, total: int, *, console: Console | None = None, refresh_per_s: float = 4.0) -> None:
        self.state = ProgressState(total)
        self._live = Live(get_renderable=self.state.table, console=console or Console(stderr=True),
                          refresh_per_second=refresh_per_s, transient=False)
        self._live.start()

    def on_sent(self, req: PlannedRequest) -> None:
        self.state.on_sent(req)

    def on_done(self, outcome: Outcome) -> None:
        self.state.on_done(outcome)

    def close(self) -> None:
        self._live.stop()
