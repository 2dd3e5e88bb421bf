"""When requests are sent: open-loop arrival processes and the closed-loop bound.

Open loop: the send time of request ``i`` is fixed in advance, independent of how
fast the server answers (so a slow server builds a queue, as in production).
:class:`Arrivals` gives the offsets, in seconds from the start of the run:

* ``poisson``: exponential gaps with mean ``1 / rate``;
* ``gamma``: gamma-distributed gaps with shape ``burstiness`` and mean ``1 / rate``
  (``vllm bench serve``'s definition: burstiness 1 is Poisson, below 1 burstier,
  above 1 more regular);
* ``constant``: gaps of exactly ``1 / rate``;
* ``trace``: the workload's own (scaled) timestamps.

``rate = inf`` sends everything at once (the closed-loop bound then sets the pace).
Closed loop is the runner's ``concurrency`` bound: at most that many requests in
flight, the next one sent as soon as one finishes (and not before its open-loop time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["ARRIVAL_KINDS", "Arrivals"]

ARRIVAL_KINDS: tuple[str, ...] = ("poisson", "gamma", "constant", "trace")


@dataclass(frozen=True, slots=True)
class Arrivals:
    """An arrival process. ``rate`` in requests per second (``inf`` = all at once)."""

    kind: str = "poisson"
    rate: float = math.inf
    burstiness: float = 1.0  # gamma shape; only for kind "gamma"

    def __post_init__(self) -> None:
        if self.kind not in ARRIVAL_KINDS:
            raise ValueError(f"unknown arrival process {self.kind!r}; choose one of {', '.join(ARRIVAL_KINDS)}")
        if not (self.rate > 0):
            raise ValueError(f"rate must be positive (or inf), got {self.rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a positive number, got {self.burstiness}")
        if self.kind == "constant" and not math.isfinite(self.rate):
            raise ValueError("a constant arrival process needs a finite --rate")

    def offsets(self, num_requests: int, *, seed: int = 0,
                trace_offsets_s: Sequence[float] | None = None) -> np.ndarray:
        """Send offsets in seconds from the run start, non-decreasing, shape (num_requests,).

        The first request goes at offset 0. ``trace_offsets_s`` is required for
        kind ``trace`` (and must hold at least ``num_requests`` values); other
        kinds ignore it. Deterministic for a given ``seed``. Raises ``ValueError``.
        """
        if num_requests < 0:
            raise ValueError(f"num_requests must be >= 0, got {num_requests}")
        if self.kind == "trace":
            return _trace_offsets(num_requests, trace_offsets_s)
        if num_requests == 0:
            return np.zeros(0)
        if not math.isfinite(self.rate):
            return np.zeros(num_requests)
        mean_gap = 1.0 / self.rate  # seconds
        rng = np.random.default_rng(seed)
        if self.kind == "constant":
            gaps = np.full(num_requests - 1, mean_gap)
        elif self.kind == "poisson":
            gaps = rng.exponential(mean_gap, num_requests - 1)
        else:  # gamma: shape k, scale theta with k * theta = mean gap
            gaps = rng.gamma(self.burstiness, mean_gap / self.burstiness, num_requests - 1)
        return np.concatenate(([0.0], np.cumsum(gaps)))

    def describe(self) -> str:
        """One line for the printed summary."""
        if self.kind == "trace":
            return "trace timestamps"
        rate = "inf" if not math.isfinite(self.rate) else f"{self.rate:g}/s"
        extra = f", burstiness {self.burstiness:g}" if self.kind == "gamma" else ""
        return f"{self.kind} at {rate}{extra}"


def _trace_offsets(num_requests: int, trace_offsets_s: Sequence[float] | None) -> np.ndarray:
    if trace_offsets_s is None:
        raise ValueError("arrival process 'trace' needs a trace workload (azure-*, mooncake or a trace file)")
    if len(trace_offsets_s) < num_requests:
        raise ValueError(f"the trace has {len(trace_offsets_s)} timestamps, fewer than {num_requests} requests")
    out = np.asarray(trace_offsets_s[:num_requests], dtype=float)
    if out.size and (np.any(np.diff(out) < 0) or out[0] < 0):
        raise ValueError("trace timestamps must be non-negative and non-decreasing")
    return out - out[0] if out.size else out
