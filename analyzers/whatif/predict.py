"""What-if: fit the simulator to a run, check it against that run, then predict a changed configuration.

:func:`fit_whatif` reads the run (:mod:`analyzers.whatif.trace`), fits the cost models
(:mod:`analyzers.whatif.models`), replays the run's own requests through its own deployment and compares
the replay with what the run measured: the fit's own error (``fit_error``: (replayed - measured) /
measured per metric) is known before anything is predicted. :meth:`WhatIf.predict` replays the same
requests through a changed deployment or workload (:data:`SETTINGS`); :meth:`WhatIf.sweep` does it over a
range of one setting and finds the highest value that still meets the SLO targets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

import numpy as np

from analyzers.slo import DEFAULT_TARGET_SHARE, SloTargets, resolve_targets
from analyzers.source import Source
from analyzers.whatif.engine_model import POLICIES
from analyzers.whatif.metrics import HEADLINE_METRICS, LATENCY_METRICS, measured_metrics, outcome_metrics
from analyzers.whatif.models import VARIATIONS, FittedModels, fit_models
from analyzers.whatif.simulate import Arrival, Deployment, EngineSetup, StepRecord, simulate
from analyzers.whatif.trace import EngineSpec, RunTrace, read_trace
from tokentrace.schema import Role

__all__ = ["SETTINGS", "WhatIf", "Prediction", "SweepResult", "fit_whatif", "parse_setting", "parse_sweep",
           "check_settings", "crossing", "crossing_noise", "extrapolation", "SLO_METRIC", "NUM_REPLAYS"]

SETTINGS: dict[str, str] = {
    "rate_scale": "multiply the request rate (arrival gaps divided by it), > 0",
    "output_scale": "multiply every request's output tokens, > 0",
    "max_num_seqs": "sequences per engine step, integer >= 1",
    "max_num_batched_tokens": "token budget per engine step, integer >= 1",
    "num_device_blocks": "KV blocks in each engine's device tier, integer >= 1",
    "scheduling_policy": f"order of waiting requests: {', '.join(POLICIES)}",
    "instances": "colocated engine instances, integer >= 1",
    "prefill_instances": "prefill instances of a disaggregated deployment, integer >= 1",
    "decode_instances": "decode instances of a disaggregated deployment, integer >= 1",
    "step_time_scale": "multiply every engine step's time and the gap between busy steps (a device that slow), > 0",
}
"""Every setting a prediction may change, with what it accepts."""

_FLOATS = ("rate_scale", "output_scale", "step_time_scale")
_INTS = ("max_num_seqs", "max_num_batched_tokens", "num_device_blocks", "instances", "prefill_instances",
         "decode_instances")
NUM_REPLAYS = 5
"""Replays averaged per prediction (each draws the step-time variation with its own seed)."""
SLO_METRIC = "slo.all.attainment"
"""The metric a sweep holds to the target share (:data:`analyzers.slo.DEFAULT_TARGET_SHARE`)."""


def parse_setting(text: str) -> tuple[str, Any]:
    """``NAME=VALUE`` -> (name, typed value); ``ValueError`` (one sentence) for an unknown name or bad value."""
    name, sep, raw = text.partition("=")
    name, raw = name.strip(), raw.strip()
    if not sep or not name:
        raise ValueError(f"--set takes NAME=VALUE, got {text!r}")
    return name, _typed(name, raw)


def _typed(name: str, raw: Any) -> Any:
    if name not in SETTINGS:
        raise ValueError(f"unknown setting {name!r}; settings: {', '.join(SETTINGS)}")
    if name == "scheduling_policy":
        if raw not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}, got {raw!r}")
        return str(raw)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {raw!r}") from None
    if name in _FLOATS:
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive number, got {raw!r}")
        return value
    if not value.is_integer() or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {raw!r}")
    return int(value)


def check_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Typed and consistent settings; ``ValueError`` naming the problem."""
    out = {name: _typed(name, value) for name, value in settings.items()}
    if "instances" in out and ({"prefill_instances", "decode_instances"} & set(out)):
        raise ValueError("instances (colocated) and prefill_instances/decode_instances (disaggregated) exclude "
                         "each other")
    return out


