"""Two runs compared per metric and stage: bootstrap intervals, p-values, minimum effects, ranking.

Rows (``metric``, ``statistic``):

* ``ttft``, ``tpot``, ``e2e`` (per request) and ``itl`` (per token) x ``mean``,
  ``p50``, ``p90``, ``p99`` (ms);
* ``stage.<label>.ttft`` / ``stage.<label>.itl`` x ``mean``: the stage's time
  per token 0 / per later token (ms; spans clipped to their token's interval, as
  in the stage breakdown), every stage and ``unattributed``.

delta = candidate - baseline (ms). rel_change = delta / baseline, except from a
near-zero baseline (|baseline| < ``min_effect_ms``), where a ratio means nothing:
it is NaN there and only the absolute change counts. n_baseline / n_candidate:
the sample sizes (requests; tokens for ITL).

The confidence interval of delta is a percentile bootstrap: ``resamples`` times,
each run's units are drawn with replacement and the statistic recomputed; ci = the
(1-confidence)/2 and (1+confidence)/2 quantiles of the resampled deltas. Each run is
resampled on its own seeded stream, one per role (baseline, candidate), in request
and token order: the two runs independently of each other, the same two runs to the
same intervals, and one run's side (:func:`run_bootstrap`) the same whatever it is
compared with. So a finished run's side is computed once, when its analysis facts are
saved (the derived fact :data:`RUN_BOOTSTRAP`), and a comparison of two such runs
only reads them. Stage means are ratio
estimators over resampled requests (sum of stage time / number of tokens).
p_value: two-sided, delta over the bootstrap standard error of delta (normal
approximation); p_adjusted: Holm's correction over every row of the table, so
comparing ~60 rows does not flag a few by chance. To bound cost each run
contributes at most ``max_units`` units (a seeded subsample beyond that).

``significant`` = p_adjusted < 1 - ``confidence``, |delta| >= ``min_effect_ms``
and (for a baseline that is not near zero) |rel_change| >= ``min_effect``.
``regression`` = significant and delta > 0 (higher latency is worse).
``contribution`` (stage rows): what the stage's change did to the latency people
feel, delta / the baseline's mean TTFT (``.ttft``) or mean ITL (``.itl``); null on
latency rows, whose rel_change says it. ``rank`` orders the stage regressions by
contribution (1 = the largest): which stage to look at first, whatever moved most
in relative terms. A run compared with itself has delta 0 and is never significant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa

from analyzers import facts
from analyzers.source import Source
from analyzers.stage_breakdown import ROW_OF_STAGE, STAGE_LABELS, request_stage_ns
from analyzers.stats import holm, normal_p_value
from analyzers.timing import E2E_NS, LATENCY, TPOT_NS, TTFT_NS, request_table, token_times
from tokentrace.schema import Column, Stage, col

__all__ = ["diff", "run_values", "run_bootstrap", "DIFF_COLUMNS", "STATISTICS", "BOOTSTRAP_COLUMNS", "ROLES",
           "RUN_BOOTSTRAP"]

STATISTICS: dict[str, float | None] = {"mean": None, "p50": 50.0, "p90": 90.0, "p99": 99.0}
DIFF_COLUMNS = ["metric", "statistic", "n_baseline", "n_candidate", "baseline", "candidate", "delta",
                "rel_change", "ci_low", "ci_high", "p_value", "p_adjusted", "contribution", "significant",
                "regression", "rank"]
_CHUNK = 50  # resamples per vectorised batch


@dataclass(frozen=True, slots=True)
class _RunSamples:
    per_request: dict[str, np.ndarray]  # ttft / tpot / e2e in ms
    itl: np.ndarray  # ms per token
    stage_sum: dict[str, np.ndarray]  # kind -> (n_requests, n_labels) ms summed per request
    stage_count: dict[str, np.ndarray]  # kind -> (n_requests,) tokens of that kind per request


def _samples(src: Source) -> _RunSamples:
    c = col
    rf, tt = request_table(src), token_times(src)
    req = src.df(f"SELECT {c.REQUEST_ID}, {TTFT_NS} / 1e6 AS ttft, {TPOT_NS} / 1e6 AS tpot, {E2E_NS} / 1e6 AS e2e "
                 f"FROM {rf} WHERE {TTFT_NS} IS NOT NULL ORDER BY {c.REQUEST_ID}")
    itl = src.df(f"SELECT {LATENCY} / 1e6 AS v FROM {tt} WHERE {c.TOKEN_INDEX} > 0 "  # in a fixed order: the
                 f"ORDER BY {c.REQUEST_ID}, {c.TOKEN_INDEX}")["v"].to_numpy(float)  # resamples draw by position
    stage_ms = _request_stage_ms(src)
    tok = src.df(f"""SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX} = 0 AS first, COUNT(*) AS n, SUM({LATENCY}) / 1e6 AS ms
                     FROM {tt} GROUP BY ALL""")
    ids = req[c.REQUEST_ID].to_numpy()  # ascending
    sums, counts = {}, {}
    for kind, first in (("ttft", True), ("itl", False)):
        s = np.zeros((len(req), len(STAGE_LABELS)))
        n = np.zeros(len(req))
        idx, found = _positions(ids, stage_ms[c.REQUEST_ID].to_numpy())  # one row per (request, stage): its cell
        s[idx, ROW_OF_STAGE[stage_ms[c.STAGE].to_numpy(np.int64)[found]]] = stage_ms[kind].to_numpy(float)[found]
        t = tok[tok["first"] == first]
        idx, found = _positions(ids, t[c.REQUEST_ID].to_numpy())
        n[idx] = t["n"].to_numpy(float)[found]
        lat = np.zeros(len(req))
        lat[idx] = t["ms"].to_numpy(float)[found]
        s[:, -1] = lat - s[:, :-1].sum(axis=1)
        sums[kind], counts[kind] = s, n
    per_request = {k: req[k].to_numpy(float) for k in ("ttft", "tpot", "e2e")}
    return _RunSamples(per_request, itl, sums, counts)


def run_values(src: Source) -> dict[tuple[str, str], tuple[int, float]]:
    """One run's point values, no resampling: (metric, statistic) -> (sample size, value in ms), the rows of
    :func:`diff` (latency statistics and stage means per token 0 / per later token). What a comparison of several
    runs per side (:mod:`analyzers.compare`) tests at the level of runs."""
    samples = _samples(src)
    out: dict[tuple[str, str], tuple[int, float]] = {}
    for metric in ("ttft", "tpot", "itl", "e2e"):
        x = samples.itl if metric == "itl" else samples.per_request[metric]
        x = x[np.isfinite(x)]
        if x.size:
            out.update({(metric, name): (int(x.size), float(_stat(x, q))) for name, q in STATISTICS.items()})
    for kind in ("ttft", "itl"):
        s, n = samples.stage_sum[kind], samples.stage_count[kind]
        if n.sum() > 0:
            value = s.sum(axis=0) / n.sum()
            out.update({(f"stage.{label}.{kind}", "mean"): (int((n > 0).sum()), float(value[j]))
                        for j, label in enumerate(STAGE_LABELS)})
    return out


def _positions(ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``values`` in the ascending unique ``ids``: (their positions, which values are there)."""
    at = np.searchsorted(ids, values).clip(max=max(len(ids) - 1, 0))
    found = (ids[at] == values) if len(ids) else np.zeros(len(values), dtype=bool)
    return at[found], found


