"""The report's sections: each asks the run's analyzers one question and keeps the answer.

A section is a title, a sentence and zero or more result tables. When a table
the section needs is missing or empty, or this build has no analyzer for it,
the section says so in its sentence and holds no table: a report is always
complete, never an exception.

Analyzers are reached through the run's ``RunAnalysis`` (:mod:`analyzers.analysis`),
which :mod:`tokentrace.report.model` imports when a report is built.
Calls happen on the caller's thread and may take seconds on large runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pandas as pd

from tokentrace.schema import CACHE_EVENTS, SPANS, STEPS, UNATTRIBUTED_LABEL, Stage, col

__all__ = ["Section", "Context", "SECTION_BUILDERS", "stage_shares"]

_SHARE_COLUMNS = ("ttft_share", "ttft_tail_share", "itl_share", "itl_tail_share")
_STAGE_LABELS = [s.label for s in Stage] + [UNATTRIBUTED_LABEL]


@dataclass(frozen=True, slots=True, eq=False)
class Section:
    """One part of a report: ``key`` is stable (JSON), ``note`` a sentence, ``tables`` (caption, frame)."""

    key: str
    title: str
    note: str = ""
    tables: tuple[tuple[str, pd.DataFrame], ...] = ()


@dataclass(slots=True, eq=False)
class Context:
    """What section builders share: the analysis facade, rows per table, and a result cache."""

    analysis: Any
    rows: dict[str, int]
    num_slowest: int = 10
    bucket_s: float = 1.0  # time-series resolution (queues, latency windows), s
    _cache: dict[str, Any] = field(default_factory=dict)

    def has(self, method: str) -> bool:
        return callable(getattr(self.analysis, method, None))

    def get(self, method: str, **kwargs: Any) -> Any:
        """``analysis.<method>(**kwargs)``, computed once per report."""
        key = method + repr(sorted(kwargs.items()))
        if key not in self._cache:
            self._cache[key] = getattr(self.analysis, method)(**kwargs)
        return self._cache[key]


def _missing(ctx: Context, key: str, title: str, method: str, tables: tuple[str, ...] = ()) -> Section | None:
    """A sentence-only section when ``method`` is unavailable or a needed table has no rows."""
    if not ctx.has(method):
        return Section(key, title, f"Not available: this tokentrace build has no {method} analyzer.")
    empty = [t for t in tables if ctx.rows.get(t, 0) == 0]
    if empty:
        return Section(key, title, f"Not available: the run has no {' or '.join(empty)} rows.")
    return None


def _nonempty(*pairs: tuple[str, Any]) -> tuple[tuple[str, pd.DataFrame], ...]:
    return tuple((c, df) for c, df in pairs if isinstance(df, pd.DataFrame) and len(df))


def latency_section(ctx: Context) -> Section:
    title = "Latency (server view)"
    if (gone := _missing(ctx, "latency", title, "latency")) is not None:
        return gone
    df = ctx.get("latency")
    note = "TTFT, TPOT, ITL and end-to-end latency over every request, in milliseconds."
    if len(df) == 0 or int(df["count"].sum()) == 0:
        return Section("latency", title, "No request produced a token: no latency to report.")
    return Section("latency", title, note, (("", df),))


def slo_section(ctx: Context) -> Section:
    title = "SLO attainment and goodput"
    if (gone := _missing(ctx, "slo", title, "slo")) is not None:
        return gone
    parts = [("Attainment per SLO class (* = all requests)", ctx.get("slo"))]
    if ctx.has("goodput"):
        parts.append(("Goodput: requests per second meeting both TTFT and TPOT targets", ctx.get("goodput")))
    if ctx.has("fluidity"):
        parts.append(("Streaming smoothness (Etalon fluidity-index)", ctx.get("fluidity")))
    tables = _nonempty(*parts)
    if not tables:
        return Section("slo", title, "No request has an SLO class and a first token: nothing to attain.")
    return Section("slo", title, "A request attains its SLO when both its TTFT and its TPOT meet the class's "
                                 "targets.", tables)


def stage_shares(breakdown: pd.DataFrame) -> pd.DataFrame:
    """The stage breakdown without stages that took no time in any column."""
    if len(breakdown) == 0:
        return breakdown
    shares = breakdown[list(_SHARE_COLUMNS)].fillna(0).abs().sum(axis=1)
    return breakdown[shares >= 1e-4].reset_index(drop=True)


def breakdown_section(ctx: Context) -> Section:
    title = "Where the time went: stage breakdown"
    if (gone := _missing(ctx, "stage_breakdown", title, "stage_breakdown", (SPANS.name,))) is not None:
        return gone
    df = stage_shares(ctx.get("stage_breakdown"))
    if len(df) == 0:
        return Section("stage_breakdown", title, "No token has stage spans: no breakdown to report.")
    note = "Each stage's share of TTFT and of ITL, as means and over the slowest 1% of tokens (tail)."
    if ctx.has("unattributed_share"):
        share = float(ctx.get("unattributed_share"))
        note += f" Unattributed time: {share * 100:.3f}% of token latency."
    tables: list[tuple[str, pd.DataFrame]] = [("", df)]
    if ctx.has("critical_path"):
        tables.append(("Critical path of TTFT (median and p99 request)", ctx.get("critical_path")))
    return Section("stage_breakdown", title, note, _nonempty(*tables))


def _top_stages(row: pd.Series, stages: list[str], n: int = 3) -> str:
    times = sorted(((float(row[s]), s) for s in stages if pd.notna(row[s]) and row[s] > 0), reverse=True)
    total = sum(t for t, _ in times)
    if total <= 0:
        return "-"
    return ", ".join(f"{s} {t / total * 100:.0f}%" for t, s in times[:n])


def slowest_section(ctx: Context) -> Section:
    title = f"Slowest {ctx.num_slowest} requests"
    if (gone := _missing(ctx, "slowest_requests", title, "slowest_requests")) is not None:
        return gone
    df = ctx.get("slowest_requests", n=ctx.num_slowest)
    if len(df) == 0:
        return Section("slowest_requests", title, "No finished request to rank.")
    stages = [s for s in _STAGE_LABELS if s in df.columns]
    keep = [c for c in (col.REQUEST_KEY, col.TENANT, col.SLO_CLASS, "ttft_ms", "tpot_ms", "e2e_ms",
                        col.NUM_OUTPUT_TOKENS) if c in df.columns]
    out = df[keep].copy()
    out["top_stages"] = [_top_stages(r, stages) for _, r in df.iterrows()]
    return Section("slowest_requests", title, "Ordered by end-to-end latency; top_stages: where each one's time "
                                              "went.", (("", out),))


def queues_section(ctx: Context) -> Section:
    title = "Queues"
    if (gone := _missing(ctx, "queues", title, "queues", (STEPS.name,))) is not None:
        return gone
    q = ctx.get("queues", bucket_s=ctx.bucket_s)
    tables = _nonempty(("Queueing delay (schedule.queue) per SLO class, ms", q.delay),
                       ("Little's law check per engine instance (L = lambda * W)", q.littles_law))
    if not tables:
        return Section("queues", title, "The run's steps hold no queue lengths to summarize.")
    return Section("queues", title, "Waiting requests over time are charted in the HTML report.", tables)


def cache_section(ctx: Context) -> Section:
    title = "Prefix cache"
    if (gone := _missing(ctx, "cache", title, "cache")) is not None:
        return gone
    c = ctx.get("cache")
    tables = _nonempty(("Prefix hit rate", c.prefix), ("Hit rate per tier", c.tiers),
                       ("Eviction churn", c.churn), ("Swaps, offloads and loads", c.transfers),
                       ("TTFT cost of misses", c.miss_cost))
    if not tables:
        reason = "no cache_events rows" if ctx.rows.get(CACHE_EVENTS.name, 0) == 0 else "no cache activity"
        return Section("cache", title, f"Not available: the run has {reason}.")
    return Section("cache", title, "Hit rates weighted by tokens and by requests; miss cost in TTFT.", tables)


def pd_section(ctx: Context) -> Section:
    title = "Prefill and decode resources"
    if (gone := _missing(ctx, "pd_ratio", title, "pd_ratio", (STEPS.name,))) is not None:
        return gone
    p = ctx.get("pd_ratio")
    tables = _nonempty(("Utilisation per pool", p.pools), ("Queue watermarks per instance", p.watermarks),
                       ("KV transfer share", p.kv_transfer), ("Recommended prefill:decode ratio", p.recommendation))
    return Section("pd_ratio", title, "Busy time of prefill and decode work per instance role.", tables)


def batch_section(ctx: Context) -> Section:
    title = "Batching and interference"
    if (gone := _missing(ctx, "batch", title, "batch", (STEPS.name,))) is not None:
        return gone
    parts = [("Decode step time and ITL by batch size", ctx.get("batch"))]
    if ctx.has("interference"):
        parts.append(("What shared the step of the slowest 1% of tokens, against the median",
                      ctx.get("interference")))
    tables = _nonempty(*parts)
    if not tables:
        return Section("batch", title, "No decode step to bin by batch size.")
    return Section("batch", title, "Steps binned by the number of sequences in the batch.", tables)


def tenants_section(ctx: Context) -> Section:
    title = "Tenants and fairness"
    if (gone := _missing(ctx, "tenants", title, "tenants")) is not None:
        return gone
    t = ctx.get("tenants")
    parts = [("Jain's fairness index (1 = fair)", t.jain), ("Shares per tenant", t.shares)]
    if ctx.has("noisy_neighbours"):
        nn = ctx.get("noisy_neighbours")
        if len(nn) and "flagged" in nn.columns:
            parts.append(("Noisy neighbours (flagged pairs)", nn[nn["flagged"].astype(bool)]))
    tables = _nonempty(*parts)
    if not tables:
        return Section("tenants", title, "No request names a tenant.")
    return Section("tenants", title, "Fairness by requests, by tokens and by compute time.", tables)


def agreement_section(ctx: Context) -> Section:
    title = "Client and server agreement"
    if (gone := _missing(ctx, "agreement", title, "agreement")) is not None:
        return gone
    df = ctx.get("agreement")
    if len(df) == 0 or ("count" in df.columns and int(df["count"].sum()) == 0):
        return Section("agreement", title, "Not available: the run has no client-side (load generator) rows.")
    return Section("agreement", title, "Server minus client latency, ms: how far the server's own timeline "
                                       "disagrees with an independent client.", (("", df),))


SECTION_BUILDERS: tuple[Callable[[Context], Section], ...] = (
    latency_section, slo_section, breakdown_section, slowest_section, queues_section, cache_section,
    pd_section, batch_section, tenants_section, agreement_section,
)
"""Builders in report order (the diff, budgets and counters are added by the model)."""
