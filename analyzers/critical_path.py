"""The critical path of TTFT and the slowest requests with their breakdowns.

Critical path: token 0's interval [arrival, first visible content] (TTFT, as every
analysis counts it) is tiled by the spans that count in it, clipped as the stage
breakdown clips them (:data:`analyzers.stage_breakdown.REQUEST_STAGE_NS`), so the
ordered chain of those stages *is* the path to the first visible content.
For a group of requests, each stage gets its mean time per request (requests
without the stage count as 0), its share of the group's summed TTFT, and its
mean start offset from arrival (over the requests that have it), which orders
the chain. A stage counts only within the request's TTFT, and stages that claim the
same time share it, so a group's shares sum to 100% and ``unattributed`` (what no
stage covers) is never negative. Groups: ``p50`` = the requests whose TTFT lies between the 45th and
55th percentile (at least the one nearest the median); ``p99`` = requests at
or above the 99th percentile (at least the slowest one).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analyzers.source import Source
from analyzers.stage_breakdown import request_stage_ns
from analyzers.timing import E2E_NS, TPOT_NS, TTFT_NS, request_table
from tokentrace.schema import UNATTRIBUTED_LABEL, Stage, col

__all__ = ["critical_path", "slowest_requests", "CRITICAL_PATH_GROUPS"]

CRITICAL_PATH_GROUPS: dict[str, tuple[float, float]] = {"p50": (45.0, 55.0), "p99": (99.0, 100.0)}
"""Group name -> TTFT percentile range (inclusive) of the requests it averages."""

_CP_COLUMNS = ["group", "position", "stage", "mean_ms", "share_of_ttft", "mean_start_offset_ms"]


def _pick(ttft: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Indices of requests with TTFT in [P_lo, P_hi]; the nearest to P_mid if none."""
    a, b = np.percentile(ttft, lo), np.percentile(ttft, hi)
    idx = np.flatnonzero((ttft >= a) & (ttft <= b))
    if idx.size == 0:
        idx = np.array([int(np.argmin(np.abs(ttft - np.percentile(ttft, (lo + hi) / 2))))])
    return idx


def critical_path(src: Source) -> pd.DataFrame:
    """Ordered stage chain of token 0 for the median (``p50``) and tail (``p99``) requests.

    Columns: group, position (0 = first stage), stage (label; ``unattributed``
    last when non-zero), mean_ms, share_of_ttft, mean_start_offset_ms.
    """
    c = col
    rf = request_table(src)
    req = src.df(f"SELECT {c.REQUEST_ID}, {TTFT_NS} FROM {rf} WHERE {TTFT_NS} IS NOT NULL ORDER BY {c.REQUEST_ID}")
    if req.empty:
        return pd.DataFrame(columns=_CP_COLUMNS)
    ttft = req[TTFT_NS].to_numpy(float)
    picked = {group: req[c.REQUEST_ID].to_numpy()[_pick(ttft, lo, hi)]
              for group, (lo, hi) in CRITICAL_PATH_GROUPS.items()}
    per = _first_token_stages(src, rf, np.unique(np.concatenate(list(picked.values()))))
    per = _on_path(per, req.set_index(c.REQUEST_ID)[TTFT_NS])
    rows = []
    for group in CRITICAL_PATH_GROUPS:
        ids = picked[group]
        sel = per[per[c.REQUEST_ID].isin(ids)]
        total = float(ttft[np.isin(req[c.REQUEST_ID].to_numpy(), ids)].sum())
        agg = sel.groupby("stage").agg(ns=("ns", "sum"), offset=("offset_ns", "mean")).sort_values("offset")
        chain = [(Stage(int(s)).label, r["ns"], r["offset"]) for s, r in agg.iterrows()]
        rest = max(total - float(agg["ns"].sum()), 0.0)  # _on_path keeps each request's stages within its TTFT
        if rest > 0:
            chain.append((UNATTRIBUTED_LABEL, rest, np.nan))
        for pos, (label, ns, offset) in enumerate(chain):
            rows.append({"group": group, "position": pos, "stage": label, "mean_ms": ns / len(ids) / 1e6,
                         "share_of_ttft": ns / total if total > 0 else np.nan,
                         "mean_start_offset_ms": offset / 1e6})
    return pd.DataFrame(rows, columns=_CP_COLUMNS)


