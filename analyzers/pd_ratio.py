"""Prefill:decode balance: utilisation per pool, queue watermarks, KV transfer cost, a recommended ratio.

* Utilisation of an instance over the run's duration D (first arrival to last
  finish): busy = sum of its step durations; prefill_busy = summed duration of
  steps with prefill tokens; decode_busy = of steps with decode tokens (a mixed
  step of a colocated engine counts in both); *_utilisation = *_busy / D.
  Throughput while busy: prefill_tokens_per_s = prefill tokens / prefill_busy,
  decode_tokens_per_s = decode tokens / decode_busy.
* Pools: instances grouped by role; tokens and busy times summed, utilisation averaged.
* Watermarks per instance: max and 95th percentile of waiting and running over steps.
* KV transfer: transfer.kv time inside token 0 over the summed TTFT, and inside
  later tokens over the summed ITL.
* Recommendation: with lambda = requests / D, prompt P, cached C and output O
  the mean tokens per request,
  prefill work needed = lambda * (P - C) tokens/s, decode work needed = lambda * O tokens/s;
  per-instance throughput measured on the prefill-role instances (colocated
  ones if there are none) for prefill, decode-role (else colocated) for decode;
  prefill_instances = prefill work / prefill throughput, decode_instances
  likewise, prefill_to_decode_ratio = prefill_instances / decode_instances.
  Fractional counts are kept: round up at the deployment's scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from analyzers.source import Source
from analyzers.timing import LATENCY, request_table, run_bounds, token_times
from tokentrace.schema import Role, Stage, col

_UNKNOWN = "unknown"  # role label of an instance missing from the instances table

__all__ = ["PdRatio", "utilisation", "pools", "watermarks", "kv_transfer", "recommendation", "pd_ratio"]


@dataclass(frozen=True, slots=True)
class PdRatio:
    """The prefill:decode analyses of one run."""

    utilisation: pd.DataFrame
    pools: pd.DataFrame
    watermarks: pd.DataFrame
    kv_transfer: pd.DataFrame
    recommendation: pd.DataFrame


def _duration_s(src: Source) -> float:
    b = run_bounds(src)
    if b is None:
        lo, hi = src.con.execute(f"SELECT MIN({col.START_NS}), MAX({col.END_NS}) FROM steps").fetchone()
        b = (lo, hi) if lo is not None else (0, 0)
    return (b[1] - b[0]) / 1e9


def utilisation(src: Source) -> pd.DataFrame:
    """Per instance with steps (columns in the module doc and docs/analyzers.md)."""
    c = col
    df = src.df(f"""
        SELECT s.{c.INSTANCE_ID}, ANY_VALUE(i.{c.ROLE}) AS role,
               SUM(s.{c.END_NS} - s.{c.START_NS}) / 1e9 AS busy_s,
               SUM(CASE WHEN s.{c.NUM_PREFILL_TOKENS} > 0 THEN s.{c.END_NS} - s.{c.START_NS} ELSE 0 END) / 1e9
                   AS prefill_busy_s,
               SUM(CASE WHEN s.{c.NUM_DECODE_TOKENS} > 0 THEN s.{c.END_NS} - s.{c.START_NS} ELSE 0 END) / 1e9
                   AS decode_busy_s,
               SUM(s.{c.NUM_PREFILL_TOKENS})::BIGINT AS prefill_tokens, SUM(s.{c.NUM_DECODE_TOKENS})::BIGINT AS decode_tokens
        FROM steps s LEFT JOIN instances i USING ({c.INSTANCE_ID})
        GROUP BY s.{c.INSTANCE_ID} ORDER BY s.{c.INSTANCE_ID}
    """)
    dur = _duration_s(src)
    df["role"] = df["role"].map(lambda r: Role(int(r)).label if pd.notna(r) else _UNKNOWN)
    df.insert(2, "duration_s", dur)
    df["prefill_utilisation"] = df["prefill_busy_s"] / dur if dur > 0 else math.nan
    df["decode_utilisation"] = df["decode_busy_s"] / dur if dur > 0 else math.nan
    df["prefill_tokens_per_s"] = df["prefill_tokens"] / df["prefill_busy_s"].where(df["prefill_busy_s"] > 0)
    df["decode_tokens_per_s"] = df["decode_tokens"] / df["decode_busy_s"].where(df["decode_busy_s"] > 0)
    return df[[c.INSTANCE_ID, "role", "duration_s", "busy_s", "prefill_busy_s", "decode_busy_s",
               "prefill_utilisation", "decode_utilisation", "prefill_tokens", "decode_tokens",
               "prefill_tokens_per_s", "decode_tokens_per_s"]]


def pools(util: pd.DataFrame) -> pd.DataFrame:
    """Per role: role, num_instances, busy and token sums, mean utilisation, throughput while busy."""
    cols = ["role", "num_instances", "busy_s", "prefill_busy_s", "decode_busy_s", "prefill_utilisation",
            "decode_utilisation", "prefill_tokens", "decode_tokens", "prefill_tokens_per_s", "decode_tokens_per_s"]
    if util.empty:
        return pd.DataFrame(columns=cols)
    g = util.groupby("role", sort=True)
    out = g.agg(num_instances=(col.INSTANCE_ID, "count"), busy_s=("busy_s", "sum"),
                prefill_busy_s=("prefill_busy_s", "sum"), decode_busy_s=("decode_busy_s", "sum"),
                prefill_utilisation=("prefill_utilisation", "mean"), decode_utilisation=("decode_utilisation", "mean"),
                prefill_tokens=("prefill_tokens", "sum"), decode_tokens=("decode_tokens", "sum")).reset_index()
    out["prefill_tokens_per_s"] = out["prefill_tokens"] / out["prefill_busy_s"].where(out["prefill_busy_s"] > 0)
    out["decode_tokens_per_s"] = out["decode_tokens"] / out["decode_busy_s"].where(out["decode_busy_s"] > 0)
    return out[cols]


def watermarks(src: Source) -> pd.DataFrame:
    """Per instance: instance_id, max_waiting, p95_waiting, max_running, p95_running (over its steps)."""
    c = col
    return src.df(f"""
        SELECT {c.INSTANCE_ID}, MAX({c.NUM_WAITING}) AS max_waiting,
               quantile_cont({c.NUM_WAITING}, 0.95) AS p95_waiting,
               MAX({c.NUM_RUNNING}) AS max_running, quantile_cont({c.NUM_RUNNING}, 0.95) AS p95_running
        FROM steps GROUP BY {c.INSTANCE_ID} ORDER BY {c.INSTANCE_ID}
    """)


def kv_transfer(src: Source) -> pd.DataFrame:
    """One row: transfer_ms, ttft_total_ms, itl_total_ms, share_of_ttft, share_of_itl."""
    c = col
    tt = token_times(src)
    df = src.df(f"""
        WITH x AS (
            SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX}, SUM({c.END_NS} - {c.START_NS}) AS ns FROM srv_spans
            WHERE {c.STAGE} = {int(Stage.TRANSFER_KV)} GROUP BY {c.REQUEST_ID}, {c.TOKEN_INDEX}
        )
        SELECT (SELECT COALESCE(SUM(ns), 0) FROM x) / 1e6 AS transfer_ms,
               COALESCE(SUM(CASE WHEN t.{c.TOKEN_INDEX} = 0 THEN t.{LATENCY} END), 0) / 1e6 AS ttft_total_ms,
               COALESCE(SUM(CASE WHEN t.{c.TOKEN_INDEX} > 0 THEN t.{LATENCY} END), 0) / 1e6 AS itl_total_ms,
               COALESCE(SUM(CASE WHEN t.{c.TOKEN_INDEX} = 0 THEN x.ns END), 0) / 1e6 AS ttft_transfer_ms,
               COALESCE(SUM(CASE WHEN t.{c.TOKEN_INDEX} > 0 THEN x.ns END), 0) / 1e6 AS itl_transfer_ms
        FROM {tt} t LEFT JOIN x USING ({c.REQUEST_ID}, {c.TOKEN_INDEX})
    """)
    df["share_of_ttft"] = df["ttft_transfer_ms"] / df["ttft_total_ms"].where(df["ttft_total_ms"] > 0)
    df["share_of_itl"] = df["itl_transfer_ms"] / df["itl_total_ms"].where(df["itl_total_ms"] > 0)
    return df[["transfer_ms", "ttft_total_ms", "itl_total_ms", "share_of_ttft", "share_of_itl"]]


def _throughput(util: pd.DataFrame, role: Role, kind: str) -> float:
    """Per-instance tokens per busy second of ``kind`` on ``role`` instances.

    Falls back to colocated instances, then to instances of unknown role (no ``instances`` rows).
    """
    for label in (role.label, Role.COLOCATED.label, _UNKNOWN):
        rows = util[util["role"] == label]
        busy = rows[f"{kind}_busy_s"].sum()
        if len(rows) and busy > 0:
            return float(rows[f"{kind}_tokens"].sum() / busy)
    return math.nan


def recommendation(src: Source, util: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row with the recommended prefill:decode instance ratio (formula in the module doc)."""
    c = col
    util = utilisation(src) if util is None else util
    m = src.df(f"""
        SELECT COUNT(*) AS n, AVG({c.NUM_PROMPT_TOKENS}) AS p, AVG(COALESCE({c.NUM_CACHED_TOKENS}, 0)) AS cached,
               AVG({c.NUM_OUTPUT_TOKENS}) AS o
        FROM {request_table(src)} WHERE {c.ARRIVAL_NS} IS NOT NULL
    """).iloc[0]
    dur = _duration_s(src)
    rate = m["n"] / dur if dur > 0 else math.nan
    prompt, cached, out = (float(m[k]) if pd.notna(m[k]) else math.nan for k in ("p", "cached", "o"))
    need_p, need_d = rate * (prompt - cached), rate * out
    thr_p, thr_d = _throughput(util, Role.PREFILL, "prefill"), _throughput(util, Role.DECODE, "decode")
    n_p, n_d = need_p / thr_p, need_d / thr_d
    return pd.DataFrame([{
        "arrival_rate_rps": rate, "mean_prompt_tokens": prompt, "mean_cached_tokens": cached,
        "mean_output_tokens": out, "prefill_tokens_per_s_needed": need_p, "decode_tokens_per_s_needed": need_d,
        "prefill_throughput_per_instance": thr_p, "decode_throughput_per_instance": thr_d,
        "prefill_instances": n_p, "decode_instances": n_d,
        "prefill_to_decode_ratio": n_p / n_d if n_d and n_d > 0 else math.nan,
    }])


def pd_ratio(src: Source) -> PdRatio:
    """Every prefill:decode analysis."""
    util = utilisation(src)
    return PdRatio(util, pools(util), watermarks(src), kv_transfer(src), recommendation(src, util))
