"""The what-if benchmark's changes run twice (used by ``benchmarks/whatif.py``; not a benchmark of its own).

The four changes the accuracy bar is about (the rate at 0.5x and 1.5x, ``max_num_seqs``, ``max_num_batched_tokens``)
each run twice in a session: the rate changes in the sweep's two passes, the other two again after the second
pass (``p2-seqs``, ``p2-budget``). The second run of a configuration is the best any prediction of it could be on
this machine: the same configuration, served at another moment of the machine's speed. Held to the simulator's bar
(its error against the first run within max(15%, 1.5x the base runs' noise)), it says how many of the metrics a
rerun of each configuration meets where the simulator meets its count: a session whose reruns miss the bar is one
whose machine, not the simulator, decided the misses.

Also, per change: its own run-to-run noise (the two runs against each other), and the simulator against the mean
of the two runs, within max(15%, 1.5x the larger of its own and the base runs' noise).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

CHANGES = ("rate-0.5", "rate-1.5", "seqs", "budget")


def second_run(name: str) -> str:
    """The second run of a change (``rate-0.5`` -> ``p2-rate-0.5``: the sweep's second pass names it alike)."""
    return f"p2-{name}"


def later_changes(passes: int) -> list[str]:
    """The changes that are not rates, run again after the sweep's second pass, in the reverse order of their
    first runs (as the second pass reverses the first); none with one pass."""
    return [second_run(n) for n in reversed(CHANGES) if not n.startswith("rate-")] if passes >= 2 else []


def rel(a: float, b: float) -> float:
    """``|a - b| / |b|``; NaN where either is not finite or ``b`` is 0."""
    return abs(a - b) / abs(b) if math.isfinite(a) and math.isfinite(b) and b else math.nan


def spread(a: float, b: float) -> float:
    """Two runs' difference against their mean: the run-to-run noise of a configuration run twice."""
    return abs(a - b) / float(np.mean([a, b])) if a + b else math.nan


class RerunTally:
    """Per change run twice: the simulator's error against its first run, the second run's against the first (a
    rerun as the prediction), and the simulator's against the mean of both; each counted within its bar."""

    def __init__(self, metrics: tuple[str, ...], bar: Callable[[float], float]) -> None:
        self.metrics, self.bar = metrics, bar
        self.rows: list[tuple[str, str, float, float, float, float, float]] = []

    def add(self, name: str, predicted: dict[str, float], first: dict[str, float], second: dict[str, float],
            noise: dict[str, float]) -> None:
        for m in self.metrics:
            mean = float(np.mean([first[m], second[m]]))
            self.rows.append((name, m, rel(predicted[m], first[m]), rel(second[m], first[m]),
                              rel(predicted[m], mean), spread(first[m], second[m]), noise[m]))

    def counts(self) -> dict[str, int]:
        """How many rows meet the bar: ``simulator`` and ``rerun`` against the first run (the base runs' noise),
        ``simulator vs mean`` against the two runs' mean (the larger of the two noises)."""
        out = {"simulator": 0, "rerun": 0, "simulator vs mean": 0}
        for _, _, sim, again, vs_mean, own, base in self.rows:
            out["simulator"] += sim <= self.bar(base)
            out["rerun"] += again <= self.bar(base)
            out["simulator vs mean"] += vs_mean <= self.bar(max(own, base))
        return out

    def lines(self) -> list[str]:
        out = []
        for name in dict.fromkeys(r[0] for r in self.rows):
            rows = [r for r in self.rows if r[0] == name]
            out.append(f"{name} run twice ({name}, {second_run(name)}): own noise "
                       + "  ".join(f"{m} {100 * own:.0f}%" for _, m, _, _, _, own, _ in rows)
                       + "; the second run as a prediction of the first "
                       + "  ".join(f"{m} {100 * again:.0f}%" for _, m, _, again, _, _, _ in rows)
                       + "; the simulator against the first " + "  ".join(f"{m} {100 * sim:.0f}%" for _, m, sim, *_ in rows)
                       + ", against their mean " + "  ".join(f"{m} {100 * v:.0f}%" for _, m, _, _, v, _, _ in rows))
        c, n = self.counts(), len(self.rows)
        out.append(f"changes run twice ({n // len(self.metrics)} of {len(CHANGES)}), each against its first run within "
                   f"the bar (max(15%, 1.5x base-a/base-b's noise)): the simulator {c['simulator']}/{n}, the second run "
                   f"as the prediction {c['rerun']}/{n}; the simulator against the mean of the two runs, within max(15%, "
                   f"1.5x the larger of their own and the base runs' noise): {c['simulator vs mean']}/{n}")
        return out
