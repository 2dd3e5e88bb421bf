"""Latency metrics: TTFT, TPOT, ITL and end-to-end, with the same definitions as
``vllm bench serve`` so numbers compare.

* TTFT (time to first token) = t_0 - arrival.
* TPOT (time per output token) = (t_last - t_0) / (n - 1), requests with n > 1 tokens.
* ITL (inter-token latency) = t_i - t_{i-1} for every token i >= 1 of every request.
* E2E (end-to-end latency) = finish - arrival (last token time when no finish was recorded).

Times as in :mod:`analyzers.timing`. Results in milliseconds.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from analyzers.timing import LATENCY, request_facts, token_intervals
from tokentrace.schema import col

__all__ = ["PERCENTILES", "latency_samples", "latency_summary", "summarize"]

PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0, 99.9)
METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2e")


def latency_samples(requests: pa.Table, tokens: pa.Table, instances: pa.Table) -> dict[str, np.ndarray]:
    """Raw samples in ms per metric (ttft, tpot, e2e per request; itl per token)."""
    facts = request_facts(requests, tokens, instances)
    ti = token_intervals(requests, tokens, instances)
    f = facts[facts[col.FIRST_TOKEN_NS].notna()]
    ttft = (f[col.FIRST_TOKEN_NS] - f[col.ARRIVAL_NS]) / 1e6
    multi = f[f[col.NUM_OUTPUT_TOKENS] > 1]
    tpot = (multi["last_token_ns"] - multi[col.FIRST_TOKEN_NS]) / (multi[col.NUM_OUTPUT_TOKENS] - 1) / 1e6
    end = f[col.FINISH_NS].where(f[col.FINISH_NS].notna(), f["last_token_ns"])
    e2e = (end - f[col.ARRIVAL_NS]) / 1e6
    itl = ti.loc[ti[col.TOKEN_INDEX] > 0, LATENCY] / 1e6
    return {name: np.asarray(v, dtype=float) for name, v in
            (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e))}


def summarize(samples: dict[str, np.ndarray], percentiles: tuple[float, ...] = PERCENTILES) -> pd.DataFrame:
    """Count, mean and percentiles per metric; NaN where a metric has no samples."""
    rows = []
    for name in METRICS:
        v = samples.get(name, np.empty(0))
        row: dict[str, float | str | int] = {"metric": name, "count": int(v.size),
                                             "mean_ms": float(v.mean()) if v.size else float("nan")}
        for p in percentiles:
            row[f"p{p:g}_ms"] = float(np.percentile(v, p)) if v.size else float("nan")
        rows.append(row)
    return pd.DataFrame(rows)


def latency_summary(requests: pa.Table, tokens: pa.Table, instances: pa.Table) -> pd.DataFrame:
    """One row per metric (ttft, tpot, itl, e2e): count, mean and p50/p90/p99/p99.9 in ms."""
    return summarize(latency_samples(requests, tokens, instances))
