"""Batching: step time and ITL against batch size, and interference inside a step.

* Batch profile: steps are binned by batch size (sequences in the step) into
  powers of two: [1], [2], [3, 4], [5, 8], [9, 16], ...; per bin the step
  durations (mean, p99) and the ITL of the decode tokens (index >= 1) those
  steps produced (a token's step is the engine step that emitted it).
* Interference: the decode tokens are ranked by ITL. ``slowest`` = the slowest
  ceil(tail_fraction * n) (at least one); ``median`` = tokens whose ITL lies
  between the 45th and 55th percentile (at least the one nearest the median).
  For each group: how long their steps took, how full they were, and how many
  prompt tokens of *other* requests (prefill chunks) shared the step
  (the step's prefill tokens: a decode token's own request adds none).
"""

from __future__ import annotations

import pandas as pd

from analyzers.source import Source
from analyzers.timing import LATENCY, token_steps, token_times
from tokentrace.schema import col

__all__ = ["batch_profile", "interference", "TAIL_FRACTION"]

TAIL_FRACTION = 0.01
_BIN = "CAST(CEIL(LOG2(GREATEST({n}, 1)) - 1e-9) AS INTEGER)"  # ceil(log2 n): 1->0, 2->1, 3,4->2, 5..8->3


def _bin(expr: str) -> str:
    return _BIN.format(n=expr)


def batch_profile(src: Source) -> pd.DataFrame:
    """Per batch-size bin: batch_size_lo, batch_size_hi, num_steps, mean_step_ms, p99_step_ms,
    num_tokens, mean_itl_ms, p99_itl_ms (NaN ITL columns where the bin produced no decode token)."""
    c = col
    tt, ts = token_times(src), token_steps(src)
    steps = src.df(f"""
        SELECT {_bin(c.NUM_SEQS)} AS k, COUNT(*) AS num_steps,
               AVG({c.END_NS} - {c.START_NS}) / 1e6 AS mean_step_ms,
               quantile_cont({c.END_NS} - {c.START_NS}, 0.99) / 1e6 AS p99_step_ms
        FROM steps GROUP BY k
    """)
    toks = src.df(f"""
        SELECT {_bin('s.' + c.NUM_SEQS)} AS k, COUNT(*) AS num_tokens, AVG(t.{LATENCY}) / 1e6 AS mean_itl_ms,
               quantile_cont(t.{LATENCY}, 0.99) / 1e6 AS p99_itl_ms
        FROM {tt} t JOIN {ts} x ON t.{c.REQUEST_ID} = x.{c.REQUEST_ID} AND t.{c.TOKEN_INDEX} = x.{c.TOKEN_INDEX}
        JOIN steps s ON x.{c.INSTANCE_ID} = s.{c.INSTANCE_ID} AND x.{c.STEP} = s.{c.STEP}
        WHERE t.{c.TOKEN_INDEX} > 0 GROUP BY k
    """)
    df = steps.merge(toks, on="k", how="left").sort_values("k")
    df["num_tokens"] = df["num_tokens"].fillna(0).astype("int64")
    df.insert(0, "batch_size_hi", (2 ** df["k"]).astype("int64"))
    df.insert(0, "batch_size_lo", df["k"].map(lambda k: 1 if k == 0 else 2 ** (int(k) - 1) + 1).astype("int64"))
    return df.drop(columns="k").reset_index(drop=True)


def interference(src: Source, *, tail_fraction: float = TAIL_FRACTION) -> pd.DataFrame:
    """Rows ``slowest`` and ``median``: group, num_tokens, mean_itl_ms, mean_step_ms, mean_batch_size,
    mean_other_prefill_tokens, share_with_prefill. Empty when no decode token has a recorded step."""
    if not 0 < tail_fraction <= 1:
        raise ValueError(f"tail_fraction must be in (0, 1], got {tail_fraction!r}")
    c = col
    tt, ts = token_times(src), token_steps(src)
    src.con.execute(f"""
        CREATE OR REPLACE TEMP TABLE intf_tok AS
        SELECT t.{LATENCY} AS lat, s.{c.END_NS} - s.{c.START_NS} AS step_ns, s.{c.NUM_SEQS} AS seqs,
               s.{c.NUM_PREFILL_TOKENS} AS other_prefill
        FROM {tt} t JOIN {ts} x ON t.{c.REQUEST_ID} = x.{c.REQUEST_ID} AND t.{c.TOKEN_INDEX} = x.{c.TOKEN_INDEX}
        JOIN steps s ON x.{c.INSTANCE_ID} = s.{c.INSTANCE_ID} AND x.{c.STEP} = s.{c.STEP}
        WHERE t.{c.TOKEN_INDEX} > 0
    """)
    agg = """COUNT(*) AS num_tokens, AVG(lat) / 1e6 AS mean_itl_ms, AVG(step_ns) / 1e6 AS mean_step_ms,
             AVG(seqs) AS mean_batch_size, AVG(other_prefill) AS mean_other_prefill_tokens,
             AVG(CASE WHEN other_prefill > 0 THEN 1.0 ELSE 0.0 END) AS share_with_prefill"""
    df = src.df(f"""
        WITH r AS (SELECT *, ROW_NUMBER() OVER (ORDER BY lat DESC, step_ns DESC) AS rn, COUNT(*) OVER () AS n
                   FROM intf_tok),
        q AS (SELECT quantile_cont(lat, 0.45) AS a, quantile_cont(lat, 0.55) AS b,
                     quantile_cont(lat, 0.5) AS m FROM intf_tok)
        SELECT 'slowest' AS "group", {agg} FROM r WHERE rn <= GREATEST(1, CEIL(n * {tail_fraction}))
        UNION ALL
        SELECT 'median', {agg} FROM intf_tok, q WHERE lat BETWEEN a AND b
        UNION ALL
        SELECT 'nearest', {agg} FROM (SELECT intf_tok.* FROM intf_tok, q ORDER BY ABS(lat - m) LIMIT 1)
    """)
    src.con.execute("DROP TABLE IF EXISTS intf_tok")
    df = df[df["num_tokens"] > 0]
    if "median" not in set(df["group"]):
        df.loc[df["group"] == "nearest", "group"] = "median"
    return df[df["group"] != "nearest"].reset_index(drop=True)