def parse_sweep(text: str) -> tuple[str, list[Any]]:
    """``NAME=START:STOP:STEP`` (inclusive of STOP) or ``NAME=V1,V2,...`` -> (name, values)."""
    name, sep, raw = text.partition("=")
    name = name.strip()
    if not sep:
        raise ValueError(f"--sweep takes NAME=START:STOP:STEP or NAME=V1,V2,..., got {text!r}")
    if name not in SETTINGS:
        raise ValueError(f"unknown setting {name!r}; settings: {', '.join(SETTINGS)}")
    if ":" in raw:
        parts = raw.split(":")
        try:
            start, stop, step = (float(p) for p in parts)
        except ValueError:
            raise ValueError(f"--sweep range must be START:STOP:STEP numbers, got {raw!r}") from None
        if len(parts) != 3 or not (step > 0 and stop >= start):
            raise ValueError(f"--sweep range needs START <= STOP and STEP > 0, got {raw!r}")
        count = int(math.floor((stop - start) / step + 1e-9)) + 1
        if count > 200:
            raise ValueError(f"--sweep range has {count} points; at most 200")
        values = [_typed(name, round(start + k * step, 10)) for k in range(count)]
    else:
        values = [_typed(name, v.strip()) for v in raw.split(",") if v.strip()]
    if not values:
        raise ValueError(f"--sweep {name} has no values")
    return name, values


@dataclass(frozen=True, slots=True)
class Prediction:
    """Metrics of one replay, with the settings that made it.

    ``ranges``: when the replay's steps carry batch sizes the run's steps did not cover, each metric's range
    over the replays with the step-time refits on resampled steps and the other step-time forms
    (:func:`extrapolation`), the prediction inside it; empty otherwise. ``notes``: what the prediction extrapolates, in sentences."""

    settings: dict[str, Any]
    metrics: dict[str, float]
    num_preemptions: int
    num_unserved: int
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SweepResult:
    """A sweep of one setting: one prediction per value, and the highest value meeting the SLO."""

    name: str
    values: list[Any]
    predictions: list[Prediction]
    highest_meeting: Any | None  # None: no value met the SLO target share
    target_share: float
    breaking_value: float | None = None  # numeric sweeps: where attainment crosses the target (interpolated)


