"""The report's sections: each asks the run's analyzers one question and keeps the answer.

A section is a title, a sentence and zero or more result tables. When a table
the section needs is missing or empty, or this build has no analyzer for it,
the section says so in its sentence and holds no table: a report is always
complete, never an exception.

Analyzers are reached through the run's ``RunAnalysis`` (:mod:`analyzers.analysis`),
which :mod:`tokentrace.app.report.model` imports when a report is built.
Calls happen on the caller's thread and may take seconds on large runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pandas as pd

from analyzers.loop_lag import BLOCKING, CAUSE_MS, OTHER_THREADS, STARVED
from tokentrace.app.report.headline import (
    advice_sentence,
    attribution_sentence,
    failed_sentence,
    hidden_stages_sentence,
    load_sentence,
    slo_not_measured,
)
from tokentrace.app.report.sessions import session_sentences, session_tables
from tokentrace.app.report.speculative import NO_SPECULATION, speculation_sentences, speculation_tables
from tokentrace.schema import CACHE_EVENTS, SPANS, SPEC_STEPS, STEPS, UNATTRIBUTED_LABEL, Role, Stage, col

__all__ = ["Section", "Context", "SECTION_BUILDERS", "stage_shares", "hidden_stages", "HIDDEN_SHARE"]

_SHARE_COLUMNS = ("ttft_share", "ttft_tail_share", "itl_share", "itl_tail_share")
HIDDEN_SHARE = 1e-4  # a stage under 0.01% of every share column is left out of a breakdown table, and said so
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
    title = "Latency (client view: no server lane)" if ctx.analysis.source.client_lane_only else "Latency (server view)"
    if (gone := _missing(ctx, "latency", title, "latency")) is not None:
        return gone
    df = ctx.get("latency")
    note = ("TTFT, TPOT, ITL and end-to-end latency over every request, in milliseconds. TTFT runs from the "
            "request's arrival (its first bytes at the server, when the transport tells) to the first chunk with "
            "visible text, as AIPerf and vllm bench count it; TPOT is the rest of the stream over the other tokens.")
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
    slo = ctx.get("slo")
    note = " ".join(x for x in ["A request attains its SLO when it was served and both its TTFT and its TPOT "
                                "meet the class's targets.", failed_sentence(slo), *slo_not_measured(slo)] if x)
    return Section("slo", title, note, tables)


def _is_small(breakdown: pd.DataFrame) -> pd.Series:
    """Rows whose every share column is under :data:`HIDDEN_SHARE` (``unattributed`` is always shown)."""
    shares = breakdown[list(_SHARE_COLUMNS)].fillna(0).abs().max(axis=1)
    return (shares < HIDDEN_SHARE) & (breakdown["stage"] != UNATTRIBUTED_LABEL)


def stage_shares(breakdown: pd.DataFrame) -> pd.DataFrame:
    """The stage breakdown without the stages under 0.01% in every column (:func:`hidden_stages` names them)."""
    if len(breakdown) == 0:
        return breakdown
    return breakdown[~_is_small(breakdown)].reset_index(drop=True)


def hidden_stages(breakdown: pd.DataFrame) -> list[str]:
    """The stages :func:`stage_shares` leaves out, in breakdown order."""
    if len(breakdown) == 0:
        return []
    return [str(s) for s in dict.fromkeys(breakdown.loc[_is_small(breakdown), "stage"])]


def breakdown_section(ctx: Context) -> Section:
    title = "Where the time went: stage breakdown"
    if (gone := _missing(ctx, "stage_breakdown", title, "stage_breakdown", (SPANS.name,))) is not None:
        return gone
    full = ctx.get("stage_breakdown")
    df = stage_shares(full)
    if len(df) == 0:
        return Section("stage_breakdown", title, "No token has stage spans: no breakdown to report.")
    note = "Each stage's share of TTFT and of ITL, as means and over the slowest 1% of tokens (tail)."
    hidden = hidden_stages_sentence(hidden_stages(full))
    if hidden:
        note += " " + hidden
    attribution = ctx.get("attribution") if ctx.has("attribution") else None
    if attribution is not None:
        note += " " + attribution_sentence(attribution)
    tables: list[tuple[str, pd.DataFrame]] = [("", df)]
    if attribution is not None:
        tables.append(("Attribution: unattributed (signed) and overlap (double-counted) shares", attribution))
    if ctx.has("critical_path"):
        tables.append(("Critical path of TTFT (median and p99 request)", ctx.get("critical_path")))
    return Section("stage_breakdown", title, note, _nonempty(*tables))


_LATE_WHY = {BLOCKING: "its own thread running (blocking callbacks)",
             OTHER_THREADS: "other threads of its process running (the GIL held away from it)",
             STARVED: "neither running (a starved host)"}


def _late_why(r: Any) -> str:
    """Why one loop ran late: the share of its measured late time for each reason (analyzers.loop_lag)."""
    ms = {k: float(r[CAUSE_MS[k]]) for k in _LATE_WHY if pd.notna(r.get(CAUSE_MS[k]))}
    total = sum(ms.values())
    if not total > 0:
        return ""
    return " Of its measured late time: " + ", ".join(f"{v / total:.0%} {_LATE_WHY[k]}" for k, v in ms.items()) + "."


def loop_sentence(lag: Any) -> str:
    """One sentence per sampled loop, and the stages it explains most."""
    if lag.is_empty:
        return ("No event loop was sampled: the run has no loop_lags rows (a gateway traced by the reference "
                "adapters or the ASGI middleware samples its loop).")
    parts = []
    for _, r in lag.instances.iterrows():
        parts.append(f"{r['instance']} ({r['role']}): {int(r['late_ticks']):,} late ticks, {r['late_ms']:,.1f} ms in "
                     f"all ({r['late_share']:.1%} of its time), the longest {r['longest_ms']:,.1f} ms.{_late_why(r)}")
    stages = lag.stages[lag.stages["share_in_late"] >= 0.01].sort_values("in_late_ms", ascending=False)
    if len(stages):
        named = ", ".join(f"{s['share_in_late']:.0%} of {s['stage']}" for _, s in stages.head(3).iterrows())
        parts.append(f"Time spent while the loop ran late: {named}.")
    else:
        parts.append("Less than 1% of any stage's time fell while the loop ran late.")
    return " ".join(parts)


def loop_section(ctx: Context) -> Section:
    title = "Event loop"
    if (gone := _missing(ctx, "loop_lag", title, "loop_lag")) is not None:
        return gone
    lag = ctx.get("loop_lag")
    tables = () if lag.is_empty else (("Late ticks per sampled loop", lag.instances),
                                      ("Stage time inside late intervals", lag.stages))
    return Section("loop_lag", title, loop_sentence(lag), tables)


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


def _cache_note(c: Any) -> str:
    """The hit rate beside the best achievable, and what a hit is worth on the stages it changes."""
    parts = ["Hit rates weighted by tokens and by requests."]
    if len(c.prefix):
        p = c.prefix.iloc[0]
        best = p.get("best_token_hit_rate")
        if best is not None and pd.notna(best) and pd.notna(p["token_hit_rate"]):
            parts.append(f"Measured token hit rate {p['token_hit_rate'] * 100:.1f}% against the best achievable "
                         f"{best * 100:.1f}% on this run's trace (an unbounded cache, from its block hashes).")
    hv = c.hit_value.set_index("group") if len(c.hit_value) else None
    if hv is None or "hit" not in hv.index:
        parts.append("The value of a hit was not measured: no request has a prompt length.")
    elif pd.isna(hv.loc["hit", "saved_ms_per_hit"]):
        why = hv.loc["hit"].get("value_note") or "no request that hit has cache.lookup, cache.load or prefill.compute spans"
        parts.append(f"The value of a hit was not measured: {why}.")
    else:
        parts.append(f"A hit saved {hv.loc['hit', 'saved_ms_per_hit']:,.2f} ms of lookup, load and prefill per "
                     f"request: {hv.loc['hit', 'ms_per_prompt_token'] * 1e3:,.1f} us per prompt token over "
                     f"{int(hv.loc['hit', 'num_compared'])} hits against {hv.loc['miss', 'ms_per_prompt_token'] * 1e3:,.1f} "
                     f"us over {int(hv.loc['miss', 'num_compared'])} misses that queued about as long (queueing itself "
                     "excluded: it depends on when a request arrived, not on the cache).")
    return " ".join(parts)


def cache_section(ctx: Context) -> Section:
    title = "Prefix cache"
    if (gone := _missing(ctx, "cache", title, "cache")) is not None:
        return gone
    c = ctx.get("cache")
    tables = _nonempty(("Prefix hit rate, beside the best achievable on the trace", c.prefix),
                       ("Value of a hit, on the stages it changes (queue and TTFT shown, not used)",
                        c.hit_value.drop(columns="value_note", errors="ignore")),
                       ("Hit rate over time (per arrival window)", c.hit_rate_over_time),
                       ("Hit rate per tier", c.tiers), ("Eviction churn", c.churn),
                       ("Swaps, offloads and loads", c.transfers))
    no_prompts = len(c.prefix) == 0 or int(c.prefix["num_requests"].sum()) == 0
    if not tables or (ctx.rows.get(CACHE_EVENTS.name, 0) == 0 and no_prompts):
        reason = "no cache_events rows" if ctx.rows.get(CACHE_EVENTS.name, 0) == 0 else "no cache activity"
        return Section("cache", title, f"Not available: the run has {reason}.")
    return Section("cache", title, _cache_note(c), tables)


def pd_section(ctx: Context) -> Section:
    title = "Prefill and decode resources"
    if (gone := _missing(ctx, "pd_ratio", title, "pd_ratio", (STEPS.name,))) is not None:
        return gone
    p = ctx.get("pd_ratio")
    tables = _nonempty(("Instances per pool for the offered load", p.recommendation),
                       ("Demand the advice serves (offered rate over the arrival window)", p.demand),
                       ("Utilisation per pool", p.pools), ("Queue watermarks per instance", p.watermarks),
                       ("KV transfer share", p.kv_transfer))
    return Section("pd_ratio", title, advice_sentence(p.recommendation, p.demand), tables)


def load_section(ctx: Context) -> Section:
    title = "Load and saturation"
    if (gone := _missing(ctx, "load", title, "load")) is not None:
        return gone
    report = ctx.get("load")
    tables = _nonempty(("Offered against served load", report.summary),
                       ("Pools over the arrival window (early and late third)", report.pools),
                       ("Stages whose time per request grew most", report.stages.head(5)))
    return Section("load", title, load_sentence(report.row, report.pools, report.stages), tables)


def _batch_tables_per_role(batch: pd.DataFrame | None) -> list[tuple[str, pd.DataFrame | None]]:
    """One batch-size table per role: a prefill worker's steps make no decode token, so they are its own table."""
    if batch is None or len(batch) == 0 or "role" not in batch:
        return [("Decode step time and ITL by batch size", batch)]
    parts: list[tuple[str, pd.DataFrame | None]] = []
    for role, rows in batch.groupby("role", sort=True):
        rows = rows.drop(columns="role").reset_index(drop=True)
        if role == Role.PREFILL.label:
            parts.append(("Prefill step time by batch size (prefill role)",
                          rows.drop(columns=["num_tokens", "mean_itl_ms", "p99_itl_ms"])))
        else:
            parts.append((f"Decode step time and ITL by batch size ({role} role)", rows))
    return parts


