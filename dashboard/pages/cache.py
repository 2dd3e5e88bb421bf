"""Cache: prefix hit rates beside the best achievable, hit rate over time, what a hit saves on the stages it
changes, per-tier hits, eviction churn and KV transfers."""

from __future__ import annotations

import math
from typing import Any

import dash
import pandas as pd

from analyzers.analysis import RunAnalysis
from dashboard.components.controls import run_picker
from dashboard.components.explanations import EXPLAIN
from dashboard.components.figures import bars, bars_row, explained, fmt, graph_or_notice, kpis, lines
from dashboard.components.shell import ViewQuery, live_callback, notice, page
from dashboard.data import DataSource

PATH = "/cache"
dash.register_page(__name__, path=PATH, name="Cache", title="tokentrace · cache")


def _pct(value: Any) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt(100 * value, "%")


def _prefix(frame: Any) -> Any:
    if len(frame) == 0:
        return notice("No requests with prompt lengths in this run.")
    row = frame.iloc[0]
    best = row["best_token_hit_rate"]
    return kpis([("token hit rate", _pct(row["token_hit_rate"])),
                 ("best achievable on the trace", "not recorded" if pd.isna(best) else _pct(best)),
                 ("request hit rate", _pct(row["request_hit_rate"])),
                 ("cached tokens", fmt(int(row["cached_tokens"]))),
                 ("prompt tokens", fmt(int(row["prompt_tokens"])))], kpi_id="cache-kpis")


def _over_time(frame: pd.DataFrame, best: float) -> Any:
    def build(f: pd.DataFrame) -> Any:
        fig = lines(f, "window_start_s", ["token_hit_rate", "request_hit_rate"], title="Hit rate per arrival window",
                    xaxis="s since the run started", yaxis="share")
        if math.isfinite(best):
            fig.add_hline(y=best, line_dash="dash", annotation_text=f"best achievable {best:.1%}")
        return fig
    return graph_or_notice(frame, "cache-hit-rate-time", build, "No requests with prompt lengths in this run.")


def _hit_value(frame: pd.DataFrame) -> list[Any]:
    hv = frame.set_index("group")
    if hv["ms_per_prompt_token"].isna().all():
        return [notice("Not measured: no request has cache.lookup, cache.load or prefill.compute spans.")]
    parts = []
    saved = hv.loc["hit", "saved_ms_per_hit"] if "hit" in hv.index else math.nan
    if pd.notna(saved):
        parts.append(kpis([("saved per hit", fmt(float(saved), "ms", 2)),
                           ("hit: ms per prompt token", fmt(float(hv.loc["hit", "ms_per_prompt_token"]), "ms", 4)),
                           ("miss: ms per prompt token", fmt(float(hv.loc["miss", "ms_per_prompt_token"]), "ms", 4))],
                          kpi_id="cache-hit-value-kpis"))
    else:
        parts.append(notice("No request hit and missed both: no saving to measure."))
    parts.append(bars_row(frame.dropna(subset=["ms_per_prompt_token"]), "group", [
        ("ms_per_prompt_token", "Lookup + load + prefill per prompt token", "ms"),
        ("mean_queue_ms", "Mean queueing (not counted)", "ms")], "cache-hit-value", "No requests to compare."))
    return parts


def body(src: DataSource, q: ViewQuery) -> list[Any]:
    """Cache analyses of run ``q.run``."""
    rid = src.resolve(q.run)
    rep = src.result(rid, RunAnalysis.cache)
    best = float(rep.prefix.iloc[0]["best_token_hit_rate"]) if len(rep.prefix) else math.nan
    tiers = graph_or_notice(rep.tiers, "cache-tiers", lambda f: bars(
        f, "tier", ["lookup_hit_rate", "share_of_hit_blocks"], title="Hits per KV tier", yaxis="share"),
        "No cache lookups were recorded in this run.")
    churn = bars_row(rep.churn, "tier", [("evicted_blocks_per_s", "Evicted blocks per second", "blocks/s"),
                                         ("reload_ratio", "Evicted blocks loaded back", "ratio")],
                     "cache-churn", "No evictions were recorded in this run.")
    transfers = graph_or_notice(rep.transfers, "cache-transfers", lambda f: bars(
        f.assign(what=f["kind"].astype(str) + " · " + f["tier"].astype(str), mib=f["bytes"] / 2**20), "what",
        ["mib"], names=["KV moved (MiB)"], title="KV blocks moved between tiers", yaxis="MiB"),
        "No swaps, offloads, loads or prefetches in this run.")
    return [explained("Prefix cache", EXPLAIN["cache_prefix"], _prefix(rep.prefix)),
            explained("Hit rate over time", EXPLAIN["cache_hit_rate_time"], _over_time(rep.hit_rate_over_time, best)),
            explained("What a hit saves", EXPLAIN["cache_hit_value"], *_hit_value(rep.hit_value)),
            explained("Tiers", EXPLAIN["cache_tiers"], tiers),
            explained("Churn", EXPLAIN["cache_churn"], churn),
            explained("Transfers", EXPLAIN["cache_transfers"], transfers)]


def controls(src: DataSource, q: ViewQuery) -> list[Any]:
    return [run_picker(src, q.run)]


def layout(**query: str) -> Any:
    return page(PATH, "Cache", query, body, controls)


live_callback(PATH, body)
