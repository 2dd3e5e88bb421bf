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
* Noisy neighbours: :mod:`analyzers.neighbours` (re-exported here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import pandas as pd

from analyzers import facts
from analyzers.latency import latency
from analyzers.neighbours import noisy_neighbours
from analyzers.source import Source
from analyzers.timing import request_table
from tokentrace.schema import REQUESTS, Stage, col

__all__ = ["TenantReport", "tenant_shares", "jain_index", "fairness", "noisy_neighbours", "tenants", "compute_rows_sql"]


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
    return src.df(f"""
        SELECT f.{c.TENANT}, COALESCE(SUM(w2.compute_ns), 0) AS compute_ns
        FROM {facts.relation(src, REQUEST_COMPUTE_NS)} w2 JOIN {request_table(src)} f USING ({c.REQUEST_ID}) GROUP BY f.{c.TENANT}
    """)


def compute_rows_sql(src: Source) -> str:
    """SELECT of (request_id, compute_ns): each request's share of every engine step it was in (module doc),
    one row per (request, step); the derived fact :data:`REQUEST_COMPUTE_NS` holds their sum per request."""
    c = col
    p, d = int(Stage.PREFILL_COMPUTE), int(Stage.DECODE_COMPUTE)
    return f"""
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
        )
        SELECT {c.REQUEST_ID}, tok / NULLIF(SUM(tok) OVER (PARTITION BY {c.INSTANCE_ID}, {c.STEP}), 0) * dur
               AS compute_ns
        FROM w
    """


def tenant_shares(src: Source, *, weights: Mapping[str, float] | None = None) -> pd.DataFrame:
    """Per tenant: tenant_name, weight, num_requests, num_tokens, compute_s, request_share, token_share,
    compute_share (shares of the run's totals, unweighted)."""
    c = col
    df = src.df(f"""
        SELECT {c.TENANT}, COUNT(*) AS num_requests,
               CAST(SUM(COALESCE({c.NUM_PROMPT_TOKENS}, 0) + {c.NUM_OUTPUT_TOKENS}) AS BIGINT) AS num_tokens
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


def tenants(src: Source, *, weights: Mapping[str, float] | None = None) -> TenantReport:
    """Per-tenant latency, shares and Jain's index by requests, tokens and compute."""
    shares = tenant_shares(src, weights=weights)
    return TenantReport(latency(src, by="tenant"), shares, fairness(shares))


REQUEST_COMPUTE_NS = facts.Fact(
    "request_compute_ns", "Per request: its share of the engine steps it was in, summed (module doc).",
    (REQUESTS.column(col.REQUEST_ID), facts.f64("compute_ns", "The request's share of its steps' time; ns.")),
    select=lambda src: (f"SELECT {col.REQUEST_ID}, SUM(compute_ns) AS compute_ns FROM ({compute_rows_sql(src)}) "
                        f"GROUP BY {col.REQUEST_ID}"))
