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
* Value of a hit (:func:`hit_value`), measured on the stages a hit changes:
  ``cache.lookup``, ``cache.load`` and ``prefill.compute`` (every span of the
  request, on any instance), with queueing (``schedule.queue``) and everything
  else excluded: requests that hit arrive when the cache is warm, often behind a
  burst, so their whole TTFT says more about the queue than about the cache.
  Per group (``hit``: some cached prompt tokens, ``miss``: none): mean lookup,
  load and prefill ms, and ms_per_prompt_token = summed stage time / summed prompt
  tokens. saved_ms_per_hit = what a hit request's prompt would cost at the miss
  rate per prompt token, minus what it cost. Requests without any of those
  spans are not measured (the group's figures are NaN); mean queue and TTFT are
  shown beside, not used.
* Hit rate over time (:func:`hit_rate_over_time`): token- and request-weighted
  hit rates per arrival window.
* Best achievable hit rate: when the run replayed a trace with block hashes
  (Mooncake ``hash_ids``), ``tokentrace bench`` records in the manifest
  (``config.bench.prefix_bound``) the hit rate an unbounded prefix cache would
  get on it, by tokens in whole server blocks (``best_token_hit_rate``) and by
  trace blocks (``best_block_hit_rate``); :func:`prefix_hits` shows it beside the
  measured rate (NaN when the run's trace had no block hashes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import pandas as pd

from analyzers import facts
from analyzers.source import Source
from analyzers.timing import TTFT_NS, request_table, run_bounds
from tokentrace.schema import CacheEventKind, Stage, Tier, col

__all__ = ["CacheReport", "PREFIX_BOUND_KEY", "prefix_bound", "prefix_hits", "tier_hits", "eviction_churn", "transfers",
           "hit_value", "hit_rate_over_time", "cache"]

PREFIX_BOUND_KEY = "prefix_bound"
"""Key, inside the manifest's ``config.bench``, of the best achievable prefix hit rates of the replayed trace."""
_BENCH_KEY = "bench"  # tokentrace.bench.runner.BENCH_CONFIG_KEY (analyzers do not import the application layer)
_HIT_STAGES = (Stage.CACHE_LOOKUP, Stage.CACHE_LOAD, Stage.PREFILL_COMPUTE)
_NUM_WINDOWS = 20  # default hit-rate windows over a run

_TRANSFER_KINDS = (CacheEventKind.SWAP_OUT, CacheEventKind.SWAP_IN, CacheEventKind.OFFLOAD,
                   CacheEventKind.LOAD, CacheEventKind.PREFETCH)


@dataclass(frozen=True, slots=True)
class CacheReport:
    """The cache analyses of one run."""

    prefix: pd.DataFrame
    tiers: pd.DataFrame
    churn: pd.DataFrame
    transfers: pd.DataFrame
    hit_value: pd.DataFrame
    hit_rate_over_time: pd.DataFrame


def _tier_label(t: object) -> str:
    return Tier(int(t)).label if t is not None and not pd.isna(t) and int(t) >= 0 else "none"


def prefix_bound(manifest: Mapping[str, Any]) -> dict[str, float]:
    """The best achievable hit rates the bench recorded for the run's trace (empty when none was)."""
    config = manifest.get("config") if isinstance(manifest, Mapping) else None
    bench = config.get(_BENCH_KEY) if isinstance(config, Mapping) else None
    bound = bench.get(PREFIX_BOUND_KEY) if isinstance(bench, Mapping) else None
    if not isinstance(bound, Mapping):
        return {}
    out = {}
    for key in ("best_token_hit_rate", "best_block_hit_rate"):
        value = bound.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[key] = float(value)
    return out


def prefix_hits(src: Source) -> pd.DataFrame:
    """One row: num_requests, prompt_tokens, cached_tokens, token_hit_rate, request_hit_rate,
    best_token_hit_rate, best_block_hit_rate (NaN unless the bench recorded the trace's bound).

    The rates are over the requests whose cached-token count was reported: a server that does
    not report it (a vLLM without the cache attribute on its spans) gets NaN rates, "not
    measured", not a 0% hit rate.
    """
    c = col
    df = src.df(f"""
        SELECT COUNT(*) AS num_requests, SUM({c.NUM_PROMPT_TOKENS}) AS prompt_tokens,
               SUM({c.NUM_PROMPT_TOKENS}) FILTER (WHERE {c.NUM_CACHED_TOKENS} IS NOT NULL) AS reported_prompt_tokens,
               SUM({c.NUM_CACHED_TOKENS}) AS cached_tokens,
               AVG(CASE WHEN {c.NUM_CACHED_TOKENS} > 0 THEN 1.0 ELSE 0.0 END)
                   FILTER (WHERE {c.NUM_CACHED_TOKENS} IS NOT NULL) AS request_hit_rate
        FROM {request_table(src)} WHERE {c.NUM_PROMPT_TOKENS} > 0
    """)
    df["prompt_tokens"] = df["prompt_tokens"].fillna(0).astype("int64")
    df["cached_tokens"] = df["cached_tokens"].fillna(0).astype("int64")
    reported = df["reported_prompt_tokens"].astype("float64")
    df["token_hit_rate"] = df["cached_tokens"] / reported.where(reported > 0)
    bound = prefix_bound(src.manifest)
    for key in ("best_token_hit_rate", "best_block_hit_rate"):
        df[key] = bound.get(key, math.nan)
    return df[["num_requests", "prompt_tokens", "cached_tokens", "token_hit_rate", "request_hit_rate",
               "best_token_hit_rate", "best_block_hit_rate"]]


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
        lo, hi = src.fetchone(f"SELECT MIN({col.START_NS}), MAX({col.END_NS}) FROM cache_events")
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


def _per_request_stage_sql(src: Source, derived: str, lookup: int, load: int, prefill: int, queue: int) -> str:
    """``hit_value``'s per-request stage times (lookup_ns, load_ns, prefill_ns, queue_ns, measured) from the run's
    derived per-request stage sums (:mod:`analyzers.facts`): one row per request with spans, as from the spans."""
    combos, _ = facts.request_stage_layout(src, derived)

    def total(stage: int) -> str:
        names = [name for st, _, name in combos if st == stage]
        return " + ".join(f"COALESCE(w.{name}, 0)" for name in names) or "0"

    present = " OR ".join(f"w.{name} IS NOT NULL" for st, _, name in combos if st in (lookup, load, prefill))
    return (f"SELECT w.{col.REQUEST_ID}, {total(lookup)} AS lookup_ns, {total(load)} AS load_ns, "
            f"{total(prefill)} AS prefill_ns, {total(queue)} AS queue_ns, ({present or 'false'}) AS measured "
            f"FROM {derived} w")


def hit_value(src: Source) -> pd.DataFrame:
    """Rows ``hit`` and ``miss`` (module doc): num_requests, num_measured, mean_prompt_tokens, mean_cached_tokens,
    lookup_ms, load_ms, prefill_ms (means per measured request), ms_per_prompt_token, saved_ms_per_hit (hit
    row), and for context only mean_queue_ms and mean_ttft_ms. Requests with a positive prompt length."""
    c = col
    lookup, load, prefill = (int(s) for s in _HIT_STAGES)
    queue = int(Stage.SCHEDULE_QUEUE)
    derived = facts.view(src, "request_stage_ns")
    per_sql = _per_request_stage_sql(src, derived, lookup, load, prefill, queue) if derived is not None else f"""
            SELECT {c.REQUEST_ID},
                   SUM(CASE WHEN {c.STAGE} = {lookup} THEN {c.END_NS} - {c.START_NS} ELSE 0 END) AS lookup_ns,
                   SUM(CASE WHEN {c.STAGE} = {load} THEN {c.END_NS} - {c.START_NS} ELSE 0 END) AS load_ns,
                   SUM(CASE WHEN {c.STAGE} = {prefill} THEN {c.END_NS} - {c.START_NS} ELSE 0 END) AS prefill_ns,
                   SUM(CASE WHEN {c.STAGE} = {queue} THEN {c.END_NS} - {c.START_NS} ELSE 0 END) AS queue_ns,
                   BOOL_OR({c.STAGE} IN ({lookup}, {load}, {prefill})) AS measured
            FROM srv_spans GROUP BY {c.REQUEST_ID}"""
    df = src.df(f"""
        WITH per AS ({per_sql}
        ), r AS (
            SELECT CASE WHEN COALESCE(f.{c.NUM_CACHED_TOKENS}, 0) > 0 THEN 'hit' ELSE 'miss' END AS "group",
                   f.{c.NUM_PROMPT_TOKENS} AS prompt, COALESCE(f.{c.NUM_CACHED_TOKENS}, 0) AS cached,
                   f.{TTFT_NS} AS ttft, p.*
            FROM {request_table(src)} f LEFT JOIN per p USING ({c.REQUEST_ID})
            WHERE f.{c.NUM_PROMPT_TOKENS} > 0
        )
        SELECT "group", COUNT(*) AS num_requests, COUNT(*) FILTER (WHERE measured) AS num_measured,
               AVG(prompt) AS mean_prompt_tokens, AVG(cached) AS mean_cached_tokens,
               AVG(lookup_ns) FILTER (WHERE measured) / 1e6 AS lookup_ms,
               AVG(load_ns) FILTER (WHERE measured) / 1e6 AS load_ms,
               AVG(prefill_ns) FILTER (WHERE measured) / 1e6 AS prefill_ms,
               SUM(lookup_ns + load_ns + prefill_ns) FILTER (WHERE measured)::DOUBLE
                   / SUM(prompt) FILTER (WHERE measured) / 1e6 AS ms_per_prompt_token,
               AVG(prompt) FILTER (WHERE measured) AS measured_prompt_tokens,
               AVG(queue_ns) FILTER (WHERE measured) / 1e6 AS mean_queue_ms,
               AVG(ttft) / 1e6 AS mean_ttft_ms
        FROM r GROUP BY "group"
    """)
    base = pd.DataFrame({"group": ["hit", "miss"]})
    out = base.merge(df, on="group", how="left")
    out["num_requests"] = out["num_requests"].fillna(0).astype("int64")
    out["num_measured"] = out["num_measured"].fillna(0).astype("int64")
    per_token = out.set_index("group")["ms_per_prompt_token"]
    hit = out["group"] == "hit"
    hit_cost = out["lookup_ms"] + out["load_ms"] + out["prefill_ms"]
    out["saved_ms_per_hit"] = (per_token.get("miss", math.nan) * out["measured_prompt_tokens"] - hit_cost).where(hit)
    return out[["group", "num_requests", "num_measured", "mean_prompt_tokens", "mean_cached_tokens", "lookup_ms",
                "load_ms", "prefill_ms", "ms_per_prompt_token", "saved_ms_per_hit", "mean_queue_ms", "mean_ttft_ms"]]


def hit_rate_over_time(src: Source, *, window_s: float | None = None) -> pd.DataFrame:
    """Per arrival window: window_start_s, num_requests, prompt_tokens, cached_tokens, token_hit_rate,
    request_hit_rate. ``window_s`` defaults to a twentieth of the run (at least 1 ms)."""
    if window_s is not None and not (isinstance(window_s, (int, float)) and math.isfinite(window_s) and window_s > 0):
        raise ValueError(f"window_s must be a positive number of seconds, got {window_s!r}")
    c = col
    b = run_bounds(src)
    cols = ["window_start_s", "num_requests", "prompt_tokens", "cached_tokens", "token_hit_rate", "request_hit_rate"]
    if b is None:
        return pd.DataFrame(columns=cols)
    w_ns = int(window_s * 1e9) if window_s else max(1_000_000, (b[1] - b[0]) // _NUM_WINDOWS)
    df = src.df(f"""
        SELECT FLOOR(({c.ARRIVAL_NS} - {b[0]}) / {w_ns}) * {w_ns / 1e9} AS window_start_s, COUNT(*) AS num_requests,
               SUM({c.NUM_PROMPT_TOKENS})::BIGINT AS prompt_tokens,
               SUM(COALESCE({c.NUM_CACHED_TOKENS}, 0))::BIGINT AS cached_tokens,
               AVG(CASE WHEN COALESCE({c.NUM_CACHED_TOKENS}, 0) > 0 THEN 1.0 ELSE 0.0 END) AS request_hit_rate
        FROM {request_table(src)} WHERE {c.NUM_PROMPT_TOKENS} > 0 AND {c.ARRIVAL_NS} IS NOT NULL
        GROUP BY ALL ORDER BY window_start_s
    """)
    df["token_hit_rate"] = df["cached_tokens"] / df["prompt_tokens"].where(df["prompt_tokens"] > 0)
    return df[cols]


def cache(src: Source) -> CacheReport:
    """Every cache analysis."""
    return CacheReport(prefix_hits(src), tier_hits(src), eviction_churn(src), transfers(src), hit_value(src),
                       hit_rate_over_time(src))