@dataclass(slots=True)
class WhatIf:
    """A run's fitted simulator: its inputs, models, and its error on the run itself."""

    trace: RunTrace
    models: FittedModels
    targets: dict[str, SloTargets]
    measured: dict[str, float]
    fitted: dict[str, float]
    notes: list[str] = field(default_factory=list)
    num_replays: int = NUM_REPLAYS  # replays averaged per prediction
    max_requests: int | None = None  # replay the run's first this many served requests (None: all)

    @property
    def fit_error(self) -> dict[str, float]:
        """(replayed - measured) / measured per metric (NaN where the run did not measure it or it is 0); for a
        share (``slo.<class>.attainment``) the difference itself (replayed - measured, in fractions: a share
        near 0 has no useful relative error); plus ``step_time.mape``: the step-time model's mean error on
        the run's steps."""
        out = {}
        for name, m in self.measured.items():
            f = self.fitted.get(name, math.nan)
            if not (math.isfinite(m) and math.isfinite(f)):
                out[name] = math.nan
            elif name.endswith(".attainment"):
                out[name] = f - m
            else:
                out[name] = (f - m) / m if m else math.nan
        out["step_time.mape"] = self.models.all_steps.mape
        return out

    def predict(self, settings: Mapping[str, Any] | None = None, *, ranges: bool = True,
                in_place: bool | None = None) -> Prediction:
        """Replay the run's requests under ``settings`` (:data:`SETTINGS`) :attr:`num_replays` times (step
        variation drawn with seeds 0, 1, ...) and average each metric; ``ValueError`` for bad settings.

        With the ``timeline`` variation, replay ``k`` reads the run's speed ``k / num_replays`` of the run's
        span later (:func:`~analyzers.whatif.simulate.simulate`'s ``phase``): another run's slow periods do not
        come at the same moments as this run's, so a prediction is the average over where they may fall;
        ``in_place``: every replay at phase 0, the run's slow periods where they were (the replay of the run
        itself, :attr:`fitted`); None (the default): so when no setting is given (nothing changed, the prediction
        is the replay of the run), else averaged over the phases.

        When the replay's steps leave the batch sizes the run covered (:func:`extrapolation`), the prediction
        says so in ``notes`` and, with ``ranges``, replays again with the step-time refits at either end of
        the resampled ones and with each other step-time form fitted to the run, and gives each metric's
        range."""
        s = check_settings(settings or {})
        in_place = not s if in_place is None else in_place
        deployment = self.deployment(s)
        arrivals = self.arrivals(s)
        records: list[StepRecord] = []
        metrics, preemptions, unserved = self._replays(deployment, arrivals, records.append, in_place)
        notes, variants = extrapolation(deployment, records)
        spans: dict[str, tuple[float, float]] = {}
        if notes and ranges and variants:
            ends = [self._replays(replace(deployment, engines=tuple(
                replace(e, model=v[i]) if i in v else e for i, e in enumerate(deployment.engines))), arrivals,
                in_place=in_place)[0]
                for v in variants.values()]
            for name, v in metrics.items():
                vals = [v, *(m.get(name, math.nan) for m in ends)]
                if all(math.isfinite(x) for x in vals):
                    spans[name] = (min(vals), max(vals))
            shown = [m for m in ("ttft.p50", "ttft.p99", "itl.p50", "itl.p99", "e2e.p50", "e2e.p99") if m in spans]
            notes.append("over the step-time refits on resampled steps (the 5th and 95th percentile of their step "
                         "time on this replay's batches) and the other step-time forms fitted to the run "
                         f"({', '.join(k for k in variants if k not in ('low', 'high')) or 'none'}) the "
                         "prediction ranges " + ", ".join(
                             f"{m} {spans[m][0]:,.0f}-{spans[m][1]:,.0f} ms" for m in shown))
        return Prediction(s, metrics, preemptions, unserved, spans, tuple(notes))

    def _replays(self, deployment: Deployment, arrivals: list[Arrival],
                 record: Callable[[StepRecord], None] | None = None, in_place: bool = False
                 ) -> tuple[dict[str, float], int, int]:
        """Mean metrics over :attr:`num_replays` seeded replays (replay ``k`` at timeline phase ``k / num_replays``,
        0 with ``in_place``), mean preemptions and unserved requests; ``record`` gets the first replay's steps."""
        runs, preemptions, unserved = [], 0, 0
        for seed in range(self.num_replays):
            outcomes = simulate(deployment, arrivals, seed=seed, record=record if seed == 0 else None,
                                phase=0.0 if in_place else seed / self.num_replays)
            runs.append(outcome_metrics(outcomes, self.targets))
            preemptions += sum(o.num_preemptions for o in outcomes)
            unserved += sum(1 for o in outcomes if not o.delivered_ns)
        names = set(HEADLINE_METRICS).union(*runs)
        metrics = {name: _mean([r.get(name, math.nan) for r in runs]) for name in sorted(names, key=_order)}
        return metrics, round(preemptions / self.num_replays), round(unserved / self.num_replays)

    def sweep(self, name: str, values: list[Any], settings: Mapping[str, Any] | None = None, *,
              target_share: float = DEFAULT_TARGET_SHARE) -> SweepResult:
        """Predict at every value of one setting (the others from ``settings``); the highest value whose
        ``slo.all.attainment`` reaches ``target_share``."""
        base = dict(settings or {})
        preds = [self.predict({**base, name: v}, ranges=False) for v in values]
        meeting = [v for v, p in zip(values, preds) if p.metrics.get(SLO_METRIC, math.nan) >= target_share]
        best = max(meeting) if meeting and name != "scheduling_policy" else (meeting[0] if meeting else None)
        breaking = None
        if name != "scheduling_policy":
            breaking = crossing([float(v) for v in values], [p.metrics.get(SLO_METRIC, math.nan) for p in preds],
                                target_share)
        return SweepResult(name, list(values), preds, best, target_share, breaking)

    # ------------------------------------------------------------------ inputs of a replay

    def arrivals(self, s: Mapping[str, Any]) -> list[Arrival]:
        reqs = [r for r in self.trace.requests if r.ok][:self.max_requests]
        if not reqs:
            return []
        t0 = reqs[0].arrival_ns
        rate = float(s.get("rate_scale", 1.0))
        out_scale = float(s.get("output_scale", 1.0))
        out = []
        for r in reqs:
            t = self.targets.get(r.slo_class) or next(iter(self.targets.values()))
            num_output = max(1, int(round(r.num_output_tokens * out_scale)))
            out.append(Arrival(
                r.request_id, t0 + int((r.arrival_ns - t0) / rate), r.engine_arrival_ns - r.arrival_ns,
                r.num_prompt_tokens, r.num_cached_tokens, num_output, r.slo_class, int(t.ttft_ms * 1e6),
                1 if r.slo_class == "interactive" else 0, r.tenant, min(r.first_visible_index, num_output - 1)))
        return out

    def deployment(self, s: Mapping[str, Any]) -> Deployment:
        engines = list(self.trace.engines)
        by_role = {e.role: e for e in engines}
        template = engines[0]
        if "instances" in s:
            base = by_role.get(Role.COLOCATED, template)
            engines = [replace(base, role=Role.COLOCATED)] * int(s["instances"])
        elif {"prefill_instances", "decode_instances"} & set(s):
            was_disagg = Role.PREFILL in by_role
            n_p = int(s.get("prefill_instances", sum(e.role is Role.PREFILL for e in engines) or 1))
            n_d = int(s.get("decode_instances", sum(e.role is Role.DECODE for e in engines) or 1))
            p = replace(by_role.get(Role.PREFILL, template), role=Role.PREFILL)
            d = replace(by_role.get(Role.DECODE, template), role=Role.DECODE)
            engines = [p] * n_p + [d] * n_d
            if not was_disagg and not self.models.stages.has_handoff:
                self._note("the run has no KV hand-over to fit a transfer time to: the disaggregated prediction "
                           "counts none")
        return Deployment(tuple(self._setup(e, s) for e in engines), self.models.stages)

    def _setup(self, e: EngineSpec, s: Mapping[str, Any]) -> EngineSetup:
        model = self.models.step.get(e.role) or self.models.step.get(Role.COLOCATED) or self.models.all_steps
        if "step_time_scale" in s:
            model = model.scaled(float(s["step_time_scale"]))
        return EngineSetup(
            e.role, int(s.get("max_num_seqs", e.max_num_seqs)),
            int(s.get("max_num_batched_tokens", e.max_num_batched_tokens)), e.block_size,
            int(s.get("num_device_blocks", e.num_device_blocks)), str(s.get("scheduling_policy", e.scheduling_policy)),
            e.chunked_prefill, model)

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


