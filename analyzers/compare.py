"""Comparisons that know run-to-run noise: several runs per side, tested at the level of runs.

Two runs of one configuration on a shared machine differ by tens of percent (another
process, a slower minute of CPU). Resampling tokens inside each run (:func:`analyzers.diff.diff`)
treats thousands of tokens as independent and calls that drift significant. Here the unit
is the run: each run gives one value per metric (:func:`analyzers.diff.run_values`, plus the
context figures of :func:`context_values`), and a metric's change is judged against how much
that value moves between runs of one configuration.

For each metric, on the log scale ``y = ln(value + floor)`` (a change is relative; ``floor``
keeps stages near zero from making huge ratios: ``min_effect_ms`` for times and, for a stage, at
least :data:`STAGE_FLOOR_SHARE` of the latency it is part of; 0.01 for fractions, 1 for counts):

* the noise sigma: the standard deviation of ``y`` between runs of one configuration. With
  two or more runs on each side it is the row's own spread within each side (pooled, ``nb + nc - 2``
  degrees of freedom), moderated by the noise model's figure for this row when it has one (counted
  as :data:`PRIOR_RUNS` runs' worth, ``PRIOR_RUNS + nb + nc - 2`` degrees of freedom): three runs that
  agree by chance are not noiseless, and Student's t with 4 degrees of freedom alone needs t ~ 9
  at a family's share of the false-alarm rate. A class's figure is never mixed in: it can be
  several times a row's own (a stage mean's against a stage median's). With one run on a side it is the noise model's (:class:`NoiseModel`): A/A runs
  the user measured (:func:`measure_noise`) or :data:`DEFAULT_NOISE`, measured on the reference
  server (``benchmarks/comparison.py``), each row's own figure where it has one. Column
  ``noise_source`` says which.
* the test: Student's t of the difference of the sides' mean ``y``; p-values Holm-adjusted within
  each family of :data:`FAMILIES` (:func:`family_of`): the primary rows declared in advance
  (:data:`PRIMARY`: TTFT, ITL and E2E at p50 and p99), the other latency statistics, the stage
  rows (which explain a latency change) and the context rows. The three families of times share
  the false-alarm rate ``1 - confidence`` in equal parts (each family's Holm-adjusted p-values
  times 3), so the chance that an identical configuration shows any significant change of a time
  (a regression or an improvement) is at most ``1 - confidence``; the context rows, never a
  regression, have theirs on their own.
* ``significant``: p_adjusted < 1 - confidence, |delta| >= ``min_effect_ms`` (times) and
  |rel_change| >= ``min_effect``; ``regression``: significant and a time went up.
* ``verdict``: ``regression``, ``improvement``, ``noise`` (not distinguishable from run-to-run
  noise) or ``untested`` (both sides under the floor).
* ``min_detectable``: the smallest relative change this many runs per side detects with
  probability ``power`` at the row's share of the false-alarm rate (Bonferroni's ``alpha / m``, ``m`` the
  rows tested in its family times the family's part, Holm's first step); ``runs_needed``: runs per side that would detect the observed change (NaN
  when it was detected or cannot be, within 1000 runs).

Rows: the rows of :func:`analyzers.diff.diff` (``metric``, ``statistic``: latency statistics, each stage's
mean time per token inside the token's interval), each stage's median per token of its own time (statistic
``p50``: a planted delay in every engine step moves it whatever a busy machine's stalls do to the mean, and
whether or not the stream delivers the tokens in bursts) and the context rows
(statistic ``value``): ``cache.hit_rate`` (prompt tokens served from the prefix cache),
``schedule.preemptions`` (preempted intervals), ``engine.utilisation`` (share of each engine
instance's stepping window spent in steps, mean over instances) and ``schedule.queue_depth``
(requests waiting for admission, mean over steps). :func:`explain` words a stage regression
with the context that moved beside it: "hit rate fell from 83% to 24%, so prefill.compute
+233 ms".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from analyzers.compare_values import CONTEXT, RunValues, context_values, values_of
from analyzers.source import Source
from analyzers.stats import holm, min_detectable_effect, runs_needed, t_p_value
from tokentrace.schema import Stage

__all__ = ["NoiseModel", "RunValues", "STAGE_FLOOR_SHARE", "values_of", "DEFAULT_NOISE", "PRIMARY", "FAMILIES",
           "family_of", "PRIOR_RUNS",
           "COMPARE_COLUMNS", "CONTEXT", "compare", "measure_noise",
           "context_values", "explain", "noise_key"]

COMPARE_COLUMNS = ["metric", "statistic", "unit", "runs_baseline", "runs_candidate", "n_baseline", "n_candidate",
                   "baseline", "candidate", "delta", "rel_change", "rel_ci_low", "rel_ci_high", "noise",
                   "noise_source", "p_value", "p_adjusted", "significant", "regression", "verdict", "min_detectable",
                   "runs_needed"]
_FLOOR = {"fraction": 0.01, "count": 1.0}  # the ms floor is min_effect_ms
PRIOR_RUNS = 4
"""How many runs' worth a row's own A/A figure counts for beside its spread between the compared runs (a moderated t;
a class's figure is never used there)."""
STAGE_FLOOR_SHARE = 0.02
"""A stage's floor is at least this share of the baseline's mean TTFT (``.ttft`` rows) or mean ITL (``.itl``):
a stage that small can neither move the latency people feel nor be measured apart from run-to-run noise."""
_CONTEXT_OF: dict[Stage, tuple[str, ...]] = {
    Stage.CACHE_LOOKUP: ("cache.hit_rate",), Stage.CACHE_LOAD: ("cache.hit_rate",),
    Stage.PREFILL_COMPUTE: ("cache.hit_rate",),
    Stage.SCHEDULE_QUEUE: ("schedule.queue_depth", "schedule.preemptions", "engine.utilisation"),
    Stage.SCHEDULE_PREEMPTED: ("schedule.preemptions",),
    Stage.DECODE_QUEUE: ("schedule.queue_depth", "engine.utilisation"),
}
"""Stage -> the context rows that cause its time to grow (a lost prefix costs prefill; a full pool, queueing)."""
_CONTEXT_WORDS = {"cache.hit_rate": "hit rate", "schedule.preemptions": "preemptions",
                  "engine.utilisation": "utilisation", "schedule.queue_depth": "queue depth"}


PRIMARY: tuple[tuple[str, str], ...] = tuple((m, s) for m in ("ttft", "itl", "e2e") for s in ("p50", "p99"))
"""The primary rows, declared before any data: TTFT, ITL and E2E at p50 and p99, the latencies people feel."""
FAMILIES = ("primary", "latency", "stage", "context")
"""The families a comparison's p-values are Holm-adjusted within (:func:`family_of`)."""


def family_of(metric: str, statistic: str) -> str:
    """The row's family (:data:`FAMILIES`): ``primary`` (:data:`PRIMARY`), ``latency`` (the other latency
    statistics), ``stage`` (the stage rows, which explain a latency change) or ``context``."""
    if (metric, statistic) in PRIMARY:
        return "primary"
    if metric.startswith("stage."):
        return "stage"
    return "context" if metric in CONTEXT else "latency"


def noise_key(metric: str, statistic: str) -> str:
    """The class of a row in a :class:`NoiseModel` when it has no figure of its own: ``latency.<statistic>``,
    ``stage`` (stage means), ``stage.p50`` (stage medians) or ``context``."""
    if metric.startswith("stage."):
        return "stage" if statistic == "mean" else f"stage.{statistic}"
    if metric in CONTEXT:
        return "context"
    return f"latency.{statistic}"


@dataclass(frozen=True, slots=True)
class NoiseModel:
    """Run-to-run noise of one configuration on one machine: per row (``"<metric>.<statistic>"``) and per class
    (:func:`noise_key`), the standard deviation of ``ln(value + floor)`` between runs; ``runs``: how many runs
    measured it (its degrees of freedom are ``runs - 1``); ``source``: where it came from, in words."""

    sigma: Mapping[str, float]
    runs: int
    source: str
    fallback: float = 0.35  # a class the model lacks

    def of(self, metric: str, statistic: str) -> float:
        key = f"{metric}.{statistic}"
        if key in self.sigma and math.isfinite(self.sigma[key]):
            return float(self.sigma[key])
        return float(self.sigma.get(noise_key(metric, statistic), self.fallback))

    @property
    def df(self) -> float:
        return float(max(self.runs - 1, 1))


DEFAULT_NOISE = NoiseModel(
    sigma={"cache.hit_rate.value": 0.05, "e2e.mean": 0.40, "e2e.p50": 0.40, "e2e.p90": 0.40, "e2e.p99": 0.45,
           "engine.utilisation.value": 0.30, "itl.mean": 0.45, "itl.p50": 0.95, "itl.p90": 0.45, "itl.p99": 0.55,
           "stage.cache.lookup.ttft.mean": 1.30, "stage.decode.compute.itl.mean": 0.60,
           "stage.decode.queue.itl.mean": 0.50, "stage.detokenize.itl.mean": 0.60,
           "stage.detokenize.ttft.mean": 1.40, "stage.gateway.accept.ttft.mean": 0.75,
           "stage.gateway.receive.ttft.mean": 1.00, "stage.gateway.route.ttft.mean": 0.35,
           "stage.prefill.compute.ttft.mean": 0.45, "stage.schedule.queue.ttft.mean": 1.10,
           "stage.stream.relay.itl.mean": 0.35, "stage.stream.relay.ttft.mean": 0.40,
           "stage.stream.send.itl.mean": 0.40, "stage.stream.send.ttft.mean": 0.85, "tpot.mean": 0.45,
           "tpot.p50": 0.40, "tpot.p90": 0.45, "tpot.p99": 0.55, "ttft.mean": 0.40, "ttft.p50": 0.40,
           "ttft.p90": 0.45, "ttft.p99": 0.55, "latency.mean": 0.50, "latency.p50": 0.60, "latency.p90": 0.60,
           "latency.p99": 0.55, "stage": 0.80, "context": 0.20,
           "stage.decode.compute.itl.p50": 0.15, "stage.decode.queue.itl.p50": 0.20,
           "stage.gateway.accept.ttft.p50": 0.50, "stage.gateway.route.ttft.p50": 0.65,
           "stage.prefill.compute.ttft.p50": 0.60, "stage.stream.relay.itl.p50": 0.40,
           "stage.stream.relay.ttft.p50": 0.40, "stage.p50": 0.45},
    runs=12,
    source="default: A/A runs of the reference server on a 2-core machine under load (docs/report.md)",
)
"""Used for a side with one run when no A/A runs are given: what ``benchmarks/comparison.py`` measured on the
reference server (12 A/A runs of 24 requests x 16 tokens, 4 at a time, on 2 CPU cores other work kept busy): each
row's spread rounded up to 0.05, and per class the larger root mean square of two such measurements; the latency
rows and the stage medians (statistic ``p50``) then raised to the root mean square of five later measurements of 10
or 12 A/A runs each, rounded up to 0.05 (decode.compute's median per later token: 0.09, 0.09, 0.09, 0.10 and 0.20,
and 0.14 over three runs at a heavier load: 0.15). A server on a quieter machine is less noisy:
measure yours with ``tokentrace report --noise``."""


@dataclass(frozen=True, slots=True)
class _Side:
    values: list[dict[tuple[str, str], float]] = field(default_factory=list)
    sizes: list[dict[tuple[str, str], int]] = field(default_factory=list)


def _side(runs: Sequence[Source | RunValues]) -> _Side:
    side = _Side()
    for run in runs:
        got = run if isinstance(run, RunValues) else values_of(run)
        side.values.append(got.values)
        side.sizes.append(got.sizes)
    return side


def _unit(metric: str) -> str:
    return CONTEXT.get(metric, "ms")


def _floors(keys: Sequence[tuple[str, str]], values: Sequence[Mapping[tuple[str, str], float]],
            min_effect_ms: float) -> dict[tuple[str, str], float]:
    """Each row's floor: 0.01 for fractions, 1 for counts, ``min_effect_ms`` for times and, for a stage, at least
    :data:`STAGE_FLOOR_SHARE` of the mean latency it is part of (over the runs ``values``)."""
    latency = {}
    for kind in ("ttft", "itl"):
        x = np.array([v.get((kind, "mean"), math.nan) for v in values], float)
        latency[kind] = float(np.nanmean(x)) if np.isfinite(x).any() else 0.0
    out = {}
    for metric, statistic in keys:
        floor = _FLOOR.get(_unit(metric), min_effect_ms)
        if metric.startswith("stage."):
            floor = max(floor, STAGE_FLOOR_SHARE * latency[metric.rsplit(".", 1)[-1]])
        out[metric, statistic] = floor
    return out


def _log(values: np.ndarray, floor: float) -> np.ndarray:
    return np.log(np.maximum(values, 0.0) + floor)


def measure_noise(runs: Sequence[Source | RunValues], *, source: str, min_effect_ms: float = 0.1) -> NoiseModel:
    """The noise of runs of one configuration (A/A runs): per row the standard deviation of ``ln(value + floor)``
    between them, per class the root mean square over its rows. ``ValueError`` with fewer than 3 runs."""
    if len(runs) < 3:
        raise ValueError(f"measuring run-to-run noise needs at least 3 runs of one configuration, got {len(runs)}")
    values = _side(runs).values
    keys = sorted(set().union(*values))
    floors = _floors(keys, values, min_effect_ms)
    sigma: dict[str, float] = {}
    classes: dict[str, list[float]] = {}
    for metric, statistic in keys:
        x = np.array([v.get((metric, statistic), math.nan) for v in values], float)
        x = x[np.isfinite(x)]
        floor = floors[metric, statistic]
        if x.size < 3 or x.max() < floor:
            continue
        s = float(np.std(_log(x, floor), ddof=1))
        sigma[f"{metric}.{statistic}"] = s
        classes.setdefault(noise_key(metric, statistic), []).append(s * s)
    for key, variances in classes.items():
        sigma[key] = math.sqrt(float(np.mean(variances)))
    return NoiseModel(sigma=sigma, runs=len(runs), source=source)


def compare(baselines: Sequence[Source | RunValues], candidates: Sequence[Source | RunValues], *,
            noise: NoiseModel | None = None, confidence: float = 0.95, power: float = 0.9, min_effect: float = 0.02,
            min_effect_ms: float = 0.1) -> pd.DataFrame:
    """Candidate runs against baseline runs, one row per metric (module doc; columns :data:`COMPARE_COLUMNS`).

    ``noise``: the run-to-run noise for sides of one run (default :data:`DEFAULT_NOISE`). ``ValueError`` for an
    empty side, confidence or power outside (0, 1) or a negative minimum effect."""
    if not baselines or not candidates:
        raise ValueError("a comparison needs at least one baseline run and one candidate run")
    if not (0 < confidence < 1 and 0 < power < 1):
        raise ValueError(f"confidence and power must be in (0, 1), got {confidence!r} and {power!r}")
    if min_effect < 0 or min_effect_ms < 0:
        raise ValueError("min_effect and min_effect_ms must be >= 0")
    noise = noise or DEFAULT_NOISE
    base, cand = _side(baselines), _side(candidates)
    keys = [k for k in base.values[0] if all(k in v for v in base.values + cand.values)]
    floors = _floors(keys, base.values, min_effect_ms)
    rows = [_row(k, base, cand, noise, _pooled(k, base, cand, floors[k]), floors[k]) for k in keys]
    df = pd.DataFrame(rows, columns=[c for c in COMPARE_COLUMNS if c not in
                                     ("p_adjusted", "significant", "regression", "verdict", "min_detectable",
                                      "runs_needed")] + ["log_delta", "se", "dof", "tested"])
    if df.empty:
        return pd.DataFrame(columns=COMPARE_COLUMNS)
    return _judge(df, alpha=1 - confidence, power=power, min_effect=min_effect, min_effect_ms=min_effect_ms)


def _arrays(key: tuple[str, str], base: _Side, cand: _Side) -> tuple[np.ndarray, np.ndarray]:
    b = np.array([v[key] for v in base.values], float)
    c = np.array([v[key] for v in cand.values], float)
    return b[np.isfinite(b)], c[np.isfinite(c)]


def _pooled(key: tuple[str, str], base: _Side, cand: _Side, floor: float) -> tuple[float, int]:
    """(pooled variance of the log values within each side, its degrees of freedom); NaN with one run a side
    or a row under the floor."""
    b, c = _arrays(key, base, cand)
    if b.size < 2 or c.size < 2 or max(b.max(), c.max()) < floor:
        return math.nan, 0
    yb, yc = _log(b, floor), _log(c, floor)
    dof = b.size + c.size - 2
    return float((((yb - yb.mean()) ** 2).sum() + ((yc - yc.mean()) ** 2).sum()) / dof), dof


def _row(key: tuple[str, str], base: _Side, cand: _Side, noise: NoiseModel, spread: tuple[float, int],
         floor: float) -> dict:
    metric, statistic = key
    unit = _unit(metric)
    b, c = _arrays(key, base, cand)
    nb, nc = b.size, c.size
    out = {"metric": metric, "statistic": statistic, "unit": unit, "runs_baseline": nb, "runs_candidate": nc,
           "n_baseline": sum(s.get(key, 0) for s in base.sizes), "n_candidate": sum(s.get(key, 0) for s in cand.sizes),
           "baseline": float(b.mean()) if nb else math.nan, "candidate": float(c.mean()) if nc else math.nan}
    out["delta"] = out["candidate"] - out["baseline"]
    tested = bool(nb and nc and max(b.max(), c.max()) >= floor)
    pooled, dof = spread
    known = noise.sigma.get(f"{metric}.{statistic}", math.nan)
    if dof and math.isfinite(known):
        # the row's own spread, moderated by the row's own A/A figure (PRIOR_RUNS' worth): three runs that agree by
        # chance are not noiseless, and a t with 4 degrees of freedom alone would need t ~ 9 at a family's share
        sigma = math.sqrt((PRIOR_RUNS * known ** 2 + dof * pooled) / (PRIOR_RUNS + dof))
        df = PRIOR_RUNS + dof
        source = f"measured: the spread of these {nb} + {nc} runs, steadied by this row's figure from {noise.source}"
    elif dof:
        # no figure of the row's own: only its spread between these runs (a class's figure would hide or invent
        # a change these runs measure)
        sigma, df, source = math.sqrt(pooled), dof, f"measured: the spread of these {nb} + {nc} runs"
    else:
        sigma, df, source = noise.of(metric, statistic), noise.df, noise.source
    se = sigma * math.sqrt(1 / max(nb, 1) + 1 / max(nc, 1))
    log_delta = float(_log(c, floor).mean() - _log(b, floor).mean()) if tested else math.nan
    if not tested:
        p = math.nan
    elif se > 0:
        p = t_p_value(log_delta / se, df)
    else:  # runs that agree exactly within each side: any difference between the sides is past their noise
        p = 1.0 if log_delta == 0 else 0.0
    rel = out["delta"] / out["baseline"] if abs(out["baseline"]) >= floor else math.nan
    return out | {"rel_change": rel, "rel_ci_low": math.nan, "rel_ci_high": math.nan, "noise": sigma,
                  "noise_source": source, "p_value": p, "log_delta": log_delta, "se": se, "dof": df,
                  "tested": tested}


def _judge(df: pd.DataFrame, *, alpha: float, power: float, min_effect: float, min_effect_ms: float) -> pd.DataFrame:
    from analyzers.stats import t_quantile

    families = np.array([family_of(str(mt), str(st)) for mt, st in zip(df["metric"], df["statistic"])])
    df["p_adjusted"] = math.nan
    m = {}
    for name in np.unique(families):
        rows = families == name
        parts = 1 if name == "context" else len(FAMILIES) - 1  # the time families share the false-alarm rate
        df.loc[rows, "p_adjusted"] = np.minimum(parts * holm(df.loc[rows, "p_value"].to_numpy(float)), 1.0)
        m[str(name)] = parts * max(int((df["tested"] & rows).sum()), 1)
    rel = df["rel_change"].to_numpy(float)
    delta = df["delta"].to_numpy(float)
    is_ms = (df["unit"] == "ms").to_numpy()
    big = np.where(is_ms, np.abs(delta) >= min_effect_ms, True) & (np.isnan(rel) | (np.abs(rel) >= min_effect))
    df["significant"] = (df["p_adjusted"].to_numpy(float) < alpha) & big & df["tested"].to_numpy(bool)
    df["regression"] = df["significant"] & is_ms & (delta > 0)
    df["verdict"] = np.where(~df["tested"], "untested", np.where(
        df["significant"], np.where(is_ms, np.where(delta > 0, "regression", "improvement"), "changed"), "noise"))
    mde, need, lo, hi = [], [], [], []
    for r, family in zip(df.itertuples(index=False), families):
        share = alpha / m[str(family)]
        detectable = min_detectable_effect(r.noise, r.runs_baseline, r.runs_candidate, alpha=share, power=power,
                                           df=r.dof)
        mde.append(math.expm1(detectable) if r.tested else math.nan)
        n = None if r.significant or not r.tested else runs_needed(r.log_delta, r.noise, alpha=share, power=power)
        need.append(math.nan if n is None else float(n))
        half = t_quantile(1 - alpha / 2, r.dof) * r.se
        lo.append(math.expm1(r.log_delta - half) if r.tested else math.nan)
        hi.append(math.expm1(r.log_delta + half) if r.tested else math.nan)
    df["min_detectable"], df["runs_needed"], df["rel_ci_low"], df["rel_ci_high"] = mde, need, lo, hi
    return df[COMPARE_COLUMNS]


def _percent(v: float) -> str:
    return f"{v * 100:.0f}%"


def _context_phrase(r: pd.Series) -> str:
    words = _CONTEXT_WORDS[str(r["metric"])]
    went = "rose" if r["delta"] > 0 else "fell"
    if r["unit"] == "fraction":
        return f"{words} {went} from {_percent(r['baseline'])} to {_percent(r['candidate'])}"
    return f"{words} {went} from {r['baseline']:.3g} to {r['candidate']:.3g}"


def explain(df: pd.DataFrame) -> list[str]:
    """One sentence per stage with a regression (its mean row, else its median's, worded ``(p50)``), with the
    context rows that changed beside it (significantly) first: "hit rate fell from 83% to 24%, so prefill.compute
    +233 ms per first token"."""
    by_metric = {str(r["metric"]): r for _, r in df[df["metric"].isin(list(CONTEXT))].iterrows()}
    labels = {s.label: s for s in Stage}
    out = []
    stage_rows = df[df["regression"].astype(bool) & df["metric"].str.startswith("stage.")]
    # one sentence per stage: its mean per token (the time it added) when that moved, else its median
    stage_rows = stage_rows.sort_values("statistic", key=lambda x: x != "mean", kind="stable").drop_duplicates("metric")
    for _, r in stage_rows.sort_values("delta", ascending=False).iterrows():
        label, kind = str(r["metric"])[len("stage."):].rsplit(".", 1)
        context = [by_metric[k] for k in _CONTEXT_OF.get(labels.get(label), ())  # type: ignore[arg-type]
                   if k in by_metric and bool(by_metric[k]["significant"])]
        per = ("per first token" if kind == "ttft" else "per later token") + (
            "" if r["statistic"] == "mean" else f" ({r['statistic']})")
        change = f"{label} {r['delta']:+.3g} ms {per}"
        out.append(f"{', '.join(_context_phrase(x) for x in context)}, so {change}" if context else change)
    return out
