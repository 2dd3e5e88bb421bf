"""Predictions against small real runs of the reference engine (``engine_runs``: the real scheduler, block
manager, tracers and store; forward passes that take a dedicated device's time).

The simulator is fitted to one run and predicts four changed configurations, each then run for real in this
process. Every configuration (the fitted one too) is run twice and the run with the shorter median E2E is
kept: the test machine's other work only ever slows a run down, by up to twice for seconds at a time (load
averages of 15-20 on 2 cores), so the faster of two is the cleaner measurement of what the configuration
does. The device time is a floor, not a constant: the host's own share of a step (the tiny model's pass,
the scheduler, the tracers) outlasts it when both cores are busy, and in one such session the changed runs
took 1.45-3.3x the fitted run's step time (against its model), which put the uncorrected predictions of the
three rate and budget changes 81-86% under their TTFT p50. Each prediction is therefore made on a device as
much slower or faster as the machine ran the predicted run (:func:`_slowdown`: its steps' measured time
against the fitted model's, over the same for the fitted run's steps, from the raw steps table), as
``benchmarks/whatif.py`` corrects its predictions: what is left is the simulator's own error in queueing
and scheduling. The correction would also take out an error of the step-time model that is the same over
all of a run's steps (a wrong cost of the small batches a ``max_num_seqs`` 2 run is made of), so the device
whose step time bends with the batch, where that cost is what is tested, is predicted uncorrected.
Tolerances are measured, not hoped for (docs/whatif.md, "Accuracy"): over ten sessions, predictions from a
run the machine had not slowed were mostly within 20% at p50; a slowed run put single predictions up to
130% off; and at twice the rate, where the 40 requests arrive within 0.7 s and are served in about 30 steps,
the ITL p50 was off by 57% and 71% in two of them. The bars sit above those figures; a simulator that
ignored the scheduler's limits would miss the ``max_num_seqs`` run by more than an order of magnitude,
whatever the correction.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from engine_runs import engine_run

from analyzers.source import Source
from analyzers.whatif import fit_whatif
from analyzers.whatif.models import STEP_FORMS
from analyzers.whatif.trace import read_trace
from tokentrace.store import open_run

pytestmark = pytest.mark.timeout(600)

DEVICE_MS = (10.0, 0.1)  # each forward pass: 10 ms + 0.1 ms per token
P50 = ("ttft.p50", "itl.p50", "e2e.p50")
SEQS_TOLERANCE = 0.4  # |predicted - real| / real at p50 for max_num_seqs 2 (p99: TAIL_TOLERANCE)
TOLERANCE = 0.8  # the rate and budget changes, at p50; see the module doc
TAIL_TOLERANCE = 0.6
FIT_TOLERANCE = 0.35  # the replay of the fitted run against that run, at p50
CONCAVE_TOLERANCE = (0.8, 1.0)  # max_num_seqs 2 on the concave device, p50 and p99: misses of -40% and +59% seen
# with both cores busy (the machine's speed changing between the fitted run and the predicted one)
CHANGES = {  # run -> (engine and workload options, the same change as a what-if setting)
    "seqs2": ({"max_num_seqs": 2}, {"max_num_seqs": 2}),
    "budget32": ({"max_num_batched_tokens": 32}, {"max_num_batched_tokens": 32}),
    "rate2x": ({"rate_rps": 60.0}, {"rate_scale": 2.0}),
    "rate-half": ({"rate_rps": 15.0}, {"rate_scale": 0.5}),
}


def _faster_of_two(store, name: str, device_ms=DEVICE_MS, **options) -> tuple[str, dict[str, float]]:
    """Run a configuration twice; the run id and measured metrics of the one with the shorter median E2E."""
    measured = {}
    for attempt in ("a", "b"):
        run = f"{name}-{attempt}"
        engine_run(store, run, device_ms=device_ms, **options)
        src = Source.of_run(open_run(store, run))
        try:
            measured[run] = fit_whatif(src).measured
        finally:
            src.close()
    return min(measured.items(), key=lambda kv: kv[1]["e2e.p50"])


def _median_step_ratio(model, store, run: str) -> float:
    """Median over ``run``'s engine steps of measured / modelled duration (the fitted model of ``model``)."""
    src = Source.of_run(open_run(store, run))
    try:
        s = read_trace(src).steps
    finally:
        src.close()
    m = model.models.all_steps
    modelled = m.features(s.num_prefill_tokens, s.num_decode_tokens, s.num_seqs, s.decode_context) @ np.asarray(
        m.coefficients)
    ok = (modelled > 0) & (s.duration_ns > 0)
    return float(np.median(s.duration_ns[ok] / modelled[ok]))


