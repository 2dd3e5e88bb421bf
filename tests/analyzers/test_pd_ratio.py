"""Prefill:decode analyses over a hand-made disaggregated store (prefill instance 1, decode instance 2)."""

from __future__ import annotations

import math

import pytest

from analyzers.pd_ratio import demand, kv_transfer, pd_ratio, recommendation, utilisation, watermarks
from tokentrace.schema import Role, Stage, col


@pytest.fixture
def disagg(handmade):
    """The run spans 0 .. 1000 ms; two requests, prompts 100 (20 cached) and 60, three tokens each.

    Prefill instance 1: steps 0-100 (100 prompt tokens), 100-200 (60) -> 800 tokens per busy second.
    Decode instance 2: four 50 ms steps with 2 decode tokens each -> 40 tokens per busy second;
    waiting 0, 1, 2, 3 and running 2 in those steps.
    transfer.kv: 10 ms in r1's token 0, 5 ms in r2's token 1.
    """
    h = handmade.instance(1, Role.PREFILL).instance(2, Role.DECODE)
    h.request(1, 0, 1000, prompt=100, cached=20).tokens(1, [100, 500, 1000], inst=2)
    h.request(2, 0, 1000, prompt=60, cached=0).tokens(2, [200, 600, 1000], inst=2)
    h.step(1, 0, 100, prefill=100, inst=1).step(2, 100, 200, prefill=60, inst=1)
    for i in range(4):
        h.step(i + 1, 200 + 50 * i, 250 + 50 * i, seqs=2, decode=2, waiting=i, running=2, inst=2)
    h.span(1, Stage.TRANSFER_KV, 90, 100, 0, inst=2).span(2, Stage.TRANSFER_KV, 200, 205, 1, inst=2)
    return h.source()


UTIL = [  # (instance, column, expected)
    (1, "role", "prefill"), (1, "prefill_busy_s", 0.2), (1, "prefill_utilisation", 0.2),
    (1, "prefill_tokens_per_s", 800.0), (1, "decode_busy_s", 0.0), (2, "role", "decode"),
    (2, "decode_tokens", 8), (2, "decode_tokens_per_s", 40.0), (2, "decode_utilisation", 0.2),
]


@pytest.mark.parametrize(("inst", "column", "expected"), UTIL)
def test_utilisation(disagg, inst, column, expected):
    value = utilisation(disagg).set_index(col.INSTANCE_ID).loc[inst, column]
    assert value == (pytest.approx(expected) if isinstance(expected, float) else expected)


def test_demand_is_the_offered_rate_and_decode_tokens_only(disagg):
    row = demand(disagg).iloc[0]
    assert math.isnan(row["arrival_rate_rps"])  # both arrive at 0: no arrival window, no offered rate
    assert row["prefill_tokens_per_request"] == pytest.approx(70)  # mean of (100 - 20) and 60
    assert row["decode_tokens_per_request"] == pytest.approx(2)  # 3 output tokens, token 0 from prefill
    assert row["ttft_target_ms"] == 500.0 and row["tpot_target_ms"] == 100.0  # interactive defaults


def test_advice_in_whole_instances(handmade):
    # Prefill instance 1: 200 tokens in 100 ms -> 2000 tok/s. Decode instance 2: 1 token per 50 ms step -> 20 tok/s.
    # Four requests 1 s apart -> 1 req/s offered: 100 prefill tok/s, 4 decode tok/s (5 output tokens each).
    h = handmade.instance(1, Role.PREFILL).instance(2, Role.DECODE)
    for r in range(4):
        t = r * 1000.0
        h.request(r + 1, t, t + 300, prompt=100, output=5).tokens(r + 1, [t + 50 + 50 * i for i in range(5)])
    h.step(1, 0, 100, prefill=200, inst=1)
    for i in range(4):
        h.step(i + 1, 200 + 50 * i, 250 + 50 * i, decode=1, inst=2)
    advice = recommendation(h.source(), headroom=0.5).set_index("pool")
    assert advice.loc["prefill", "work_per_s"] == pytest.approx(100.0)
    assert advice.loc["decode", "work_per_s"] == pytest.approx(4.0)
    assert advice.loc["decode", "capacity_per_instance"] == pytest.approx(20.0)
    assert advice.loc["decode", "service_ms"] == pytest.approx(50.0)
    assert advice.loc["decode", "max_utilisation"] == 0.5 and advice.loc["decode", "instances"] == 1
    assert advice.loc["decode", "utilisation_at_advice"] == pytest.approx(0.2)
    assert advice.loc["prefill", "service_ms"] == pytest.approx(50.0)  # 100 tokens at 2000 tok/s
    assert bool(advice.loc["decode", "slo_reachable"])
    with pytest.raises(ValueError):
        recommendation(h.source(), headroom=1.0)


