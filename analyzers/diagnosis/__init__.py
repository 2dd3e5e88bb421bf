"""Diagnosis: for every request that missed a target, the causes of its time over target.

A request *missed* when (status ok, measured) its TTFT exceeds its SLO class's TTFT target, its
TPOT the TPOT target, one of its token gaps the ITL target (a request meets ITL when none of its
gaps exceeds it), or, when an E2E target is given, its end-to-end time that target. Targets are
the classes' (:func:`analyzers.slo.resolve_targets`) unless :class:`Targets` overrides them; the ITL
target defaults to the class's TPOT target. TTFT is the server's (as :mod:`analyzers.slo` judges it);
with client rows, a request whose TTFT only the client saw over target (send to first chunk) missed
too, and its excess is explained by its server-side time as any TTFT is, and by the serving event loop's
late ticks after the first chunk was written (``event_loop_lag``, ``gil_contention`` or ``cpu_starved`` by why
the loop ran late: :mod:`analyzers.diagnosis.event_loop`) and the rest (``outside_server``).

The *excess* is the time over target: TTFT - target, plus each gap over the ITL target beyond it
(or, for a TPOT miss without such a gap, (TPOT - target) x (tokens - 1)); the E2E excess instead
when larger. The rules (:mod:`analyzers.diagnosis.queueing`, :mod:`analyzers.diagnosis.stages`,
:mod:`analyzers.diagnosis.prefill`, :mod:`analyzers.diagnosis.event_loop`, documented with their thresholds
in ``docs/diagnosis.md``) turn the request's spans in its TTFT and in each missed gap into findings; a phase's findings are scaled down to that phase's excess when
they explain more than it, and what they do not explain is ``unknown`` (the request's own ordinary
work, or a cause no rule knows). Causes are merged per (cause, stage, tenant) and ordered by
milliseconds, largest first, ``unknown`` last whatever its size (it is no cause, only what is left);
``share`` = ms / excess. ``outside_server`` counts the client's TTFT beyond the server's (and beyond
the event loop's late ticks) when that gap is at least ``OUTSIDE_MIN_MS`` and
``OUTSIDE_MEDIAN_FACTOR`` x the run's median gap, or whatever the median when the gap is the ~40 ms step
of Nagle's algorithm meeting delayed ACKs (``DELAYED_ACK_MS`` +- ``DELAYED_ACK_BAND_MS``) and at least
``DELAYED_ACK_SHARE`` of the run's requests show it: a gap every request pays is still a cause.

Pure: tables in (a :class:`~analyzers.source.Source`), frames out (:class:`Diagnosis`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import pandas as pd

from analyzers.diagnosis.causes import CAUSES, FIXES, OUTSIDE_SERVER, UNKNOWN, Finding
from analyzers.diagnosis.event_loop import loop_lag_findings
from analyzers.diagnosis.evidence import gap_tokens, gather, requests_frame
from analyzers.diagnosis.run_context import RunContext
from analyzers.diagnosis.stages import gap_findings, ttft_findings
from analyzers.slo import SloTargets, resolve_targets
from analyzers.source import Source
from analyzers.timing import E2E_NS, LATENCY, TOKEN_END, TOKEN_START, TPOT_NS, TTFT_NS
from tokentrace.schema import RequestStatus, col

__all__ = ["Targets", "Diagnosis", "diagnose", "CAUSES", "FIXES", "REQUEST_COLUMNS", "CAUSE_COLUMNS", "GAP_COLUMNS",
           "SUMMARY_COLUMNS"]

MIN_FINDING_MS = 0.05  # a finding smaller than this is noise, not a cause
OUTSIDE_MIN_MS = 5.0  # client-observed TTFT beyond the server's by less than this ...
OUTSIDE_MEDIAN_FACTOR = 2.0  # ... or than twice the run's median such gap is the client's usual overhead
DELAYED_ACK_MS = 40.0  # Linux's shortest delayed-ACK timer: a small write held by Nagle waits for it
DELAYED_ACK_BAND_MS = 8.0  # a client-server gap within this of DELAYED_ACK_MS has its signature ...
DELAYED_ACK_SHARE = 0.2  # ... when at least this share of the run's requests show it

REQUEST_COLUMNS = [col.REQUEST_ID, col.REQUEST_KEY, col.TENANT, col.SLO_CLASS, col.ARRIVAL_NS, "missed", "excess_ms",
                   "ttft_ms", "ttft_target_ms", "tpot_ms", "tpot_target_ms", "max_gap_ms", "itl_target_ms", "e2e_ms",
                   "e2e_target_ms", "num_gaps_missed", "first_cause"]
CAUSE_COLUMNS = [col.REQUEST_ID, col.REQUEST_KEY, "rank", "cause", "ms", "share", "evidence", "fix", "stage", "tenant",
                 "requests"]
GAP_COLUMNS = [col.REQUEST_ID, col.TOKEN_INDEX, "gap_ms", "excess_ms", "cause", "cause_ms"]
SUMMARY_COLUMNS = ["cause", "num_first", "num_requests", "ms", "share", "stage", "tenant", "fix", "evidence"]


@dataclass(frozen=True, slots=True)
class Targets:
    """Targets given by the caller (ms), overriding every class's; ``None`` keeps the class's."""

    ttft_ms: float | None = None
    itl_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "itl_ms", "e2e_ms"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"target {name} must be a positive number of ms, got {v!r}")


@dataclass(frozen=True, slots=True, eq=False)
class Diagnosis:
    """Per missed request (``requests``), its causes (``causes``, one row per cause, rank 1 the largest),
    its gaps over the ITL target (``gaps``) and the causes over the run (``summary``: ranked by the share
    of all missed time they explain; ``num_first``: requests whose first cause it is)."""

    requests: pd.DataFrame
    causes: pd.DataFrame
    gaps: pd.DataFrame
    summary: pd.DataFrame
    num_judged: int

    @property
    def num_missed(self) -> int:
        return len(self.requests)


def diagnose(src: Source, *, targets: Targets | None = None,
             slo_targets: Mapping[str, SloTargets] | None = None) -> Diagnosis:
    """The diagnosis of the run behind ``src`` (module doc)."""
    from analyzers.load import cached_load

    given = targets or Targets()
    c = col
    req = requests_frame(src)
    classes = sorted(set(req[c.SLO_CLASS].fillna("").astype(str)))
    per_class = resolve_targets(src, classes, slo_targets)
    itl_ns = {k: int((given.itl_ms or v.tpot_ms) * 1e6) for k, v in per_class.items()}
    gaps = gap_tokens(src, itl_ns)
    served = req[(req[c.STATUS].fillna(0) == int(RequestStatus.OK)) & req[TTFT_NS].notna()]
    client = None
    judged = _judge(served, gaps, per_class, given)
    missed = judged[judged["missed"] != ""]
    ids = missed[c.REQUEST_ID].astype("int64").tolist()
    ev = gather(src, req, gaps, ids)
    if len(ev.client):
        client = ev.client.set_index(c.REQUEST_ID)
        judged = _judge(served, gaps, per_class, given, client)
        missed = judged[judged["missed"] != ""]
        if set(missed[c.REQUEST_ID].astype("int64")) - set(ids):  # misses only the client saw: their spans too
            ev = gather(src, req, gaps, missed[c.REQUEST_ID].astype("int64").tolist())
    if not len(missed):
        return _empty(len(judged))
    ctx = RunContext(ev, cached_load(src).row)
    spans_by = {int(k): g for k, g in ev.spans.groupby(c.REQUEST_ID)}
    gaps_by = {int(k): g for k, g in gaps.groupby(c.REQUEST_ID)}
    req_rows, cause_rows, gap_rows = [], [], []
    for r in missed.to_dict("records"):
        rid = int(r[c.REQUEST_ID])
        causes, gap_out = _request_causes(ctx, r, spans_by.get(rid, ev.spans.iloc[0:0]),
                                          gaps_by.get(rid, gaps.iloc[0:0]), client)
        gap_rows += gap_out
        for rank, f in enumerate(causes, 1):
            cause_rows.append({c.REQUEST_ID: rid, c.REQUEST_KEY: r[c.REQUEST_KEY], "rank": rank, "cause": f.cause,
                               "ms": f.ms, "share": f.ms / r["excess_ms"] if r["excess_ms"] > 0 else math.nan,
                               "evidence": f.evidence, "fix": FIXES.get(f.cause, ""), "stage": f.stage,
                               "tenant": f.tenant, "requests": ", ".join(f.requests)})
        req_rows.append({**{k: r[k] for k in REQUEST_COLUMNS if k != "first_cause"},
                         "first_cause": causes[0].cause if causes else UNKNOWN})
    causes_df = pd.DataFrame(cause_rows, columns=CAUSE_COLUMNS)
    requests_df = pd.DataFrame(req_rows, columns=REQUEST_COLUMNS).sort_values(
        ["excess_ms", c.REQUEST_ID], ascending=[False, True], kind="stable").reset_index(drop=True)
    return Diagnosis(requests=requests_df, causes=causes_df, gaps=pd.DataFrame(gap_rows, columns=GAP_COLUMNS),
                     summary=_summary(causes_df, requests_df), num_judged=len(judged))


def _empty(num_judged: int) -> Diagnosis:
    return Diagnosis(requests=pd.DataFrame(columns=REQUEST_COLUMNS), causes=pd.DataFrame(columns=CAUSE_COLUMNS),
                     gaps=pd.DataFrame(columns=GAP_COLUMNS), summary=pd.DataFrame(columns=SUMMARY_COLUMNS),
                     num_judged=num_judged)


def _judge(served: pd.DataFrame, gaps: pd.DataFrame, per_class: Mapping[str, SloTargets], given: Targets,
           client: pd.DataFrame | None = None) -> pd.DataFrame:
    """``served`` with each request's targets, figures, ``missed`` ("ttft,itl", '' when met) and excess."""
    c = col
    df = served.copy()
    cls = df[c.SLO_CLASS].fillna("").astype(str)
    df["ttft_target_ms"] = given.ttft_ms if given.ttft_ms else cls.map(lambda k: per_class[k].ttft_ms)
    df["tpot_target_ms"] = cls.map(lambda k: per_class[k].tpot_ms)
    df["itl_target_ms"] = given.itl_ms if given.itl_ms else df["tpot_target_ms"]
    df["e2e_target_ms"] = given.e2e_ms if given.e2e_ms else math.nan
    ttft = df[TTFT_NS].astype("float64") / 1e6
    df["ttft_ms"] = ttft
    seen = ttft
    if client is not None and len(client):
        seen = df[c.REQUEST_ID].map((client["client_first_ns"] - client["client_sent_ns"]).astype("float64") / 1e6)
        seen = seen.where(seen.notna() & (seen > ttft), ttft)
    df["client_ttft_ms"] = seen
    df["outside_median_ms"] = float((seen - ttft).median()) if len(df) else math.nan
    df["delayed_ack_share"] = float(((seen - ttft - DELAYED_ACK_MS).abs() <= DELAYED_ACK_BAND_MS).mean()) if len(df) else 0.0
    df["tpot_ms"] = df[TPOT_NS].astype("float64") / 1e6
    df["e2e_ms"] = df[E2E_NS].astype("float64") / 1e6
    over = gaps.assign(over_ms=gaps[LATENCY].astype("float64") / 1e6)
    by = over.groupby(c.REQUEST_ID)["over_ms"]
    df["max_gap_ms"] = df[c.REQUEST_ID].map(by.max()).astype("float64")
    df["num_gaps_missed"] = df[c.REQUEST_ID].map(by.size()).fillna(0).astype("int64")
    gap_sum = df[c.REQUEST_ID].map(by.sum()).fillna(0.0).astype("float64")
    server_miss = df["ttft_ms"] > df["ttft_target_ms"]
    miss_ttft = server_miss | (df["client_ttft_ms"] > df["ttft_target_ms"])  # a miss only the client saw counts
    miss_tpot = df["tpot_ms"] > df["tpot_target_ms"]
    miss_itl = df["num_gaps_missed"] > 0
    miss_e2e = df["e2e_ms"] > df["e2e_target_ms"]
    df["missed"] = [",".join(n for n, m in zip(("ttft", "tpot", "itl", "e2e"), row) if m)
                    for row in zip(miss_ttft, miss_tpot, miss_itl, miss_e2e)]
    ttft_ex = (df["ttft_ms"].where(server_miss, df["client_ttft_ms"]) - df["ttft_target_ms"]).where(miss_ttft, 0.0)
    df["client_only_ttft"] = miss_ttft & ~server_miss
    gap_ex = (gap_sum - df["num_gaps_missed"] * df["itl_target_ms"]).where(miss_itl, 0.0)
    tokens = df[c.NUM_OUTPUT_TOKENS].astype("float64") - 1
    tpot_ex = ((df["tpot_ms"] - df["tpot_target_ms"]) * tokens).where(miss_tpot & ~miss_itl, 0.0)
    e2e_ex = (df["e2e_ms"] - df["e2e_target_ms"]).where(miss_e2e, 0.0)
    df["ttft_excess_ms"], df["decode_excess_ms"] = ttft_ex, gap_ex + tpot_ex
    df["excess_ms"] = np.maximum(ttft_ex + gap_ex + tpot_ex, e2e_ex)
    return df