def batch_section(ctx: Context) -> Section:
    title = "Batching and interference"
    if (gone := _missing(ctx, "batch", title, "batch", (STEPS.name,))) is not None:
        return gone
    parts = _batch_tables_per_role(ctx.get("batch"))
    if ctx.has("interference"):
        parts.append(("What shared the step of the slowest 1% of tokens, against the median",
                      ctx.get("interference")))
    tables = _nonempty(*parts)
    if not tables:
        return Section("batch", title, "No decode step to bin by batch size.")
    return Section("batch", title, "Steps binned by the number of sequences in the batch.", tables)


def speculative_section(ctx: Context) -> Section:
    title = "Speculative decoding"
    if (gone := _missing(ctx, "speculative", title, "speculation")) is not None:
        return gone
    if ctx.rows.get(SPEC_STEPS.name, 0) == 0:
        return Section("speculative", title, NO_SPECULATION)
    rep = ctx.get("speculation")
    return Section("speculative", title, " ".join(speculation_sentences(rep)), speculation_tables(rep))


def sessions_section(ctx: Context) -> Section:
    title = "Sessions and KV retention between turns"
    if (gone := _missing(ctx, "sessions", title, "sessions")) is not None:
        return gone
    rep = ctx.get("sessions")
    return Section("sessions", title, " ".join(session_sentences(rep)), session_tables(rep))


