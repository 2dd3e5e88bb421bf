"""Prefill:decode balance: utilisation per pool, queue watermarks, KV transfer cost, and instance advice.

* Utilisation of an instance over the run's duration D (first arrival to last
  finish): busy = sum of its step durations; prefill_busy = summed duration of
  steps with prefill tokens; decode_busy = of steps with decode tokens (a mixed
  step of a colocated engine counts in both); *_utilisation = *_busy / D.
  Throughput while busy: prefill_tokens_per_s = prefill tokens / prefill_busy,
  decode_tokens_per_s = decode tokens / decode_busy.
* Pools: instances grouped by role; tokens and busy times summed, utilisation averaged.
* Watermarks per instance: max and 95th percentile of waiting and running over steps.
* KV transfer: transfer.kv time inside token 0 over the summed TTFT, and inside
  later tokens over the summed ITL.
* Advice (:func:`recommendation`), whole instances per pool for the *offered* load:

  - demand: lambda = the offered rate over the arrival window
    (:func:`analyzers.load.arrival_window`, not over the drain); per request, over
    requests that completed (all requests if none did): prefill tokens = prompt -
    cached, decode tokens = output - 1 (token 0 is produced by the prefill pass);
    work = lambda x tokens per request, tokens/s.
  - capacity: tokens per busy second of one instance, measured on the pool's own
    steps (prefill-role instances for prefill, decode-role for decode; colocated, then
    instances of unknown role, when there are none). Measured at the batch sizes the
    run had, so under light load it is conservative.
  - utilisation limit rho_max: at most 1 - ``headroom``; for prefill also at most
    1 - S / T, with S the prefill time of a mean request (prefill tokens / capacity)
    and T the strictest TTFT target of the run's SLO classes: an M/M/1 queue at
    utilisation rho waits S * rho / (1 - rho) on average, so S plus the wait stays
    within T. Decode time per token is the step time, which more instances do not
    shorten: the TPOT target is met only when one decode step (decode busy / decode
    steps) fits in it (``slo_reachable``); its limit is the headroom alone.
  - instances = ceil(work / (capacity x rho_max)), at least 1; the utilisation it
    implies = work / (instances x capacity); ``lacks`` = instances beyond the ones the
    run had. A colocated pool serves both: work = (prefill work / prefill capacity +
    decode work / decode capacity) x busy / (prefill busy + decode busy), in busy seconds
    per second: a mixed step serves prefill and decode tokens at once and is busy once,
    not twice (the factor is 1 for an engine that never mixes them, about 1/2 for one that
    always does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import pandas as pd

from analyzers.load import arrival_window, offered_rate
from analyzers.slo import SloTargets, resolve_targets
from analyzers.source import Source
from analyzers.stage_breakdown import breakdown
from analyzers.timing import LATENCY, request_table, run_bounds, token_times
from tokentrace.schema import RequestStatus, Role, Stage, col

_UNKNOWN = "unknown"  # role label of an instance missing from the instances table
DEFAULT_HEADROOM = 0.2  # advice keeps every instance at most 80% busy

__all__ = ["PdRatio", "DEFAULT_HEADROOM", "utilisation", "pools", "watermarks", "kv_transfer", "demand",
           "recommendation", "pd_ratio"]


@dataclass(frozen=True, slots=True)
class PdRatio:
    """The prefill:decode analyses of one run; ``demand`` (one row) and ``recommendation`` (per pool) are the advice."""

    utilisation: pd.DataFrame
    pools: pd.DataFrame
    watermarks: pd.DataFrame
    kv_transfer: pd.DataFrame
    demand: pd.DataFrame
    recommendation: pd.DataFrame


def _duration_s(src: Source) -> float:
    b = run_bounds(src)
    if b is None:
        lo, hi = src.fetchone(f"SELECT MIN({col.START_NS}), MAX({col.END_NS}) FROM steps")
        b = (lo, hi) if lo is not None else (0, 0)
    return (b[1] - b[0]) / 1e9


def utilisation(src: Source) -> pd.DataFrame:
    """Per instance with steps (columns in the module doc and docs/analyzers.md)."""
    c = col
    df = src.df(f"""
        SELECT s.{c.INSTANCE_ID}, ANY_VALUE(i.{c.ROLE}) AS role,
               SUM(s.{c.END_NS} - s.{c.START_NS}) / 1e9 AS busy_s,
               SUM(CASE WHEN s.{c.NUM_PREFILL_TOKENS} > 0 THEN s.{c.END_NS} - s.{c.START_NS} ELSE 0 END) / 1e9
                   AS prefill_busy_s,
               SUM(CASE WHEN s.{c.NUM_DECODE_TOKENS} > 0 THEN s.{c.END_NS} - s.{c.START_NS} ELSE 0 END) / 1e9
                   AS decode_busy_s,
               SUM(s.{c.NUM_PREFILL_TOKENS})::BIGINT AS prefill_tokens, SUM(s.{c.NUM_DECODE_TOKENS})::BIGINT AS decode_tokens,
               COUNT(*) FILTER (WHERE s.{c.NUM_DECODE_TOKENS} > 0) AS decode_steps
        FROM steps s LEFT JOIN instances i USING ({c.INSTANCE_ID})
        GROUP BY s.{c.INSTANCE_ID} ORDER BY s.{c.INSTANCE_ID}
    """)
    dur = _duration_s(src)
    df["role"] = df["role"].map(lambda r: Role(int(r)).label if pd.notna(r) else _UNKNOWN)
    df.insert(2, "duration_s", dur)
    df["prefill_utilisation"] = df["prefill_busy_s"] / dur if dur > 0 else math.nan
    df["decode_utilisation"] = df["decode_busy_s"] / dur if dur > 0 else math.nan
    df["prefill_tokens_per_s"] = df["prefill_tokens"] / df["prefill_busy_s"].where(df["prefill_busy_s"] > 0)
    df["decode_tokens_per_s"] = df["decode_tokens"] / df["decode_busy_s"].where(df["decode_busy_s"] > 0)
    return df[[c.INSTANCE_ID, "role", "duration_s", "busy_s", "prefill_busy_s", "decode_busy_s",
               "prefill_utilisation", "decode_utilisation", "prefill_tokens", "decode_tokens",
               "prefill_tokens_per_s", "decode_tokens_per_s", "decode_steps"]]


def pools(util: pd.DataFrame) -> pd.DataFrame:
    """Per role: role, num_instances, busy and token sums, mean utilisation, throughput while busy."""
    cols = ["role", "num_instances", "busy_s", "prefill_busy_s", "decode_busy_s", "prefill_utilisation",
            "decode_utilisation", "prefill_tokens", "decode_tokens", "prefill_tokens_per_s", "decode_tokens_per_s"]
    if util.empty:
        return pd.DataFrame(columns=cols)
    g = util.groupby("role", sort=True)
    out = g.agg(num_instances=(col.INSTANCE_ID, "count"), busy_s=("busy_s", "sum"),
                prefill_busy_s=("prefill_busy_s", "sum"), decode_busy_s=("decode_busy_s", "sum"),
                prefill_utilisation=("prefill_utilisation", "mean"), decode_utilisation=("decode_utilisation", "mean"),
                prefill_tokens=("prefill_tokens", "sum"), decode_tokens=("decode_tokens", "sum")).reset_index()
    out["prefill_tokens_per_s"] = out["prefill_tokens"] / out["prefill_busy_s"].where(out["prefill_busy_s"] > 0)
    out["decode_tokens_per_s"] = out["decode_tokens"] / out["decode_busy_s"].where(out["decode_busy_s"] > 0)
    return out[cols]


def watermarks(src: Source) -> pd.DataFrame:
    """Per instance: instance_id, max_waiting, p95_waiting, max_running, p95_running (over its steps)."""
    c = col
    return src.df(f"""
        SELECT {c.INSTANCE_ID}, MAX({c.NUM_WAITING}) AS max_waiting,
               quantile_cont({c.NUM_WAITING}, 0.95) AS p95_waiting,
               MAX({c.NUM_RUNNING}) AS max_running, quantile_cont({c.NUM_RUNNING}, 0.95) AS p95_running
        FROM steps GROUP BY {c.INSTANCE_ID} ORDER BY {c.INSTANCE_ID}
    """)


def kv_transfer(src: Source) -> pd.DataFrame:
    """One row: transfer_ms, ttft_total_ms, itl_total_ms, share_of_ttft, share_of_itl.

    The shares are the stage breakdown's ``transfer.kv`` shares (spans clipped to their token's interval), so
    the report states one KV-transfer share of ITL; transfer_ms is that time within the tokens' intervals."""
    c = col
    tt = token_times(src)
    df = src.df(f"""
        SELECT COALESCE(SUM(CASE WHEN {c.TOKEN_INDEX} = 0 THEN {LATENCY} END), 0) / 1e6 AS ttft_total_ms,
               COALESCE(SUM(CASE WHEN {c.TOKEN_INDEX} > 0 THEN {LATENCY} END), 0) / 1e6 AS itl_total_ms
        FROM {tt}
    """)
    shares = breakdown(src).set_index("stage").loc[Stage.TRANSFER_KV.label]
    df["share_of_ttft"] = float(shares["ttft_share"]) if df["ttft_total_ms"].iloc[0] > 0 else math.nan
    df["share_of_itl"] = float(shares["itl_share"]) if df["itl_total_ms"].iloc[0] > 0 else math.nan
    df["transfer_ms"] = (df["share_of_ttft"].fillna(0) * df["ttft_total_ms"]
                         + df["share_of_itl"].fillna(0) * df["itl_total_ms"])
    return df[["transfer_ms", "ttft_total_ms", "itl_total_ms", "share_of_ttft", "share_of_itl"]]