def _request_causes(ctx: RunContext, r: dict, spans: pd.DataFrame, gaps: pd.DataFrame,
                    client: pd.DataFrame | None) -> tuple[list[Finding], list[dict]]:
    """The merged, ordered causes of one missed request, and its gap rows."""
    c = col
    rid, arrival, first = int(r[c.REQUEST_ID]), int(r[c.ARRIVAL_NS]), int(r[c.FIRST_TOKEN_NS])
    found: list[Finding] = []
    e2e_only = r["ttft_excess_ms"] <= 0 and r["decode_excess_ms"] <= 0
    if r["ttft_excess_ms"] > 0 or e2e_only:
        phase = ttft_findings(ctx, rid, arrival, first, spans, r["ttft_target_ms"] * 1e6)
        if r["client_only_ttft"]:  # the target is on the client's TTFT: the server's part counts as well
            phase += _outside(ctx, r)
        found += phase if e2e_only else _scaled(phase, r["ttft_excess_ms"])
    gap_rows = []
    itl_ns = r["itl_target_ms"] * 1e6
    for g in gaps.itertuples(index=False):
        token, lo, hi = int(getattr(g, c.TOKEN_INDEX)), int(getattr(g, TOKEN_START)), int(getattr(g, TOKEN_END))
        excess = (hi - lo) / 1e6 - r["itl_target_ms"]
        phase = _scaled(gap_findings(ctx, rid, token, lo, hi, spans, itl_ns), excess)
        top = max(phase, key=lambda f: f.ms) if phase else None
        gap_rows.append({c.REQUEST_ID: rid, c.TOKEN_INDEX: token, "gap_ms": (hi - lo) / 1e6, "excess_ms": excess,
                         "cause": top.cause if top else UNKNOWN, "cause_ms": top.ms if top else excess})
        found += phase
    merged = _merge(found)
    if e2e_only or r["excess_ms"] > r["ttft_excess_ms"] + r["decode_excess_ms"]:
        merged = _scaled(merged, r["excess_ms"])
    explained = sum(f.ms for f in merged)
    rest = r["excess_ms"] - explained
    if rest > 1e-6 and rest >= 0.01 * r["excess_ms"]:
        merged.append(Finding(UNKNOWN, rest, f"{rest:,.1f} ms of the time over target has no cause in the trace"))
    return sorted(merged, key=lambda f: (f.cause == UNKNOWN, -f.ms)), gap_rows


