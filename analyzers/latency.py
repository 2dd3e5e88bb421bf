"""Latency metrics: TTFT, TPOT, ITL and end-to-end, with the same definitions as
``vllm bench serve`` so numbers compare.

* TTFT (time to first token) = t_0 - arrival.
* TPOT (time per output token) = (t_last - t_0) / (n - 1), requests with n > 1 tokens.
* ITL (inter-token latency) = t_i - t_{i-1} for every token i >= 1 of every request.
* E2E (end-to-end latency) = finish - arrival (last token time when no finish was recorded).

Times as in :mod:`analyzers.timing`. Results in milliseconds; percentiles are
linear-interpolated (numpy's default). Computed in DuckDB over the run's files,
so only the result rows reach memory.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from analyzers import facts
from analyzers.groups import PERCENTILES, group_column, group_sql, pct_name, percentile_or_nan
from analyzers.source import Source
from analyzers.timing import E2E_NS, LATENCY, TPOT_NS, TTFT_NS, request_table, run_bounds, token_times
from tokentrace.schema import REQUESTS, TOKENS, col

__all__ = ["PERCENTILES", "METRICS", "latency", "latency_summary", "summarize", "itl_samples_sql",
           "token_groups_sql"]

METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2e")


def latency(src: Source, *, by: str | None = None, window_s: float | None = None,
            percentiles: tuple[float, ...] = PERCENTILES) -> pd.DataFrame:
    """Count, mean and percentiles (ms) per metric, overall or per group.

    ``by``: ``"tenant"``, ``"slo_class"`` or ``"instance"``; ``window_s``: arrival
    time windows of that many seconds. Columns: [group column], metric, count,
    mean_ms, p50_ms, p90_ms, p99_ms, p99.9_ms. Every group has the four metric
    rows (count 0 and NaN where a metric has no samples). ``ValueError`` on a bad grouping.
    """
    gcol = group_column(by, window_s)
    rf, tt = request_table(src), token_times(src)
    bounds = run_bounds(src) if window_s is not None else None
    g = group_sql(by, window_s, alias="f", start_ns=bounds[0] if bounds else 0)
    qs = ", ".join(str(p / 100) for p in percentiles)
    c = col
    df = src.df(f"""
        WITH f AS (SELECT f.*, {g} AS grp FROM {rf} f WHERE f.{c.FIRST_TOKEN_NS} IS NOT NULL),
        s AS (
            SELECT grp, 'ttft' AS metric, {TTFT_NS} / 1e6 AS v FROM f
            UNION ALL SELECT grp, 'tpot', {TPOT_NS} / 1e6 FROM f WHERE {TPOT_NS} IS NOT NULL
            UNION ALL {itl_samples_sql(src, tt, g)}
            UNION ALL SELECT grp, 'e2e', {E2E_NS} / 1e6 FROM f
        )
        SELECT grp, metric, COUNT(*) AS count, AVG(v) AS mean_ms, quantile_cont(v, [{qs}]) AS q
        FROM s GROUP BY grp, metric
    """)
    groups = sorted(df["grp"].unique().tolist()) if gcol is not None else [0]
    found = {(grp, metric): (count, mean, q) for grp, metric, count, mean, q
             in zip(df["grp"], df["metric"], df["count"], df["mean_ms"], df["q"])}  # one pass: 10 000 tenants
    rows = []
    for grp in groups:
        for metric in METRICS:
            hit = found.get((grp, metric))
            row: dict[str, object] = {} if gcol is None else {gcol: grp}
            row["metric"] = metric
            if hit is not None:
                count, mean, q = hit
                row.update(count=int(count), mean_ms=float(mean))
                row.update({pct_name(p): float(v) for p, v in zip(percentiles, q)})
            else:
                row.update(count=0, mean_ms=float("nan"))
                row.update({pct_name(p): float("nan") for p in percentiles})
            rows.append(row)
    return pd.DataFrame(rows)


def itl_samples_sql(src: Source, tt: str, group: str) -> str:
    """SELECT of (grp, 'itl', ms) for every token i >= 1 of ``tt`` (token times), its request's group from the
    request facts ``f`` (with their ``grp``; ``group`` is its expression over them). Without a grouping
    (``group`` is ``"0"``) the tokens are not joined to ``f``: every token of the token times belongs to a
    request with a first token (the facts' first token time is their earliest delivery), so the join would keep
    every row. With one, the group is read from :data:`TOKEN_GROUPS` (each token with its request's grouping
    columns) as ``f``."""
    c = col
    if group == "0":
        return f"SELECT 0 AS grp, 'itl', {LATENCY} / 1e6 FROM {tt} WHERE {c.TOKEN_INDEX} > 0"
    rows = facts.relation(src, TOKEN_GROUPS)
    return f"SELECT {group} AS grp, 'itl', f.{LATENCY} / 1e6 FROM {rows} f WHERE f.{c.TOKEN_INDEX} > 0"


def token_groups_sql(src: Source) -> str:
    """SELECT of every delivered token of a request with a first token: request_id, token_index, latency_ns and
    the request's columns a grouping reads (arrival_ns, tenant_name, slo_class_name, instance_id)."""
    c = col
    groups = ", ".join(f"f.{name}" for name in (c.ARRIVAL_NS, c.TENANT, c.SLO_CLASS, c.INSTANCE_ID))
    return (f"SELECT t.{c.REQUEST_ID}, t.{c.TOKEN_INDEX}, t.{LATENCY}, {groups} "
            f"FROM {token_times(src)} t JOIN {request_table(src)} f USING ({c.REQUEST_ID}) "
            f"WHERE f.{c.FIRST_TOKEN_NS} IS NOT NULL")


def summarize(samples: dict[str, np.ndarray], percentiles: tuple[float, ...] = PERCENTILES) -> pd.DataFrame:
    """Count, mean and percentiles per metric from raw samples; NaN where a metric has no samples."""
    rows = []
    for name in METRICS:
        v = np.asarray(samples.get(name, np.empty(0)), dtype=float)
        row: dict[str, float | str | int] = {"metric": name, "count": int(v.size),
                                             "mean_ms": float(v.mean()) if v.size else float("nan")}
        for p in percentiles:
            row[pct_name(p)] = percentile_or_nan(v, p)
        rows.append(row)
    return pd.DataFrame(rows)


def latency_summary(requests: pa.Table, tokens: pa.Table, instances: pa.Table) -> pd.DataFrame:
    """One row per metric (ttft, tpot, itl, e2e): count, mean and p50/p90/p99/p99.9 in ms."""
    return latency(Source.of_tables(requests=requests, tokens=tokens, instances=instances))


TOKEN_GROUPS = facts.Fact(
    "token_groups", "Every delivered token of a request with a first token, with its latency and its request's "
                    "columns a grouping reads.",
    (TOKENS.column(col.REQUEST_ID), TOKENS.column(col.TOKEN_INDEX),
     facts.i64(LATENCY, "The token's latency (TTFT for token 0, else ITL); ns."),
     REQUESTS.column(col.ARRIVAL_NS), REQUESTS.column(col.TENANT), REQUESTS.column(col.SLO_CLASS),
     facts.i64(col.INSTANCE_ID, "The request's instance (analyzers.timing.request_table).")),
    select=token_groups_sql)
