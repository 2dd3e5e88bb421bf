"""KV cache: prefix hit rates, per-tier hits, eviction churn, tier transfers, cost of misses.

* Token-weighted prefix hit rate = sum of cached prompt tokens / sum of prompt
  tokens (``requests.num_cached_tokens`` / ``num_prompt_tokens``); request-weighted
  = share of requests with at least one cached token. Requests with a known,
  positive prompt length only.
* Per tier: a *lookup* is one prefix match (the HIT and MISS events sharing
  instance, request and start time). lookup_hit_rate(tier) = lookups that hit
  blocks in that tier / all lookups; share_of_hit_blocks = blocks hit there /
  all hit blocks.
* Churn per tier: evicted blocks (EVICT) and their rate over the run's
  duration; offloaded blocks (OFFLOAD, counted in the tier they left) and
  loaded blocks (LOAD, counted in the tier they entered); reload_ratio = loaded /
  evicted blocks: the share of evictions later undone by a load instead of a
  recompute (an estimate: events carry block counts, not block ids).
* Transfers per kind and tier: events, blocks, bytes, summed time and bytes per
  second of transfer time.
* Cost of misses: requests with and without a prefix hit compared on mean TTFT
  and on TTFT per prompt token (mean of ttft / prompt tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from analyzers.source import Source
from analyzers.timing import TTFT_NS, request_table, run_bounds
from tokentrace.schema import CacheEventKind, Tier, col

__all__ = ["CacheReport", "prefix_hits", "tier_hits", "eviction_churn", "transfers", "miss_cost", "cache"]

_TRANSFER_KINDS = (CacheEventKind.SWAP_OUT, CacheEventKind.SWAP_IN, CacheEventKind.OFFLOAD,
                   CacheEventKind.LOAD, CacheEventKind.PREFETCH)


@dataclass(frozen=True, slots=True)
class CacheReport:
    """The cache analyses of one run."""

    prefix: pd.DataFrame
    tiers: pd.DataFrame
    churn: pd.DataFrame
    transfers: pd.DataFrame
    miss_cost: pd.DataFrame


def _tier_label(t: object) -> str:
    return Tier(int(t)).label if t is not None and not pd.isna(t) and int(t) >= 0 else "none"


def prefix_hits(src: Source) -> pd.DataFrame:
    """One row: num_requests, prompt_tokens, cached_tokens, token_hit_rate, request_hit_rate."""
    c = col
    df = src.df(f"""
        SELECT COUNT(*) AS num_requests, SUM({c.NUM_PROMPT_TOKENS}) AS prompt_tokens,
               SUM(COALESCE({c.NUM_CACHED_TOKENS}, 0)) AS cached_tokens,
               AVG(CASE WHEN COALESCE({c.NUM_CACHED_TOKENS}, 0) > 0 THEN 1.0 ELSE 0.0 END) AS request_hit_rate
        FROM {request_table(src)} WHERE {c.NUM_PROMPT_TOKENS} > 0
    """)
    df["prompt_tokens"] = df["prompt_tokens"].fillna(0).astype("int64")
    df["cached_tokens"] = df["cached_tokens"].fillna(0).astype("int64")
    df["token_hit_rate"] = df["cached_tokens"] / df["prompt_tokens"].where(df["prompt_tokens"] > 0)
    return df[["num_requests", "prompt_tokens", "cached_tokens", "token_hit_rate", "request_hit_rate"]]


def tier_hits(src: Source) -> pd.DataFrame:
    """Per tier: tier, num_lookups, num_lookups_hit, lookup_hit_rate, hit_blocks, share_of_hit_blocks."""
    c = col
    hit, miss = int(CacheEventKind.HIT), int(CacheEventKind.MISS)
    df = src.df(f"""
        WITH ev AS (SELECT * FROM cache_events WHERE {c.KIND} IN ({hit}, {miss})),
        lookups AS (SELECT COUNT(*) AS n FROM (SELECT DISTINCT {c.INSTANCE_ID}, {c.REQUEST_ID}, {c.START_NS} FROM ev))
        SELECT {c.TIER} AS tier, (SELECT n FROM lookups) AS num_lookups,
               COUNT(DISTINCT ({c.INSTANCE_ID}, {c.REQUEST_ID}, {c.START_NS})) AS num_lookups_hit,
               SUM({c.NUM_BLOCKS})::BIGINT AS hit_blocks
        FROM ev WHERE {c.KIND} = {hit} GROUP BY {c.TIER} ORDER BY {c.TIER}
    """)
    df["tier"] = df["tier"].map(_tier_label)
    df["lookup_hit_rate"] = df["num_lookups_hit"] / df["num_lookups"]
    total = df["hit_blocks"].sum()
    df["share_of_hit_blocks"] = df["hit_blocks"] / total if total > 0 else math.nan
    return df[["tier", "num_lookups", "num_lookups_hit", "lookup_hit_rate", "hit_blocks", "share_of_hit_blocks"]]


def _duration_s(src: Source) -> float:
    b = run_bounds(src)
    if b is None:
        lo, hi = src.con.execute(f"SELECT MIN({col.START_NS}), MAX({col.END_NS}) FROM cache_events").fetchone()
        b = (lo, hi) if lo is not None else (0, 0)
    return (b[1] - b[0]) / 1e9


def eviction_churn(src: Source) -> pd.DataFrame:
    """Per tier: tier, evicted_blocks, evicted_blocks_per_s, offloaded_blocks, loaded_blocks, reload_ratio."""
    c = col
    k = CacheEventKind
    df = src.df(f"""
        SELECT {c.TIER} AS tier,
               SUM(CASE WHEN {c.KIND} = {int(k.EVICT)} THEN {c.NUM_BLOCKS} ELSE 0 END)::BIGINT AS evicted_blocks,
               SUM(CASE WHEN {c.KIND} = {int(k.OFFLOAD)} THEN {c.NUM_BLOCKS} ELSE 0 END)::BIGINT AS offloaded_blocks,
               SUM(CASE WHEN {c.KIND} = {int(k.LOAD)} THEN {c.NUM_BLOCKS} ELSE 0 END)::BIGINT AS loaded_blocks
        FROM cache_events WHERE {c.KIND} IN ({int(k.EVICT)}, {int(k.OFFLOAD)}, {int(k.LOAD)})
        GROUP BY {c.TIER} ORDER BY {c.TIER}
    """)
    dur = _duration_s(src)
    df["tier"] = df["tier"].map(_tier_label)
    df["evicted_blocks_per_s"] = df["evicted_blocks"] / dur if dur > 0 else math.nan
    df["reload_ratio"] = df["loaded_blocks"] / df["evicted_blocks"].where(df["evicted_blocks"] > 0)
    return df[["tier", "evicted_blocks", "evicted_blocks_per_s", "offloaded_blocks", "loaded_blocks",
               "reload_ratio"]]


def transfers(src: Source) -> pd.DataFrame:
    """Per kind and tier: kind, tier, num_events, blocks, bytes, time_ms, gb_per_s (bytes per transfer second / 1e9)."""
    c = col
    kinds = ", ".join(str(int(k)) for k in _TRANSFER_KINDS)
    df = src.df(f"""
        SELECT {c.KIND} AS kind, {c.TIER} AS tier, COUNT(*) AS num_events, SUM({c.NUM_BLOCKS})::BIGINT AS blocks,
               SUM(CASE WHEN {c.NUM_BYTES} > 0 THEN {c.NUM_BYTES} ELSE 0 END)::BIGINT AS bytes,
               SUM({c.END_NS} - {c.START_NS}) / 1e6 AS time_ms
        FROM cache_events WHERE {c.KIND} IN ({kinds}) GROUP BY {c.KIND}, {c.TIER} ORDER BY {c.KIND}, {c.TIER}
    """)
    df["kind"] = df["kind"].map(lambda k: CacheEventKind(int(k)).label)
    df["tier"] = df["tier"].map(_tier_label)
    df["gb_per_s"] = df["bytes"] / (df["time_ms"] / 1e3).where(df["time_ms"] > 0) / 1e9
    return df


def miss_cost(src: Source) -> pd.DataFrame:
    """Rows ``hit`` and ``miss``: group, num_requests, mean_ttft_ms, mean_prompt_tokens,
    mean_ttft_per_prompt_token_ms. Requests with a first token and a positive prompt length."""
    c = col
    df = src.df(f"""
        SELECT CASE WHEN COALESCE({c.NUM_CACHED_TOKENS}, 0) > 0 THEN 'hit' ELSE 'miss' END AS "group",
               COUNT(*) AS num_requests, AVG({TTFT_NS}) / 1e6 AS mean_ttft_ms,
               AVG({c.NUM_PROMPT_TOKENS}) AS mean_prompt_tokens,
               AVG({TTFT_NS} / {c.NUM_PROMPT_TOKENS}) / 1e6 AS mean_ttft_per_prompt_token_ms
        FROM {request_table(src)} WHERE {TTFT_NS} IS NOT NULL AND {c.NUM_PROMPT_TOKENS} > 0
        GROUP BY ALL
    """)
    base = pd.DataFrame({"group": ["hit", "miss"]})
    return base.merge(df, on="group", how="left").assign(num_requests=lambda d: d["num_requests"].fillna(0)
                                                         .astype("int64"))


def cache(src: Source) -> CacheReport:
    """Every cache analysis."""
    return CacheReport(prefix_hits(src), tier_hits(src), eviction_churn(src), transfers(src), miss_cost(src))