def _pool_rows(util: pd.DataFrame, role: Role) -> pd.DataFrame:
    """The instances that measure ``role``'s work: that role, else colocated, else unknown-role instances."""
    for label in (role.label, Role.COLOCATED.label, _UNKNOWN):
        rows = util[util["role"] == label]
        if len(rows):
            return rows
    return util.iloc[0:0]


def _capacity(rows: pd.DataFrame, kind: str) -> float:
    """Tokens of ``kind`` per busy second of one instance, over ``rows``; NaN without such work."""
    busy = float(rows[f"{kind}_busy_s"].sum()) if len(rows) else 0.0
    return float(rows[f"{kind}_tokens"].sum()) / busy if busy > 0 else math.nan


def _strictest(src: Source, classes: list[str], targets: Mapping[str, SloTargets] | None) -> SloTargets:
    resolved = resolve_targets(src, classes or [""], targets)
    return SloTargets(min(t.ttft_ms for t in resolved.values()), min(t.tpot_ms for t in resolved.values()))


def demand(src: Source, *, targets: Mapping[str, SloTargets] | None = None,
           headroom: float = DEFAULT_HEADROOM) -> pd.DataFrame:
    """One row: the offered rate and the work per request the advice serves (module doc).

    Columns: arrival_rate_rps, num_requests_measured, mean_prompt_tokens, mean_cached_tokens,
    mean_output_tokens, prefill_tokens_per_request, decode_tokens_per_request,
    prefill_tokens_per_s_needed, decode_tokens_per_s_needed, ttft_target_ms, tpot_target_ms, headroom.
    """
    c = col
    window = arrival_window(src)
    # No offered rate (so no advice) from arrivals within less than MIN_WINDOW_S: a burst's rate is no load.
    rate = offered_rate(window[2], (window[1] - window[0]) / 1e9) if window else math.nan
    rf = request_table(src)
    ok = int(RequestStatus.OK)
    per = src.df(f"""
        WITH done AS (SELECT * FROM {rf} WHERE {c.ARRIVAL_NS} IS NOT NULL AND COALESCE({c.STATUS}, 0) = {ok}
                                            AND {c.NUM_OUTPUT_TOKENS} > 0),
             basis AS (SELECT * FROM done UNION ALL
                       SELECT * FROM {rf} WHERE {c.ARRIVAL_NS} IS NOT NULL AND NOT EXISTS (SELECT 1 FROM done))
        SELECT COUNT(*) AS n, AVG({c.NUM_PROMPT_TOKENS}) AS p, AVG(COALESCE({c.NUM_CACHED_TOKENS}, 0)) AS cached,
               AVG({c.NUM_OUTPUT_TOKENS}) AS o, AVG(GREATEST({c.NUM_OUTPUT_TOKENS} - 1, 0)) AS d,
               AVG(GREATEST(COALESCE({c.NUM_PROMPT_TOKENS}, 0) - COALESCE({c.NUM_CACHED_TOKENS}, 0), 0)) AS pf
        FROM basis
    """).iloc[0]
    val = (lambda k: float(per[k]) if pd.notna(per[k]) else math.nan)
    classes = src.df(f"SELECT DISTINCT {c.SLO_CLASS} FROM {rf}")[c.SLO_CLASS].tolist()
    slo = _strictest(src, classes, targets)
    prefill_per_req = val("pf") if pd.notna(per["p"]) else math.nan
    return pd.DataFrame([{
        "arrival_rate_rps": rate, "num_requests_measured": int(per["n"]), "mean_prompt_tokens": val("p"),
        "mean_cached_tokens": val("cached"), "mean_output_tokens": val("o"),
        "prefill_tokens_per_request": prefill_per_req, "decode_tokens_per_request": val("d"),
        "prefill_tokens_per_s_needed": rate * prefill_per_req, "decode_tokens_per_s_needed": rate * val("d"),
        "ttft_target_ms": slo.ttft_ms, "tpot_target_ms": slo.tpot_ms, "headroom": headroom,
    }])


