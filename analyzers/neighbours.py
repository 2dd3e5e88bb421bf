"""Noisy neighbours: does one tenant's burst of arrivals slow another tenant down?

The run is cut into arrival windows (``window_s``, default a twentieth of the run).
For tenant A (the aggressor), z_A(w) = (A's arrivals in w - their mean) / std over
all windows; A *bursts* in w when z_A(w) >= ``z_threshold``. For tenant B (the
victim), over the windows where B has requests with a TTFT: m_B(w) = B's mean TTFT
of requests arriving in w, n_B(w) their number.

* Trend removed: a saturated server slows every tenant as its queue grows, which
  is not one tenant's doing. A line (weighted by n_B) is fitted to m_B over the
  windows where A does not burst; each window's residual is m_B(w) minus the line.
* effect_ms = the n_B-weighted mean residual over A's burst windows: how much
  slower B was when A burst than B's own trend says.
* p_value: a permutation test. The burst labels are shuffled among B's windows
  (``permutations`` times, one seeded generator); p = (1 + #{effect of shuffled
  labels >= observed}) / (1 + permutations), one-sided. ``p_adjusted``: Holm's
  correction over every ordered pair of the run.
* enough_data: at least ``min_windows`` windows of B, ``min_burst_windows`` of them
  burst windows of A, and ``min_victim_requests`` of B's requests in those.

``flagged`` = enough data, p_adjusted < ``alpha``, effect_ms >= ``min_effect_ms``
and effect_ms >= ``min_rel_effect`` x B's mean TTFT outside A's bursts. Every
pair's sample sizes and p-value are in the table, flagged or not.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analyzers.source import Source
from analyzers.stats import holm, permutation_p_value
from analyzers.timing import TTFT_NS, request_table, run_bounds
from tokentrace.schema import col

__all__ = ["COLUMNS", "MIN_WINDOWS", "MIN_BURST_WINDOWS", "MIN_VICTIM_REQUESTS", "noisy_neighbours"]

MIN_WINDOWS = 10  # victim windows needed to judge a pair
MIN_BURST_WINDOWS = 2  # aggressor bursts needed
MIN_VICTIM_REQUESTS = 5  # victim requests inside the bursts
_NUM_WINDOWS = 20  # default windows over a run
COLUMNS = ["aggressor", "victim", "num_windows", "num_burst_windows", "num_victim_burst", "num_victim_normal",
           "victim_mean_burst_ms", "victim_mean_normal_ms", "effect_ms", "rel_effect", "victim_p99_burst_ms",
           "victim_p99_normal_ms", "correlation", "p_value", "p_adjusted", "enough_data", "flagged"]


def _trend_residuals(x: np.ndarray, y: np.ndarray, w: np.ndarray, fit_on: np.ndarray) -> np.ndarray:
    """y minus a weighted least-squares line through the points ``fit_on`` (a weighted mean with < 2 x values)."""
    xs, ys, ws = x[fit_on], y[fit_on], w[fit_on]
    if ws.sum() <= 0:
        return np.full(y.size, math.nan)
    if np.unique(xs).size < 2:
        return y - float(np.average(ys, weights=ws))
    slope, intercept = np.polyfit(xs, ys, 1, w=np.sqrt(ws))
    return y - (slope * x + intercept)


def _effect(x: np.ndarray, y: np.ndarray, w: np.ndarray, burst: np.ndarray) -> float:
    """Weighted mean residual of the burst windows against the trend of the others; NaN if undefined."""
    burst = burst.astype(bool)
    if not burst.any() or burst.all():
        return math.nan
    r = _trend_residuals(x, y, w, ~burst)
    return float(np.average(r[burst], weights=w[burst])) if w[burst].sum() > 0 else math.nan


def _p99(v: np.ndarray) -> float:
    return float(np.percentile(v, 99)) if v.size else math.nan


def noisy_neighbours(src: Source, *, window_s: float | None = None, z_threshold: float = 2.0,
                     min_windows: int = MIN_WINDOWS, min_burst_windows: int = MIN_BURST_WINDOWS,
                     min_victim_requests: int = MIN_VICTIM_REQUESTS, alpha: float = 0.05,
                     min_effect_ms: float = 5.0, min_rel_effect: float = 0.1, permutations: int = 1000,
                     seed: int = 0) -> pd.DataFrame:
    """Every ordered tenant pair (aggressor, victim) with its effect, sample sizes and p-value (module doc).

    Columns: :data:`COLUMNS`. Empty with fewer than two tenants. ``ValueError`` for a
    non-positive window, a bad alpha or fewer than 10 permutations.
    """
    if window_s is not None and not (isinstance(window_s, (int, float)) and math.isfinite(window_s) and window_s > 0):
        raise ValueError(f"window_s must be a positive number of seconds, got {window_s!r}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    if permutations < 10:
        raise ValueError(f"permutations must be at least 10, got {permutations!r}")
    c = col
    bounds = run_bounds(src)
    req = src.df(f"SELECT {c.TENANT}, {c.ARRIVAL_NS}, {TTFT_NS} / 1e6 AS ttft_ms FROM {request_table(src)} "
                 f"WHERE {c.ARRIVAL_NS} IS NOT NULL")
    names = sorted(req[c.TENANT].unique().tolist())
    if bounds is None or len(names) < 2:
        return pd.DataFrame(columns=COLUMNS)
    w_ns = int(window_s * 1e9) if window_s else max(1, (bounds[1] - bounds[0]) // _NUM_WINDOWS)
    num_w = max(1, int(math.ceil((bounds[1] - bounds[0] + 1) / w_ns)))
    req["w"] = (req[c.ARRIVAL_NS] - bounds[0]) // w_ns
    counts = req.pivot_table(index="w", columns=c.TENANT, values=c.ARRIVAL_NS, aggfunc="count")
    counts = counts.reindex(index=range(num_w), columns=names).fillna(0)
    std = counts.std(ddof=0).replace(0, np.nan)
    z = ((counts - counts.mean()) / std).fillna(0)
    rng = np.random.default_rng(seed)
    rows = []
    for victim in names:
        mine = req[(req[c.TENANT] == victim) & req["ttft_ms"].notna()]
        per_w = mine.groupby("w")["ttft_ms"].agg(["mean", "count"])
        x, y, n = per_w.index.to_numpy(float), per_w["mean"].to_numpy(float), per_w["count"].to_numpy(float)
        for aggressor in names:
            if aggressor == victim:
                continue
            burst = z[aggressor].reindex(per_w.index).to_numpy(float) >= z_threshold
            rows.append(_pair(aggressor, victim, mine, per_w.index, x, y, n, burst,
                              z[aggressor].reindex(per_w.index).to_numpy(float), rng, permutations,
                              min_windows, min_burst_windows, min_victim_requests))
    out = pd.DataFrame(rows, columns=[k for k in COLUMNS if k not in ("p_adjusted", "flagged")])
    out["p_adjusted"] = holm(out["p_value"].to_numpy(float))
    normal = out["victim_mean_normal_ms"].to_numpy(float)
    effect = out["effect_ms"].to_numpy(float)
    with np.errstate(invalid="ignore"):
        out["flagged"] = (out["enough_data"].astype(bool) & (out["p_adjusted"] < alpha)
                          & (effect >= min_effect_ms) & (effect >= min_rel_effect * normal))
    return out[COLUMNS]


def _pair(aggressor: str, victim: str, mine: pd.DataFrame, windows: pd.Index, x: np.ndarray, y: np.ndarray,
          n: np.ndarray, burst: np.ndarray, za: np.ndarray, rng: np.random.Generator, permutations: int,
          min_windows: int, min_burst_windows: int, min_victim_requests: int) -> dict:
    in_burst = mine["w"].isin(windows[burst])
    hi, lo = mine.loc[in_burst, "ttft_ms"].to_numpy(float), mine.loc[~in_burst, "ttft_ms"].to_numpy(float)
    enough = bool(x.size >= min_windows and burst.sum() >= min_burst_windows and hi.size >= min_victim_requests)
    effect = _effect(x, y, n, burst)
    p = (permutation_p_value(lambda labels: _effect(x, y, n, labels), burst, num=permutations, rng=rng)
         if enough else math.nan)
    normal = float(lo.mean()) if lo.size else math.nan
    corr = (float(np.corrcoef(za, y)[0, 1]) if x.size >= 3 and np.std(za) > 0 and np.std(y) > 0 else math.nan)
    return {"aggressor": aggressor, "victim": victim, "num_windows": int(x.size), "num_burst_windows": int(burst.sum()),
            "num_victim_burst": int(hi.size), "num_victim_normal": int(lo.size),
            "victim_mean_burst_ms": float(hi.mean()) if hi.size else math.nan, "victim_mean_normal_ms": normal,
            "effect_ms": effect, "rel_effect": effect / normal if normal and math.isfinite(normal) else math.nan,
            "victim_p99_burst_ms": _p99(hi), "victim_p99_normal_ms": _p99(lo), "correlation": corr,
            "p_value": p, "enough_data": enough}