def _outside(ctx: RunContext, r: dict) -> list[Finding]:
    """The client's TTFT beyond the server's: while the serving event loop ran late, the server's write had not
    left it (``event_loop_lag`` and its siblings, by why the loop ran late); the rest, past the noise floor, is ``outside_server``."""
    outside = r["client_ttft_ms"] - r["ttft_ms"]
    if not outside > 0:
        return []
    sent = int(r[col.ARRIVAL_NS] + r["ttft_ms"] * 1e6)
    lag = min(ctx.lag_overlap_ns(sent, int(sent + outside * 1e6)) / 1e6, outside)
    out = loop_lag_findings(ctx, sent, int(sent + outside * 1e6), "the serving event loop running late after its "
                            "first chunk was written, before the client received it", limit_ms=outside)
    rest = outside - lag
    nagle = abs(outside - DELAYED_ACK_MS) <= DELAYED_ACK_BAND_MS and r["delayed_ack_share"] >= DELAYED_ACK_SHARE
    if rest >= OUTSIDE_MIN_MS and (nagle or rest >= OUTSIDE_MEDIAN_FACTOR * r["outside_median_ms"]):
        why = (f": a ~{DELAYED_ACK_MS:.0f} ms step that {r['delayed_ack_share']:.0%} of the run's requests show, the "
               f"signature of Nagle's algorithm holding the server's small writes until the client's delayed ACK "
               f"(set TCP_NODELAY on the server's sockets)") if nagle else ""
        out.append(Finding(OUTSIDE_SERVER, rest, f"reached the client {rest:,.1f} ms later than the server's TTFT "
                           f"and its event loop account for ({r['client_ttft_ms']:,.1f} against "
                           f"{r['ttft_ms']:,.1f} ms){why}"))
    return out


