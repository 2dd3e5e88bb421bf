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
tested pair's sample sizes and p-value are in the table, flagged or not.

Many tenants (a deployment with thousands of API keys): with more than ``top_k``
tenants, the pairs tested are the ``top_k`` likeliest aggressors (ranked by their
burst excess: the arrivals above their mean in the windows where they burst) against
the ``top_k`` best-judged victims (ranked by their requests with a TTFT, among the
tenants with ``min_windows`` windows), not all T(T-1) pairs; a tenant that never
bursts cannot be an aggressor and one with too few windows cannot be judged a victim,
so the pairs left out are mostly ones that could not be flagged anyway. Holm's
correction is over the pairs tested. The table's ``attrs`` say what was tested:
``num_tenants``, ``num_pairs`` (all ordered pairs), ``num_pairs_tested``, ``top_k``.
The permutation test is vectorised over the permutations (one weighted line fit per
permutation in closed form), so a pair costs about a millisecond.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analyzers.groups import check_window_s
from analyzers.source import Source
from analyzers.stats import holm
from analyzers.timing import TTFT_NS, request_table, run_bounds
from tokentrace.schema import col

__all__ = ["COLUMNS", "MIN_WINDOWS", "MIN_BURST_WINDOWS", "MIN_VICTIM_REQUESTS", "TOP_K", "noisy_neighbours"]

MIN_WINDOWS = 10  # victim windows needed to judge a pair
MIN_BURST_WINDOWS = 2  # aggressor bursts needed
MIN_VICTIM_REQUESTS = 5  # victim requests inside the bursts
TOP_K = 20  # aggressors and victims tested when a run has more tenants: at most 20 x 19 pairs
_NUM_WINDOWS = 20  # default windows over a run
COLUMNS = ["aggressor", "victim", "num_windows", "num_burst_windows", "num_victim_burst", "num_victim_normal",
           "victim_mean_burst_ms", "victim_mean_normal_ms", "effect_ms", "rel_effect", "victim_p99_burst_ms",
           "victim_p99_normal_ms", "correlation", "p_value", "p_adjusted", "enough_data", "flagged"]


def _effects(x: np.ndarray, y: np.ndarray, w: np.ndarray, burst: np.ndarray) -> np.ndarray:
    """Per row of ``burst`` (P, n) labels: the w-weighted mean residual of the burst windows against the
    w-weighted least-squares line through the other windows (their weighted mean when they have fewer than
    two distinct x); NaN where undefined (no burst window, or only burst windows). Shape (P,)."""
    burst = np.atleast_2d(burst).astype(bool)
    fit = (~burst) * w  # (P, n) weights of the windows the line is fitted to
    sw, sx, sy = fit.sum(1), fit @ x, fit @ y
    sxx, sxy = fit @ (x * x), fit @ (x * y)
    with np.errstate(invalid="ignore", divide="ignore"):
        den = sw * sxx - sx * sx
        flat = den <= 1e-12 * np.maximum(sw * sxx, 1e-300)  # one distinct x: the line is the weighted mean
        slope = np.where(flat, 0.0, (sw * sxy - sx * sy) / np.where(flat, 1.0, den))
        intercept = (sy - slope * sx) / sw
        resid = y[None, :] - (slope[:, None] * x[None, :] + intercept[:, None])
        hit = burst * w
        num_hit = hit.sum(1)
        out = (hit * resid).sum(1) / num_hit
    undefined = ~burst.any(1) | burst.all(1) | (sw <= 0) | (num_hit <= 0)
    return np.where(undefined, math.nan, out)