def _slowdown(model, store, fitted_run: str, run: str) -> float:
    """How much slower the machine ran ``run`` than ``fitted_run`` (the run ``model`` was fitted to): the median of its steps'
    measured / modelled time over the same median on the fitted run's steps (the model only puts steps of
    different sizes on one scale; their times come from the raw steps table)."""
    return _median_step_ratio(model, store, run) / _median_step_ratio(model, store, fitted_run)


def _predict(fitted, run: str, settings: dict) -> tuple[dict[str, float], float]:
    """The prediction for ``settings`` on a device as much slower as the machine ran ``run``, and that factor;
    ``fitted``: (model, store, the run it was fitted to)."""
    model, store, fitted_run = fitted
    scale = _slowdown(model, store, fitted_run, run)
    return model.predict({**settings, "step_time_scale": scale}).metrics, scale


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    store = tmp_path_factory.mktemp("whatif-real")
    base, _ = _faster_of_two(store, "base")
    real = {name: _faster_of_two(store, name, **options) for name, (options, _) in CHANGES.items()}
    src = Source.of_run(open_run(store, base))
    model = fit_whatif(src)
    yield model, real, (model, store, base)
    src.close()


def _error(predicted: float, real: float) -> float:
    return abs(predicted - real) / real


def test_the_fit_reproduces_its_own_run_and_records_the_engine_configuration(runs):
    model, _, _ = runs
    (engine,) = model.trace.engines
    assert (engine.max_num_seqs, engine.max_num_batched_tokens, engine.inferred) == (64, 512, False)
    for m in P50:
        assert abs(model.fit_error[m]) < FIT_TOLERANCE, (m, model.measured[m], model.fitted[m])


def test_max_num_seqs_2_is_predicted_within_the_documented_error(runs):
    model, real, fitted = runs
    run, measured = real["seqs2"]
    predicted, scale = _predict(fitted, run, CHANGES["seqs2"][1])
    assert measured["ttft.p50"] > 10 * model.measured["ttft.p50"]  # the change is large
    for m in P50:
        assert _error(predicted[m], measured[m]) < SEQS_TOLERANCE, (m, predicted[m], measured[m], scale)
    for m in ("ttft.p99", "e2e.p99"):
        assert _error(predicted[m], measured[m]) < TAIL_TOLERANCE, (m, predicted[m], measured[m], scale)


@pytest.mark.parametrize("run", ["budget32", "rate2x", "rate-half"])
def test_rate_and_budget_changes_are_predicted_within_the_documented_error(runs, run):
    model, real, fitted = runs
    run_id, measured = real[run]
    predicted, scale = _predict(fitted, run_id, CHANGES[run][1])
    for m in P50:
        assert _error(predicted[m], measured[m]) < TOLERANCE, (m, predicted[m], measured[m], scale)


def concave_device_ms(num_seqs: int, num_tokens: int) -> float:
    """A device whose step time grows less than linearly with the batch (as the small model's on a CPU, or a
    GPU's memory-bound decode): 4 ms + 6 ms x sqrt(sequences) + 0.05 ms per token."""
    return 4.0 + 6.0 * math.sqrt(num_seqs) + 0.05 * num_tokens


@pytest.fixture(scope="module")
def concave_runs(tmp_path_factory):
    store = tmp_path_factory.mktemp("whatif-concave")
    base, _ = _faster_of_two(store, "base", concave_device_ms)
    real = _faster_of_two(store, "seqs2", concave_device_ms, max_num_seqs=2)
    src = Source.of_run(open_run(store, base))
    model = fit_whatif(src)
    yield model, real, (model, store, base)
    src.close()


def test_max_num_seqs_2_on_a_device_concave_in_the_batch_is_predicted_within_the_documented_error(concave_runs):
    """The run's batches are large (about 2-25 sequences); at ``max_num_seqs`` 2 every step carries two, where a
    line through the large batches would put too much time on each step. Which form the held-out comparison
    picks depends on the machine's load (on a quiet machine a bent one; with both cores busy the host's share
    of each step blurs the bend: docs/whatif.md, "Accuracy"); the prediction must land within the documented
    error either way (wider than the linear device's: with both cores busy its runs missed by -40% to +59%),
    and the replay of the run itself within the fit's."""
    model, (_, real), _ = concave_runs
    assert model.models.all_steps.form in STEP_FORMS and dict(model.models.all_steps.heldout)
    for m in P50:
        assert abs(model.fit_error[m]) < FIT_TOLERANCE, (m, model.measured[m], model.fitted[m])
    predicted = model.predict({"max_num_seqs": 2}).metrics  # uncorrected: the bend at small batches is the point
    assert real["ttft.p50"] > 5 * model.measured["ttft.p50"]  # the change is large
    for m in P50:
        assert _error(predicted[m], real[m]) < CONCAVE_TOLERANCE[0], (m, predicted[m], real[m])
    for m in ("ttft.p99", "e2e.p99"):
        assert _error(predicted[m], real[m]) < CONCAVE_TOLERANCE[1], (m, predicted[m], real[m])