def _flagged_pairs(nn: pd.DataFrame) -> str:
    """The flagged pairs by name, " (acme slows globex: +12.3 ms TTFT, ...)", or "" when none is."""
    if not {"aggressor", "victim"} <= set(nn.columns):
        return ""
    flagged = nn[nn["flagged"].astype(bool)]
    pairs = [f"{r['aggressor']} slows {r['victim']}" + (f": {float(r['effect_ms']):+.1f} ms TTFT"
                                                        if "effect_ms" in flagged.columns else "")
             for _, r in flagged.iterrows()]
    return f" ({'; '.join(pairs)})" if pairs else ""


def _pairs_sample(nn: Any) -> str:
    """The sentence saying which pairs were tested when not every pair was (many tenants), else ""."""
    attrs = getattr(nn, "attrs", {})
    total, tested = attrs.get("num_pairs"), attrs.get("num_pairs_tested")
    if not (isinstance(total, int) and isinstance(tested, int)) or tested >= total:
        return ""
    k = attrs.get("top_k")
    return (f" With {attrs.get('num_tenants', 0):,} tenants, {tested:,} of the {total:,} ordered pairs were tested: "
            f"the {k} likeliest aggressors (the largest burst excess) against the {k} best-judged victims (the most "
            f"requests with a TTFT).")


