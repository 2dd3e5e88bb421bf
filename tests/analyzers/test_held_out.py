"""Held-out style checks: simulated runs with a known truth, and each analyzer's answer against it.

Every run comes from :mod:`simulated` (a first-come-first-served queueing model whose
capacities are known exactly) or is built by hand, and none of them was used to
tune the analyzers' thresholds:

* an overloaded run (arrivals at twice the decode pool's capacity, then the prefill
  pool's, then a colocated pool's) and a lightly loaded one;
* a run with errors; a run without per-token data;
* a cache-friendly run queued behind a burst;
* two tenants with and without interference (and everyone slowed by one growing queue);
* two identical runs, and two runs drawn from the same distribution.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from simulated import simulate

from analyzers.attribution import attribution
from analyzers.cache import hit_value
from analyzers.diff import diff
from analyzers.groups import ALL
from analyzers.load import load
from analyzers.neighbours import noisy_neighbours
from analyzers.pd_ratio import pd_ratio
from analyzers.slo import fluidity, goodput, slo_attainment
from tokentrace.schema import RequestStatus, Stage, col

# Decode: 9 tokens of 50 ms per request -> one decode instance serves 1000 / 450 = 2.22 req/s.
DECODE_RPS = 1000 / (9 * 50.0)


def _arrivals(rate_rps: float, seconds: float) -> list[float]:
    return [i * 1000.0 / rate_rps for i in range(int(rate_rps * seconds))]


def _overloaded_decode(h):
    simulate(h, _arrivals(2.25 * DECODE_RPS, 20), decode_step_ms=50.0)  # 5 req/s offered
    return h.source()


# ------------------------------------------------------------------------------------------ load


def test_overloaded_decode_pool_is_named_saturated(handmade):
    report = load(_overloaded_decode(handmade))
    row = report.row
    assert row["offered_rps"] == pytest.approx(5.0, rel=0.01)
    assert row["served_rps"] == pytest.approx(DECODE_RPS, rel=0.02)  # it serves at capacity
    assert row["saturated"] is True
    assert row["saturated_pool"] == "decode"
    assert row["saturated_stage"] == "decode.queue"
    pools = report.pools.set_index("role")
    assert pools.loc["decode", "utilisation"] > 0.95 and bool(pools.loc["decode", "queue_grows"])
    assert not bool(pools.loc["prefill", "queue_grows"]) and pools.loc["prefill", "utilisation"] < 0.2


def test_overloaded_prefill_pool_is_named_saturated(handmade):
    # Prefill 100 tokens x 2 ms = 200 ms -> 5 req/s per instance; 10 req/s offered. Decode is quick.
    simulate(handmade, _arrivals(10.0, 10), prefill_ms_per_token=2.0, decode_step_ms=1.0)
    row = load(handmade.source()).row
    assert row["saturated"] is True and row["saturated_pool"] == "prefill"
    assert row["saturated_stage"] == "schedule.queue"
    assert row["served_rps"] == pytest.approx(5.0, rel=0.02)


def test_overloaded_colocated_pool_is_named_saturated(handmade):
    # One colocated instance: 20 ms prefill + 9 x 10 ms decode = 110 ms -> 9.1 req/s; 20 req/s offered.
    simulate(handmade, _arrivals(20.0, 6), mode="colocated", decode_step_ms=10.0)
    row = load(handmade.source()).row
    assert row["saturated"] is True and row["saturated_pool"] == "colocated"


def test_light_load_is_not_saturated(handmade):
    simulate(handmade, _arrivals(0.4 * DECODE_RPS, 20), decode_step_ms=50.0)
    row = load(handmade.source()).row
    assert row["saturated"] is False and row["saturated_pool"] is None
    assert row["offered_rps"] == pytest.approx(row["served_rps"], rel=0.02)


def test_too_few_requests_are_not_judged(handmade):
    simulate(handmade, _arrivals(10.0, 0.5), decode_step_ms=50.0)  # 5 requests
    row = load(handmade.source()).row
    assert row["num_requests"] == 5 and row["saturated"] is None


# ---------------------------------------------------------------------------------------- P:D advice


def test_advice_asks_for_more_of_the_saturated_pool_in_whole_instances(handmade):
    p = pd_ratio(_overloaded_decode(handmade))
    demand = p.demand.iloc[0]
    assert demand["arrival_rate_rps"] == pytest.approx(5.0, rel=0.01)  # the offered rate, not the served one
    assert demand["decode_tokens_per_request"] == 9  # 10 output tokens, token 0 from prefill
    advice = p.recommendation.set_index("pool")
    # decode: 5 req/s x 9 tokens = 45 tok/s; one instance does 20 tok/s; at most 80% busy -> 3 instances.
    assert advice.loc["decode", "instances"] == 3 and advice.loc["decode", "lacks"] == 2
    assert advice.loc["decode", "utilisation_at_advice"] == pytest.approx(45 / 60)
    assert advice.loc["decode", "current_utilisation"] == pytest.approx(45 / 20)
    assert advice.loc["prefill", "instances"] == 1 and advice.loc["prefill", "lacks"] == 0


def test_advice_on_a_light_run_asks_for_nothing_more(handmade):
    simulate(handmade, _arrivals(0.4 * DECODE_RPS, 20), decode_step_ms=50.0)
    advice = pd_ratio(handmade.source()).recommendation
    assert (advice["lacks"] == 0).all() and (advice["instances"] == 1).all()


def test_prefill_advice_keeps_the_ttft_target(handmade):
    # Prefill of 200 ms against a 500 ms TTFT target: an M/M/1 queue keeps 200 + wait <= 500 ms at
    # utilisation <= 1 - 200 / 500 = 0.6, tighter than the 0.8 headroom.
    simulate(handmade, _arrivals(4.0, 10), prefill_ms_per_token=2.0, decode_step_ms=1.0)
    row = pd_ratio(handmade.source()).recommendation.set_index("pool").loc["prefill"]
    assert row["limited_by"] == "ttft target" and row["max_utilisation"] == pytest.approx(0.6)
    assert row["instances"] == math.ceil(4.0 / 5.0 / 0.6)  # 0.8 instance of work at <= 60% busy -> 2


# -------------------------------------------------------------------------------------------- SLOs


def test_errored_requests_are_never_good(handmade):
    statuses = [int(RequestStatus.ERROR) if i % 4 == 0 else int(RequestStatus.OK) for i in range(20)]
    simulate(handmade, _arrivals(1.0, 20), decode_step_ms=10.0, statuses=statuses)
    att = slo_attainment(handmade.source()).set_index(col.SLO_CLASS).loc[ALL]
    # The errored ones had the fastest first token of all (no queue): still not good.
    assert att["num_failed"] == 5 and att["attainment"] == pytest.approx(15 / 20)
    assert att["ttft_attainment"] == pytest.approx(15 / 20)
    good = goodput(handmade.source()).set_index(col.SLO_CLASS).loc[ALL]
    assert good["num_good"] == 15


def test_a_run_without_per_token_data_has_tpot_not_measured(handmade):
    simulate(handmade, _arrivals(1.0, 20), decode_step_ms=10.0, per_token=False)
    att = slo_attainment(handmade.source()).set_index(col.SLO_CLASS).loc[ALL]
    assert att["ttft_attainment"] == 1.0  # TTFT was measured: token 0 is there
    assert math.isnan(att["tpot_attainment"]) and math.isnan(att["attainment"])
    assert att["num_tpot_measured"] == 0
    good = goodput(handmade.source()).set_index(col.SLO_CLASS).loc[ALL]
    assert math.isnan(good["goodput_rps"]) and good["num_good"] is None and good["meets_target"] is None
    assert math.isnan(fluidity(handmade.source()).set_index(col.SLO_CLASS).loc[ALL, "fluidity_index"])


# ------------------------------------------------------------------------------------------- cache


def test_a_cache_hit_queued_behind_a_burst_is_still_worth_it(handmade):
    # A burst of 20 misses (100 tokens, 20 ms prefill each, 10 ms apart) fills the queue; then 10 requests
    # whose prompts are 80% cached arrive and wait behind it. Their whole TTFT is the worst of the run.
    arrivals = [i * 10.0 for i in range(20)] + [200.0 + i * 10.0 for i in range(10)]
    cached = [0] * 20 + [80] * 10
    simulate(handmade, arrivals, mode="colocated", cached=cached, output=2, decode_step_ms=5.0)
    hv = hit_value(handmade.source()).set_index("group")
    assert hv.loc["hit", "mean_ttft_ms"] > hv.loc["miss", "mean_ttft_ms"]  # what the whole-TTFT view showed
    # Measured on the stages a hit changes, per prompt token: lookup 0.05 + load 0.8 + prefill 4 ms
    # over 100 tokens for a hit, against lookup 0.05 + prefill 20 ms for a miss.
    assert hv.loc["hit", "ms_per_prompt_token"] == pytest.approx((0.05 + 0.8 + 4.0) / 100)
    assert hv.loc["miss", "ms_per_prompt_token"] == pytest.approx(20.05 / 100)
    assert hv.loc["hit", "saved_ms_per_hit"] == pytest.approx(20.05 - 4.85)
    assert hv.loc["hit", "mean_queue_ms"] > hv.loc["miss", "mean_queue_ms"]  # shown beside, not used


# --------------------------------------------------------------------------------------- tenants


def _tenants_run(h, *, interference: bool, trend_ms_per_s: float = 0.0):
    """30 windows of 1 s. 'agg' sends 2 requests a window, 15 in its 5 burst windows; 'vic' sends 4 a
    window. vic's TTFT: 20 ms + a deterministic jitter, + 40 ms in agg's bursts with interference;
    every request slows by ``trend_ms_per_s`` per second of the run (a queue that keeps growing)."""
    rng = np.random.default_rng(5)
    bursts = {3, 9, 16, 22, 27}
    rid = 0
    for w in range(30):
        for j in range(15 if w in bursts else 2):
            rid += 1
            t = w * 1000.0 + 30 * j + 5
            ttft = 20 + rng.uniform(-3, 3) + trend_ms_per_s * t / 1000
            h.request(rid, t, t + ttft, tenant="agg").tokens(rid, [t + ttft])
        for j in range(4):
            rid += 1
            t = w * 1000.0 + 200 * j + 17
            ttft = 20 + rng.uniform(-3, 3) + trend_ms_per_s * t / 1000 + (40 if interference and w in bursts else 0)
            h.request(rid, t, t + ttft, tenant="vic").tokens(rid, [t + ttft])
    return h.source()


def _pair(df, aggressor, victim):
    return df.set_index(["aggressor", "victim"]).loc[(aggressor, victim)]


def test_interference_is_flagged_with_its_p_value_and_sample_sizes(handmade):
    df = noisy_neighbours(_tenants_run(handmade, interference=True), window_s=1.0, z_threshold=1.5)
    pair = _pair(df, "agg", "vic")
    assert bool(pair["flagged"]) and bool(pair["enough_data"])
    assert pair["num_windows"] == 30 and pair["num_burst_windows"] == 5 and pair["num_victim_burst"] == 20
    assert pair["effect_ms"] == pytest.approx(40, abs=3)
    assert pair["p_value"] < 0.01
    assert not bool(_pair(df, "vic", "agg")["flagged"])  # vic never bursts


def test_no_interference_is_not_flagged(handmade):
    df = noisy_neighbours(_tenants_run(handmade, interference=False), window_s=1.0, z_threshold=1.5)
    assert not df["flagged"].any()
    assert bool(_pair(df, "agg", "vic")["enough_data"])  # judged, and cleared


def test_one_growing_queue_slowing_everyone_is_not_a_noisy_neighbour(handmade):
    # Every request, of both tenants, 20 ms slower per second of the run: nobody's doing but the queue's.
    df = noisy_neighbours(_tenants_run(handmade, interference=False, trend_ms_per_s=20.0), window_s=1.0,
                          z_threshold=1.5)
    assert not df["flagged"].any()


def test_seven_windows_and_one_burst_are_not_enough(handmade):
    h = handmade
    rid = 0
    for w in range(7):
        for j in range(10 if w == 5 else 1):
            rid += 1
            h.request(rid, w * 1000 + j, w * 1000 + j + 10, tenant="agg").tokens(rid, [w * 1000 + j + 10])
        rid += 1
        ttft = 100 if w == 5 else 10
        h.request(rid, w * 1000 + 500, w * 1000 + 500 + ttft, tenant="vic").tokens(rid, [w * 1000 + 500 + ttft])
    pair = _pair(noisy_neighbours(h.source(), window_s=1.0, z_threshold=1.5), "agg", "vic")
    assert pair["num_windows"] == 7 and pair["num_burst_windows"] == 1
    assert not bool(pair["enough_data"]) and not bool(pair["flagged"]) and math.isnan(pair["p_value"])


# ------------------------------------------------------------------------------------------ diffs


def _served(make_store, seed: int, *, detokenize_ms: float = 0.0, compute_ms: float = 10.0):
    """40 requests of 8 tokens: decode.compute ``compute_ms`` +- 1 ms (seeded) per token, then detokenize."""
    rng = np.random.default_rng(seed)
    h = make_store()
    for rid in range(1, 41):
        t = rid * 1000.0
        h.span(rid, Stage.PREFILL_COMPUTE, t, t + 20, 0)
        times, now = [t + 20], t + 20
        for i in range(1, 8):
            compute = compute_ms + rng.uniform(-1, 1)
            h.span(rid, Stage.DECODE_COMPUTE, now, now + compute, i)
            if detokenize_ms:
                h.span(rid, Stage.DETOKENIZE, now + compute, now + compute + detokenize_ms, i)
            now += compute + detokenize_ms
            times.append(now)
        h.request(rid, t, now).tokens(rid, times)
    return h.source()


def test_identical_runs_diff_with_no_flagged_change(make_store):
    df = diff(_served(make_store, 1), _served(make_store, 1), resamples=200)
    assert not df["significant"].any() and (df["delta"] == 0).all()
    assert (df["p_value"] == 1.0).all()
    assert (df["n_baseline"] > 0).all() and (df["n_baseline"] == df["n_candidate"]).all()


def test_runs_from_the_same_distribution_diff_with_no_flagged_change(make_store):
    df = diff(_served(make_store, 1), _served(make_store, 2), resamples=300)
    assert not df["significant"].any(), df[df["significant"]]


def test_stage_regressions_are_ranked_by_their_contribution(make_store):
    # The candidate's decode steps take 2 ms more (+20% of mean ITL) and a detokenize stage appears
    # (0 -> 0.5 ms per token, +5%): from a zero baseline only the absolute change counts.
    df = diff(_served(make_store, 1), _served(make_store, 3, detokenize_ms=0.5, compute_ms=12.0),
              resamples=200).set_index(["metric", "statistic"])
    itl_mean = df.loc[("itl", "mean"), "baseline"]
    detok = df.loc[("stage.detokenize.itl", "mean")]
    assert math.isnan(detok["rel_change"]) and detok["delta"] == pytest.approx(0.5)
    assert bool(detok["regression"]) and detok["contribution"] == pytest.approx(0.5 / itl_mean)
    compute = df.loc[("stage.decode.compute.itl", "mean")]
    assert compute["contribution"] == pytest.approx(2.0 / itl_mean, rel=0.15)
    assert (compute["rank"], detok["rank"]) == (1, 2)
    itl = df.loc[("itl", "mean")]
    assert bool(itl["regression"]) and pd.isna(itl["rank"]) and pd.isna(itl["contribution"])  # the symptom


def test_a_change_below_the_absolute_minimum_is_not_significant(make_store):
    # 0.05 ms more detokenize per token: real (every token has it) but under the 0.1 ms minimum effect.
    df = diff(_served(make_store, 1, detokenize_ms=1.0), _served(make_store, 1, detokenize_ms=1.05), resamples=200)
    row = df[(df["metric"] == "stage.detokenize.itl")].iloc[0]
    assert row["ci_low"] > 0 and row["rel_change"] == pytest.approx(0.05)
    assert not row["significant"]


# ------------------------------------------------------------------------------------- attribution


def test_overlap_is_its_own_figure_and_unattributed_is_signed(handmade):
    # Token 0: 10 ms, spans 0-6 and 4-10 cover 12 ms: 2 ms double-counted, unattributed -2 ms.
    # Token 1: 10 ms, one span of 6 ms: 4 ms unattributed.
    h = handmade.request(1, 0, 20).tokens(1, [10, 20])
    h.span(1, Stage.SCHEDULE_QUEUE, 0, 6, 0).span(1, Stage.PREFILL_COMPUTE, 4, 10, 0)
    h.span(1, Stage.DECODE_COMPUTE, 10, 16, 1)
    a = attribution(h.source()).set_index("kind")
    assert a.loc["ttft", "unattributed_share"] == pytest.approx(-0.2)
    assert a.loc["ttft", "overlap_share"] == pytest.approx(0.2)
    assert a.loc["ttft", "uncovered_share"] == pytest.approx(0.0)
    assert a.loc["itl", "unattributed_share"] == pytest.approx(0.4) and a.loc["itl", "overlap_share"] == 0
    assert a.loc["all", "unattributed_share"] == pytest.approx((-2 + 4) / 20)
    assert a.loc["all", "overlap_share"] == pytest.approx(2 / 20)
