"""Prefill:decode analyses over a hand-made disaggregated store (prefill instance 1, decode instance 2)."""

from __future__ import annotations

import pytest

from analyzers.pd_ratio import kv_transfer, pd_ratio, recommendation, utilisation, watermarks
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


def test_recommended_ratio(disagg):
    row = recommendation(disagg).iloc[0]
    assert row["arrival_rate_rps"] == pytest.approx(2.0)
    assert row["prefill_tokens_per_s_needed"] == pytest.approx(2 * (80 - 10))  # lambda * (P - C)
    assert row["decode_tokens_per_s_needed"] == pytest.approx(2 * 3)  # lambda * O
    assert row["prefill_instances"] == pytest.approx(140 / 800)
    assert row["decode_instances"] == pytest.approx(6 / 40)
    assert row["prefill_to_decode_ratio"] == pytest.approx((140 / 800) / (6 / 40))


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


def test_colocated_engine_serves_both_throughputs(handmade):
    h = handmade.request(1, 0, 1000, prompt=10, cached=0).tokens(1, [100, 1000])
    h.step(1, 0, 100, prefill=10).step(2, 100, 200, decode=1)
    row = recommendation(h.source()).iloc[0]
    assert row["prefill_throughput_per_instance"] == pytest.approx(100.0)
    assert row["decode_throughput_per_instance"] == pytest.approx(10.0)
    assert row["prefill_to_decode_ratio"] == pytest.approx((1 * 10 / 100) / (1 * 2 / 10))


def test_empty_store(handmade):
    report = pd_ratio(handmade.source())
    assert report.utilisation.empty and report.pools.empty and report.watermarks.empty
    assert report.recommendation["prefill_to_decode_ratio"].isna().all()