def fit_whatif(src: Source, *, targets: Mapping[str, SloTargets] | None = None, num_replays: int = NUM_REPLAYS,
               max_requests: int | None = None) -> WhatIf:
    """Fit the simulator to the run behind ``src`` and replay the run itself (see the module doc).

    ``num_replays``: replays averaged per prediction; ``max_requests``: replay only the run's first this many
    served requests (by arrival; the measured metrics stay the whole run's): a bound on the work of many
    predictions over a long run (the report's capacity section). ``ValueError`` when the run cannot be
    fitted (no engine steps, nothing served)."""
    trace = read_trace(src)
    models = fit_models(trace)
    classes = sorted({r.slo_class for r in trace.requests})
    tg = resolve_targets(src, classes, targets)
    measured = measured_metrics(src, targets)
    notes = []
    if any(e.inferred for e in trace.engines):
        notes.append("the run has no recorded engine configuration (engine_configs): limits were read off its "
                     "steps (the largest batch and token count seen), so raising a limit may be predicted "
                     "optimistic")
    best: WhatIf | None = None
    for variation in VARIATIONS:  # the step-time variation that replays the run itself better
        w = WhatIf(trace, models.with_variation(variation), tg, measured, {}, list(notes), num_replays, max_requests)
        w.fitted = w.predict({}, in_place=True).metrics
        if best is None or _latency_error(w) < _latency_error(best):
            best = w
    assert best is not None
    return best


