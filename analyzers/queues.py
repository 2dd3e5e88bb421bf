"""Queues: lengths over time, queueing delay, and a Little's-law consistency check.

* Timeline: each engine step records, after scheduling, how many requests wait,
  run and are preempted. Steps are bucketed by their end time into buckets of
  ``bucket_s`` seconds since the run's first arrival; each bucket reports the
  mean over its steps (and the maximum of waiting).
* Queueing delay of a request = the time its ``schedule.queue`` spans (admission
  wait) count in its token intervals, clipped as the stage breakdown clips them
  (:data:`analyzers.stage_breakdown.REQUEST_STAGE_NS`: a decode worker's wait hidden
  behind an earlier token's delivery is no part of the request's latency), distribution
  per SLO class.
* Little's law, per engine instance: L = lambda * W, over the window T from the
  instance's first request arrival to its last finish:
  L (measured) = sum over steps of (waiting + running + preempted) * step duration / T
  (time between steps counts as an empty system);
  lambda = requests that arrived at the instance / T; W = mean (finish - arrival)
  of those requests; relative_error = (L - lambda * W) / (lambda * W).
  A large error means steps miss requests (e.g. queued outside the engine) or
  times are inconsistent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from analyzers.groups import ALL, PERCENTILES, pct_name
from analyzers.source import Source
from analyzers.stage_breakdown import request_stage_ns
from analyzers.timing import request_table, run_start
from tokentrace.schema import Stage, col

__all__ = ["Queues", "queue_timeline", "queueing_delay", "littles_law", "queues"]


@dataclass(frozen=True, slots=True)
class Queues:
    """The three queue analyses of one run."""

    timeline: pd.DataFrame
    delay: pd.DataFrame
    littles_law: pd.DataFrame


def queue_timeline(src: Source, *, bucket_s: float = 1.0) -> pd.DataFrame:
    """Mean queue lengths per instance and time bucket.

    Columns: instance_id, t_s (bucket start, s since the run's first arrival, or
    the first step when there are no requests), num_waiting, num_running,
    num_preempted (means), max_waiting. ``ValueError`` if bucket_s <= 0.
    """
    if not (math.isfinite(bucket_s) and bucket_s > 0):
        raise ValueError(f"bucket_s must be a positive number of seconds, got {bucket_s!r}")
    c = col
    first = run_start(src)
    start = first if first is not None else src.scalar(f"SELECT MIN({c.START_NS}) FROM steps") or 0
    w = int(bucket_s * 1e9)
    return src.df(f"""
        SELECT {c.INSTANCE_ID}, FLOOR(({c.END_NS} - {start}) / {w}) * {float(bucket_s)} AS t_s,
               AVG({c.NUM_WAITING}) AS {c.NUM_WAITING}, AVG({c.NUM_RUNNING}) AS {c.NUM_RUNNING},
               AVG({c.NUM_PREEMPTED}) AS {c.NUM_PREEMPTED}, MAX({c.NUM_WAITING}) AS max_waiting
        FROM steps GROUP BY ALL ORDER BY {c.INSTANCE_ID}, t_s
    """)


def queueing_delay(src: Source) -> pd.DataFrame:
    """Distribution of per-request admission wait (schedule.queue time), per SLO class and ``*``.

    Columns: slo_class_name, count, mean_ms, p50_ms, p90_ms, p99_ms, p99.9_ms,
    max_ms. Requests without a queue span count as 0 ms.
    """
    c = col
    qs = ", ".join(str(p / 100) for p in PERCENTILES)
    classes = request_table(src)  # every server-side request and its class
    df = src.df(f"""
        WITH q AS ({_queue_ns_sql(src)}), r AS (
            SELECT f.{c.SLO_CLASS} AS cls, COALESCE(q.ns, 0) / 1e6 AS ms
            FROM {classes} f LEFT JOIN q USING ({c.REQUEST_ID})
        )
        SELECT cls, COUNT(*) AS count, AVG(ms) AS mean_ms, quantile_cont(ms, [{qs}]) AS q, MAX(ms) AS max_ms
        FROM (SELECT cls, ms FROM r UNION ALL SELECT '{ALL}' AS cls, ms FROM r)
        GROUP BY cls ORDER BY cls = '{ALL}', cls
    """)
    rows = []
    for _, r in df.iterrows():
        row = {c.SLO_CLASS: r["cls"], "count": int(r["count"]), "mean_ms": float(r["mean_ms"])}
        row.update({pct_name(p): float(v) for p, v in zip(PERCENTILES, r["q"])})
        row["max_ms"] = float(r["max_ms"])
        rows.append(row)
    if not rows:  # no requests: the overall row still exists, empty
        rows.append({c.SLO_CLASS: ALL, "count": 0, "mean_ms": math.nan, "max_ms": math.nan,
                     **{pct_name(p): math.nan for p in PERCENTILES}})
    cols = [c.SLO_CLASS, "count", "mean_ms"] + [pct_name(p) for p in PERCENTILES] + ["max_ms"]
    return pd.DataFrame(rows, columns=cols)


def _queue_ns_sql(src: Source) -> str:
    """SELECT of (request_id, ns): the time each request's schedule.queue spans count in its token intervals, for
    requests that have one (from the per-request stage sums, :data:`analyzers.stage_breakdown.REQUEST_STAGE_NS`)."""
    c = col
    return (f"SELECT {c.REQUEST_ID}, SUM(ns) AS ns FROM {request_stage_ns(src)} "
            f"WHERE {c.STAGE} = {int(Stage.SCHEDULE_QUEUE)} GROUP BY {c.REQUEST_ID}")


def littles_law(src: Source) -> pd.DataFrame:
    """L measured from steps against lambda * W from requests, per engine instance (module doc).

    Columns: instance_id, duration_s, num_requests, arrival_rate_rps,
    mean_time_in_system_s, lambda_w, mean_in_system, relative_error. Only
    instances that both recorded steps and request rows with arrival and finish.
    """
    c = col
    df = src.df(f"""
        WITH r AS (
            SELECT {c.INSTANCE_ID}, COUNT(*) AS n, MIN({c.ARRIVAL_NS}) AS t0, MAX({c.FINISH_NS}) AS t1,
                   SUM({c.FINISH_NS} - {c.ARRIVAL_NS})::DOUBLE AS lifetime_ns
            FROM srv_requests WHERE {c.ARRIVAL_NS} IS NOT NULL AND {c.FINISH_NS} IS NOT NULL
            GROUP BY {c.INSTANCE_ID}
        ), s AS (
            SELECT {c.INSTANCE_ID},
                   SUM(({c.NUM_WAITING} + {c.NUM_RUNNING} + {c.NUM_PREEMPTED})
                       * ({c.END_NS} - {c.START_NS}))::DOUBLE AS area
            FROM steps GROUP BY {c.INSTANCE_ID}
        )
        SELECT r.{c.INSTANCE_ID}, (r.t1 - r.t0) / 1e9 AS duration_s, r.n AS num_requests,
               r.lifetime_ns, s.area
        FROM r JOIN s USING ({c.INSTANCE_ID}) WHERE r.t1 > r.t0 ORDER BY r.{c.INSTANCE_ID}
    """)
    dur = df["duration_s"]
    df["arrival_rate_rps"] = df["num_requests"] / dur
    df["mean_time_in_system_s"] = df["lifetime_ns"] / df["num_requests"] / 1e9
    df["lambda_w"] = df["arrival_rate_rps"] * df["mean_time_in_system_s"]
    df["mean_in_system"] = df["area"] / (dur * 1e9)
    df["relative_error"] = (df["mean_in_system"] - df["lambda_w"]) / df["lambda_w"]
    return df[[c.INSTANCE_ID, "duration_s", "num_requests", "arrival_rate_rps", "mean_time_in_system_s",
               "lambda_w", "mean_in_system", "relative_error"]]


def queues(src: Source, *, bucket_s: float = 1.0) -> Queues:
    """All three queue analyses."""
    return Queues(queue_timeline(src, bucket_s=bucket_s), queueing_delay(src), littles_law(src))