def _p_value(x: np.ndarray, y: np.ndarray, w: np.ndarray, burst: np.ndarray, observed: float, *,
             num: int, rng: np.random.Generator) -> float:
    """One-sided permutation p-value of ``observed`` against ``num`` shuffles of the burst labels
    (:func:`analyzers.stats.permutation_p_value`'s definition, all shuffles at once)."""
    if not math.isfinite(observed):
        return math.nan
    shuffled = rng.permuted(np.broadcast_to(burst, (num, burst.size)), axis=1)
    values = _effects(x, y, w, shuffled)
    at_least = int(np.count_nonzero(np.isfinite(values) & (values >= observed - 1e-12)))
    return (1 + at_least) / (1 + num)


def _p99(v: np.ndarray) -> float:
    return float(np.percentile(v, 99)) if v.size else math.nan


def noisy_neighbours(src: Source, *, window_s: float | None = None, z_threshold: float = 2.0,
                     min_windows: int = MIN_WINDOWS, min_burst_windows: int = MIN_BURST_WINDOWS,
                     min_victim_requests: int = MIN_VICTIM_REQUESTS, alpha: float = 0.05,
                     min_effect_ms: float = 5.0, min_rel_effect: float = 0.1, permutations: int = 1000,
                     seed: int = 0, top_k: int = TOP_K) -> pd.DataFrame:
    """Ordered tenant pairs (aggressor, victim) with their effect, sample sizes and p-value (module doc): every
    pair with at most ``top_k`` tenants, else the ``top_k`` ranked aggressors against the ``top_k`` ranked victims.

    Columns: :data:`COLUMNS`; ``attrs``: ``num_tenants``, ``num_pairs``, ``num_pairs_tested``, ``top_k``. Empty
    with fewer than two tenants. ``ValueError`` for a non-positive window, a bad alpha, fewer than 10
    permutations or a ``top_k`` below 2.
    """
    check_window_s(window_s)
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    if permutations < 10:
        raise ValueError(f"permutations must be at least 10, got {permutations!r}")
    if not (isinstance(top_k, int) and top_k >= 2):
        raise ValueError(f"top_k must be an integer of at least 2, got {top_k!r}")
    c = col
    bounds = run_bounds(src)
    req = src.df(f"SELECT {c.TENANT}, {c.ARRIVAL_NS}, {TTFT_NS} / 1e6 AS ttft_ms FROM {request_table(src)} "
                 f"WHERE {c.ARRIVAL_NS} IS NOT NULL")
    names = sorted(req[c.TENANT].unique().tolist())
    if bounds is None or len(names) < 2:
        return _with_attrs(pd.DataFrame(columns=COLUMNS), len(names), 0, top_k)
    w_ns = int(window_s * 1e9) if window_s else max(1, (bounds[1] - bounds[0]) // _NUM_WINDOWS)
    num_w = max(1, int(math.ceil((bounds[1] - bounds[0] + 1) / w_ns)))
    req["w"] = (req[c.ARRIVAL_NS] - bounds[0]) // w_ns
    counts = req.pivot_table(index="w", columns=c.TENANT, values=c.ARRIVAL_NS, aggfunc="count")
    counts = counts.reindex(index=range(num_w), columns=names).fillna(0)
    std = counts.std(ddof=0).replace(0, np.nan)
    z = ((counts - counts.mean()) / std).fillna(0)
    timed = req[req["ttft_ms"].notna()]
    aggressors, victims = _candidates(names, counts, z, timed, z_threshold, min_windows, top_k)
    rng = np.random.default_rng(seed)
    rows = []
    by_victim = dict(tuple(timed[timed[c.TENANT].isin(victims)].groupby(c.TENANT, sort=False)))
    for victim in victims:
        mine = by_victim.get(victim, timed.iloc[:0])
        per_w = mine.groupby("w")["ttft_ms"].agg(["mean", "count"])
        x, y, n = per_w.index.to_numpy(float), per_w["mean"].to_numpy(float), per_w["count"].to_numpy(float)
        window_of = mine["w"].to_numpy()
        ttft = mine["ttft_ms"].to_numpy(float)
        for aggressor in aggressors:
            if aggressor == victim:
                continue
            za = z[aggressor].reindex(per_w.index).to_numpy(float)
            rows.append(_pair(aggressor, victim, window_of, ttft, per_w.index.to_numpy(), x, y, n, za >= z_threshold,
                              za, rng, permutations, min_windows, min_burst_windows, min_victim_requests))
    out = pd.DataFrame(rows, columns=[k for k in COLUMNS if k not in ("p_adjusted", "flagged")])
    out["p_adjusted"] = holm(out["p_value"].to_numpy(float))
    normal = out["victim_mean_normal_ms"].to_numpy(float)
    effect = out["effect_ms"].to_numpy(float)
    with np.errstate(invalid="ignore"):
        out["flagged"] = (out["enough_data"].astype(bool) & (out["p_adjusted"] < alpha)
                          & (effect >= min_effect_ms) & (effect >= min_rel_effect * normal))
    return _with_attrs(out[COLUMNS], len(names), len(out), top_k)


def _candidates(names: list[str], counts: pd.DataFrame, z: pd.DataFrame, timed: pd.DataFrame, z_threshold: float,
                min_windows: int, top_k: int) -> tuple[list[str], list[str]]:
    """Aggressors and victims to test: every tenant with at most ``top_k`` of them, else the ``top_k`` with the
    largest burst excess and the ``top_k`` judged victims with the most timed requests (module doc)."""
    if len(names) <= top_k:
        return names, names
    excess = ((counts - counts.mean()) * (z >= z_threshold)).sum()  # arrivals above the mean, in burst windows
    bursting = excess[excess > 0]
    aggressors = sorted(bursting.sort_values(ascending=False, kind="stable").index[:top_k])
    stats = timed.groupby(col.TENANT).agg(num=("ttft_ms", "size"), windows=("w", "nunique"))
    judged = stats[stats["windows"] >= min_windows].sort_values("num", ascending=False, kind="stable")
    victims = sorted(judged.index[:top_k])
    return aggressors, victims


def _with_attrs(df: pd.DataFrame, num_tenants: int, num_tested: int, top_k: int) -> pd.DataFrame:
    df.attrs.update(num_tenants=num_tenants, num_pairs=num_tenants * (num_tenants - 1), num_pairs_tested=num_tested,
                    top_k=top_k)
    return df


def _pair(aggressor: str, victim: str, window_of: np.ndarray, ttft: np.ndarray, windows: np.ndarray, x: np.ndarray,
          y: np.ndarray, n: np.ndarray, burst: np.ndarray, za: np.ndarray, rng: np.random.Generator,
          permutations: int, min_windows: int, min_burst_windows: int, min_victim_requests: int) -> dict:
    in_burst = np.isin(window_of, windows[burst])
    hi, lo = ttft[in_burst], ttft[~in_burst]
    enough = bool(x.size >= min_windows and burst.sum() >= min_burst_windows and hi.size >= min_victim_requests)
    effect = float(_effects(x, y, n, burst)[0]) if x.size else math.nan
    p = _p_value(x, y, n, burst, effect, num=permutations, rng=rng) if enough else math.nan
    normal = float(lo.mean()) if lo.size else math.nan
    corr = (float(np.corrcoef(za, y)[0, 1]) if x.size >= 3 and np.std(za) > 0 and np.std(y) > 0 else math.nan)
    return {"aggressor": aggressor, "victim": victim, "num_windows": int(x.size), "num_burst_windows": int(burst.sum()),
            "num_victim_burst": int(hi.size), "num_victim_normal": int(lo.size),
            "victim_mean_burst_ms": float(hi.mean()) if hi.size else math.nan, "victim_mean_normal_ms": normal,
            "effect_ms": effect, "rel_effect": effect / normal if normal and math.isfinite(normal) else math.nan,
            "victim_p99_burst_ms": _p99(hi), "victim_p99_normal_ms": _p99(lo), "correlation": corr,
            "p_value": p, "enough_data": enough}
