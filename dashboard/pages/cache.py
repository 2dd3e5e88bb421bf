"""Cache: prefix hit rates, per-tier hits, eviction churn, KV transfers and what a miss costs."""

from __future__ import annotations

from typing import Any

import dash

from dashboard.components.controls import run_picker
from dashboard.components.explanations import EXPLAIN
from dashboard.components.figures import bars, bars_row, explained, fmt, graph_or_notice, kpis
from dashboard.components.shell import ViewQuery, live_callback, notice, page
from dashboard.data import DataSource

PATH = "/cache"
dash.register_page(__name__, path=PATH, name="Cache", title="tokentrace · cache")


def _prefix(frame: Any) -> Any:
    if len(frame) == 0:
        return notice("No requests with prompt lengths in this run.")
    row = frame.iloc[0]
    return kpis([("token hit rate", fmt(100 * row["token_hit_rate"], "%")),
                 ("request hit rate", fmt(100 * row["request_hit_rate"], "%")),
                 ("cached tokens", fmt(int(row["cached_tokens"]))),
                 ("prompt tokens", fmt(int(row["prompt_tokens"])))], kpi_id="cache-kpis")


def body(src: DataSource, q: ViewQuery) -> list[Any]:
    """Cache analyses of run ``q.run``."""
    rid = src.resolve(q.run)
    rep = src.result(rid, "cache")
    tiers = graph_or_notice(rep.tiers, "cache-tiers", lambda f: bars(
        f, "tier", ["lookup_hit_rate", "share_of_hit_blocks"], title="Hits per KV tier", yaxis="share"),
        "No cache lookups were recorded in this run.")
    churn = bars_row(rep.churn, "tier", [("evicted_blocks_per_s", "Evicted blocks per second", "blocks/s"),
                                         ("reload_ratio", "Evicted blocks loaded back", "ratio")],
                     "cache-churn", "No evictions were recorded in this run.")
    transfers = graph_or_notice(rep.transfers, "cache-transfers", lambda f: bars(
        f.assign(what=f["kind"].astype(str) + " · " + f["tier"].astype(str)), "what", ["bytes"],
        title="KV bytes moved", yaxis="bytes"), "No swaps, offloads, loads or prefetches in this run.")
    miss = bars_row(rep.miss_cost, "group", [("mean_ttft_ms", "Mean TTFT", "ms"),
                                             ("mean_ttft_per_prompt_token_ms", "Mean TTFT per prompt token", "ms")],
                    "cache-miss-cost", "No requests to compare.")
    return [explained("Prefix cache", EXPLAIN["cache_prefix"], _prefix(rep.prefix)),
            explained("Tiers", EXPLAIN["cache_tiers"], tiers),
            explained("Churn", EXPLAIN["cache_churn"], churn),
            explained("Transfers", EXPLAIN["cache_transfers"], transfers),
            explained("Cost of a miss", EXPLAIN["cache_miss_cost"], miss)]


def controls(src: DataSource, q: ViewQuery) -> list[Any]:
    return [run_picker(src, q.run)]


def layout(**query: str) -> Any:
    return page(PATH, "Cache", query, body, controls)


live_callback(PATH, body)
