"""SLO attainment, goodput (DistServe) and streaming smoothness (Etalon's fluidity-index).

Targets per SLO class (:class:`SloTargets`, TTFT and TPOT in ms) come from, in
order: the ``targets`` argument; the run manifest's config
``{"slo": {"<class>": {"ttft_ms": .., "tpot_ms": ..}}}``; its
``{"slo_ms": {"ttft": .., "tpot": ..}}`` (one pair for every class, as written by
``tokentrace bench --slo``); else :data:`DEFAULT_TARGETS` (interactive: TTFT
500 ms, TPOT 100 ms; batch: TTFT 30 s, TPOT 1 s). A class with no target of its
own gets the interactive one.

A request *meets its SLO* when it was served (status ok), TTFT <= the TTFT
target and TPOT <= the TPOT target (a request of one output token has no TPOT
and meets that half). An errored, aborted, timed-out (cut off) or rejected
request is never good, whatever its tokens. Every server-side request with an
arrival time is counted.

What the run did not measure is *not measured*, never met: a served request
whose first token was not recorded has no TTFT verdict, and one of more than
one output token (by its request row or its delivered tokens) with fewer than
two delivered tokens has no TPOT verdict (e.g. OTLP spans without per-token
events). Attainment = met / judged, where judged = failed requests + served
requests with the metric measured; it is NaN (not measured) when the class has
served requests and none of them has the metric measured. ``attainment`` (both
targets) needs both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import pandas as pd

from analyzers import facts
from analyzers.groups import ALL, check_window_s
from analyzers.source import Source
from analyzers.timing import TOKEN_END, TPOT_NS, TTFT_NS, request_table, run_bounds, token_times
from tokentrace.schema import REQUESTS, RequestStatus, col

__all__ = ["SloTargets", "DEFAULT_TARGETS", "resolve_targets", "request_slo", "slo_attainment", "goodput",
           "fluidity", "request_fluidity", "DEFAULT_TARGET_SHARE", "reported_tokens_sql"]

DEFAULT_TARGET_SHARE = 0.9  # DistServe's usual attainment goal


@dataclass(frozen=True, slots=True)
class SloTargets:
    """Latency targets of one SLO class, in milliseconds."""

    ttft_ms: float
    tpot_ms: float

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"SLO target {name} must be a positive number of ms, got {v!r}")


DEFAULT_TARGETS: dict[str, SloTargets] = {
    "interactive": SloTargets(ttft_ms=500.0, tpot_ms=100.0),
    "batch": SloTargets(ttft_ms=30_000.0, tpot_ms=1_000.0),
}


def _from_manifest(manifest: Mapping[str, Any]) -> dict[str, SloTargets]:
    config = manifest.get("config") if isinstance(manifest, Mapping) else None
    if not isinstance(config, Mapping):
        return {}
    out: dict[str, SloTargets] = {}
    pair = config.get("slo_ms")
    if isinstance(pair, Mapping) and {"ttft", "tpot"} <= set(pair):
        try:
            out[ALL] = SloTargets(float(pair["ttft"]), float(pair["tpot"]))
        except (TypeError, ValueError):
            pass
    per_class = config.get("slo")
    if isinstance(per_class, Mapping):
        for name, t in per_class.items():
            if isinstance(t, Mapping) and {"ttft_ms", "tpot_ms"} <= set(t):
                try:
                    out[str(name)] = SloTargets(float(t["ttft_ms"]), float(t["tpot_ms"]))
                except (TypeError, ValueError):
                    continue
    return out


def resolve_targets(src: Source, classes: list[str],
                    targets: Mapping[str, SloTargets] | None = None) -> dict[str, SloTargets]:
    """The target of every class in ``classes`` (see the module doc for the order of sources)."""
    if targets is not None:
        bad = [k for k, v in targets.items() if not isinstance(v, SloTargets)]
        if bad:
            raise ValueError(f"targets must map class names to SloTargets; bad entries: {', '.join(map(str, bad))}")
    manifest = _from_manifest(src.manifest)
    out = {}
    for name in classes:
        for source in (targets or {}, manifest):
            if name in source:
                out[name] = source[name]
                break
            if ALL in source:
                out[name] = source[ALL]
                break
        else:
            out[name] = DEFAULT_TARGETS.get(name, DEFAULT_TARGETS["interactive"])
    return out


def request_slo(src: Source, targets: Mapping[str, SloTargets] | None = None) -> pd.DataFrame:
    """One row per request: request_id, slo_class_name, arrival_ns, ttft_ms, tpot_ms, failed, ttft_ok,
    tpot_ok, ok. The verdicts are True, False or None (not measured); see the module doc.

    Computed once per source and targets (attainment and goodput both judge every request); each call
    returns its own copy."""
    return _verdicts(src, targets)[0].copy()


_VERDICT_OF_CODE = np.array([None, False, True], dtype=object)
"""Verdict object of a verdict code + 1 (codes: -1 not measured, 0 missed, 1 met)."""


def _verdicts(src: Source, targets: Mapping[str, SloTargets] | None
              ) -> tuple[pd.DataFrame, dict[str, np.ndarray]]:
    """:func:`request_slo`'s rows (cached once per source and targets) and, per verdict column, its verdicts as
    int8 codes (-1 not measured, 0 missed, 1 met) aligned with the rows, for counting without object compares."""
    key = "request_slo:" + repr(sorted((targets or {}).items()))
    return src.cached(key, lambda: _request_slo(src, targets))


def reported_tokens_sql() -> str:
    """SELECT of (request_id, reported): the most output tokens any server row of the request reported (the rows
    of the derived fact :data:`REQUEST_REPORTED_TOKENS`)."""
    c = col
    return f"SELECT {c.REQUEST_ID}, MAX({c.NUM_OUTPUT_TOKENS}) AS reported FROM srv_requests GROUP BY {c.REQUEST_ID}"


REQUEST_REPORTED_TOKENS = facts.Fact(
    "request_reported_tokens", "Per request: the most output tokens any server row of it reported.",
    (REQUESTS.column(col.REQUEST_ID), facts.i64("reported", "Output tokens reported (most over its rows).")),
    select=lambda src: reported_tokens_sql())


def _request_slo(src: Source, targets: Mapping[str, SloTargets] | None
                 ) -> tuple[pd.DataFrame, dict[str, np.ndarray]]:
    c = col
    reported = facts.relation(src, REQUEST_REPORTED_TOKENS)
    f = src.df(f"""
        WITH reported AS (SELECT * FROM {reported})
        SELECT f.{c.REQUEST_ID}, f.{c.SLO_CLASS}, f.{c.ARRIVAL_NS}, f.{TTFT_NS} / 1e6 AS ttft_ms,
               f.{TPOT_NS} / 1e6 AS tpot_ms, COALESCE(f.{c.STATUS}, {int(RequestStatus.OK)}) AS status,
               GREATEST(COALESCE(r.reported, 0), f.{c.NUM_OUTPUT_TOKENS}) AS num_tokens
        FROM {request_table(src)} f LEFT JOIN reported r USING ({c.REQUEST_ID})
        WHERE f.{c.ARRIVAL_NS} IS NOT NULL ORDER BY f.{c.ARRIVAL_NS}, f.{c.REQUEST_ID}
    """)
    tg = resolve_targets(src, sorted(f[c.SLO_CLASS].unique().tolist()), targets)
    classes = f[c.SLO_CLASS].astype("category")  # a few classes: map each once, not each request
    ttft_t = classes.map({k: t.ttft_ms for k, t in tg.items()}).astype(float)
    tpot_t = classes.map({k: t.tpot_ms for k, t in tg.items()}).astype(float)
    failed = (f["status"] != int(RequestStatus.OK)).to_numpy()
    ttft_ok = np.where(failed, 0, np.where(f["ttft_ms"].isna(), -1, f["ttft_ms"] <= ttft_t)).astype(np.int8)
    one_token = (f["num_tokens"] <= 1).to_numpy()
    tpot_ok = np.where(failed, 0, np.where(one_token, 1, np.where(f["tpot_ms"].isna(), -1, f["tpot_ms"] <= tpot_t))
                       ).astype(np.int8)
    codes = {"ttft_ok": ttft_ok, "tpot_ok": tpot_ok, "ok": _both_all(ttft_ok, tpot_ok)}
    f["failed"] = failed
    for name, code in codes.items():
        f[name] = pd.Series(_VERDICT_OF_CODE[code + 1], index=f.index, dtype=object)
    return f.drop(columns=["status", "num_tokens"]), codes


def _both_all(ttft_ok: np.ndarray, tpot_ok: np.ndarray) -> np.ndarray:
    """:func:`_both` of every pair of verdict codes (-1 not measured, 0 missed, 1 met), without a Python loop."""
    missed = (ttft_ok == 0) | (tpot_ok == 0)
    unknown = (ttft_ok == -1) | (tpot_ok == -1)
    return np.where(missed, 0, np.where(unknown, -1, 1)).astype(np.int8)


def _both(ttft_ok: object, tpot_ok: object) -> object:
    """Both targets met: False as soon as one is missed, None when one is not measured."""
    if ttft_ok is False or tpot_ok is False:
        return False
    if ttft_ok is None or tpot_ok is None:
        return None
    return True


def _judge(code: np.ndarray, failed: np.ndarray) -> tuple[int, float]:
    """(served requests with a verdict measured, share met among judged requests; NaN if not measured), from the
    verdict codes of a group's requests (-1 not measured, 0 missed, 1 met) and whether each failed."""
    served = ~failed.astype(bool)
    judged = code >= 0
    measured = int((served & judged).sum())
    if served.any() and measured == 0:
        return 0, math.nan
    if not judged.any():
        return measured, math.nan
    return measured, float((code[judged] == 1).mean())


