"""The sentences a reader needs first, written once from the analyzers' results.

The report (its first lines, in every format), the demo's terminal report and
the dashboard's overview all say the same thing in the same words, so the
wording lives here: the load verdict (:func:`load_sentence`), the prefill:decode
advice (:func:`advice_sentence`), the attribution invariant's two figures
(:func:`attribution_sentence`) and what a run did not measure
(:func:`slo_not_measured`). Pure functions of analyzer frames; no I/O.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import pandas as pd

from analyzers.load import MIN_REQUESTS, MIN_WINDOW_S
from tokentrace.app.report.frames import as_float
from tokentrace.schema import col

__all__ = ["change_phrase", "load_sentence", "advice_sentence", "attribution_sentence", "slo_not_measured", "failed_sentence",
           "hidden_stages_sentence", "ATTRIBUTION_TARGET"]

ALL_CLASSES_ROW = "*"  # the analyzers' row for every SLO class together
ATTRIBUTION_TARGET = 0.01  # the attribution invariant: |unattributed| and overlap each under 1% of token latency


def _rate(value: Any) -> str:
    v = as_float(value)
    return f"{v:.2f} req/s" if math.isfinite(v) else "unknown"


def _pool_row(pools: pd.DataFrame | None, role: str | None) -> Mapping[str, Any] | None:
    if pools is None or role is None or len(pools) == 0:
        return None
    rows = pools[pools["role"] == role]
    return rows.iloc[0].to_dict() if len(rows) else None


def _stage_row(stages: pd.DataFrame | None, stage: str | None, role: str | None) -> Mapping[str, Any] | None:
    if stages is None or stage is None or len(stages) == 0:
        return None
    rows = stages[(stages["stage"] == stage) & (stages["role"] == role)]
    rows = rows if len(rows) else stages[stages["stage"] == stage]
    return rows.iloc[0].to_dict() if len(rows) else None


def change_phrase(early: Any, late: Any, fmt: str, unit: str = "") -> str:
    """``grew from A to B``, ``fell from A to B`` or ``stayed at A``: the direction word is computed from the two
    numbers as they are printed (``fmt``, e.g. ``",.0f"``), so the words never contradict the figures."""
    a, b = format(as_float(early), fmt), format(as_float(late), fmt)
    if a == b:
        return f"stayed at {a}{unit}"
    return f"{'grew' if as_float(late) > as_float(early) else 'fell'} from {a} to {b}{unit}"


def load_sentence(row: Mapping[str, Any], pools: pd.DataFrame | None = None,
                  stages: pd.DataFrame | None = None) -> str:
    """The load verdict in one or two sentences (``row``: ``analyzers.load.LoadReport.row``)."""
    count = as_float(row.get("num_requests"))
    n = int(count) if math.isfinite(count) else 0
    window = as_float(row.get("arrival_window_s"))
    if not math.isfinite(window):
        rates = ""
    elif window < MIN_WINDOW_S:  # a rate over a blink would be tens of thousands of req/s: none is given
        rates = f"no offered rate over so short a window, served {_rate(row.get('served_rps'))}"
    else:
        rates = (f"offered {_rate(row.get('offered_rps'))} over the {window:.1f} s arrival window, "
                 f"served {_rate(row.get('served_rps'))}")
    saturated = row.get("saturated")
    if saturated is None or (isinstance(saturated, float) and math.isnan(saturated)):
        if n == 0:
            return "Load not judged: no request has an arrival time."
        if n < MIN_REQUESTS:
            why = f"only {n} request(s) arrived (at least {MIN_REQUESTS} are needed)"
        elif math.isfinite(window) and window < MIN_WINDOW_S:
            why = f"the arrivals span {window:.3f} s (at least {MIN_WINDOW_S:g} s are needed)"
        else:
            why = "no served rate could be measured"
        return f"Load not judged: {why}" + (f"; {rates}." if rates else ".")
    if not saturated:
        busiest = ""
        if pools is not None and len(pools):
            top = pools.sort_values("utilisation", ascending=False).iloc[0]
            busiest = f"; busiest pool: {top['role']}, {as_float(top['utilisation']) * 100:.0f}% busy"
        return f"Not saturated: {rates}{busiest}."
    ratio = as_float(row.get("load_ratio"))
    text = f"SATURATED: arrivals outran service, {rates}" + (f" ({ratio:.1f}x)." if math.isfinite(ratio) else ".")
    pool = row.get("saturated_pool")
    if pool:
        text += f" The {pool} pool saturates"
        p = _pool_row(pools, pool)
        if p is not None:
            text += (f": {as_float(p['utilisation']) * 100:.0f}% busy, requests in it "
                     f"{change_phrase(p['in_system_early'], p['in_system_late'], '.1f')}")
        s = _stage_row(stages, row.get("saturated_stage"), pool)
        if s is not None:
            text += (f"; {s['stage']} time per request {change_phrase(s['early_ms'], s['late_ms'], ',.0f', ' ms')}"
                     " through the run")
        text += "."
    else:
        text += " Which pool saturates is unknown (no steps or spans show a growing queue)."
    return text


def advice_sentence(advice: pd.DataFrame, demand: pd.DataFrame | None = None, *, slo_missed: bool = False) -> str:
    """The prefill:decode advice: whole instances per pool, the utilisation each implies, what is missing.

    ``slo_missed``: requests missed a target, so the count is no all-clear: instead of "has enough
    instances" it says that more instances are not what the missed targets ask for.
    """
    if advice is None or len(advice) == 0:
        return "No instance advice: the run has no engine steps to measure capacity on."
    d = demand.iloc[0].to_dict() if demand is not None and len(demand) else {}
    rate = as_float(d.get("arrival_rate_rps"))
    head = f"Instances for the offered {_rate(rate)}" if math.isfinite(rate) else "Instances, with no offered rate"
    targets = [f"{name} {as_float(d.get(key)):g} ms" for name, key in (("TTFT", "ttft_target_ms"), ("TPOT", "tpot_target_ms"))
               if math.isfinite(as_float(d.get(key)))]
    headroom = as_float(d.get("headroom"))
    conditions = (["SLO " + ", ".join(targets)] if targets else []) + (
        [f"at most {(1 - headroom) * 100:.0f}% busy"] if math.isfinite(headroom) else [])
    if conditions:
        head += f" ({'; '.join(conditions)})"
    parts, lacking, unreachable = [], [], []
    for _, r in advice.iterrows():
        count = as_float(r["instances"])
        if not math.isfinite(count):
            why = (f"no {r['pool']} work measured" if math.isfinite(as_float(d.get("arrival_rate_rps")))
                   else "no offered rate")
            parts.append(f"{r['pool']} unknown ({why})")
            continue
        current = int(as_float(r["current_instances"]))
        parts.append(f"{r['pool']} {int(count)} ({as_float(r['utilisation_at_advice']) * 100:.0f}% busy; has {current})")
        if as_float(r["lacks"]) > 0:
            lacking.append(f"{int(as_float(r['lacks']))} {r['pool']}")
        if r.get("slo_reachable") is False:
            unreachable.append(str(r["pool"]))
    text = f"{head}: " + ", ".join(parts) + "."
    counts = [int(as_float(c)) for c in advice["instances"] if math.isfinite(as_float(c))]
    if len(advice) == 2 and len(counts) == 2:
        text += f" P:D = {counts[0]}:{counts[1]}."
    if lacking:
        text += f" The deployment lacks {' and '.join(lacking)} instance(s)."
    elif len(counts) != len(advice):  # a pool not judged is not "enough"
        text += " Whether the deployment's instances suffice is not judged."
    elif slo_missed:
        text += (" The instance count covers the load, but targets were missed: more instances are not the fix "
                 "(see the causes above).")
    else:
        text += " The deployment has enough instances."
    if unreachable:
        text += (f" More {', '.join(unreachable)} instances cannot meet the SLO on their own: one request's "
                 f"service time already exceeds its target.")
    return text


def attribution_sentence(attribution: pd.DataFrame) -> str:
    """Unattributed (signed) and overlap shares of token latency, against the invariant's 1% bound."""
    if attribution is None or len(attribution) == 0:
        return "Attribution not measured: no token latency."
    a = attribution.set_index("kind")
    if "all" not in a.index or not math.isfinite(as_float(a.loc["all", "unattributed_share"])):
        return "Attribution not measured: no token latency."
    un, ov = as_float(a.loc["all", "unattributed_share"]), as_float(a.loc["all", "overlap_share"])
    per = ", ".join(f"{k.upper()} {as_float(a.loc[k, 'unattributed_share']) * 100:+.3f}%" for k in ("ttft", "itl")
                    if k in a.index and math.isfinite(as_float(a.loc[k, "unattributed_share"])))
    ok = abs(un) < ATTRIBUTION_TARGET and ov < ATTRIBUTION_TARGET
    return (f"Unattributed time {un * 100:+.3f}% of token latency ({per}); overlap (time two stages both claim) "
            f"{ov * 100:.3f}%. Target: each under {ATTRIBUTION_TARGET * 100:.0f}%: "
            + ("met." if ok else "NOT met."))


