"""Cache analyses: prefix hit rates, per-tier hits, churn, transfers and the cost of misses."""

from __future__ import annotations

import pytest

from analyzers.cache import cache, eviction_churn, miss_cost, prefix_hits, tier_hits, transfers
from tokentrace.schema import CacheEventKind as K
from tokentrace.schema import Tier


@pytest.fixture
def store(handmade):
    """r1: prompt 100, 60 cached, TTFT 10. r2: prompt 50, none cached, TTFT 40.
    r3: prompt 50, 40 cached, TTFT 30. r4: prompt unknown. The run spans 0 .. 2000 ms.

    Lookups: r1 hits 3 device + 2 host blocks; r2 misses; r3 hits 5 device blocks.
    Evictions: 4 + 6 device blocks. Offload 3 device blocks (3000 B, 1 ms); load 2 (2000 B, 2 ms).
    """
    h = handmade
    h.request(1, 0, 100, prompt=100, cached=60).tokens(1, [10])
    h.request(2, 0, 100, prompt=50, cached=0).tokens(2, [40])
    h.request(3, 0, 100, prompt=50, cached=40).tokens(3, [30])
    h.request(4, 0, 2000).tokens(4, [50])
    h.cache(K.HIT, Tier.DEVICE, 3, 1, 1.1, rid=1).cache(K.HIT, Tier.HOST, 2, 1, 1.1, rid=1)
    h.cache(K.MISS, Tier.DEVICE, 0, 2, 2.1, rid=2, tokens=50)
    h.cache(K.HIT, Tier.DEVICE, 5, 3, 3.1, rid=3, tokens=40)
    h.cache(K.EVICT, Tier.DEVICE, 4, 5).cache(K.EVICT, Tier.DEVICE, 6, 7)
    h.cache(K.OFFLOAD, Tier.DEVICE, 3, 1, 2, nbytes=3000).cache(K.LOAD, Tier.DEVICE, 2, 3, 5, rid=1, nbytes=2000)
    return h.source()


def test_prefix_hit_rates(store):
    row = prefix_hits(store).iloc[0]
    assert row["num_requests"] == 3
    assert row["token_hit_rate"] == pytest.approx(100 / 200)
    assert row["request_hit_rate"] == pytest.approx(2 / 3)


TIERS = [("device", "num_lookups_hit", 2), ("device", "lookup_hit_rate", 2 / 3), ("device", "hit_blocks", 8),
         ("host", "lookup_hit_rate", 1 / 3), ("host", "share_of_hit_blocks", 0.2), ("device", "num_lookups", 3)]


@pytest.mark.parametrize(("tier", "column", "expected"), TIERS)
def test_tier_hits(store, tier, column, expected):
    assert tier_hits(store).set_index("tier").loc[tier, column] == pytest.approx(expected)


def test_eviction_churn(store):
    row = eviction_churn(store).set_index("tier").loc["device"]
    assert row["evicted_blocks"] == 10
    assert row["evicted_blocks_per_s"] == pytest.approx(5.0)
    assert row["offloaded_blocks"] == 3 and row["loaded_blocks"] == 2
    assert row["reload_ratio"] == pytest.approx(0.2)


def test_transfers(store):
    df = transfers(store).set_index("kind")
    assert df.loc["offload", "bytes"] == 3000
    assert df.loc["offload", "time_ms"] == pytest.approx(1.0)
    assert df.loc["offload", "gb_per_s"] == pytest.approx(3000 / 1e-3 / 1e9)
    assert df.loc["load", "blocks"] == 2 and df.loc["load", "tier"] == "device"
    assert set(df.index) == {"offload", "load"}


def test_miss_cost(store):
    df = miss_cost(store).set_index("group")
    assert df.loc["hit", "num_requests"] == 2
    assert df.loc["hit", "mean_ttft_ms"] == pytest.approx(20.0)
    assert df.loc["hit", "mean_ttft_per_prompt_token_ms"] == pytest.approx((0.1 + 0.6) / 2)
    assert df.loc["miss", "mean_ttft_per_prompt_token_ms"] == pytest.approx(0.8)
    assert df.loc["miss", "mean_prompt_tokens"] == pytest.approx(50.0)


def test_empty_store_gives_empty_frames(handmade):
    report = cache(handmade.source())
    assert report.tiers.empty and report.churn.empty and report.transfers.empty
    assert list(report.miss_cost["num_requests"]) == [0, 0]
    assert report.prefix.iloc[0]["num_requests"] == 0