def _class_rows(f: pd.DataFrame) -> list[tuple[str, np.ndarray]]:
    """(class, positions of its rows) for every class, then (ALL, every position), as :func:`_class_frames`."""
    groups = f.groupby(col.SLO_CLASS, sort=True).indices
    return [(k, groups[k]) for k in sorted(groups)] + [(ALL, np.arange(len(f)))]


def _class_frames(f: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(class, rows) for every class, then (ALL, every row)."""
    return [(k, g) for k, g in f.groupby(col.SLO_CLASS, sort=True)] + [(ALL, f)]


def slo_attainment(src: Source, *, targets: Mapping[str, SloTargets] | None = None) -> pd.DataFrame:
    """Share of requests meeting TTFT, TPOT and both, per SLO class and over all (``"*"``).

    Columns: slo_class_name, ttft_target_ms, tpot_target_ms (NaN on the ``*``
    row), num_requests, num_failed (not served: error, aborted, timeout,
    rejected), num_ttft_measured, num_tpot_measured (served requests with a
    verdict), ttft_attainment, tpot_attainment, attainment (NaN: not measured).
    """
    f, codes = _verdicts(src, targets)
    tg = resolve_targets(src, sorted(f[col.SLO_CLASS].unique().tolist()), targets)
    failed = f["failed"].to_numpy(bool)
    rows = []
    for name, at in _class_rows(f):
        t = tg.get(name)
        n_ttft, ttft = _judge(codes["ttft_ok"][at], failed[at])
        n_tpot, tpot = _judge(codes["tpot_ok"][at], failed[at])
        _, both = _judge(codes["ok"][at], failed[at])
        rows.append({col.SLO_CLASS: name, "ttft_target_ms": t.ttft_ms if t else math.nan,
                     "tpot_target_ms": t.tpot_ms if t else math.nan, "num_requests": len(at),
                     "num_failed": int(failed[at].sum()), "num_ttft_measured": n_ttft, "num_tpot_measured": n_tpot,
                     "ttft_attainment": ttft, "tpot_attainment": tpot, "attainment": both})
    return pd.DataFrame(rows)


def goodput(src: Source, *, targets: Mapping[str, SloTargets] | None = None,
            target_share: float = DEFAULT_TARGET_SHARE, window_s: float | None = None) -> pd.DataFrame:
    """Goodput per SLO class and over all (``"*"``), two ways (see docs/analyzers.md).

    * ``goodput_rps`` = requests meeting both SLOs / run duration (s).
    * ``attainment_constrained_rate_rps``: split the run into arrival windows
      of ``window_s`` (default: a tenth of the run); sort windows by their
      arrival rate; the highest window rate r such that the requests of all
      windows with rate <= r together meet the SLO at >= ``target_share``
      (0 when even the quietest windows miss it). DistServe's goodput is the
      highest rate sustaining the target attainment; this is its estimate
      from the load levels the run actually went through.

    Columns: slo_class_name, duration_s, num_requests, num_good,
    request_rate_rps, goodput_rps, attainment, meets_target,
    attainment_constrained_rate_rps. Failed requests are never good; when
    attainment is not measured (see the module doc) num_good, goodput_rps and
    meets_target are null, never 0 or "met".
    """
    if not 0 < target_share <= 1:
        raise ValueError(f"target_share must be in (0, 1], got {target_share!r}")
    f, codes = _verdicts(src, targets)
    failed, ok, arrival = f["failed"].to_numpy(bool), codes["ok"], f[col.ARRIVAL_NS].to_numpy()
    bounds = run_bounds(src)
    duration_ns = (bounds[1] - bounds[0]) if bounds else 0
    check_window_s(window_s)
    window_ns = int(window_s * 1e9) if window_s else max(1, duration_ns // 10)
    rows = []
    for name, at in _class_rows(f):
        n = len(at)
        _, attain = _judge(ok[at], failed[at])
        measured = not math.isnan(attain)
        good = int((ok[at] == 1).sum()) if measured else None
        dur_s = duration_ns / 1e9
        sel = at[ok[at] >= 0]
        judged = pd.DataFrame({col.ARRIVAL_NS: arrival[sel], "ok": ok[sel] == 1})
        rows.append({col.SLO_CLASS: name, "duration_s": dur_s, "num_requests": n, "num_good": good,
                     "request_rate_rps": n / dur_s if dur_s > 0 else math.nan,
                     "goodput_rps": good / dur_s if measured and dur_s > 0 else math.nan,
                     "attainment": attain, "meets_target": bool(attain >= target_share) if measured else None,
                     "attainment_constrained_rate_rps":
                         _constrained_rate(judged, bounds, window_ns, target_share) if bounds and measured
                         else math.nan})
    return pd.DataFrame(rows)


def _constrained_rate(g: pd.DataFrame, bounds: tuple[int, int], window_ns: int, target_share: float) -> float:
    """Highest window arrival rate (req/s) up to which pooled attainment stays >= target_share."""
    if not len(g):
        return math.nan
    start, end = bounds
    k = ((g[col.ARRIVAL_NS].to_numpy(np.int64) - start) // window_ns).astype(np.int64)
    num_windows = max(1, int(math.ceil((end - start) / window_ns)))
    lengths_s = np.array([min(window_ns, end - (start + i * window_ns)) for i in range(num_windows)]) / 1e9
    counts = np.bincount(k, minlength=num_windows)[:num_windows]
    goods = np.bincount(k, weights=(g["ok"] == True).to_numpy(float), minlength=num_windows)[:num_windows]  # noqa: E712
    keep = (counts > 0) & (lengths_s > 0)
    rates, counts, goods = counts[keep] / lengths_s[keep], counts[keep], goods[keep]
    order = np.argsort(rates, kind="stable")
    cum = np.cumsum(goods[order]) / np.cumsum(counts[order])
    ok = np.nonzero(cum >= target_share - 1e-12)[0]
    return float(rates[order][ok[-1]]) if ok.size else 0.0


def request_fluidity(src: Source, *, targets: Mapping[str, SloTargets] | None = None) -> pd.DataFrame:
    """Per request: request_id, slo_class_name, num_deadlines, num_missed, fluidity_index (Etalon).

    Token i's deadline is ``arrival + TTFT_target + i * TPOT_target``; when a
    token misses its deadline, the deadlines of the later tokens restart from
    that token's delivery: ``d_j = t_i + (j - i) * TPOT_target`` (Etalon's
    reset, so one stall is counted once, not for every later token).
    fluidity_index = met deadlines / deadlines.
    """
    c = col
    rf, tt = request_table(src), token_times(src)
    df = src.df(f"""
        SELECT t.{c.REQUEST_ID}, f.{c.SLO_CLASS}, f.{c.ARRIVAL_NS}, t.{TOKEN_END}
        FROM {tt} t JOIN {rf} f USING ({c.REQUEST_ID}) WHERE f.{c.ARRIVAL_NS} IS NOT NULL
        ORDER BY t.{c.REQUEST_ID}, t.{c.TOKEN_INDEX}
    """)
    tg = resolve_targets(src, sorted(df[c.SLO_CLASS].unique().tolist()), targets)
    ids = df[c.REQUEST_ID].to_numpy()
    starts = np.r_[0, np.flatnonzero(ids[1:] != ids[:-1]) + 1] if len(ids) else np.empty(0, np.int64)
    counts = np.diff(np.r_[starts, len(ids)]).astype(np.int64)
    classes = df[c.SLO_CLASS].iloc[starts].reset_index(drop=True)
    per_class = classes.astype("category")  # a few classes: map each once, not each request
    ttft_ns = per_class.map({k: t.ttft_ms * 1e6 for k, t in tg.items()}).to_numpy(float)
    tpot_ns = per_class.map({k: t.tpot_ms * 1e6 for k, t in tg.items()}).to_numpy(float)
    arrival = df[c.ARRIVAL_NS].to_numpy(np.int64)[starts]
    missed = _missed_deadlines(df[TOKEN_END].to_numpy(np.int64), starts, counts, arrival, ttft_ns, tpot_ns)
    return pd.DataFrame({c.REQUEST_ID: ids[starts], c.SLO_CLASS: classes, "num_deadlines": counts,
                         "num_missed": missed, "fluidity_index": 1 - missed / counts})


def _missed_deadlines(times: np.ndarray, starts: np.ndarray, counts: np.ndarray, arrival: np.ndarray,
                      ttft_ns: np.ndarray, tpot_ns: np.ndarray) -> np.ndarray:
    """Per request, the deadlines its tokens missed, with Etalon's reset: request r's tokens were delivered at
    ``times[starts[r]:starts[r] + counts[r]]`` (ns, token order).

    Every request steps through its tokens at once, one token position at a time (the reset makes each
    request's deadlines depend on its own earlier tokens, not on other requests'); requests are taken longest
    first, so the ones still streaming at position i are a prefix. Times are taken relative to each request's
    arrival: small enough for the float deadlines to be exact to the nanosecond."""
    order = np.argsort(-counts, kind="stable")
    n, lo = counts[order], starts[order]
    rel = times - np.repeat(arrival, counts)  # ns since the request's arrival (exact integers)
    anchor = ttft_ns[order].astype(float)  # the deadline of token anchor_index, relative to arrival
    anchor_index = np.zeros(len(order), np.int64)
    tpot = tpot_ns[order]
    missed_sorted = np.zeros(len(order), np.int64)
    for i in range(int(n[0]) if len(n) else 0):
        active = int(np.searchsorted(-n, -i, side="left"))  # requests of more than i tokens: a prefix of n
        t = rel[lo[:active] + i]
        deadline = anchor[:active] + (i - anchor_index[:active]) * tpot[:active]
        late = t > deadline
        missed_sorted[:active] += late
        anchor[:active] = np.where(late, t, anchor[:active])
        anchor_index[:active] = np.where(late, i, anchor_index[:active])
    missed = np.empty_like(missed_sorted)
    missed[order] = missed_sorted
    return missed


def fluidity(src: Source, *, targets: Mapping[str, SloTargets] | None = None) -> pd.DataFrame:
    """Etalon fluidity-index per SLO class and over all (``"*"``).

    Columns: slo_class_name, num_requests, num_deadlines, num_missed,
    fluidity_index (met / all deadlines, pooled over tokens),
    mean_request_fluidity, p10_request_fluidity (the unsmoothest 10% of requests).
    NaN (not measured) for a class whose requests reported more than one output
    token but have no delivered token after the first.
    """
    per = request_fluidity(src, targets=targets)
    streamed = _streamed_requests(src)
    rows = []
    for name, g in _class_frames(per):
        d, m = int(g["num_deadlines"].sum()), int(g["num_missed"].sum())
        v = g["fluidity_index"].to_numpy(float)
        # Requests of several output tokens whose later tokens were never recorded: not measured.
        unmeasured = bool(len(g)) and not (g["num_deadlines"] > 1).any() and g[col.REQUEST_ID].isin(streamed).any()
        if unmeasured:
            d = m = 0
            v = np.empty(0)
        rows.append({col.SLO_CLASS: name, "num_requests": len(g), "num_deadlines": d, "num_missed": m,
                     "fluidity_index": 1 - m / d if d else math.nan,
                     "mean_request_fluidity": float(v.mean()) if v.size else math.nan,
                     "p10_request_fluidity": float(np.percentile(v, 10)) if v.size else math.nan})
    return pd.DataFrame(rows)


def _streamed_requests(src: Source) -> set:
    """Ids of requests whose request row reports more than one output token."""
    c = col
    ids = src.df(f"SELECT DISTINCT {c.REQUEST_ID} FROM srv_requests WHERE {c.NUM_OUTPUT_TOKENS} > 1")
    return set(ids[c.REQUEST_ID].tolist())