def slo_not_measured(slo: pd.DataFrame) -> list[str]:
    """A sentence per SLO figure the run did not measure (empty when everything was measured)."""
    if slo is None or len(slo) == 0 or "tpot_attainment" not in slo.columns:
        return []
    out = []
    overall = slo[slo[col.SLO_CLASS] == ALL_CLASSES_ROW]
    row = overall.iloc[0] if len(overall) else slo.iloc[0]
    if math.isnan(as_float(row["ttft_attainment"])):
        out.append("TTFT attainment was not measured: no served request has a recorded first token.")
    if math.isnan(as_float(row["tpot_attainment"])):
        out.append("TPOT attainment, and so SLO attainment and goodput, were not measured: the run has no "
                   "per-token data (no served request of more than one output token has a second token "
                   "recorded). They are not met and not failed; a budget on them fails.")
    return out


def failed_sentence(slo: pd.DataFrame) -> str:
    """How many requests failed and so count as missing their SLO ('' when none did)."""
    if slo is None or len(slo) == 0 or "num_failed" not in slo.columns:
        return ""
    overall = slo[slo[col.SLO_CLASS] == ALL_CLASSES_ROW]
    row = overall.iloc[0] if len(overall) else slo.iloc[0]
    failed = int(as_float(row["num_failed"]))
    if failed == 0:
        return ""
    return (f"{failed} of {int(as_float(row['num_requests']))} requests failed (error, aborted, cut off, rejected): "
            f"they never count as good.")


def hidden_stages_sentence(hidden: list[str]) -> str:
    """'N stages under 0.01% not shown: a, b.' ('' when every stage is shown)."""
    if not hidden:
        return ""
    return f"{len(hidden)} stage(s) under 0.01% of every column not shown: {', '.join(hidden)}."
