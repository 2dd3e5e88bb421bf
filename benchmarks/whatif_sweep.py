"""The what-if benchmark's SLO sweep (used by ``benchmarks/whatif.py``; not a benchmark of its own).

The measured sweep runs every rate scale in several passes, the second in the reverse order of the first (and
so on), so that a rate's runs sit at different places in the session: a measured rate's share of requests within
target is pooled over its passes' requests, and the 1x share over every run of the base configuration. This
machine's speed moves 10-30% between runs (docs/whatif.md, "Accuracy"); one pass puts that drift, amplified
where the curve is flat, into the measured break, which the passes' own breaks show beside the pooled one.
"""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

import numpy as np
from whatif_reruns import rel

from analyzers.slo import SloTargets, request_slo
from analyzers.source import Source
from analyzers.whatif.metrics import outcome_metrics
from analyzers.whatif.predict import crossing, crossing_noise
from analyzers.whatif.simulate import simulate
from tokentrace.store import open_run

DEFAULT_SCALES = (0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0)


def rate_run(scale: float, sweep_pass: int) -> str:
    """The run of one rate scale in one pass (pass 1: ``rate-1.5``; pass 2: ``p2-rate-1.5``)."""
    return f"rate-{scale}" if sweep_pass == 1 else f"p{sweep_pass}-rate-{scale}"


def later_passes(scales: tuple[float, ...], passes: int) -> list[tuple[str, float]]:
    """The rate runs of passes 2.. (run name, rate scale) in session order: each pass the reverse of the one
    before it, 1x left out (the base runs are its points)."""
    out = []
    for p in range(2, passes + 1):
        order = sorted((s for s in scales if s != 1.0), reverse=p % 2 == 0)
        out += [(rate_run(s, p), s) for s in order]
    return out


def runs_by_scale(scales: tuple[float, ...], runs: list[str]) -> dict[float, list[str]]:
    """Each rate scale's runs among ``runs`` (1x: every base run, base-a first)."""
    out = {}
    for s in scales:
        if s == 1.0:
            out[s] = [n for n in runs if n.startswith("base-")]
        else:
            out[s] = [n for n in runs if n == f"rate-{s}" or n.endswith(f"-rate-{s}")]
    return out


def verdicts(store: Path, run: str, targets: dict[str, SloTargets]) -> np.ndarray:
    """Each request's verdict in one run: True when it met both targets (not measured or failed: False)."""
    with closing(Source.of_run(open_run(store, run))) as src:
        return (request_slo(src, targets).ok == True).to_numpy(dtype=bool)  # noqa: E712 (verdicts are objects)


class MeasuredSweep:
    """The measured curve: per rate scale, its runs' verdicts (``met[scale][run]``)."""

    def __init__(self, met: dict[float, dict[str, np.ndarray]]) -> None:
        self.scales = sorted(met)
        self.met = {s: met[s] for s in self.scales}

    @classmethod
    def read(cls, store: Path, by_scale: dict[float, list[str]], targets: dict[str, SloTargets]) -> MeasuredSweep:
        """The verdicts of every run of ``by_scale`` in ``store``."""
        return cls({s: {n: verdicts(store, n, targets) for n in runs} for s, runs in by_scale.items()})

    def pooled_flags(self) -> list[np.ndarray]:
        """Per scale (in :attr:`scales` order), the verdicts of all its runs' requests."""
        return [np.concatenate(list(self.met[s].values())) for s in self.scales]

    def pooled(self) -> dict[float, float]:
        """Per scale, the share of its runs' requests within target, pooled."""
        return {s: float(flags.mean()) for s, flags in zip(self.scales, self.pooled_flags())}

    def one_pass(self, k: int) -> dict[float, float] | None:
        """The curve of the k-th pass alone (0: each scale's first run; 1x: the k-th base run); None when a
        scale has no k-th run."""
        if any(len(self.met[s]) <= k for s in self.scales):
            return None
        return {s: float(list(self.met[s].values())[k].mean()) for s in self.scales}

    def passes(self) -> int:
        """How many runs every rate scale other than 1x has."""
        return min(len(v) for s, v in self.met.items() if s != 1.0)


def breaks_line(sweep: MeasuredSweep, target: float) -> str:
    """The measured break of each pass alone, beside which the pooled one is read."""
    parts, breaks = [], []
    for k in range(sweep.passes()):
        curve = sweep.one_pass(k)
        if curve is None:
            continue
        v = crossing(list(curve), list(curve.values()), target)
        breaks.append(v)
        parts.append(f"pass {k + 1} {'none in range' if v is None else f'{v:.2f}'} ("
                     + " ".join(f"{100 * c:.0f}" for c in curve.values()) + ")")
    line = "measured break of each pass alone (its 1x point: the k-th base run; shares in %): " + ", ".join(parts)
    if len(breaks) >= 2 and None not in breaks[:2]:  # a second pass as the prediction of the first: a rerun's error
        line += f"; pass 2 against pass 1 {100 * rel(breaks[1], breaks[0]):.0f}% (bar 15%)"
    return line


def break_noise(measured_sweep: MeasuredSweep, model, targets: dict[str, SloTargets], target: float) -> None:
    """How far the break moves with the requests' granularity: the measured one with each rate's pooled requests
    resampled (or one request's verdict changed), the predicted one per replay (timeline phase) and on a finer grid."""
    scales = measured_sweep.scales
    met = measured_sweep.pooled_flags()
    boot, flipped = crossing_noise(scales, met, target)
    print(f"measured break's sampling noise ({min(m.size for m in met)}-{max(m.size for m in met)} requests a rate): "
          f"each rate's requests resampled 2000 times, the break 10th-90th percentile "
          + (f"{np.percentile(boot, 10):.2f}-{np.percentile(boot, 90):.2f}" if boot.size else "n/a")
          + f" ({boot.size} of 2000 cross in range); one request's verdict changed at one rate: "
          + (f"{min(flipped):.2f}-{max(flipped):.2f}" if flipped else "n/a"))
    n = model.num_replays
    per_phase = []
    for k in range(n):
        shares = [outcome_metrics(simulate(model.deployment({"rate_scale": s}), model.arrivals({"rate_scale": s}),
                                           seed=k, phase=k / n), targets)["slo.all.attainment"] for s in scales]
        per_phase.append(crossing(scales, shares, target))
    fine = [round(scales[0] + 0.05 * k, 2) for k in range(int(round((scales[-1] - scales[0]) / 0.05)) + 1)]
    hf = model.sweep("rate_scale", fine).breaking_value
    print("predicted break per replay (timeline phase 0, 1/n, ...; each alone): " + ", ".join(
        "none in range" if v is None else f"{v:.2f}" for v in per_phase)
        + f"; their average's curve on a finer grid ({scales[0]:g}-{scales[-1]:g} by 0.05): {'none in range' if hf is None else f'{hf:.2f}'}")
