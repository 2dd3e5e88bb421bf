"""Sessions in words: the sentences, tables and metrics the report and the dashboard share.

Pure functions of an ``analyzers.sessions.SessionReport`` (passed in; nothing is imported
from the analyzers here). A run without sessions gets one sentence, :data:`NO_SESSIONS`.

Metrics (the budget namespace; see ``docs/report.md``): ``session.reuse_fraction`` (reused
/ carried tokens over every later turn), ``session.lost_tokens``, ``session.extra_prefill``,
``session.load`` (sums over turns), ``session.ttft_sum.mean`` and ``session.ttft_sum.p90``
(per session, the sum of its turns' TTFTs, ms) and ``session.think.mean`` (ms). Comparing two
runs with different retention policies (``tokentrace report --baseline``) puts them side by side.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from tokentrace.app.report.frames import as_float
from tokentrace.schema import col

__all__ = ["NO_SESSIONS", "session_sentences", "session_tables", "session_metrics", "session_comparison",
           "SESSION_METRICS"]

NO_SESSIONS = ("No sessions in this run: no request carried a session id (X-Session-Id, the OpenAI user field or "
               "an OTLP session attribute; `tokentrace bench --sessions agent` sends them).")

SESSION_METRICS: dict[str, str] = {
    "session.reuse_fraction": "share of carried prefix tokens served from cache",
    "session.lost_tokens": "carried tokens lost during think time (recomputed)",
    "session.extra_prefill": "prefill time spent recomputing lost tokens, ms",
    "session.load": "time loading carried KV from lower tiers, ms",
    "session.ttft_sum.mean": "sum of a session's TTFTs, mean over sessions, ms",
    "session.ttft_sum.p90": "sum of a session's TTFTs, p90 over sessions, ms",
    "session.think.mean": "think time between turns, mean, ms",
}
"""Metric name -> what it measures (the comparison table's rows, in order)."""


def _pct(value: Any) -> str:
    v = as_float(value)
    return f"{v:.1%}" if math.isfinite(v) else "not measured"


def _ms(value: Any) -> str:
    v = as_float(value)
    return f"{v:,.1f} ms" if math.isfinite(v) else "not measured"


def session_sentences(report: Any) -> tuple[str, ...]:
    """What the run's sessions did, in a few sentences (:data:`NO_SESSIONS` without any)."""
    if report is None or report.empty:
        return (NO_SESSIONS,)
    r = report.retention.iloc[0] if len(report.retention) else pd.Series(dtype=object)
    turns = report.turns
    out = [f"{int(r['num_sessions']):,} session(s), {int(r['num_turns']):,} turn(s): mean think time "
           f"{_ms(r['mean_think_ms'])} between turns, mean TTFT {_ms(r['mean_ttft_ms'])} per turn; "
           f"a session's TTFTs add up to {_ms(report.sessions['ttft_sum_ms'].mean())} on average."]
    if int(r.get("num_measured_turns", 0) or 0) == 0:
        out.append("Cross-turn reuse not measured: the server reported no carried prefixes (the reference engine "
                   "records a carry event when a session's next turn is admitted).")
        return tuple(out)
    carried = as_float(r["carried_tokens"])
    out.append(
        f"Cross-turn reuse: of {carried:,.0f} prompt tokens the sessions' previous turns had computed, "
        f"{_pct(r['reuse_fraction'])} were served from cache (device {as_float(r['reused_device_tokens']):,.0f}, "
        f"host {as_float(r['reused_host_tokens']):,.0f}, disk {as_float(r['reused_disk_tokens']):,.0f} tokens).")
    lost = as_float(r["lost_tokens"])
    if lost > 0:
        hit = turns[turns["lost_tokens"].fillna(0) > 0]
        out.append(f"{lost:,.0f} carried tokens were lost during think time in {len(hit):,} turn(s) (evicted or "
                   f"dropped) and computed again: about {_ms(r['extra_prefill_ms'])} of extra prefill.")
    else:
        out.append("No carried token was lost during think time.")
    if as_float(r["load_ms"]) > 0:
        out.append(f"Bringing carried KV up from lower tiers took {_ms(r['load_ms'])}.")
    kept, dropped = as_float(r.get("retained_blocks")), as_float(r.get("dropped_blocks"))
    if kept > 0:
        out.append(f"The retention policy pinned {kept:,.0f} block(s) between turns, for "
                   f"{_ms(r['mean_retain_ms'])} on average.")
    if dropped > 0:
        out.append(f"The retention policy dropped {dropped:,.0f} cached block(s) at turn ends.")
    return tuple(out)


def session_tables(report: Any, *, max_sessions: int = 20) -> tuple[tuple[str, pd.DataFrame], ...]:
    """(caption, frame) pairs: per-session summary (the ``max_sessions`` with most lost tokens first), and
    fairness per tenant counted per session and per request."""
    if report is None or report.empty:
        return ()
    keep = [col.SESSION, col.TENANT, "num_turns", "ttft_sum_ms", "generation_ms", "think_ms", "carried_tokens",
            "reused_tokens", "lost_tokens", "reuse_fraction", "extra_prefill_ms", "load_ms"]
    per = report.sessions[[c for c in keep if c in report.sessions.columns]]
    per = per.sort_values(["lost_tokens", "ttft_sum_ms"], ascending=False, na_position="last").head(max_sessions)
    out = [(f"Sessions (most lost tokens first, at most {max_sessions})", per.reset_index(drop=True))]
    if len(report.fairness) > 1:
        out.append(("Tenants per session and per request", report.fairness))
    return tuple(out)


def session_metrics(report: Any) -> dict[str, float]:
    """The ``session.*`` metrics of a run with sessions (empty dict without)."""
    if report is None or report.empty:
        return {}
    r = report.retention.iloc[0]
    sums = report.sessions["ttft_sum_ms"].astype(float)
    return {
        "session.reuse_fraction": as_float(r["reuse_fraction"]),
        "session.lost_tokens": as_float(r["lost_tokens"]),
        "session.extra_prefill": as_float(r["extra_prefill_ms"]),
        "session.load": as_float(r["load_ms"]),
        "session.ttft_sum.mean": float(sums.mean()),
        "session.ttft_sum.p90": float(sums.quantile(0.9)),
        "session.think.mean": as_float(r["mean_think_ms"]),
    }


def session_comparison(metrics: dict[str, float], baseline: dict[str, float]) -> pd.DataFrame:
    """Baseline against this run for every ``session.*`` metric either has (NaN where one lacks it)."""
    rows = []
    for name, meaning in SESSION_METRICS.items():
        if name not in metrics and name not in baseline:
            continue
        b, c = baseline.get(name, math.nan), metrics.get(name, math.nan)
        rows.append({"metric": name, "meaning": meaning, "baseline": b, "candidate": c, "delta": c - b})
    return pd.DataFrame(rows, columns=["metric", "meaning", "baseline", "candidate", "delta"])
