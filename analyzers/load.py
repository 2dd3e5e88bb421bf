"""Offered load against served load, and whether the run was saturated (and where).

An answer must hold when the server is saturated, so rates are measured where
they mean something (server view, reference clock):

* Arrival window: the first to the last request arrival, ``W`` seconds, ``n`` arrivals.
  ``offered_rps = (n - 1) / W``, the inverse of the mean gap between arrivals (not measured, NaN, when ``W`` is
  under ``MIN_WINDOW_S``: arrivals that come all at once have no rate). The drain
  after the last arrival is not part of it: over the whole run a saturated server's
  "arrival rate" would equal what it managed to serve.
* ``served_rps``: the departure rate of completed requests (status ok, with a finish
  or a last token time), ``(m - 1) / (last - first completion)``; 0 when none completed,
  NaN with one. A saturated server completes at its capacity, however fast work arrives.
* The arrival window is cut in thirds: *early* (first third) and *late* (last third).

Symptoms of arrivals outrunning service:

* ``arrivals_outrun_service``: ``offered_rps >= (1 + RATE_MARGIN) * served_rps``.
* ``waiting_grows``: time in system (finish or last token - arrival, of requests that
  were served or cut, not rejected or failed) rises with arrival time: Spearman's rank
  correlation >= ``TREND_MIN`` and the late third's median exceeds the early third's by
  at least ``GROWTH_MIN_MS``.
* per pool (engine instances grouped by role, from ``steps``): ``in_system_growth``, the
  mean requests in the instance (waiting + running + preempted, over steps ending in the
  late third minus the early third, averaged over the pool's instances), and
  ``utilisation``, the share of the arrival window the pool's instances spent in steps.
  A pool's queue grows at ``QUEUE_GROWTH_MIN`` requests; it is busy at ``BUSY_MIN``.

``saturated`` = arrivals outrun service and at least one symptom shows (waiting
grows, a pool's queue grows, a pool is busy); ``None`` (not judged) with fewer than
``MIN_REQUESTS`` arrivals, an arrival window under ``MIN_WINDOW_S`` or no served rate. The pool that saturates: the pool whose
queue grew most (when one grew), else the pool whose instances recorded the stage
whose time per request grew most (``stages``), else the busiest pool if busy. The
stage: the stage (and role) whose time per request grew most, at least ``GROWTH_MIN_MS``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from analyzers.source import Source
from analyzers.stage_breakdown import request_stage_ns
from analyzers.stats import spearman
from analyzers.timing import LAST_TOKEN, request_table
from tokentrace.schema import RequestStatus, Role, Stage, col

__all__ = ["LoadReport", "RATE_MARGIN", "MIN_REQUESTS", "MIN_WINDOW_S", "TREND_MIN", "GROWTH_MIN_MS", "QUEUE_GROWTH_MIN",
           "BUSY_MIN", "UNKNOWN_ROLE", "arrival_window", "offered_rate", "pool_load", "stage_growth", "load", "cached_load"]

RATE_MARGIN = 0.10  # arrivals outrun service at offered >= 1.1 x served
MIN_REQUESTS = 10  # fewer arrivals than this: no verdict
MIN_WINDOW_S = 0.5  # arrivals spread over less than this (s): no verdict (thirds of a burst say nothing of a trend)
TREND_MIN = 0.5  # Spearman correlation of time in system with arrival time
GROWTH_MIN_MS = 10.0  # late-third median minus early-third median, ms
QUEUE_GROWTH_MIN = 1.0  # requests in an instance, late third minus early third
BUSY_MIN = 0.9  # share of the arrival window an instance spent in steps
UNKNOWN_ROLE = "unknown"  # role label of an instance missing from the instances table

_WAITED = (int(RequestStatus.OK), int(RequestStatus.ABORTED), int(RequestStatus.TIMEOUT))
SUMMARY_COLUMNS = ["num_requests", "arrival_window_s", "offered_rps", "num_completed", "served_rps",
                   "load_ratio", "time_in_system_early_ms", "time_in_system_late_ms", "wait_trend",
                   "arrivals_outrun_service", "waiting_grows", "queue_grows", "busy", "saturated",
                   "saturated_pool", "saturated_stage"]
POOL_COLUMNS = ["role", "num_instances", "utilisation", "max_utilisation", "in_system_early", "in_system_late",
                "in_system_growth", "waiting_early", "waiting_late", "queue_grows", "busy"]
STAGE_COLUMNS = ["stage", "role", "early_ms", "late_ms", "growth_ms"]


@dataclass(frozen=True, slots=True)
class LoadReport:
    """The load analysis of one run: a one-row summary with the verdict, per pool, per stage."""

    summary: pd.DataFrame
    pools: pd.DataFrame
    stages: pd.DataFrame

    @property
    def row(self) -> dict[str, Any]:
        """The summary row as a dict (the verdict and its numbers)."""
        return self.summary.iloc[0].to_dict()


_WORKER_ROLE = {(int(Stage.TRANSFER_KV), int(Role.GATEWAY)): int(Role.PREFILL)}
"""(stage, role that recorded it) -> the role whose work it is, where the two differ: of a KV transfer, the prefill
worker records its own sending and the decode worker its receiving, while the gateway times the flight between
them (from the first chunk's write to the decode worker reading it: only it knows both workers' clocks); that
piece is counted with the sending prefill pool's transfer."""