def _scaled(findings: list[Finding], excess_ms: float) -> list[Finding]:
    """``findings`` scaled down so that they sum to ``excess_ms`` when they explain more than it (findings under
    ``MIN_FINDING_MS`` dropped)."""
    findings = [f for f in findings if f.ms >= MIN_FINDING_MS]
    total = sum(f.ms for f in findings)
    if total <= excess_ms or total <= 0:
        return findings
    k = max(excess_ms, 0.0) / total
    return [Finding(f.cause, f.ms * k, f.evidence, f.stage, f.tenant, f.requests) for f in findings if f.ms > 0]


def _merge(findings: list[Finding]) -> list[Finding]:
    """One finding per (cause, stage, tenant): ms summed, the largest one's evidence (with a count)."""
    groups: dict[tuple[str, str, str], list[Finding]] = {}
    for f in findings:
        groups.setdefault((f.cause, f.stage, f.tenant), []).append(f)
    out = []
    for (cause, stage, tenant), fs in groups.items():
        top = max(fs, key=lambda f: f.ms)
        names = tuple(dict.fromkeys(n for f in fs for n in f.requests))
        evidence = top.evidence if len(fs) == 1 else f"{top.evidence} (and {len(fs) - 1} more like it)"
        out.append(Finding(cause, sum(f.ms for f in fs), evidence, stage, tenant, names))
    return out


def _summary(causes: pd.DataFrame, requests: pd.DataFrame) -> pd.DataFrame:
    """The causes over the run, ranked by the share of all missed time (summed excess) they explain, ``unknown``
    last whatever its size (as in each request's causes: it is no cause, only what is left)."""
    if not len(causes):
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    total = float(requests["excess_ms"].sum())
    first = causes[causes["rank"] == 1]["cause"].value_counts()
    rows = []
    for cause, g in causes.groupby("cause"):
        top = g.loc[g["ms"].idxmax()]
        stage = g.groupby("stage")["ms"].sum().idxmax()
        tenant = g.groupby("tenant")["ms"].sum().idxmax()
        rows.append({"cause": cause, "num_first": int(first.get(cause, 0)), "num_requests": g[col.REQUEST_ID].nunique(),
                     "ms": float(g["ms"].sum()), "share": float(g["ms"].sum()) / total if total > 0 else math.nan,
                     "stage": stage, "tenant": tenant, "fix": FIXES.get(str(cause), ""),
                     "evidence": f"{top[col.REQUEST_KEY]}: {top['evidence']}"})
    rows.sort(key=lambda r: (r["cause"] == UNKNOWN, -r["ms"], r["cause"]))  # as each request's causes are sorted
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)
