"""Capacity: throughput, the latency distribution, and latency against load and prompt length.

What a load test (GenAI-Perf, guidellm, ``vllm bench serve``) reports, from the
server's own timeline (times as in :mod:`analyzers.timing`, reference clock):

* :func:`throughput` per time window of ``window_s`` seconds since the run's first
  arrival: ``offered_rps`` (arrivals / s), ``completed_rps`` (requests that ended
  ok / s, by their end: finish, else last token), ``output_tokens_per_s`` (tokens
  delivered / s, by delivery time), ``prompt_tokens_per_s`` (prompt tokens of the
  arrivals / s), and two time averages over the window: ``in_flight`` (requests
  arrived and not ended) and ``waiting_first_token`` (arrived, first token not yet
  delivered). A request without an end counts until the last window.
* :func:`throughput_summary`: the same totals over the run (first arrival to last
  end): requests, completed, output and prompt tokens, and their rates.
* :func:`load_latency`: per arrival window, the offered rate beside TTFT, TPOT,
  ITL and E2E percentiles of the requests that arrived in it (the latency-vs-load
  curve a run traces as its load changes).
* :func:`cdf`: each metric's distribution as ``points`` quantiles (linear
  interpolation, as :func:`analyzers.latency.latency`).
* :func:`ttft_by_prompt`: TTFT percentiles per prompt-length bin (bins hold about
  equal numbers of requests).

Percentiles default to :data:`CAPACITY_PERCENTILES` (p50, p90, p95, p99). Computed
in DuckDB; only result rows reach memory. Empty frames (with the columns) when the
run has no requests.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analyzers.groups import check_window_s, pct_name
from analyzers.latency import METRICS, itl_samples_sql, latency
from analyzers.load import arrival_window, offered_rate
from analyzers.slo import resolve_targets
from analyzers.source import Source
from analyzers.timing import (
    E2E_NS,
    LAST_TOKEN,
    TOKEN_END,
    TPOT_NS,
    TTFT_NS,
    request_table,
    run_bounds,
    token_times,
)
from tokentrace.schema import RequestStatus, col

__all__ = ["CAPACITY_PERCENTILES", "THROUGHPUT_COLUMNS", "SUMMARY_COLUMNS", "throughput", "throughput_summary",
           "percentiles", "load_latency", "cdf", "ttft_by_prompt", "offered_load", "slo_targets",
           "interpolated_quantiles"]

CAPACITY_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0)
THROUGHPUT_COLUMNS = ["window_start_s", "offered_rps", "completed_rps", "output_tokens_per_s", "prompt_tokens_per_s",
                      "in_flight", "waiting_first_token"]
SUMMARY_COLUMNS = ["duration_s", "num_requests", "num_completed", col.NUM_OUTPUT_TOKENS, col.NUM_PROMPT_TOKENS,
                   "completed_rps", "output_tokens_per_s", "prompt_tokens_per_s"]
_OK = int(RequestStatus.OK)


def _check_window(window_s: float) -> int:
    check_window_s(window_s)
    return max(1, int(round(window_s * 1e9)))


def throughput(src: Source, *, window_s: float) -> pd.DataFrame:
    """Rates and time-averaged requests in flight per window (columns :data:`THROUGHPUT_COLUMNS`)."""
    w = _check_window(window_s)
    bounds = run_bounds(src)
    if bounds is None:
        return pd.DataFrame(columns=THROUGHPUT_COLUMNS)
    start, end = bounds
    num = max(1, -(-(end - start) // w))  # windows covering [start, end]
    c, rf, tt = col, request_table(src), token_times(src)
    end_of = f"COALESCE({c.FINISH_NS}, {LAST_TOKEN}, {end})"
    first = f"COALESCE({c.FIRST_TOKEN_NS}, {end_of})"
    # Each request's [from, to) interval, cut at the window edges it crosses: sum(overlap) / w = time average.
    overlap_sql = """
        SELECT k, SUM(LEAST(t1, {start} + (k + 1) * {w}) - GREATEST(t0, {start} + k * {w}))::DOUBLE / {w} AS v
        FROM (SELECT t0, t1, UNNEST(range((t0 - {start}) // {w}, (GREATEST(t1 - 1, t0) - {start}) // {w} + 1)) AS k
              FROM ({intervals}) WHERE t1 > t0)
        GROUP BY k
    """
    frames = {
        "arrivals": src.df(f"""SELECT ({c.ARRIVAL_NS} - {start}) // {w} AS k, COUNT(*)::DOUBLE AS n,
                                      SUM(COALESCE({c.NUM_PROMPT_TOKENS}, 0))::DOUBLE AS prompt
                               FROM {rf} WHERE {c.ARRIVAL_NS} IS NOT NULL GROUP BY k"""),
        "completed": src.df(f"""SELECT (COALESCE({c.FINISH_NS}, {LAST_TOKEN}) - {start}) // {w} AS k,
                                       COUNT(*)::DOUBLE AS done
                                FROM {rf} WHERE COALESCE({c.STATUS}, {_OK}) = {_OK}
                                  AND COALESCE({c.FINISH_NS}, {LAST_TOKEN}) IS NOT NULL GROUP BY k"""),
        "tokens": src.df(f"SELECT ({TOKEN_END} - {start}) // {w} AS k, COUNT(*)::DOUBLE AS tok FROM {tt} GROUP BY k"),
        "in_flight": src.df(overlap_sql.format(start=start, w=w, intervals=(
            f"SELECT {c.ARRIVAL_NS} AS t0, {end_of} AS t1 FROM {rf} WHERE {c.ARRIVAL_NS} IS NOT NULL"))),
        "waiting": src.df(overlap_sql.format(start=start, w=w, intervals=(
            f"SELECT {c.ARRIVAL_NS} AS t0, {first} AS t1 FROM {rf} WHERE {c.ARRIVAL_NS} IS NOT NULL"))),
    }
    out = pd.DataFrame({"k": np.arange(num, dtype=np.int64)})
    for name, frame in frames.items():
        frame = frame.rename(columns={"v": name}) if "v" in frame.columns else frame
        out = out.merge(frame.astype({"k": np.int64}), on="k", how="left")
    out = out.fillna(0.0)
    seconds = w / 1e9
    result = pd.DataFrame({
        "window_start_s": out["k"] * seconds,
        "offered_rps": out["n"] / seconds,
        "completed_rps": out["done"] / seconds,
        "output_tokens_per_s": out["tok"] / seconds,
        "prompt_tokens_per_s": out["prompt"] / seconds,
        "in_flight": out["in_flight"],
        "waiting_first_token": out["waiting"],
    })
    return result[THROUGHPUT_COLUMNS]


def throughput_summary(src: Source) -> pd.DataFrame:
    """One row (columns :data:`SUMMARY_COLUMNS`): totals and rates over the run, first arrival to last end."""
    bounds = run_bounds(src)
    c, rf = col, request_table(src)
    row = src.fetchone(f"""
        SELECT COUNT(*), COUNT(*) FILTER (WHERE COALESCE({c.STATUS}, {_OK}) = {_OK}
                                          AND COALESCE({c.FINISH_NS}, {LAST_TOKEN}) IS NOT NULL),
               COALESCE(SUM({c.NUM_OUTPUT_TOKENS}), 0), COALESCE(SUM({c.NUM_PROMPT_TOKENS}), 0)
        FROM {rf} WHERE {c.ARRIVAL_NS} IS NOT NULL
    """)
    n, done, out_tok, prompt_tok = (int(v or 0) for v in row)
    duration = (bounds[1] - bounds[0]) / 1e9 if bounds else math.nan
    rate = (lambda x: x / duration if duration and duration > 0 else math.nan)
    return pd.DataFrame([{"duration_s": duration, "num_requests": n, "num_completed": done,
                          col.NUM_OUTPUT_TOKENS: out_tok, col.NUM_PROMPT_TOKENS: prompt_tok,
                          "completed_rps": rate(done), "output_tokens_per_s": rate(out_tok),
                          "prompt_tokens_per_s": rate(prompt_tok)}], columns=SUMMARY_COLUMNS)


def offered_load(src: Source) -> pd.DataFrame:
    """One row: num_requests, arrival_window_s, offered_rps, as ``analyzers.load.load`` measures them (over the
    arrival window), without the rest of the saturation analysis."""
    window = arrival_window(src)
    if window is None:
        return pd.DataFrame([{"num_requests": 0, "arrival_window_s": math.nan, "offered_rps": math.nan}])
    a0, a1, n = window
    w_s = (a1 - a0) / 1e9
    return pd.DataFrame([{"num_requests": n, "arrival_window_s": w_s, "offered_rps": offered_rate(n, w_s)}])


def slo_targets(src: Source) -> pd.DataFrame:
    """Per SLO class of the requests with an arrival time: slo_class_name, ttft_target_ms, tpot_target_ms (the
    targets ``analyzers.slo.slo_attainment`` judges them by), without judging any request."""
    c = col
    classes = src.df(f"SELECT DISTINCT {c.SLO_CLASS} FROM {request_table(src)} WHERE {c.ARRIVAL_NS} IS NOT NULL")
    targets = resolve_targets(src, sorted(classes[c.SLO_CLASS].tolist()))
    return pd.DataFrame([{c.SLO_CLASS: k, "ttft_target_ms": t.ttft_ms, "tpot_target_ms": t.tpot_ms}
                         for k, t in targets.items()], columns=[c.SLO_CLASS, "ttft_target_ms", "tpot_target_ms"])


def percentiles(src: Source, *, levels: tuple[float, ...] = CAPACITY_PERCENTILES) -> pd.DataFrame:
    """:func:`analyzers.latency.latency` over the whole run at ``levels`` (default p50, p90, p95, p99)."""
    return latency(src, percentiles=levels)


def _samples_sql(src: Source, group: str) -> str:
    """UNION of (grp, metric, v ms) samples: TTFT, TPOT, E2E per request and ITL per token, grouped by ``group``
    (an expression over request facts alias ``f``)."""
    c, rf, tt = col, request_table(src), token_times(src)
    return f"""
        WITH f AS (SELECT f.*, {group} AS grp FROM {rf} f WHERE f.{c.FIRST_TOKEN_NS} IS NOT NULL)
        SELECT grp, 'ttft' AS metric, {TTFT_NS} / 1e6 AS v FROM f
        UNION ALL SELECT grp, 'tpot', {TPOT_NS} / 1e6 FROM f WHERE {TPOT_NS} IS NOT NULL
        UNION ALL {itl_samples_sql(src, tt, group)}
        UNION ALL SELECT grp, 'e2e', {E2E_NS} / 1e6 FROM f
    """


def load_latency(src: Source, *, window_s: float,
                 percentiles: tuple[float, ...] = CAPACITY_PERCENTILES) -> pd.DataFrame:
    """Per arrival window with arrivals: window_start_s, offered_rps, num_requests, then
    ``<metric>_<pNN>_ms`` for every metric of :data:`analyzers.latency.METRICS` and percentile."""
    w = _check_window(window_s)
    bounds = run_bounds(src)
    pcols = [f"{m}_{pct_name(p)}" for m in METRICS for p in percentiles]
    columns = ["window_start_s", "offered_rps", "num_requests", *pcols]
    if bounds is None:
        return pd.DataFrame(columns=columns)
    start = bounds[0]
    c, rf = col, request_table(src)
    qs = ", ".join(str(p / 100) for p in percentiles)
    arrivals = src.df(f"SELECT ({c.ARRIVAL_NS} - {start}) // {w} AS grp, COUNT(*) AS num_requests FROM {rf} "
                      f"WHERE {c.ARRIVAL_NS} IS NOT NULL GROUP BY grp ORDER BY grp")
    stats = src.df(f"""SELECT grp, metric, quantile_cont(v, [{qs}]) AS q
                       FROM ({_samples_sql(src, f'(f.{c.ARRIVAL_NS} - {start}) // {w}')}) GROUP BY grp, metric""")
    out = arrivals.copy()
    out["window_start_s"] = out["grp"].astype(float) * (w / 1e9)
    out["offered_rps"] = out["num_requests"] / (w / 1e9)
    for metric in METRICS:
        part = stats[stats["metric"] == metric].set_index("grp")["q"]
        for i, p in enumerate(percentiles):
            out[f"{metric}_{pct_name(p)}"] = out["grp"].map(lambda g, i=i: part[g][i] if g in part.index else math.nan)
    return out[columns].reset_index(drop=True)


def cdf(src: Source, *, points: int = 200) -> pd.DataFrame:
    """Columns metric, quantile (0..1), value_ms: ``points`` + 1 evenly spaced quantiles per metric with samples."""
    if points < 2:
        raise ValueError(f"points must be >= 2, got {points}")
    levels = [i / points for i in range(points + 1)]
    # Each metric's samples sorted once and read at every level (a list of 200 quantiles in the engine selects
    # each one apart, ~6x the time), interpolated as the engine's quantile_cont (interpolated_quantiles).
    codes = " ".join(f"WHEN '{m}' THEN {i}" for i, m in enumerate(METRICS))
    samples = src.arrow(f"SELECT CASE metric {codes} END AS m, v FROM ({_samples_sql(src, '0')}) WHERE v IS NOT NULL")
    which = samples.column("m").to_numpy(zero_copy_only=False)
    values = samples.column("v").to_numpy(zero_copy_only=False)
    rows = []
    for i, metric in enumerate(METRICS):
        v = np.sort(values[which == i])
        if v.size == 0:
            continue
        rows += [{"metric": metric, "quantile": lv, "value_ms": q} for lv, q in zip(levels, interpolated_quantiles(v, levels))]
    return pd.DataFrame(rows, columns=["metric", "quantile", "value_ms"])


def interpolated_quantiles(ordered: np.ndarray, levels: list[float]) -> list[float]:
    """Quantiles of the ascending ``ordered`` (no NaN) at ``levels`` in [0, 1], as SQL's ``quantile_cont``: with
    ``rn = (n - 1) * q``, the value at ``floor(rn)`` plus ``(rn - floor(rn))`` of the step to the next one
    (``lo + (hi - lo) * d``; an engine that fuses the multiply-add may differ in the last bit)."""
    n = ordered.size
    out = []
    for q in levels:
        rn = float(n - 1) * q
        lo_i, hi_i = math.floor(rn), math.ceil(rn)
        lo = float(ordered[lo_i])
        out.append(lo if lo_i == hi_i else lo + (float(ordered[hi_i]) - lo) * (rn - lo_i))
    return out


def ttft_by_prompt(src: Source, *, bins: int = 20,
                   percentiles: tuple[float, ...] = CAPACITY_PERCENTILES) -> pd.DataFrame:
    """TTFT percentiles per prompt-length bin: prompt_tokens_lo, prompt_tokens_hi (inclusive), prompt_tokens_mid
    (median prompt of the bin), num_requests, ``ttft_<pNN>_ms``. Bins split the requests with a first token and a
    prompt length into about ``bins`` groups of equal size (ties stay together)."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    c, rf = col, request_table(src)
    qs = ", ".join(str(p / 100) for p in percentiles)
    pcols = [f"ttft_{pct_name(p)}" for p in percentiles]
    df = src.df(f"""
        WITH f AS (SELECT {c.NUM_PROMPT_TOKENS} AS prompt, {TTFT_NS} / 1e6 AS ttft FROM {rf}
                   WHERE {TTFT_NS} IS NOT NULL AND {c.NUM_PROMPT_TOKENS} IS NOT NULL),
        b AS (SELECT *, NTILE({bins}) OVER (ORDER BY prompt) AS tile FROM f),
        e AS (SELECT tile, MIN(prompt) AS lo, MAX(prompt) AS hi FROM b GROUP BY tile),
        -- ties across tiles go to the tile where the prompt length first appears
        g AS (SELECT f.prompt, f.ttft, (SELECT MIN(tile) FROM e WHERE f.prompt BETWEEN e.lo AND e.hi) AS tile FROM f)
        SELECT tile, MIN(prompt) AS prompt_tokens_lo, MAX(prompt) AS prompt_tokens_hi,
               quantile_cont(prompt, 0.5) AS prompt_tokens_mid, COUNT(*) AS num_requests,
               quantile_cont(ttft, [{qs}]) AS q
        FROM g GROUP BY tile ORDER BY tile
    """)
    out = df.drop(columns=["tile", "q"]).reset_index(drop=True)
    for i, name in enumerate(pcols):
        out[name] = [float(q[i]) for q in df["q"]]
    return out[["prompt_tokens_lo", "prompt_tokens_hi", "prompt_tokens_mid", "num_requests", *pcols]]