def tenants_section(ctx: Context) -> Section:
    title = "Tenants and fairness"
    if (gone := _missing(ctx, "tenants", title, "tenants")) is not None:
        return gone
    t = ctx.get("tenants")
    parts = [("Jain's fairness index (1 = fair)", t.jain), ("Shares per tenant", t.shares)]
    note = "Fairness by requests, by tokens and by compute time."
    if ctx.has("noisy_neighbours"):
        nn = ctx.get("noisy_neighbours")
        if len(nn) and "flagged" in nn.columns:
            parts.append(("Noisy neighbours: each pair tested, its sample sizes and permutation p-value", nn))
            judged = int(nn["enough_data"].astype(bool).sum()) if "enough_data" in nn.columns else len(nn)
            note += (f" Noisy neighbours: {int(nn['flagged'].astype(bool).sum())} of {len(nn)} tenant pair(s) "
                     f"flagged{_flagged_pairs(nn)}, {judged} with enough data to judge (a pair needs 10 windows, 2 bursts and 5 of "
                     f"the victim's requests in them; flagged at a Holm-adjusted p < 0.05 with at least 5 ms and "
                     f"10% more TTFT than the victim's own trend).{_pairs_sample(nn)}")
    tables = _nonempty(*parts)
    if not tables:
        return Section("tenants", title, "No request names a tenant.")
    return Section("tenants", title, note, tables)


def agreement_section(ctx: Context) -> Section:
    title = "Client and server agreement"
    if (gone := _missing(ctx, "agreement", title, "agreement")) is not None:
        return gone
    if ctx.analysis.source.client_lane_only:
        return Section("agreement", title, "Not available: the run has no server lane (client rows only).")
    df = ctx.get("agreement")
    if len(df) == 0 or ("count" in df.columns and int(df["count"].sum()) == 0):
        return Section("agreement", title, "Not available: the run has no client-side (load generator) rows.")
    return Section("agreement", title, "Server minus client latency, ms: how far the server's own timeline "
                                       "disagrees with an independent client.", (("", df),))


SECTION_BUILDERS: tuple[Callable[[Context], Section], ...] = (
    load_section, latency_section, slo_section, breakdown_section, loop_section, slowest_section, queues_section,
    cache_section,
    pd_section, batch_section, speculative_section, sessions_section, tenants_section, agreement_section,
)
"""Builders in report order (the diff, budgets and counters are added by the model)."""