def extrapolation(deployment: Deployment, records: list[StepRecord]) -> tuple[list[str], dict[str, dict[int, Any]]]:
    """Whether a replay's steps leave the batch sizes its engines' step-time models were fitted on.

    For each engine whose replayed steps have a median batch (sequences per step) outside the fitted steps'
    5th-95th percentile: a sentence saying how far, and the step-time models to replay again for the range: the
    refits on resampled steps (:attr:`~analyzers.whatif.models.StepTimeModel.alternatives`) at the 5th and 95th
    percentile of their mean step time over the replayed steps, and the model in each other form fitted to the
    run (:meth:`~analyzers.whatif.models.StepTimeModel.other_forms`: which bend the run's steps chose is itself
    uncertain outside them), as ``{"low" | "high" | form: {engine index: model}}`` (empty when no engine
    extrapolates or the models have neither refits nor other forms)."""
    notes: list[str] = []
    variants: dict[str, dict[int, Any]] = {}
    by_engine: dict[int, list[StepRecord]] = {}
    for r in records:
        by_engine.setdefault(r.engine, []).append(r)
    for i, steps in sorted(by_engine.items()):
        model = deployment.engines[i].model
        seqs = np.array([r.plan.num_seqs for r in steps], dtype=float)
        median = float(np.median(seqs))
        if model.seqs_low <= median <= model.seqs_high:
            continue
        far = model.seqs_low / median if median < model.seqs_low else median / model.seqs_high
        who = "the engine" if len(deployment.engines) == 1 else f"engine {i} ({deployment.engines[i].role.label})"
        text = (f"{who} runs steps of {median:g} sequences (median) where "
                f"the run's steps had {model.seqs_low:g}-{model.seqs_high:g} (5th-95th percentile): its step time "
                f"is extrapolated {far:.1f}x beyond the batch sizes the fit covered, which do not pin down how a "
                f"step's time grows with its batch")
        if text not in notes:
            notes.append(text)
        for other in model.other_forms():
            variants.setdefault(other.form, {})[i] = other
        if len(model.alternatives) < 2:
            continue
        x = model.features([r.plan.num_prefill_tokens for r in steps], [r.plan.num_decode_tokens for r in steps],
                           seqs, [r.plan.decode_context for r in steps])
        alts = np.asarray(model.alternatives)
        mean_step = (x @ alts.T).mean(axis=0)
        order = np.argsort(mean_step)
        k_lo, k_hi = order[int(0.05 * (len(order) - 1))], order[int(round(0.95 * (len(order) - 1)))]
        variants.setdefault("low", {})[i] = model.with_coefficients(tuple(alts[k_lo]))
        variants.setdefault("high", {})[i] = model.with_coefficients(tuple(alts[k_hi]))
    return notes, variants


def _latency_error(w: WhatIf) -> float:
    """Median absolute relative error of the replay's latency percentiles on the run itself (inf: none)."""
    err = [abs(w.fit_error[m]) for m in LATENCY_METRICS if math.isfinite(w.fit_error.get(m, math.nan))]
    return float(np.median(err)) if err else math.inf


def crossing(values: list[float], shares: list[float], target: float) -> float | None:
    """Where ``shares`` (falling as ``values`` rise) first drop below ``target``, linearly interpolated
    between the last value at or above it and the first below (a share below the target before one at or above it,
    as a measured curve's can be, is passed over); None when no share at or above the target is followed by one
    below."""
    points = sorted((v, s) for v, s in zip(values, shares) if math.isfinite(s))
    for (v0, s0), (v1, s1) in zip(points, points[1:]):
        if s0 >= target > s1:
            return v0 + (v1 - v0) * (s0 - target) / (s0 - s1)
    return None


def crossing_noise(values: list[float], met: list[np.ndarray], target: float, *, resamples: int = 2000,
                   seed: int = 0) -> tuple[np.ndarray, list[float]]:
    """How much :func:`crossing` moves when each value's share is that of a few requests (``met``: per value, each
    request's verdict): the crossings over ``resamples`` resamplings of every value's requests with replacement
    (seeded; those that cross in range), and the crossings with one request's verdict changed at one value."""
    rng = np.random.default_rng(seed)
    flags = [np.asarray(m, dtype=float) for m in met]
    boot = [crossing(values, [float(rng.choice(f, f.size).mean()) for f in flags], target) for _ in range(resamples)]
    shares = [float(f.mean()) for f in flags]
    flipped = []
    for i, f in enumerate(flags):
        for d in (-1.0, 1.0):
            if 0.0 <= shares[i] + d / f.size <= 1.0:
                flipped.append(crossing(values, [*shares[:i], shares[i] + d / f.size, *shares[i + 1:]], target))
    return np.array([b for b in boot if b is not None]), [v for v in flipped if v is not None]


def _mean(values: list[float]) -> float:
    v = [x for x in values if math.isfinite(x)]
    return float(np.mean(v)) if v else math.nan


def _order(name: str) -> tuple[int, str]:
    return (HEADLINE_METRICS.index(name), name) if name in HEADLINE_METRICS else (len(HEADLINE_METRICS), name)