def _request_stage_ms(src: Source) -> pd.DataFrame:
    """One row per request and stage with spans inside its token intervals: request_id, stage_id, and ``ttft`` /
    ``itl``: the ms of that stage's spans inside its first token's interval / its later tokens' intervals, from the
    per-request stage sums (:data:`analyzers.stage_breakdown.REQUEST_STAGE_NS`: token 0's part, and the rest; summed
    over the roles that recorded them). A stage without a row has no span there: 0."""
    c = col
    first_ns = "COALESCE(first_ns, 0)"
    known = ", ".join(str(int(st)) for st in Stage)
    return src.df(f"""SELECT {c.REQUEST_ID}, {c.STAGE}, SUM({first_ns}) / 1e6 AS ttft, SUM(ns - {first_ns}) / 1e6 AS itl
                      FROM {request_stage_ns(src)} WHERE {c.STAGE} IN ({known}) GROUP BY {c.REQUEST_ID}, {c.STAGE}""")


def _stat(x: np.ndarray, q: float | None, axis: int = -1) -> np.ndarray:
    return x.mean(axis=axis) if q is None else np.percentile(x, q, axis=axis)


def _counts(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(k, n): how often each of n units is drawn in each of k resamples of n draws with replacement."""
    drawn = rng.integers(0, n, size=(k, n)) + (np.arange(k) * n)[:, None]
    return np.bincount(drawn.ravel(), minlength=k * n).reshape(k, n)


def _boot_statistics(x: np.ndarray, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """(statistics, resamples): every statistic of :data:`STATISTICS` of each resample of ``x``, the statistics of
    one resample from the same draws. A resample is counted, not gathered: a unit's count in it, over the sorted
    values, gives its mean and, through the running counts, the order statistics its percentiles interpolate
    between (as ``np.percentile``'s linear rule) without sorting it."""
    xs = np.sort(x)
    n = xs.size
    out = np.empty((len(STATISTICS), resamples))
    for lo in range(0, resamples, _CHUNK):
        k = min(_CHUNK, resamples - lo)
        w = _counts(n, k, rng)
        running = (np.cumsum(w, axis=1) + (np.arange(k) * n)[:, None]).ravel()  # ascending over all k rows
        base = np.arange(k) * n
        for i, q in enumerate(STATISTICS.values()):
            if q is None:
                out[i, lo:lo + k] = (w @ xs) / n
                continue
            h = (n - 1) * q / 100
            j = int(math.floor(h))
            # the j-th order statistic of row r is the first sorted unit whose running count exceeds j
            low = xs[np.searchsorted(running, base + j, side="right") - base]
            high = xs[np.searchsorted(running, base + min(j + 1, n - 1), side="right") - base]
            out[i, lo:lo + k] = low + (h - j) * (high - low)
    return out


def _boot_ratio(s: np.ndarray, n: np.ndarray, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """Resampled sum(s) / sum(n) over rows; s is (rows, columns) -> (resamples, columns)."""
    out = np.empty((resamples, s.shape[1]))
    for lo in range(0, resamples, _CHUNK):
        k = min(_CHUNK, resamples - lo)
        w = _counts(s.shape[0], k, rng)  # (k, rows)
        with np.errstate(invalid="ignore", divide="ignore"):
            out[lo:lo + k] = (w @ s) / (w @ n)[:, None]
    return out


def _cap(x: np.ndarray, max_units: int, rng: np.random.Generator) -> np.ndarray:
    return x if x.shape[0] <= max_units else x[rng.choice(x.shape[0], max_units, replace=False)]


def _row(metric: str, statistic: str, sizes: tuple[int, int], b: float, c: float, bb: np.ndarray, cb: np.ndarray,
         confidence: float) -> dict:
    """A row's values, interval and p-value; significance is decided over the whole table (:func:`_judge`)."""
    d = cb - bb
    d = d[np.isfinite(d)]
    lo, hi = (np.quantile(d, [(1 - confidence) / 2, (1 + confidence) / 2]) if d.size else (math.nan, math.nan))
    delta = c - b
    p = normal_p_value(delta, float(np.std(d, ddof=1))) if d.size > 1 else math.nan
    return {"metric": metric, "statistic": statistic, "n_baseline": sizes[0], "n_candidate": sizes[1],
            "baseline": b, "candidate": c, "delta": delta, "rel_change": math.nan, "ci_low": float(lo),
            "ci_high": float(hi), "p_value": p}


def _judge(df: pd.DataFrame, *, confidence: float, min_effect: float, min_effect_ms: float) -> pd.DataFrame:
    """Relative change, Holm-adjusted p-values, significance, contribution and rank of every row."""
    base = df["baseline"].to_numpy(float)
    delta = df["delta"].to_numpy(float)
    near_zero = np.abs(base) < min_effect_ms
    with np.errstate(divide="ignore", invalid="ignore"):
        df["rel_change"] = np.where(near_zero, math.nan, delta / base)
    df["p_adjusted"] = holm(df["p_value"].to_numpy(float))
    rel_ok = near_zero | (np.abs(df["rel_change"].to_numpy(float)) >= min_effect)
    df["significant"] = ((df["p_adjusted"].to_numpy(float) < 1 - confidence) & (np.abs(delta) >= min_effect_ms)
                         & rel_ok)
    df["regression"] = df["significant"] & (delta > 0)
    means = {m: float(df.loc[(df["metric"] == m) & (df["statistic"] == "mean"), "baseline"].iloc[0])
             for m in ("ttft", "itl") if ((df["metric"] == m) & (df["statistic"] == "mean")).any()}
    kind = df["metric"].str.rsplit(".", n=1).str[-1]
    stage = df["metric"].str.startswith("stage.")
    scale = kind.map(means).astype(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        df["contribution"] = np.where(stage, delta / scale.where(scale > 0).to_numpy(float), math.nan)
    order = df[df["regression"] & stage].sort_values("contribution", ascending=False, na_position="last",
                                                     kind="stable")
    df["rank"] = pd.Series(range(1, len(order) + 1), index=order.index, dtype="Int64").reindex(df.index)
    return df


BOOTSTRAP_COLUMNS = ["metric", "statistic", "n", "value", "draws"]
ROLES = ("baseline", "candidate")
"""A run's resamples are drawn from a stream of its role: a run compared with another (or with itself) is
resampled independently of it, and its draws as baseline are the same whatever it is compared with."""


def run_bootstrap(src: Source, role: str, *, resamples: int = 1000, seed: int = 0,
                  max_units: int = 20_000) -> pd.DataFrame:
    """One run's side of :func:`diff`, as ``role`` (``"baseline"`` or ``"candidate"``): one row per metric and
    statistic it has samples of, with its sample size (``n``), ``value`` and the statistic of each of
    ``resamples`` resamples (``draws``). With the default parameters both roles' rows are the derived fact
    :data:`RUN_BOOTSTRAP` (saved with the run's facts)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if (resamples, seed, max_units) != _DEFAULTS:
        return _bootstrap(_samples(src), role, resamples=resamples, seed=seed, max_units=max_units)
    cols = ", ".join(BOOTSTRAP_COLUMNS)
    table = src.arrow(f"SELECT {cols} FROM {facts.relation(src, RUN_BOOTSTRAP)} WHERE role = '{role}'")
    frame = table.to_pandas()
    frame["draws"] = [np.asarray(d, float) for d in frame["draws"]]
    return frame


_DEFAULTS = (1000, 0, 20_000)  # resamples, seed, max_units of run_bootstrap: those of the saved fact


def _build_bootstrap(src: Source, table: str) -> None:
    """Materialize :data:`RUN_BOOTSTRAP` (both roles, default parameters) as ``table``."""
    samples = _samples(src)
    frames = [_bootstrap(samples, role).assign(role=role) for role in ROLES]
    frame = pd.concat(frames, ignore_index=True)
    rows = pa.table({"role": frame["role"].tolist(), "metric": frame["metric"].tolist(),
                     "statistic": frame["statistic"].tolist(), "n": pa.array(frame["n"], pa.int64()),
                     "value": pa.array(frame["value"], pa.float64()),
                     "draws": pa.array([np.asarray(d, float) for d in frame["draws"]], pa.list_(pa.float64()))},
                    schema=RUN_BOOTSTRAP.schema)
    src.register(table, rows)


RUN_BOOTSTRAP = facts.Fact(
    "run_bootstrap", "The run's side of a comparison of two runs, as baseline and as candidate: per metric and "
                     "statistic its sample size, value and 1,000 resampled values (run_bootstrap's defaults).",
    (facts.text("role", "baseline or candidate."), facts.text("metric", "ttft, tpot, itl, e2e or a stage share."),
     facts.text("statistic", "mean, p50, p90, p99 or share."), facts.i64("n", "Sample size."),
     facts.f64("value", "The statistic over the samples."),
     Column("draws", pa.list_(pa.float64()), "The statistic of each resample.")),
    build=_build_bootstrap)


def _bootstrap(samples: _RunSamples, role: str, *, resamples: int = 1000, seed: int = 0,
               max_units: int = 20_000) -> pd.DataFrame:
    rng = np.random.default_rng([int(seed), ROLES.index(role)])
    rows = []
    for metric in ("ttft", "tpot", "itl", "e2e"):
        x = samples.itl if metric == "itl" else samples.per_request[metric]
        x = x[np.isfinite(x)]
        if not x.size:
            continue
        x = _cap(x, max_units, rng)
        draws = _boot_statistics(x, rng, resamples)
        for i, (name, q) in enumerate(STATISTICS.items()):
            rows.append((metric, name, int(x.size), float(_stat(x, q)), draws[i]))
    for kind in ("ttft", "itl"):
        s, n = samples.stage_sum[kind], samples.stage_count[kind]
        if n.sum() <= 0:
            continue
        keep = _cap(np.arange(len(n)), max_units, rng)
        s, n = s[keep], n[keep]
        draws = _boot_ratio(s, n, rng, resamples)
        value = s.sum(axis=0) / n.sum()
        size = int((n > 0).sum())
        for j, label in enumerate(STAGE_LABELS):
            rows.append((f"stage.{label}.{kind}", "mean", size, float(value[j]), draws[:, j]))
    return pd.DataFrame(rows, columns=BOOTSTRAP_COLUMNS)


def diff(baseline: Source, candidate: Source, *, resamples: int = 1000, seed: int = 0, min_effect: float = 0.02,
         min_effect_ms: float = 0.1, confidence: float = 0.95, max_units: int = 20_000) -> pd.DataFrame:
    """Per metric and stage: sample sizes, values, delta, rel_change, bootstrap CI, p-values, significance,
    contribution and the rank of each regression (module doc).

    ``ValueError`` for resamples < 10, confidence outside (0, 1), a negative minimum effect or max_units < 2.
    Metrics with no samples in either run are left out.
    """
    if resamples < 10:
        raise ValueError(f"resamples must be at least 10, got {resamples!r}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    if min_effect < 0 or min_effect_ms < 0 or max_units < 2:
        raise ValueError("min_effect and min_effect_ms must be >= 0 and max_units >= 2")
    b = run_bootstrap(baseline, "baseline", resamples=resamples, seed=seed, max_units=max_units)
    c = {(m, st): (n, v, d) for m, st, n, v, d in run_bootstrap(candidate, "candidate", resamples=resamples,
                                                                 seed=seed, max_units=max_units).itertuples(index=False)}
    rows = []
    for metric, statistic, nb, vb, db in b.itertuples(index=False):
        if (metric, statistic) in c:
            nc, vc, dc = c[metric, statistic]
            rows.append(_row(metric, statistic, (int(nb), int(nc)), float(vb), float(vc), np.asarray(db, float),
                             np.asarray(dc, float), confidence))
    df = pd.DataFrame(rows, columns=[k for k in DIFF_COLUMNS if k not in ("p_adjusted", "contribution", "significant",
                                                                        "regression", "rank")])
    if df.empty:
        return pd.DataFrame(columns=DIFF_COLUMNS)
    df = _judge(df, confidence=confidence, min_effect=min_effect, min_effect_ms=min_effect_ms)
    return df[DIFF_COLUMNS]
