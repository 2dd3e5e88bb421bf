"""Tenants: per-tenant latency, fair shares (Jain's index) and noisy neighbours.

* Shares per tenant: requests; tokens (prompt + delivered output tokens);
  compute time: each engine step's duration is split among the requests in it
  by their token share: a request with a prefill chunk in the step
  (``prefill.compute`` span of that step) is credited the step's prefill tokens
  divided by the number of such requests, a request with a decode token
  (``decode.compute`` span) one token; its compute = step duration * its tokens /
  all credited tokens of the step.
* Jain's fairness index over tenants, per basis (requests, tokens, compute):
  J = (sum x)^2 / (n * sum x^2) with x_t = tenant t's amount / its weight
  (weights from the argument, else the manifest's
  ``config["tenants"][name]["weight"]``, else 1). J = 1 when every tenant got
  the same weighted amount, 1/n when one tenant got everything.
* Noisy neighbours: the run is cut into arrival windows (``window_s``, default
  a twentieth of the run). For tenant A, z_A(w) = (arrivals of A in w - mean) /
  std over all windows. For tenant B, p99_B(w) = p99 TTFT of B's requests
  arriving in w. For every ordered pair (A, B), A != B, over the windows where
  B has requests: correlation = Pearson(z_A, p99_B); burst windows = z_A >=
  ``z_threshold``. Flagged when correlation >= ``min_correlation``, there is at
  least one burst window, and B's p99 TTFT over burst windows exceeds that over
  the other windows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import pandas as pd

from analyzers.latency import latency
from analyzers.source import Source
from analyzers.timing import TTFT_NS, request_table, run_bounds
from tokentrace.schema import Stage, col

__all__ = ["TenantReport", "tenant_shares", "jain_index", "fairness", "noisy_neighbours", "tenants"]


@dataclass(frozen=True, slots=True)
class TenantReport:
    """Per-tenant latency, shares and fairness of one run."""

    latency: pd.DataFrame
    shares: pd.DataFrame
    jain: pd.DataFrame


def _weights(src: Source, names: list[str], weights: Mapping[str, float] | None) -> dict[str, float]:
    conf: Any = src.manifest.get("config", {})
    conf = conf.get("tenants", {}) if isinstance(conf, Mapping) else {}
    out = {}
    for name in names:
        w: Any = None
        if weights is not None and name in weights:
            w = weights[name]
        elif isinstance(conf, Mapping) and isinstance(conf.get(name), Mapping):
            w = conf[name].get("weight")
        w = 1.0 if w is None else w
        if not (isinstance(w, (int, float)) and math.isfinite(w) and w > 0):
            raise ValueError(f"tenant weight of {name!r} must be a positive number, got {w!r}")
        out[name] = float(w)
    return out


def _compute_ns(src: Source) -> pd.DataFrame:
    """Per tenant: compute time in ns attributed from the steps (module doc)."""
    c = col
    p, d = int(Stage.PREFILL_COMPUTE), int(Stage.DECODE_COMPUTE)
    return src.df(f"""
        WITH part AS (
            SELECT {c.INSTANCE_ID}, {c.STEP}, {c.REQUEST_ID},
                   MAX(CASE WHEN {c.STAGE} = {p} THEN 1 ELSE 0 END) AS is_prefill
            FROM srv_spans WHERE {c.STAGE} IN ({p}, {d}) AND {c.STEP} >= 0
            GROUP BY {c.INSTANCE_ID}, {c.STEP}, {c.REQUEST_ID}
        ), w AS (
            SELECT part.{c.REQUEST_ID}, part.{c.INSTANCE_ID}, part.{c.STEP},
                   CASE WHEN is_prefill = 1
                        THEN s.{c.NUM_PREFILL_TOKENS}::DOUBLE
                             / SUM(is_prefill) OVER (PARTITION BY part.{c.INSTANCE_ID}, part.{c.STEP})
                        ELSE 1.0 END AS tok,
                   (s.{c.END_NS} - s.{c.START_NS})::DOUBLE AS dur
            FROM part JOIN steps s ON part.{c.INSTANCE_ID} = s.{c.INSTANCE_ID} AND part.{c.STEP} = s.{c.STEP}
        ), w2 AS (
            SELECT {c.REQUEST_ID}, tok / NULLIF(SUM(tok) OVER (PARTITION BY {c.INSTANCE_ID}, {c.STEP}), 0) * dur AS ns
            FROM w
        )
        SELECT f.{c.TENANT}, COALESCE(SUM(w2.ns), 0) AS compute_ns
        FROM w2 JOIN {request_table(src)} f USING ({c.REQUEST_ID}) GROUP BY f.{c.TENANT}
    """)


def tenant_shares(src: Source, *, weights: Mapping[str, float] | None = None) -> pd.DataFrame:
    """Per tenant: tenant_name, weight, num_requests, num_tokens, compute_s, request_share, token_share,
    compute_share (shares of the run's totals, unweighted)."""
    c = col
    df = src.df(f"""
        SELECT {c.TENANT}, COUNT(*) AS num_requests,
               SUM(COALESCE({c.NUM_PROMPT_TOKENS}, 0) + {c.NUM_OUTPUT_TOKENS}) AS num_tokens
        FROM {request_table(src)} GROUP BY {c.TENANT} ORDER BY {c.TENANT}
    """)
    df = df.merge(_compute_ns(src), on=c.TENANT, how="left")
    df["compute_s"] = df["compute_ns"].fillna(0) / 1e9
    w = _weights(src, df[c.TENANT].tolist(), weights)
    df.insert(1, "weight", df[c.TENANT].map(w).astype(float))
    for basis, name in (("num_requests", "request_share"), ("num_tokens", "token_share"),
                        ("compute_s", "compute_share")):
        total = df[basis].sum()
        df[name] = df[basis] / total if total > 0 else math.nan
    return df.drop(columns="compute_ns")


def jain_index(x: np.ndarray) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2); NaN for no tenants or all zero."""
    x = np.asarray(x, dtype=float)
    denom = x.size * float(np.square(x).sum())
    return float(x.sum() ** 2 / denom) if denom > 0 else math.nan


def fairness(shares: pd.DataFrame) -> pd.DataFrame:
    """Rows basis in requests, tokens, compute with jain_index over weight-normalised amounts."""
    rows = []
    for basis, column in (("requests", "num_requests"), ("tokens", "num_tokens"), ("compute", "compute_s")):
        x = (shares[column] / shares["weight"]).to_numpy(float) if len(shares) else np.empty(0)
        rows.append({"basis": basis, "jain_index": jain_index(x)})
    return pd.DataFrame(rows)


def noisy_neighbours(src: Source, *, window_s: float | None = None, z_threshold: float = 2.0,
                     min_correlation: float = 0.5) -> pd.DataFrame:
    """Tenant pairs whose bursts line up with the other's TTFT tail (module doc).

    Columns: aggressor, victim, num_windows, num_burst_windows, correlation,
    victim_p99_burst_ms, victim_p99_normal_ms, flagged.
    """
    cols = ["aggressor", "victim", "num_windows", "num_burst_windows", "correlation",
            "victim_p99_burst_ms", "victim_p99_normal_ms", "flagged"]
    if window_s is not None and not (math.isfinite(window_s) and window_s > 0):
        raise ValueError(f"window_s must be a positive number of seconds, got {window_s!r}")
    c = col
    bounds = run_bounds(src)
    req = src.df(f"SELECT {c.TENANT}, {c.ARRIVAL_NS}, {TTFT_NS} / 1e6 AS ttft_ms FROM {request_table(src)} "
                 f"WHERE {c.ARRIVAL_NS} IS NOT NULL")
    names = sorted(req[c.TENANT].unique().tolist())
    if bounds is None or len(names) < 2:
        return pd.DataFrame(columns=cols)
    w_ns = int(window_s * 1e9) if window_s else max(1, (bounds[1] - bounds[0]) // 20)
    num_w = max(1, int(math.ceil((bounds[1] - bounds[0] + 1) / w_ns)))
    req["w"] = (req[c.ARRIVAL_NS] - bounds[0]) // w_ns
    counts = req.pivot_table(index="w", columns=c.TENANT, values=c.ARRIVAL_NS, aggfunc="count")
    counts = counts.reindex(index=range(num_w), columns=names).fillna(0)
    std = counts.std(ddof=0).replace(0, np.nan)
    z = ((counts - counts.mean()) / std).fillna(0)
    rows = []
    for victim in names:
        mine = req[(req[c.TENANT] == victim) & req["ttft_ms"].notna()]
        p99 = mine.groupby("w")["ttft_ms"].quantile(0.99)
        for aggressor in names:
            if aggressor == victim:
                continue
            za = z[aggressor].reindex(p99.index).to_numpy(float)
            burst_w = p99.index[za >= z_threshold]
            corr = _pearson(za, p99.to_numpy(float))
            in_burst = mine["w"].isin(burst_w)
            hi = _p99(mine.loc[in_burst, "ttft_ms"])
            lo = _p99(mine.loc[~in_burst, "ttft_ms"])
            flagged = bool(len(burst_w) >= 1 and corr >= min_correlation and hi > lo)
            rows.append({"aggressor": aggressor, "victim": victim, "num_windows": len(p99),
                         "num_burst_windows": len(burst_w), "correlation": corr,
                         "victim_p99_burst_ms": hi, "victim_p99_normal_ms": lo, "flagged": flagged})
    return pd.DataFrame(rows, columns=cols)


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    if a.size < 3 or np.std(a) == 0 or np.std(b) == 0:
        return math.nan
    return float(np.corrcoef(a, b)[0, 1])


def _p99(v: pd.Series) -> float:
    return float(np.percentile(v.to_numpy(float), 99)) if len(v) else math.nan


def tenants(src: Source, *, weights: Mapping[str, float] | None = None) -> TenantReport:
    """Per-tenant latency, shares and Jain's index by requests, tokens and compute."""
    shares = tenant_shares(src, weights=weights)
    return TenantReport(latency(src, by="tenant"), shares, fairness(shares))