def test_watermarks(disagg):
    row = watermarks(disagg).set_index(col.INSTANCE_ID).loc[2]
    assert row["max_waiting"] == 3
    assert row["p95_waiting"] == pytest.approx(2.85)
    assert row["max_running"] == 2


def test_kv_transfer_share(disagg):
    row = kv_transfer(disagg).iloc[0]
    assert row["transfer_ms"] == pytest.approx(15.0)
    assert row["share_of_ttft"] == pytest.approx(10 / 300)  # TTFTs 100 + 200
    assert row["share_of_itl"] == pytest.approx(5 / 1700)  # ITLs 400 + 500 + 400 + 400


def test_pools_group_by_role(disagg):
    pools = pd_ratio(disagg).pools.set_index("role")
    assert set(pools.index) == {"prefill", "decode"}
    assert pools.loc["prefill", "num_instances"] == 1
    assert pools.loc["decode", "decode_tokens_per_s"] == pytest.approx(40.0)


def test_colocated_engine_sums_both_kinds_of_work(handmade):
    # 10 requests 100 ms apart (10 req/s): prompt 10 at 100 tok/s (0.1 s each), 1 decode token at 10 tok/s (0.1 s).
    h = handmade
    for r in range(10):
        t = r * 100.0
        h.request(r + 1, t, t + 200, prompt=10, cached=0, output=2).tokens(r + 1, [t + 100, t + 200])
    h.step(1, 0, 100, prefill=10).step(2, 100, 200, decode=1)
    advice = recommendation(h.source())
    assert list(advice["pool"]) == ["colocated"]
    row = advice.iloc[0]
    assert row["work_per_s"] == pytest.approx(10 * 10 / 100 + 10 * 1 / 10)  # busy seconds per second
    assert row["instances"] == 3 and row["lacks"] == 2  # 2.0 / 0.8 -> 3


def test_a_colocated_engine_that_mixes_prefill_and_decode_in_one_step_is_busy_once_for_both(handmade):
    # As above (10 req/s, 10 prompt and 1 decode token each), but every step is mixed: 100 ms serves 10 prompt
    # tokens and 1 decode token at once. Prefill capacity 100 tok/s and decode 10 tok/s are each measured over
    # the same 100 ms, so their work (1.0 + 1.0 busy s/s) counts that time twice: it is 1.0 busy s/s.
    h = handmade
    for r in range(10):
        t = r * 100.0
        h.request(r + 1, t, t + 200, prompt=10, cached=0, output=2).tokens(r + 1, [t + 100, t + 200])
    h.step(1, 0, 100, prefill=10, decode=1).step(2, 100, 200, prefill=10, decode=1)
    row = recommendation(h.source()).iloc[0]
    assert row["work_per_s"] == pytest.approx(1.0)
    assert row["instances"] == 2 and row["lacks"] == 1  # 1.0 / 0.8 -> 2, not 3
    assert row["current_utilisation"] == pytest.approx(1.0)


def test_empty_store(handmade):
    report = pd_ratio(handmade.source())
    assert report.utilisation.empty and report.pools.empty and report.watermarks.empty
    assert report.recommendation.empty


def test_one_kv_transfer_share_of_itl_the_stage_breakdowns(handmade):
    """r1's transfer.kv of token 1 runs 50-110 ms, but token 1's interval starts at 100 (token 0 delivered): only
    10 ms of it is in ITL, as the stage breakdown counts it, and the PD section says the same."""
    from analyzers.stage_breakdown import breakdown
    h = handmade.instance(1, Role.PREFILL).instance(2, Role.DECODE)
    h.request(1, 0, 300, prompt=10).tokens(1, [100, 200, 300], inst=2)
    h.span(1, Stage.TRANSFER_KV, 50, 110, 1, inst=2)
    row = kv_transfer(h.source()).iloc[0]
    stage = breakdown(h.source()).set_index("stage").loc["transfer.kv"]
    assert row["share_of_itl"] == pytest.approx(stage["itl_share"]) == pytest.approx(10 / 200)
    assert row["transfer_ms"] == pytest.approx(10.0)