def _on_path(per: pd.DataFrame, ttft_ns: pd.Series) -> pd.DataFrame:
    """Each request's token-0 stage time limited to its path to the first token: a stage counts only up to the
    request's TTFT from where it starts (time after the first visible content is not on that path), and when the
    stages still claim more than the TTFT (two of them claim the same time) each is scaled by TTFT / claimed, so
    a request's stages never sum past its TTFT and the remainder (unattributed) is never negative."""
    c = col
    if per.empty:
        return per
    out = per.copy()
    limit = out[c.REQUEST_ID].map(ttft_ns).astype(float).to_numpy()
    room = np.clip(limit - out["offset_ns"].to_numpy(float), 0.0, None)
    out["ns"] = np.minimum(out["ns"].to_numpy(float), room)
    claimed = out.groupby(c.REQUEST_ID)["ns"].transform("sum").to_numpy(float)
    scale = np.where(claimed > limit, limit / np.where(claimed > 0, claimed, 1.0), 1.0)
    out["ns"] = out["ns"].to_numpy(float) * scale
    return out


def _first_token_stages(src: Source, rf: str, ids: np.ndarray) -> pd.DataFrame:
    """Per request of ``ids`` (with a TTFT) and stage of the spans that count in its TTFT: request_id, stage, ns
    (their clipped time summed), offset_ns (its earliest moment minus the request's arrival), from the per-request
    stage sums
    (:data:`analyzers.stage_breakdown.REQUEST_STAGE_NS`)."""
    c = col
    src.register("cp_ids", pd.DataFrame({c.REQUEST_ID: ids.astype(np.int64)}))
    try:
        return src.df(f"""
            SELECT w.{c.REQUEST_ID}, w.{c.STAGE} AS stage, SUM(w.first_ns)::DOUBLE AS ns,
                   (MIN(w.first_start_ns) - MIN(f.{c.ARRIVAL_NS}))::DOUBLE AS offset_ns
            FROM {request_stage_ns(src)} w JOIN {rf} f USING ({c.REQUEST_ID})
            WHERE w.first_ns IS NOT NULL AND f.{TTFT_NS} IS NOT NULL
              AND w.{c.REQUEST_ID} IN (SELECT {c.REQUEST_ID} FROM cp_ids)
            GROUP BY w.{c.REQUEST_ID}, w.{c.STAGE}
        """)
    finally:
        src.unregister("cp_ids")


def _stage_ms(src: Source) -> pd.DataFrame:
    """Per request of ``slow_ids`` and stage: request_id, stage, ms: the time its spans count in the request's token
    intervals (clipped as the stage breakdown clips them, :data:`analyzers.stage_breakdown.REQUEST_STAGE_NS`).
    A span's time hidden behind an earlier token's delivery (a decode step's wait while the previous token is still
    streamed) is no part of the request's latency, as in the breakdown."""
    c = col
    known = ", ".join(str(int(st)) for st in Stage)
    return src.df(f"""
        SELECT {c.REQUEST_ID}, {c.STAGE} AS stage, SUM(ns) / 1e6 AS ms
        FROM {request_stage_ns(src)}
        WHERE {c.REQUEST_ID} IN (SELECT {c.REQUEST_ID} FROM slow_ids) AND {c.STAGE} IN ({known})
        GROUP BY {c.REQUEST_ID}, {c.STAGE} HAVING SUM(ns) > 0
    """)


def slowest_requests(src: Source, n: int = 10) -> pd.DataFrame:
    """The ``n`` requests with the longest end-to-end latency, with where their time went.

    Columns: request_id, request_key, tenant_name, slo_class_name, ttft_ms,
    tpot_ms, e2e_ms, num_output_tokens, then one column per stage label
    (ms its spans count in the request's token intervals, clipped as the stage
    breakdown clips them, so a stage's share of E2E is read as the breakdown reads
    it) and ``unattributed`` (e2e minus those). Ordered by e2e_ms descending;
    ``ValueError`` if n < 1.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    c = col
    rf = request_table(src)
    top = src.df(f"""
        SELECT {c.REQUEST_ID}, {c.REQUEST_KEY}, {c.TENANT}, {c.SLO_CLASS}, {TTFT_NS} / 1e6 AS ttft_ms,
               {TPOT_NS} / 1e6 AS tpot_ms, {E2E_NS} / 1e6 AS e2e_ms, {c.NUM_OUTPUT_TOKENS}
        FROM {rf} WHERE {E2E_NS} IS NOT NULL ORDER BY {E2E_NS} DESC, {c.REQUEST_ID} LIMIT {n}
    """)
    labels = [s.label for s in Stage]
    for label in labels:
        top[label] = 0.0
    if not top.empty:
        src.register("slow_ids", top[[c.REQUEST_ID]])
        per = _stage_ms(src)
        src.unregister("slow_ids")
        if len(per):
            wide = per.pivot_table(index=c.REQUEST_ID, columns="stage", values="ms", aggfunc="sum")
            wide.columns = [Stage(int(s)).label for s in wide.columns]
            wide = wide.reindex(top[c.REQUEST_ID]).fillna(0.0)
            for label in wide.columns:
                top[label] = wide[label].to_numpy()
    top[UNATTRIBUTED_LABEL] = top["e2e_ms"] - top[labels].sum(axis=1)
    return top