_ADVICE_COLUMNS = ["pool", "current_instances", "work_per_s", "capacity_per_instance", "service_ms",
                   "slo_target_ms", "slo_reachable", "max_utilisation", "limited_by", "instances",
                   "utilisation_at_advice", "current_utilisation", "lacks"]


def _advice(pool: str, current: int, work: float, capacity: float, service_ms: float, target_ms: float,
            headroom: float, *, queueing: bool) -> dict:
    """One pool's advice row; ``work`` and ``capacity`` in one unit (tokens/s, or busy s/s with capacity 1)."""
    rho, limited = 1.0 - headroom, "headroom"
    reachable = bool(service_ms <= target_ms) if math.isfinite(service_ms) else None
    if queueing and reachable and 1.0 - service_ms / target_ms < rho:
        rho, limited = 1.0 - service_ms / target_ms, "ttft target"
    need = work / capacity if capacity > 0 else math.nan
    count = max(1, math.ceil(need / rho - 1e-9)) if math.isfinite(need) and rho > 0 else math.nan
    return {"pool": pool, "current_instances": current, "work_per_s": work, "capacity_per_instance": capacity,
            "service_ms": service_ms, "slo_target_ms": target_ms, "slo_reachable": reachable,
            "max_utilisation": rho, "limited_by": limited, "instances": count,
            "utilisation_at_advice": need / count if math.isfinite(count) else math.nan,
            "current_utilisation": need / current if current else math.nan,
            "lacks": max(0, count - current) if math.isfinite(count) else math.nan}


