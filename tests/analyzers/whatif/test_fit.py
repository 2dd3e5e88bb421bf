"""The cost models' fits on exact hand-made data, and the simulator reproducing a run it made itself.

The closed loop: the simulator serves a workload with a known step-time model, its steps, tokens and requests
are written as a run (a gateway instance and an engine instance, as the tracers write them), and the what-if
fit on that run must recover the model and replay the run with (almost) no error: whatever error a real run
shows is the real engine's departure from the model, not the fit's or the replay's own.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from analyzers.latency import latency
from analyzers.slo import SloTargets
from analyzers.whatif import WhatIf, fit_whatif
from analyzers.whatif.models import FittedModels, StageCosts, StepTimeModel, nonnegative_lstsq
from analyzers.whatif.predict import crossing, crossing_noise
from analyzers.whatif.simulate import Arrival, Deployment, EngineSetup, StepRecord, simulate
from analyzers.whatif.trace import StepRows
from tokentrace.app.report.whatif import whatif_json, whatif_lines
from tokentrace.schema import ENGINE_CONFIGS, Role, col

MS = 1_000_000


def test_nonnegative_least_squares_recovers_exact_coefficients_and_drops_negative_ones():
    rng = np.random.default_rng(3)
    x = np.column_stack([np.ones(50), rng.integers(0, 100, 50), rng.integers(0, 10, 50)]).astype(float)
    assert np.allclose(nonnegative_lstsq(x, x @ np.array([5.0, 0.25, 2.0])), [5.0, 0.25, 2.0])
    y = 10.0 - 0.5 * x[:, 2] + 0.1 * x[:, 1]  # a negative slope is not a cost: dropped, the rest refitted
    coef = nonnegative_lstsq(x, y)
    assert coef[2] == 0.0 and (coef >= 0).all()


def _steps(p, d, n, ctx, dur, gap, busy) -> StepRows:
    a = lambda v: np.asarray(v, dtype=float)  # noqa: E731
    return StepRows(np.zeros(len(p), "int64"), np.full(len(p), int(Role.COLOCATED)), a(dur), a(gap), a(p), a(d),
                    a(n), a(ctx), np.asarray(busy, dtype=bool))


def test_step_time_model_is_exact_on_linear_steps_and_keeps_idle_gaps_out_of_the_busy_gap():
    rng = np.random.default_rng(1)
    p, d = rng.integers(1, 200, 40) * (rng.random(40) < 0.5), rng.integers(0, 16, 40)  # half decode-only
    n, ctx = d + (p > 0), d * 100 + rng.integers(0, 50, 40)
    dur = 4e6 + 2e4 * p + 5e5 * d + 1e5 * n + 300 * ctx
    gap = np.full(40, 3e5)
    gap[::10] = 5e8  # idle: the step left no work, the engine waited for the next request
    m = StepTimeModel.fit(_steps(p, d, n, ctx, dur, gap, gap < 1e6), np.ones(40, bool))
    assert (m.intercept_ns, m.per_prefill_token_ns, m.per_decode_token_ns, m.per_seq_ns,
            m.per_context_token_ns) == pytest.approx((4e6, 2e4, 5e5, 1e5, 300), rel=1e-6)
    assert m.mape == pytest.approx(0, abs=1e-9) and set(np.round(m.ratios, 9)) == {1.0}
    assert m.busy_gap_ns(8) == pytest.approx(3e5) and set(m.gaps) == {3e5}


_MODEL = StepTimeModel(6 * MS, 0.15 * MS, 0.6 * MS, 0.2 * MS, 0.0, 0.4 * MS, 0.0, 0, 0.0, (1.0,), (0.4 * MS,))
_STAGES = StageCosts(first_delivery_ns=1.5 * MS, delivery_ns=0.8 * MS, handoff_ns=math.nan, handoff_per_token_ns=0)
_GATEWAY_MS = 2


def _workload(n: int = 40, rate: float = 25.0, seed: int = 4) -> list[Arrival]:
    rng = np.random.default_rng(seed)
    t, out = 1_000 * MS, []
    for rid in range(1, n + 1):
        out.append(Arrival(rid, int(t), _GATEWAY_MS * MS, int(rng.integers(8, 48)), 0, int(rng.integers(2, 12)),
                           "interactive", 500 * MS, 1, "a"))
        t += rng.exponential(1e9 / rate)
    return out


def _served_run(handmade, engine: EngineSetup, arrivals: list[Arrival] | None = None, seed: int | None = None):
    """Serve the workload on the simulator and write what the tracers would have recorded (``seed``: the step
    variation of the engine's model, drawn with it; None: none)."""
    steps: list[StepRecord] = []
    arrivals = arrivals or _workload()
    outcomes = simulate(Deployment((engine,), _STAGES), arrivals, seed=seed, record=steps.append)
    by_end = {s.end_ns: s.step for s in steps}
    h = handmade.instance(0, Role.GATEWAY).instance(1, Role.COLOCATED)
    for s in steps:
        h.step(s.step, s.start_ns / MS, s.end_ns / MS, seqs=s.plan.num_seqs, prefill=s.plan.num_prefill_tokens,
               decode=s.plan.num_decode_tokens, waiting=s.num_waiting, running=s.num_running, inst=1)
    for a, o in zip(arrivals, outcomes):
        emits = [d - (_STAGES.first_delivery_ns if k == 0 else _STAGES.delivery_ns)
                 for k, d in enumerate(o.delivered_ns)]
        h.request(a.rid, a.arrival_ns / MS, o.delivered_ns[-1] / MS, prompt=a.num_prompt_tokens, cached=0,
                  output=a.num_output_tokens, inst=0)
        h.request(a.rid, (a.arrival_ns + a.gateway_ns) / MS, emits[-1] / MS, prompt=a.num_prompt_tokens, cached=0,
                  output=a.num_output_tokens, inst=1)
        h.tokens(a.rid, [e / MS for e in emits], inst=1, steps=[by_end[int(e)] for e in emits])
        h.tokens(a.rid, [d / MS for d in o.delivered_ns], inst=0, kind="sent")
    h.rows[ENGINE_CONFIGS.name].append({
        col.INSTANCE_ID: 1, col.ROLE: int(Role.COLOCATED), col.MAX_NUM_SEQS: engine.max_num_seqs,
        col.MAX_NUM_BATCHED_TOKENS: engine.max_num_batched_tokens, col.KV_BLOCK_SIZE: engine.block_size,
        col.NUM_BLOCKS_TOTAL_DEVICE: engine.num_device_blocks, col.SCHEDULING_POLICY: engine.scheduling_policy,
        col.PREEMPTION_MODE: "recompute", col.CHUNKED_PREFILL: 1, col.PREFIX_CACHING: 1,
        col.SPECULATIVE_SOURCE: "", col.NUM_SPECULATIVE_TOKENS: 0})
    return h, steps


def test_the_simulator_reproduces_a_run_it_served_itself(handmade):
    engine = EngineSetup(Role.COLOCATED, 4, 32, 4, 64, "fcfs", True, _MODEL)
    h, steps = _served_run(handmade, engine)
    assert any(s.plan.num_seqs == 4 for s in steps) and any(s.num_waiting for s in steps)  # it queued
    w = fit_whatif(h.source())
    (spec,) = w.trace.engines
    assert (spec.max_num_seqs, spec.max_num_batched_tokens, spec.num_device_blocks, spec.inferred) == (4, 32, 64, False)
    m = w.models.all_steps
    assert (m.intercept_ns, m.per_prefill_token_ns, m.per_decode_token_ns, m.per_seq_ns) == pytest.approx(
        (_MODEL.intercept_ns, _MODEL.per_prefill_token_ns, _MODEL.per_decode_token_ns, _MODEL.per_seq_ns), rel=0.02)
    assert w.models.stages.first_delivery_ns == pytest.approx(_STAGES.first_delivery_ns)
    for name in ("ttft.p50", "ttft.p99", "itl.p50", "itl.p99", "e2e.p50", "e2e.p99", "load.served_rps"):
        assert abs(w.fit_error[name]) < 0.03, (name, w.measured[name], w.fitted[name])
    assert w.fitted["slo.all.attainment"] == pytest.approx(w.measured["slo.all.attainment"], abs=0.05)


def test_predictions_move_the_way_the_scheduler_says(handmade):
    engine = EngineSetup(Role.COLOCATED, 4, 32, 4, 64, "fcfs", True, _MODEL)
    h, _ = _served_run(handmade, engine)
    w = fit_whatif(h.source())
    base = w.fitted
    faster = w.predict({"rate_scale": 2.0}).metrics
    assert faster["ttft.p99"] > base["ttft.p99"] and faster["load.served_rps"] > base["load.served_rps"]
    one = w.predict({"max_num_seqs": 1}).metrics  # no batching: everyone waits for the one running request
    assert one["ttft.p50"] > 2 * base["ttft.p50"]
    two = w.predict({"instances": 2}).metrics
    assert two["ttft.p99"] < base["ttft.p99"]
    tight = w.predict({"num_device_blocks": 16})  # 64 tokens of KV for four sequences: preemptions
    assert tight.num_preemptions > 0
    longer = w.predict({"output_scale": 2.0}).metrics
    assert longer["e2e.p50"] > base["e2e.p50"]


def test_instances_are_dedicated_devices_two_at_twice_the_rate_serve_like_one(handmade):
    """docs/whatif.md: an instance-count change is predicted for dedicated devices (no shared-CPU slowdown), so
    two instances at twice the rate see about the per-instance load of the run itself."""
    engine = EngineSetup(Role.COLOCATED, 4, 32, 4, 64, "fcfs", True, _MODEL)
    h, _ = _served_run(handmade, engine)
    w = fit_whatif(h.source())
    base = w.fitted
    doubled = w.predict({"instances": 2, "rate_scale": 2.0}).metrics
    alone = w.predict({"rate_scale": 2.0}).metrics
    for m in ("ttft.p50", "itl.p50", "e2e.p50"):
        assert abs(doubled[m] - base[m]) / base[m] < 0.25, (m, doubled[m], base[m])
    assert doubled["ttft.p99"] < alone["ttft.p99"]
    assert doubled["load.served_rps"] == pytest.approx(2 * base["load.served_rps"], rel=0.25)


def test_a_run_of_large_batches_predicts_small_ones_as_an_extrapolation_with_a_range_holding_the_truth(handmade):
    """Every step of the run carries many sequences, and its step times vary by a slow, bursty factor (as a
    busy machine's do): the run alone cannot tell the step's fixed cost from its cost per sequence. A
    prediction for ``max_num_seqs`` 2 says that it extrapolates, and how far, and gives a range that holds
    what the engine itself does at that setting (its own model replayed)."""
    rng = np.random.default_rng(7)
    z = np.zeros(400)
    for k in range(1, z.size):
        z[k] = 0.8 * z[k - 1] + rng.normal(0, 0.15)
    noisy = replace(_MODEL, ratios=tuple(np.exp(z)), persistence=0.8)
    engine = EngineSetup(Role.COLOCATED, 12, 512, 4, 4096, "fcfs", True, noisy)
    h, steps = _served_run(handmade, engine, _workload(400, rate=200.0, seed=5), seed=5)
    w = fit_whatif(h.source())
    m = w.models.all_steps
    assert m.seqs_low >= 4 and len(m.alternatives) > 10  # the run never ran a small batch
    predicted = w.predict({"max_num_seqs": 2})
    assert any("extrapolated" in n and "beyond the batch sizes the fit covered" in n for n in predicted.notes)
    truth = replace(w, models=FittedModels({Role.COLOCATED: noisy}, noisy, w.models.stages)).predict(
        {"max_num_seqs": 2}, ranges=False).metrics
    for name in ("ttft.p50", "itl.p50", "e2e.p50", "e2e.p99"):
        lo, hi = predicted.ranges[name]
        assert lo <= predicted.metrics[name] <= hi
        assert lo <= truth[name] <= hi, (name, lo, hi, truth[name])
    assert not w.predict({}).notes  # the run's own configuration stays within what the fit covered
    doc = whatif_json(w, predicted)  # tokentrace whatif --format json
    assert doc["predicted_range"]["ttft.p50"] == list(predicted.ranges["ttft.p50"])
    assert set(predicted.notes) <= set(doc["notes"])
    assert any("extrapolated" in line for line in whatif_lines(w, predicted, "run"))


def test_the_simulator_reproduces_a_run_of_an_engine_whose_step_time_bends_with_the_batch(handmade):
    """An engine whose step time grows as ln(sequences) (26 ms at one, 66 at eight, as the reference server's small
    model measured): the fit chooses the bent form on held-out steps, recovers its coefficients and replays the
    run within 3%; a prediction outside the batch sizes the run covered gives a range over the refits and the
    other forms."""
    bent = StepTimeModel(26 * MS, 0.1 * MS, 0.0, 0.0, 0.0, 0.4 * MS, 0.0, 0, 0.0, (1.0,), (0.4 * MS,),
                         form="log", concave_ns=(19.2 * MS,))
    engine = EngineSetup(Role.COLOCATED, 12, 256, 4, 1024, "fcfs", True, bent)
    h, steps = _served_run(handmade, engine, _workload(150, rate=60.0, seed=6))
    assert len({s.plan.num_seqs for s in steps}) >= 6  # the run covered many batch sizes
    w = fit_whatif(h.source())
    m = w.models.all_steps
    heldout = dict(m.heldout)
    assert m.form == "log" and heldout["log"] < 0.5 * heldout["linear"], heldout
    assert m.coefficients == pytest.approx(bent.coefficients, rel=0.02, abs=0.01 * MS)
    for name in ("ttft.p50", "ttft.p99", "itl.p50", "itl.p99", "e2e.p50", "e2e.p99", "load.served_rps"):
        assert abs(w.fit_error[name]) < 0.03, (name, w.measured[name], w.fitted[name])
    assert {f for f, _, _ in m.other_fits} == set(heldout) - {"log"}
    one = w.predict({"max_num_seqs": 1})  # the run's steps carried 6-12 sequences
    assert m.seqs_low > 1 and any("other step-time forms fitted to the run (linear)" in n for n in one.notes)
    lo, hi = one.ranges["itl.p50"]
    alone = (bent.intercept_ns + bent.gap_ns) / MS  # one sequence per step: its step and the gap after it
    assert one.metrics["itl.p50"] == pytest.approx(alone, rel=0.03) and lo <= alone <= hi
    doc = whatif_json(w, w.predict({}))
    assert doc["model"]["step_time"]["colocated"]["form"] == "log"
    assert set(doc["model"]["step_time"]["colocated"]["heldout_error"]) == set(heldout)
    assert any("Step-time form log, chosen by its error on held-out steps" in line
               for line in whatif_lines(w, w.predict({}), "run"))


def test_a_slow_period_of_the_run_is_replayed_where_it_was_so_each_request_keeps_its_own_tpot(handmade):
    """The machine slows steps 3x for a stretch of the run (another process holding the CPU) and the requests
    decoding then have the longest TPOT. Replayed with the run's own speed at the same time (variation
    ``timeline``), the fit reproduces each request's TPOT and the share within a target at the run's own TPOT
    p90; drawn at random, the slow steps land on other requests' tokens and the tail is another."""
    arrivals = _workload(60, rate=25.0, seed=8)
    t0 = arrivals[0].arrival_ns
    starts = [t0 + k * 5 * MS for k in range(600)]  # a step every 5 ms of the run's time, 3x slow over 0.8-1.6 s
    ratios = tuple(3.0 if 800 * MS <= s - t0 < 1600 * MS else 1.0 for s in starts)
    slowed = replace(_MODEL, ratios=ratios, ratio_prefill=(False,) * len(ratios), ratio_start_ns=tuple(starts),
                     variation="timeline")
    engine = EngineSetup(Role.COLOCATED, 8, 64, 4, 1024, "fcfs", True, slowed)
    h, steps = _served_run(handmade, engine, arrivals, seed=0)
    src = h.source()
    lat = latency(src).set_index("metric")
    targets = {"*": SloTargets(float(lat.loc["ttft", "p90_ms"]), float(lat.loc["tpot", "p90_ms"]))}
    w = fit_whatif(src, targets=targets)
    assert w.models.all_steps.variation == "timeline"
    for name in ("tpot.p50", "tpot.p99", "ttft.p99", "e2e.p99"):
        assert abs(w.fit_error[name]) < 0.05, (name, w.measured[name], w.fitted[name])
    assert w.fitted["slo.all.attainment"] == pytest.approx(w.measured["slo.all.attainment"], abs=0.04)
    assert whatif_json(w, w.predict({}))["model"]["step_time"]["colocated"]["variation"] == "timeline"
    assert any("a prediction averages replays with them shifted along the run" in line for line in whatif_lines(w, w.predict({}), "run"))
    shuffled = replace(w, models=w.models.with_variation("ratio")).predict({}).metrics
    assert abs(shuffled["slo.all.attainment"] - w.measured["slo.all.attainment"]) > 0.04


def test_a_prediction_does_not_depend_on_where_in_the_run_the_machine_was_slow(handmade):
    """Two runs of one engine whose machine was 3x slow for the same share of the run, one early and one a fifth
    of the run later. Each replays itself with its slow period in place (the fit), so the two fits differ; a
    prediction (another run, whose slow periods come at other moments) averages the replays over where the slow
    period may fall, and comes out the same for both."""
    h, _ = _served_run(handmade, EngineSetup(Role.COLOCATED, 8, 64, 4, 1024, "fcfs", True, _MODEL))
    w = fit_whatif(h.source())
    t0 = w.arrivals({})[0].arrival_ns
    starts = [t0 + k * 5 * MS for k in range(601)]  # a step every 5 ms over 3 s; a fifth of the span is 120 steps

    def slowed(first: int) -> WhatIf:
        ratios = tuple(3.0 if first <= k < first + 90 else 1.0 for k in range(len(starts)))
        m = replace(_MODEL, ratios=ratios, ratio_prefill=(False,) * len(ratios), ratio_start_ns=tuple(starts),
                    variation="timeline")
        return replace(w, models=FittedModels({Role.COLOCATED: m}, m, w.models.stages))

    early, later = slowed(30), slowed(150)
    assert early.num_replays == 5
    in_place = [x.predict({}, in_place=True).metrics for x in (early, later)]
    assert abs(in_place[0]["tpot.p99"] - in_place[1]["tpot.p99"]) > 0.1 * in_place[1]["tpot.p99"]
    assert early.predict({}).metrics == in_place[0]  # nothing changed: the replay of the run itself
    for settings in ({"rate_scale": 1.0}, {"rate_scale": 1.5}):
        a, b = (x.predict(settings).metrics for x in (early, later))
        for name in ("ttft.p50", "ttft.p99", "tpot.p50", "tpot.p99", "e2e.p99", "slo.all.attainment"):
            assert a[name] == pytest.approx(b[name], rel=1e-6, abs=1e-9), name


def test_the_break_is_interpolated_and_its_noise_is_that_of_the_requests_behind_each_share():
    """30 requests a rate: one request's verdict is 3.3 points, and moves the break from 1.0 to 0.875 or 1.03."""
    met = [np.ones(30, bool), np.arange(30) < 27, np.arange(30) < 10]  # 100%, 90%, 33% at 0.5, 1 and 1.5
    assert crossing([0.5, 1.0, 1.5], [m.mean() for m in met], 0.9) == pytest.approx(1.0)
    assert crossing([0.5, 1.0], [0.8, 0.7], 0.9) is None  # below the target from the first value on
    assert crossing([0.5, 0.75, 1.0], [0.87, 0.93, 0.8], 0.9) == pytest.approx(0.75 + 0.25 * 0.03 / 0.13)
    boot, flipped = crossing_noise([0.5, 1.0, 1.5], met, 0.9, resamples=500)
    assert sorted(flipped)[0] == pytest.approx(0.5 + 0.5 * 0.1 / (4 / 30))  # 26 of 30 at 1x
    assert sorted(flipped)[-1] == pytest.approx(1.0 + 0.5 * (28 / 30 - 0.9) / (28 / 30 - 1 / 3))  # 28 of 30
    assert boot.size > 400 and 0.5 <= boot.min() and boot.max() <= 1.5
    assert np.percentile(boot, 10) < 0.95 and np.percentile(boot, 90) > 1.0  # a share of 30 moves the break
    again, _ = crossing_noise([0.5, 1.0, 1.5], met, 0.9, resamples=500)
    assert np.array_equal(boot, again)  # seeded