def offered_rate(n: int, window_s: float) -> float:
    """``n`` arrivals over ``window_s`` seconds as a rate, ``(n - 1) / window_s``; NaN (not measured) with fewer than
    two arrivals or a window under ``MIN_WINDOW_S``: requests that all arrive at once have no rate, and a few ms
    of window would make one of tens of thousands of req/s."""
    return (n - 1) / window_s if n >= 2 and window_s >= MIN_WINDOW_S else math.nan


def arrival_window(src: Source) -> tuple[int, int, int] | None:
    """(first arrival, last arrival, number of arrivals), ns on the reference clock; None without arrivals."""
    # Each request's arrival as in the per-request facts: its earliest server-side row.
    row = src.fetchone(f"SELECT MIN({col.ARRIVAL_NS}), MAX({col.ARRIVAL_NS}), COUNT({col.ARRIVAL_NS}) "
                       f"FROM {request_table(src)}")
    if row is None or row[0] is None:
        return None
    return int(row[0]), int(row[1]), int(row[2])


def _thirds(a0: int, a1: int) -> tuple[int, int]:
    """Ends of the early third and start of the late third of the arrival window, ns."""
    third = (a1 - a0) / 3
    return int(a0 + third), int(a1 - third)


def _requests(src: Source) -> pd.DataFrame:
    """Per request: arrival, end (finish, else last token), status."""
    c = col
    return src.df(f"""
        SELECT {c.ARRIVAL_NS} AS arrival, COALESCE({c.FINISH_NS}, {LAST_TOKEN}) AS t_end,
               COALESCE({c.STATUS}, 0) AS status, {LAST_TOKEN} IS NOT NULL AS has_token
        FROM {request_table(src)} WHERE {c.ARRIVAL_NS} IS NOT NULL ORDER BY {c.ARRIVAL_NS}
    """)


def _served_rps(req: pd.DataFrame) -> tuple[int, float]:
    done = req[(req["status"] == int(RequestStatus.OK)) & req["t_end"].notna()]["t_end"].to_numpy(float)
    m = done.size
    if m == 0:
        return 0, 0.0
    span = float(done.max() - done.min())
    return m, ((m - 1) / (span / 1e9) if m >= 2 and span > 0 else math.nan)


def _role_label(r: Any) -> str:
    return Role(int(r)).label if r is not None and not pd.isna(r) else UNKNOWN_ROLE