def recommendation(src: Source, util: pd.DataFrame | None = None, *, need: pd.DataFrame | None = None,
                   targets: Mapping[str, SloTargets] | None = None,
                   headroom: float = DEFAULT_HEADROOM) -> pd.DataFrame:
    """Per pool: whole instances for the offered load within the SLO targets and headroom (module doc).

    Rows ``prefill`` and ``decode`` for a disaggregated run, one ``colocated`` row otherwise;
    empty without steps. Columns: pool, current_instances, work_per_s (tokens/s; busy s/s for
    colocated), capacity_per_instance, service_ms (prefill of a mean request; one decode step),
    slo_target_ms, slo_reachable, max_utilisation, limited_by, instances (int),
    utilisation_at_advice, current_utilisation, lacks. ``ValueError`` for headroom outside [0, 1).
    """
    if not (isinstance(headroom, (int, float)) and 0 <= headroom < 1):
        raise ValueError(f"headroom must be in [0, 1), got {headroom!r}")
    util = utilisation(src) if util is None else util
    if util.empty:
        return pd.DataFrame(columns=_ADVICE_COLUMNS)
    d = (demand(src, targets=targets, headroom=headroom) if need is None else need).iloc[0]
    pre, dec = _pool_rows(util, Role.PREFILL), _pool_rows(util, Role.DECODE)
    cap_p, cap_d = _capacity(pre, "prefill"), _capacity(dec, "decode")
    service_p = d["prefill_tokens_per_request"] / cap_p * 1e3 if cap_p > 0 else math.nan
    steps = float(dec["decode_steps"].sum()) if len(dec) else 0.0
    service_d = float(dec["decode_busy_s"].sum()) / steps * 1e3 if steps else math.nan
    work_p, work_d = float(d["prefill_tokens_per_s_needed"]), float(d["decode_tokens_per_s_needed"])
    roles = set(util["role"])
    if {Role.PREFILL.label, Role.DECODE.label} & roles:
        rows = [_advice(Role.PREFILL.label, int((util["role"] == Role.PREFILL.label).sum()), work_p, cap_p,
                        service_p, float(d["ttft_target_ms"]), headroom, queueing=True),
                _advice(Role.DECODE.label, int((util["role"] == Role.DECODE.label).sum()), work_d, cap_d,
                        service_d, float(d["tpot_target_ms"]), headroom, queueing=False)]
    else:
        label = Role.COLOCATED.label if Role.COLOCATED.label in roles else _UNKNOWN
        pool = util[util["role"] == label]
        both = float(pool["prefill_busy_s"].sum() + pool["decode_busy_s"].sum())
        once = min(1.0, float(pool["busy_s"].sum()) / both) if both > 0 else 1.0  # a mixed step is busy once
        busy = ((work_p / cap_p if cap_p > 0 else 0.0) + (work_d / cap_d if cap_d > 0 else 0.0)) * once
        if not (cap_p > 0 or cap_d > 0) or not math.isfinite(busy):
            busy = math.nan
        row = _advice(label, int((util["role"] == label).sum()), busy, 1.0, service_p,
                      float(d["ttft_target_ms"]), headroom, queueing=True)
        if math.isfinite(service_d) and service_d > float(d["tpot_target_ms"]):
            row["slo_reachable"] = False  # one decode step alone misses the TPOT target
        rows = [row]
    return pd.DataFrame(rows, columns=_ADVICE_COLUMNS)


def pd_ratio(src: Source, *, targets: Mapping[str, SloTargets] | None = None,
             headroom: float = DEFAULT_HEADROOM) -> PdRatio:
    """Every prefill:decode analysis, with the advice for ``headroom`` and the run's SLO targets."""
    util = utilisation(src)
    need = demand(src, targets=targets, headroom=headroom)
    return PdRatio(util, pools(util), watermarks(src), kv_transfer(src), need,
                   recommendation(src, util, need=need, targets=targets, headroom=headroom))
