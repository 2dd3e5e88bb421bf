"""KV cache: prefix hit rates, per-tier hits, eviction churn, tier transfers, cost of misses.

* Token-weighted prefix hit rate = sum of cached prompt tokens / sum of prompt
  tokens (``requests.num_cached_tokens`` / ``num_prompt_tokens``); request-weighted
  = share of requests with at least one cached token. Requests with a known,
  positive prompt length only.
* Per tier: a *lookup* is one prefix match (the HIT and MISS events sharing
  instance, request and start time); a request's first only (a resumed request
  looks up again and finds its own blocks; its cached-token count is the first's). lookup_hit_rate(tier) = lookups that hit
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
  request, on any instance, counted in the request's token intervals as the stage
  breakdown counts it, so the stage times compare with the TTFT beside them:
  :data:`analyzers.stage_breakdown.REQUEST_STAGE_NS`), with queueing (``schedule.queue``) and everything
  else excluded: requests that hit arrive when the cache is warm, often behind a
  burst, so their whole TTFT says more about the queue than about the cache.
  Per group (``hit``: some cached prompt tokens, ``miss``: none): mean lookup,
  load and prefill ms, and ms_per_prompt_token = summed stage time / summed prompt
  tokens. saved_ms_per_hit = what a hit request's prompt would cost at the miss
  rate per prompt token, minus what it cost. Requests without any of those
  spans are not measured (the group's figures are NaN); mean queue and TTFT are
  shown beside. Under load the same stages take longer (a prefill shares its step),
  so the misses compared are those that queued about as long as the hits: within
  ``QUEUE_FACTOR`` of the hits' median ``schedule.queue`` time, give or take
  ``QUEUE_SLACK_NS``; with fewer than ``MIN_VALUE_REQUESTS`` compared hits or
  misses the value is not measured, and ``value_note`` (hit row) says what is missing.
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

from analyzers.groups import check_window_s
from analyzers.source import Source
from analyzers.stage_breakdown import request_stage_ns
from analyzers.timing import TTFT_NS, request_table, run_bounds
from tokentrace.schema import CacheEventKind, Stage, Tier, col

__all__ = ["CacheReport", "PREFIX_BOUND_KEY", "prefix_bound", "prefix_hits", "tier_hits", "eviction_churn", "transfers",
           "hit_value", "hit_rate_over_time", "cache"]

PREFIX_BOUND_KEY = "prefix_bound"
"""Key, inside the manifest's ``config.bench``, of the best achievable prefix hit rates of the replayed trace."""
_BENCH_KEY = "bench"  # tokentrace.app.bench.runner.BENCH_CONFIG_KEY (analyzers do not import the application layer)
_HIT_STAGES = (Stage.CACHE_LOOKUP, Stage.CACHE_LOAD, Stage.PREFILL_COMPUTE)
_NUM_WINDOWS = 20  # default hit-rate windows over a run
MIN_VALUE_REQUESTS = 5  # fewer compared hits or misses than this: the value of a hit is not measured
QUEUE_FACTOR = 2  # a miss is compared with the hits when it queued within this factor of the hits' median...
QUEUE_SLACK_NS = 5_000_000  # ...give or take 5 ms (queues near zero)

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
    """Per tier: tier, num_lookups, num_lookups_hit, lookup_hit_rate, hit_blocks, share_of_hit_blocks.

    Each request's first lookup only (events without a request count each): the one whose cached tokens the
    request reports, so that these rates and the token hit rate describe the same lookups. A request looks up
    again when it is resumed after a preemption, and then finds its own blocks."""
    c = col
    hit, miss = int(CacheEventKind.HIT), int(CacheEventKind.MISS)
    lookup = f"{c.INSTANCE_ID}, {c.REQUEST_ID}, {c.START_NS}"
    df = src.df(f"""
        WITH every_lookup AS (SELECT * FROM cache_events WHERE {c.KIND} IN ({hit}, {miss})),
        first_lookup AS (
            SELECT DISTINCT {lookup} FROM every_lookup WHERE COALESCE({c.REQUEST_ID}, -1) < 0
            UNION ALL
            SELECT {lookup} FROM (SELECT DISTINCT {lookup} FROM every_lookup WHERE {c.REQUEST_ID} >= 0)
            QUALIFY ROW_NUMBER() OVER (PARTITION BY {c.REQUEST_ID} ORDER BY {c.START_NS}, {c.INSTANCE_ID}) = 1
        ),
        ev AS (SELECT e.* FROM every_lookup e SEMI JOIN first_lookup f
               ON e.{c.INSTANCE_ID} IS NOT DISTINCT FROM f.{c.INSTANCE_ID}
              AND e.{c.REQUEST_ID} IS NOT DISTINCT FROM f.{c.REQUEST_ID} AND e.{c.START_NS} = f.{c.START_NS}),
        lookups AS (SELECT COUNT(*) AS n FROM first_lookup)
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


def hit_value(src: Source) -> pd.DataFrame:
    """Rows ``hit`` and ``miss`` (module doc): num_requests, num_measured, mean_prompt_tokens, mean_cached_tokens,
    num_compared, lookup_ms, load_ms, prefill_ms (means per compared request), ms_per_prompt_token, saved_ms_per_hit
    (hit row; NaN when not measured), mean_queue_ms and mean_ttft_ms (for context), value_note (hit row: why the
    value is not measured, "" when it is). Requests with a positive prompt length."""
    c = col
    lookup, load, prefill = (int(s) for s in _HIT_STAGES)
    queue = int(Stage.SCHEDULE_QUEUE)
    stage_ns = (lambda stage: f"SUM(CASE WHEN {c.STAGE} = {stage} THEN ns ELSE 0 END)")
    per_sql = f"""
            SELECT {c.REQUEST_ID}, {stage_ns(lookup)} AS lookup_ns, {stage_ns(load)} AS load_ns,
                   {stage_ns(prefill)} AS prefill_ns, {stage_ns(queue)} AS queue_ns,
                   BOOL_OR({c.STAGE} IN ({lookup}, {load}, {prefill})) AS measured
            FROM {request_stage_ns(src)} GROUP BY {c.REQUEST_ID}"""
    # The misses compared with the hits are those that queued about as long as the hits did (module doc).
    df = src.df(f"""
        WITH per AS ({per_sql}
        ), r AS (
            SELECT CASE WHEN COALESCE(f.{c.NUM_CACHED_TOKENS}, 0) > 0 THEN 'hit' ELSE 'miss' END AS "group",
                   f.{c.NUM_PROMPT_TOKENS} AS prompt, COALESCE(f.{c.NUM_CACHED_TOKENS}, 0) AS cached,
                   f.{TTFT_NS} AS ttft, p.*
            FROM {request_table(src)} f LEFT JOIN per p USING ({c.REQUEST_ID})
            WHERE f.{c.NUM_PROMPT_TOKENS} > 0
        ), ref AS (
            SELECT quantile_cont(queue_ns, 0.5) AS q FROM r WHERE "group" = 'hit' AND measured
        ), k AS (
            SELECT r.*, COALESCE(measured AND ("group" = 'hit' OR queue_ns BETWEEN ref.q / {QUEUE_FACTOR} - {QUEUE_SLACK_NS}
                                                                  AND ref.q * {QUEUE_FACTOR} + {QUEUE_SLACK_NS}), false)
                        AS compared
            FROM r, ref
        )
        SELECT "group", COUNT(*) AS num_requests, COUNT(*) FILTER (WHERE measured) AS num_measured,
               COUNT(*) FILTER (WHERE compared) AS num_compared,
               AVG(prompt) AS mean_prompt_tokens, AVG(cached) AS mean_cached_tokens,
               AVG(lookup_ns) FILTER (WHERE compared) / 1e6 AS lookup_ms,
               AVG(load_ns) FILTER (WHERE compared) / 1e6 AS load_ms,
               AVG(prefill_ns) FILTER (WHERE compared) / 1e6 AS prefill_ms,
               SUM(lookup_ns + load_ns + prefill_ns) FILTER (WHERE compared)::DOUBLE
                   / SUM(prompt) FILTER (WHERE compared) / 1e6 AS ms_per_prompt_token,
               AVG(prompt) FILTER (WHERE compared) AS compared_prompt_tokens,
               AVG(queue_ns) FILTER (WHERE measured) / 1e6 AS mean_queue_ms,
               AVG(ttft) / 1e6 AS mean_ttft_ms
        FROM k GROUP BY "group"
    """)
    base = pd.DataFrame({"group": ["hit", "miss"]})
    out = base.merge(df, on="group", how="left")
    for column in ("num_requests", "num_measured", "num_compared"):
        out[column] = out[column].fillna(0).astype("int64")
    g = out.set_index("group")
    note = _value_note(g)
    hit = out["group"] == "hit"
    hit_cost = out["lookup_ms"] + out["load_ms"] + out["prefill_ms"]
    saved = g.loc["miss", "ms_per_prompt_token"] * out["compared_prompt_tokens"] - hit_cost
    out["saved_ms_per_hit"] = saved.where(hit & (note == ""))
    out["value_note"] = [note if h else "" for h in hit]
    return out[["group", "num_requests", "num_measured", "num_compared", "mean_prompt_tokens", "mean_cached_tokens",
                "lookup_ms", "load_ms", "prefill_ms", "ms_per_prompt_token", "saved_ms_per_hit", "mean_queue_ms",
                "mean_ttft_ms", "value_note"]]


def _value_note(g: pd.DataFrame) -> str:
    """Why the value of a hit is not measured ("" when it is): the first thing missing (module doc)."""
    hits, misses = g.loc["hit"], g.loc["miss"]
    n_hit, n_miss, n_miss_measured = int(hits["num_compared"]), int(misses["num_compared"]), int(misses["num_measured"])
    if hits["num_requests"] == 0:
        return "no request hit the prefix cache"
    if hits["num_measured"] == 0:
        return "no request that hit has cache.lookup, cache.load or prefill.compute spans"
    if misses["num_measured"] == 0:
        return "no request missed the prefix cache to compare with (with spans)"
    if n_hit < MIN_VALUE_REQUESTS:
        return f"only {n_hit} request(s) hit (at least {MIN_VALUE_REQUESTS} are needed)"
    if n_miss < MIN_VALUE_REQUESTS:
        return (f"only {n_miss} of {n_miss_measured} request(s) that missed queued about as long "
                f"as the hits (the hits queued {float(hits['mean_queue_ms']):,.1f} ms on average; at least "
                f"{MIN_VALUE_REQUESTS} are needed): under another load the stages a hit changes take another time")
    return ""


def hit_rate_over_time(src: Source, *, window_s: float | None = None) -> pd.DataFrame:
    """Per arrival window: window_start_s, num_requests, prompt_tokens, cached_tokens, token_hit_rate,
    request_hit_rate. ``window_s`` defaults to a twentieth of the run (at least 1 ms)."""
    check_window_s(window_s)
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
