"""Tenants and fairness: latency per tenant, shares of requests, tokens and compute, Jain's index, noisy neighbours."""

from __future__ import annotations

from typing import Any

import dash

from analyzers.analysis import RunAnalysis
from dashboard.components.controls import run_picker
from dashboard.components.explanations import EXPLAIN
from dashboard.components.figures import bars, explained, graph_or_notice, table
from dashboard.components.shell import ViewQuery, live_callback, notice, page
from dashboard.data import DataSource
from tokentrace.schema import col

_NOISY_COLUMNS = ["aggressor", "victim", "flagged", "effect_ms", "p_value", "p_adjusted", "num_windows",
                  "num_burst_windows", "num_victim_burst", "num_victim_normal", "victim_mean_burst_ms",
                  "victim_mean_normal_ms", "enough_data"]
_MAX_BARS = 50  # tenants drawn per chart; with more, the ones with the most requests
PATH = "/tenants"
dash.register_page(__name__, path=PATH, name="Tenants", title="tokentrace · tenants and fairness")


def body(src: DataSource, q: ViewQuery) -> list[Any]:
    """Tenant analyses of run ``q.run``."""
    rid = src.resolve(q.run)
    rep = src.result(rid, RunAnalysis.tenants)
    lat = rep.latency
    ttft = lat[lat["metric"] == "ttft"] if len(lat) else lat
    heaviest = rep.shares
    if len(rep.shares) > _MAX_BARS:  # thousands of API keys: draw the heaviest (in name order), say so
        names = rep.shares.nlargest(_MAX_BARS, "num_requests", keep="first")[col.TENANT]
        heaviest = rep.shares[rep.shares[col.TENANT].isin(names)]
        ttft = ttft[ttft[col.TENANT].isin(names)]
    latency = graph_or_notice(ttft, "tenants-latency", lambda f: bars(
        f, col.TENANT, ["p50_ms", "p90_ms", "p99_ms"], title=_title("TTFT per tenant", len(rep.shares)), yaxis="ms"),
        "No requests with a first token in this run.")
    shares = graph_or_notice(heaviest, "tenants-shares", lambda f: bars(
        f, col.TENANT, ["request_share", "token_share", "compute_share"],
        title=_title("Shares per tenant", len(rep.shares)), yaxis="share"),
        "No tenants in this run.")
    jain = graph_or_notice(rep.jain, "tenants-jain", lambda f: bars(
        f, "basis", ["jain_index"], title="Jain's fairness index", yaxis="J (1 = fair)"), "No tenants in this run.")
    noisy = src.result(rid, RunAnalysis.noisy_neighbours)
    if len(noisy):
        judged = int(noisy["enough_data"].astype(bool).sum())
        total, k = noisy.attrs.get("num_pairs", len(noisy)), noisy.attrs.get("top_k")
        tested = (f" {len(noisy):,} of the {total:,} ordered pairs tested: the {k} likeliest aggressors against the "
                  f"{k} best-judged victims." if isinstance(total, int) and total > len(noisy) else "")
        summary = dash.html.P(f"{int(noisy['flagged'].astype(bool).sum())} of {len(noisy)} pair(s) flagged; "
                              f"{judged} with enough data to judge.{tested}", id="tenants-noisy-summary")
        noisy_part: Any = dash.html.Div([summary, table(noisy[_NOISY_COLUMNS], "tenants-noisy", highlight="flagged")])
    else:
        noisy_part = notice("Fewer than two tenants or time windows: no neighbours to compare.")
    return [explained("Latency per tenant", EXPLAIN["tenant_latency"], latency),
            explained("Shares", EXPLAIN["tenant_shares"], shares),
            explained("Fairness", EXPLAIN["jain"], jain),
            explained("Noisy neighbours", EXPLAIN["noisy"], noisy_part)]


def _title(what: str, num_tenants: int) -> str:
    if num_tenants <= _MAX_BARS:
        return what
    return f"{what}: the {_MAX_BARS} of {num_tenants:,} tenants with the most requests"


def controls(src: DataSource, q: ViewQuery) -> list[Any]:
    return [run_picker(src, q.run)]


def layout(**query: str) -> Any:
    return page(PATH, "Tenants and fairness", query, body, controls)


live_callback(PATH, body)