def pool_load(src: Source, window: tuple[int, int]) -> pd.DataFrame:
    """Per pool (instances grouped by role): utilisation over ``window`` and queue growth (module doc)."""
    c = col
    a0, a1 = window
    if a1 <= a0:
        return pd.DataFrame(columns=POOL_COLUMNS)
    early_end, late_start = _thirds(a0, a1)
    in_system = f"(s.{c.NUM_WAITING} + s.{c.NUM_RUNNING} + s.{c.NUM_PREEMPTED})"
    per = src.df(f"""
        SELECT s.{c.INSTANCE_ID}, ANY_VALUE(i.{c.ROLE}) AS role_id,
               SUM(GREATEST(0, LEAST(s.{c.END_NS}, {a1}) - GREATEST(s.{c.START_NS}, {a0})))::DOUBLE
                   / {a1 - a0} AS utilisation,
               AVG(CASE WHEN s.{c.END_NS} < {early_end} AND s.{c.END_NS} >= {a0} THEN {in_system} END) AS in_early,
               AVG(CASE WHEN s.{c.END_NS} >= {late_start} AND s.{c.END_NS} <= {a1} THEN {in_system} END) AS in_late,
               AVG(CASE WHEN s.{c.END_NS} < {early_end} AND s.{c.END_NS} >= {a0} THEN s.{c.NUM_WAITING} END)
                   AS wait_early,
               AVG(CASE WHEN s.{c.END_NS} >= {late_start} AND s.{c.END_NS} <= {a1} THEN s.{c.NUM_WAITING} END)
                   AS wait_late
        FROM steps s LEFT JOIN instances i USING ({c.INSTANCE_ID})
        GROUP BY s.{c.INSTANCE_ID}
    """)
    if per.empty:
        return pd.DataFrame(columns=POOL_COLUMNS)
    per["role"] = per["role_id"].map(_role_label)
    # An instance with no step in a third held no request then (steps only run with work).
    for column in ("in_early", "in_late", "wait_early", "wait_late"):
        per[column] = per[column].fillna(0.0)
    g = per.groupby("role", sort=True)
    out = g.agg(num_instances=(c.INSTANCE_ID, "count"), utilisation=("utilisation", "mean"),
                max_utilisation=("utilisation", "max"), in_system_early=("in_early", "mean"),
                in_system_late=("in_late", "mean"), waiting_early=("wait_early", "mean"),
                waiting_late=("wait_late", "mean")).reset_index()
    out["in_system_growth"] = out["in_system_late"] - out["in_system_early"]
    out["queue_grows"] = out["in_system_growth"] >= QUEUE_GROWTH_MIN
    out["busy"] = out["utilisation"] >= BUSY_MIN
    return out[POOL_COLUMNS]


def stage_growth(src: Source, window: tuple[int, int]) -> pd.DataFrame:
    """Per stage and role (of the process that recorded it, or whose work it is: :data:`_WORKER_ROLE`): mean time
    per request (ms) of early and late arrivals, and the growth.

    A stage's time in a request is what its spans count in the request's token intervals, clipped as the stage
    breakdown clips them (:data:`analyzers.stage_breakdown.REQUEST_STAGE_NS`), so a request's stage times add up
    to its latency as in the breakdown and the slowest requests (a decode worker's wait hidden behind an earlier
    token's delivery is not counted twice). Requests with at least one span count; a request without a span of
    a stage counts 0 ms for it. Ordered by growth, largest first.
    """
    c = col
    a0, a1 = window
    if a1 <= a0:
        return pd.DataFrame(columns=STAGE_COLUMNS)
    early_end, late_start = _thirds(a0, a1)
    # Two passes over the per-request stage sums: the span time of each (stage, role, part), and how many of
    # each part's requests have a span at all (a semi-join on their request ids).
    req = f"""
        SELECT {c.REQUEST_ID}, CASE WHEN {c.ARRIVAL_NS} < {early_end} THEN 'early'
                                    WHEN {c.ARRIVAL_NS} >= {late_start} THEN 'late' END AS part
        FROM {request_table(src)} WHERE {c.ARRIVAL_NS} IS NOT NULL"""
    df = src.df(f"""
        WITH req AS ({req}),
        counted AS (
            SELECT r.part, COUNT(*) AS n FROM req r
            WHERE r.part IS NOT NULL AND r.{c.REQUEST_ID} IN (SELECT {c.REQUEST_ID} FROM {request_stage_ns(src)})
            GROUP BY r.part
        ), summed AS (
            SELECT w.{c.STAGE}, w.{c.ROLE} AS role_id, r.part, SUM(w.ns) AS ns
            FROM {request_stage_ns(src)} w JOIN req r USING ({c.REQUEST_ID})
            WHERE r.part IS NOT NULL GROUP BY ALL
        )
        SELECT su.{c.STAGE}, su.role_id, su.part, su.ns::DOUBLE / k.n / 1e6 AS ms
        FROM summed su JOIN counted k ON k.part = su.part
    """)
    if df.empty:
        return pd.DataFrame(columns=STAGE_COLUMNS)
    df["stage"] = df[c.STAGE].map(lambda s: Stage(int(s)).label)
    df["role"] = [_role_label(_WORKER_ROLE.get((int(s), r), r) if r is not None and not pd.isna(r) else r)
                  for s, r in zip(df[c.STAGE], df["role_id"])]
    wide = df.pivot_table(index=["stage", "role"], columns="part", values="ms", aggfunc="sum", fill_value=0.0)
    wide = wide.reindex(columns=["early", "late"], fill_value=0.0).reset_index()
    wide = wide.rename(columns={"early": "early_ms", "late": "late_ms"})
    wide["growth_ms"] = wide["late_ms"] - wide["early_ms"]
    wide = wide.sort_values(["growth_ms", "stage"], ascending=[False, True], kind="stable").reset_index(drop=True)
    wide.columns.name = None
    return wide[STAGE_COLUMNS]


