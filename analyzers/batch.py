"""Batching: step time and ITL against batch size, and interference inside a step.

* Batch profile, per role (the role of the instance that ran the steps): steps are binned by batch size (sequences in the step) into
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

from analyzers import facts
from analyzers.source import Source
from analyzers.timing import LATENCY, token_steps, token_times
from tokentrace.schema import Role, col

__all__ = ["DECODE_TOKEN_STEPS", "batch_profile", "interference", "decode_token_steps", "decode_token_steps_sql",
           "TAIL_FRACTION"]

TAIL_FRACTION = 0.01
UNKNOWN_ROLE = "unknown"  # role of steps whose instance is missing from the instances table
_BIN = "CAST(CEIL(LOG2(GREATEST({n}, 1)) - 1e-9) AS INTEGER)"  # ceil(log2 n): 1->0, 2->1, 3,4->2, 5..8->3


def _bin(expr: str) -> str:
    return _BIN.format(n=expr)


def decode_token_steps_sql(src: Source) -> str:
    """SELECT of every delivered token i >= 1 with the engine step that produced it: lat (its ITL, ns), step_ns
    (the step's length), seqs (the step's batch size), other_prefill (prefill tokens in the step), instance_id
    (the instance that ran the step)."""
    c = col
    tt, ts = token_times(src), token_steps(src)
    return f"""
        SELECT t.{LATENCY} AS lat, s.{c.END_NS} - s.{c.START_NS} AS step_ns, s.{c.NUM_SEQS} AS seqs,
               s.{c.NUM_PREFILL_TOKENS} AS other_prefill, s.{c.INSTANCE_ID}
        FROM {tt} t JOIN {ts} x ON t.{c.REQUEST_ID} = x.{c.REQUEST_ID} AND t.{c.TOKEN_INDEX} = x.{c.TOKEN_INDEX}
        JOIN steps s ON x.{c.INSTANCE_ID} = s.{c.INSTANCE_ID} AND x.{c.STEP} = s.{c.STEP}
        WHERE t.{c.TOKEN_INDEX} > 0
    """


DECODE_TOKEN_STEPS = facts.Fact(
    "decode_token_steps", "Every delivered token i >= 1 with the engine step that produced it.",
    (facts.i64("lat", "The token's ITL; ns."), facts.i64("step_ns", "Length of the step that produced it; ns."),
     facts.i64("seqs", "The step's batch size (sequences)."),
     facts.i64("other_prefill", "Prefill tokens in the step."),
     facts.i64(col.INSTANCE_ID, "The instance that ran the step.")),
    select=decode_token_steps_sql)


def decode_token_steps(src: Source) -> str:
    """Relation of :data:`DECODE_TOKEN_STEPS` (:func:`analyzers.facts.relation`)."""
    return facts.relation(src, DECODE_TOKEN_STEPS)


def batch_profile(src: Source) -> pd.DataFrame:
    """Per role (of the instances that ran the steps) and batch-size bin: role, batch_size_lo, batch_size_hi,
    num_steps, mean_step_ms, p99_step_ms, num_tokens, mean_itl_ms, p99_itl_ms (NaN ITL columns where the bin
    produced no decode token). Roles apart: a prefill worker's prefill-only steps are not decode steps, and
    mixed with a decode worker's they would make a step look slower than the ITL it produced."""
    c = col
    roles = f"(SELECT {c.INSTANCE_ID}, ANY_VALUE({c.ROLE}) AS role_id FROM instances GROUP BY {c.INSTANCE_ID})"
    steps = src.df(f"""
        SELECT i.role_id, {_bin('s.' + c.NUM_SEQS)} AS k, COUNT(*) AS num_steps,
               AVG(s.{c.END_NS} - s.{c.START_NS}) / 1e6 AS mean_step_ms,
               quantile_cont(s.{c.END_NS} - s.{c.START_NS}, 0.99) / 1e6 AS p99_step_ms
        FROM steps s LEFT JOIN {roles} i USING ({c.INSTANCE_ID}) GROUP BY ALL
    """)
    toks = src.df(f"""
        SELECT i.role_id, {_bin('d.seqs')} AS k, COUNT(*) AS num_tokens,
               AVG(d.lat) / 1e6 AS mean_itl_ms, quantile_cont(d.lat, 0.99) / 1e6 AS p99_itl_ms
        FROM {decode_token_steps(src)} d LEFT JOIN {roles} i USING ({c.INSTANCE_ID}) GROUP BY ALL
    """)
    for frame in (steps, toks):
        frame["role"] = [Role(int(r)).label if pd.notna(r) else UNKNOWN_ROLE for r in frame["role_id"]]
    df = steps.drop(columns="role_id").merge(toks.drop(columns="role_id"), on=["role", "k"], how="left")
    df = df.sort_values(["role", "k"])
    df["num_tokens"] = df["num_tokens"].fillna(0).astype("int64")
    df.insert(1, "batch_size_hi", (2 ** df["k"]).astype("int64"))
    df.insert(1, "batch_size_lo", df["k"].map(lambda k: 1 if k == 0 else 2 ** (int(k) - 1) + 1).astype("int64"))
    return df.drop(columns="k")[["role", *[x for x in df.columns if x not in ("role", "k")]]].reset_index(drop=True)


def interference(src: Source, *, tail_fraction: float = TAIL_FRACTION) -> pd.DataFrame:
    """Rows ``slowest`` and ``median``: group, num_tokens, mean_itl_ms, mean_step_ms, mean_batch_size,
    mean_other_prefill_tokens, share_with_prefill. Empty when no decode token has a recorded step."""
    if not 0 < tail_fraction <= 1:
        raise ValueError(f"tail_fraction must be in (0, 1], got {tail_fraction!r}")
    tok = decode_token_steps(src)
    agg = """COUNT(*) AS num_tokens, AVG(lat) / 1e6 AS mean_itl_ms, AVG(step_ns) / 1e6 AS mean_step_ms,
             AVG(seqs) AS mean_batch_size, AVG(other_prefill) AS mean_other_prefill_tokens,
             AVG(CASE WHEN other_prefill > 0 THEN 1.0 ELSE 0.0 END) AS share_with_prefill"""
    # The slowest k = ceil(n * tail_fraction) tokens: ranked among the candidates at or above a quantile that
    # keeps at least 2k of them, so that not every token is sorted.
    cut = max(0.0, 1.0 - 2.0 * tail_fraction)
    df = src.df(f"""
        WITH q AS (SELECT quantile_cont(lat, 0.45) AS a, quantile_cont(lat, 0.55) AS b,
                          quantile_cont(lat, 0.5) AS m, quantile_disc(lat, {cut}) AS cut, COUNT(*) AS n FROM {tok}),
        r AS (SELECT k.*, ROW_NUMBER() OVER (ORDER BY lat DESC, step_ns DESC) AS rn, q.n
              FROM {tok} k, q WHERE k.lat >= q.cut)
        SELECT 'slowest' AS "group", {agg} FROM r WHERE rn <= GREATEST(1, CEIL(n * {tail_fraction}))
        UNION ALL
        SELECT 'median', {agg} FROM {tok} k, q WHERE lat BETWEEN a AND b
        UNION ALL
        SELECT 'nearest', {agg} FROM (SELECT k.* FROM {tok} k, q ORDER BY ABS(lat - m) LIMIT 1)
    """)
    df = df[df["num_tokens"] > 0]
    if "median" not in set(df["group"]):
        df.loc[df["group"] == "nearest", "group"] = "median"
    return df[df["group"] != "nearest"].reset_index(drop=True)
