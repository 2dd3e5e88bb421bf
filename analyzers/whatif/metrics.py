"""The report's headline metrics from replayed requests, and the same metrics measured on the run.

Names and units are those of ``tokentrace report --format json``'s ``metrics`` (latencies in ms):
``ttft.p50``, ``ttft.p99``, ``tpot.p50``, ``tpot.p99``, ``itl.p50``, ``itl.p99``, ``e2e.p50``, ``e2e.p99``,
``slo.<class>.attainment`` (class ``all``: every request) and, from the report's ``load`` block,
``load.served_rps`` (completed requests per second, ``(m - 1) / (last - first completion)``).
Definitions follow :mod:`analyzers.timing`: TTFT = first visible token delivered - arrival, ITL = gaps
between delivered tokens, TPOT = (last - first) / (n - 1), E2E = last token - arrival.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from analyzers.groups import ALL, percentile_or_nan
from analyzers.latency import latency
from analyzers.load import load
from analyzers.slo import SloTargets, slo_attainment
from analyzers.source import Source
from analyzers.whatif.simulate import Outcome
from tokentrace.schema import col

__all__ = ["LATENCY_METRICS", "HEADLINE_METRICS", "outcome_metrics", "measured_metrics", "class_label"]

LATENCY_METRICS: tuple[str, ...] = ("ttft.p50", "ttft.p99", "tpot.p50", "tpot.p99", "itl.p50", "itl.p99",
                                    "e2e.p50", "e2e.p99")
"""The latency metrics a prediction gives (ms)."""
HEADLINE_METRICS: tuple[str, ...] = (*LATENCY_METRICS, "slo.all.attainment", "load.served_rps")
"""Every prediction has these keys (more ``slo.<class>.attainment`` keys when the run has classes)."""


def class_label(name: str) -> str:
    """The report's name of an SLO class in a metric name (``*`` -> all, empty -> none)."""
    return "all" if name == ALL else (name or "none")


def outcome_metrics(outcomes: list[Outcome], targets: Mapping[str, SloTargets]) -> dict[str, float]:
    """Headline metrics of replayed requests; a request never served counts as failed (not met)."""
    ttft, tpot, e2e, itl, finish = [], [], [], [], []
    met: dict[str, list[bool]] = {}
    for o in outcomes:
        a, d = o.arrival, o.delivered_ns
        ok = bool(d)
        if ok:
            ttft.append((d[0] - a.arrival_ns) / 1e6)
            e2e.append((d[-1] - a.arrival_ns) / 1e6)
            finish.append(d[-1])
            if len(d) > 1:
                tpot.append((d[-1] - d[0]) / (len(d) - 1) / 1e6)
                itl.extend(np.diff(d) / 1e6)
        t = targets.get(a.slo_class) or targets.get(ALL)
        good = ok and t is not None and ttft[-1] <= t.ttft_ms and (len(d) < 2 or tpot[-1] <= t.tpot_ms)
        for key in (a.slo_class, ALL):
            met.setdefault(key, []).append(good)
    out: dict[str, float] = {}
    for name, v in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        arr = np.asarray(v, dtype=float)
        out[f"{name}.p50"] = percentile_or_nan(arr, 50)
        out[f"{name}.p99"] = percentile_or_nan(arr, 99)
    for key, flags in met.items():
        out[f"slo.{class_label(key)}.attainment"] = float(np.mean(flags)) if flags else math.nan
    m = len(finish)
    span = (max(finish) - min(finish)) / 1e9 if m >= 2 else 0.0
    out["load.served_rps"] = (m - 1) / span if span > 0 else (0.0 if m == 0 else math.nan)
    return out


def measured_metrics(src: Source, targets: Mapping[str, SloTargets] | None = None) -> dict[str, float]:
    """The same metrics measured on the run (the report's analyzers)."""
    lat = latency(src).set_index("metric")
    out: dict[str, float] = {}
    for name in ("ttft", "tpot", "itl", "e2e"):
        for p in ("p50", "p99"):
            out[f"{name}.{p}"] = float(lat.loc[name, f"{p}_ms"]) if name in lat.index else math.nan
    for r in slo_attainment(src, targets=targets).itertuples(index=False):
        out[f"slo.{class_label(getattr(r, col.SLO_CLASS))}.attainment"] = float(r.attainment)
    out["load.served_rps"] = float(load(src).row["served_rps"])
    return out