def _time_in_system_trend(req: pd.DataFrame, window: tuple[int, int]) -> tuple[float, float, float]:
    """(early median ms, late median ms, Spearman of time in system vs arrival) over requests that waited."""
    w = req[req["status"].isin(_WAITED) & req["t_end"].notna()]
    if w.empty:
        return math.nan, math.nan, math.nan
    arrival = w["arrival"].to_numpy(float)
    tis = (w["t_end"].to_numpy(float) - arrival) / 1e6
    early_end, late_start = _thirds(*window)
    early, late = tis[arrival < early_end], tis[arrival >= late_start]
    med = (lambda v: float(np.median(v)) if v.size else math.nan)
    return med(early), med(late), spearman(arrival, tis)


def _pool_that_saturates(pools: pd.DataFrame, stages: pd.DataFrame) -> str | None:
    growing = pools[pools["queue_grows"].astype(bool)] if len(pools) else pools
    if len(growing):
        return str(growing.sort_values("in_system_growth", ascending=False).iloc[0]["role"])
    if len(stages) and stages.iloc[0]["growth_ms"] >= GROWTH_MIN_MS:
        return str(stages.iloc[0]["role"])
    busy = pools[pools["busy"].astype(bool)] if len(pools) else pools
    if len(busy):
        return str(busy.sort_values("utilisation", ascending=False).iloc[0]["role"])
    return None


def cached_load(src: Source) -> LoadReport:
    """:func:`load` of ``src``, computed once per source (the report's first lines and the diagnosis both read it)."""
    return src.cached("analyzers.load", lambda: load(src))


def load(src: Source) -> LoadReport:
    """Offered and served load, the saturation verdict, and the pool and stage that saturate (module doc)."""
    window = arrival_window(src)
    if window is None:
        summary = {k: math.nan for k in SUMMARY_COLUMNS}
        summary.update(num_requests=0, num_completed=0, arrivals_outrun_service=None, waiting_grows=None,
                       queue_grows=None, busy=None, saturated=None, saturated_pool=None, saturated_stage=None)
        return LoadReport(pd.DataFrame([summary], columns=SUMMARY_COLUMNS).astype(object),
                          pd.DataFrame(columns=POOL_COLUMNS), pd.DataFrame(columns=STAGE_COLUMNS))
    a0, a1, n = window
    req = _requests(src)
    w_s = (a1 - a0) / 1e9
    offered = offered_rate(n, w_s)
    m, served = _served_rps(req)
    ratio = offered / served if served and served > 0 else (math.inf if served == 0 and offered > 0 else math.nan)
    early_ms, late_ms, trend = _time_in_system_trend(req, (a0, a1))
    pools = pool_load(src, (a0, a1))
    stages = stage_growth(src, (a0, a1))
    outrun = bool(ratio >= 1 + RATE_MARGIN) if not math.isnan(ratio) else None
    waiting = bool(trend >= TREND_MIN and late_ms - early_ms >= GROWTH_MIN_MS) if not math.isnan(trend) else False
    queue = bool(pools["queue_grows"].any()) if len(pools) else False
    busy = bool(pools["busy"].any()) if len(pools) else False
    judged = n >= MIN_REQUESTS and w_s >= MIN_WINDOW_S and outrun is not None
    saturated = bool(outrun and (waiting or queue or busy)) if judged else None
    top_stage = stages.iloc[0] if len(stages) and stages.iloc[0]["growth_ms"] >= GROWTH_MIN_MS else None
    summary = {
        "num_requests": n, "arrival_window_s": w_s, "offered_rps": offered, "num_completed": m,
        "served_rps": served, "load_ratio": ratio, "time_in_system_early_ms": early_ms,
        "time_in_system_late_ms": late_ms, "wait_trend": trend, "arrivals_outrun_service": outrun,
        "waiting_grows": waiting, "queue_grows": queue, "busy": busy, "saturated": saturated,
        "saturated_pool": _pool_that_saturates(pools, stages) if saturated else None,
        "saturated_stage": (str(top_stage["stage"]) if top_stage is not None else None) if saturated else None,
    }
    return LoadReport(pd.DataFrame([summary], columns=SUMMARY_COLUMNS).astype(object), pools, stages)
