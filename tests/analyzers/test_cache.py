"""Cache analyses: prefix hit rates, per-tier hits, churn, transfers and the cost of misses."""

from __future__ import annotations

import math

import pytest

from analyzers.cache import (
    PREFIX_BOUND_KEY,
    cache,
    eviction_churn,
    hit_rate_over_time,
    hit_value,
    prefix_hits,
    tier_hits,
    transfers,
)
from tokentrace.schema import CacheEventKind as K
from tokentrace.schema import Stage, Tier


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


def test_a_lookup_again_after_a_preemption_is_not_a_second_hit(handmade):
    """r1 misses at 1 ms, is preempted, and at 50 ms looks up again and finds its own 4 blocks: its reported
    cached tokens (0) come from the first lookup, and so do the lookup rates."""
    h = handmade
    h.request(1, 0, 100, prompt=20, cached=0).tokens(1, [10])
    h.cache(K.MISS, Tier.DEVICE, 0, 1, 1.1, rid=1, tokens=20).cache(K.HIT, Tier.DEVICE, 4, 50, 50.1, rid=1)
    tiers = tier_hits(h.source())
    assert prefix_hits(h.source()).iloc[0]["token_hit_rate"] == 0.0
    assert tiers.empty or (tiers["num_lookups_hit"] == 0).all(), tiers


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


def test_hit_value_without_stage_spans_is_not_measured(store):
    df = hit_value(store).set_index("group")
    assert df.loc["hit", "num_requests"] == 2 and df.loc["hit", "num_measured"] == 0
    assert df["ms_per_prompt_token"].isna().all() and df["saved_ms_per_hit"].isna().all()
    assert df.loc["hit", "mean_ttft_ms"] == pytest.approx(20.0)  # context only


def _hits_and_misses(h, *, num_hits: int = 5, num_misses: int = 5, miss_queue_ms: float = 40.0):
    """Hits (prompt 100, 80 cached): queue 0-50 ms, lookup 1 ms, load 2 ms, prefill 4 ms. Misses (prompt 100): queue
    ``miss_queue_ms``, lookup 1 ms, prefill 20 ms."""
    for i in range(num_hits):
        h.request(1 + i, 0, 100, prompt=100, cached=80).tokens(1 + i, [57])
        h.span(1 + i, Stage.SCHEDULE_QUEUE, 0, 50, 0).span(1 + i, Stage.CACHE_LOOKUP, 50, 51, 0)
        h.span(1 + i, Stage.CACHE_LOAD, 51, 53, 0).span(1 + i, Stage.PREFILL_COMPUTE, 53, 57, 0)
    q = miss_queue_ms
    for i in range(num_misses):
        rid = 100 + i
        h.request(rid, 0, 100, prompt=100, cached=0).tokens(rid, [q + 21])
        if q > 0:
            h.span(rid, Stage.SCHEDULE_QUEUE, 0, q, 0)
        h.span(rid, Stage.CACHE_LOOKUP, q, q + 1, 0).span(rid, Stage.PREFILL_COMPUTE, q + 1, q + 21, 0)
    return hit_value(h.source()).set_index("group")


def test_hit_value_on_the_stages_a_hit_changes(handmade):
    df = _hits_and_misses(handmade)
    assert df.loc["hit", "ms_per_prompt_token"] == pytest.approx(7 / 100)
    assert df.loc["miss", "ms_per_prompt_token"] == pytest.approx(21 / 100)
    assert df.loc["hit", "saved_ms_per_hit"] == pytest.approx(21 - 7)
    assert df.loc["hit", "load_ms"] == pytest.approx(2.0) and df.loc["hit", "mean_queue_ms"] == pytest.approx(50.0)
    assert df.loc["hit", "value_note"] == "" and df.loc["miss", "num_compared"] == 5
    assert math.isnan(df.loc["miss", "saved_ms_per_hit"])


@pytest.mark.parametrize(("kw", "words"), [
    ({"num_misses": 2}, "only 2 of 2 request(s) that missed queued about as long as the hits"),
    ({"num_hits": 1}, "only 1 request(s) hit"),
    ({"miss_queue_ms": 0.0}, "only 0 of 5 request(s) that missed queued about as long as the hits"),
    ({"num_hits": 0}, "no request hit the prefix cache"),
])
def test_no_value_of_a_hit_from_too_few_requests_or_another_load(handmade, kw, words):
    """A miss served alone (no queue) against hits that queued 50 ms is not a comparison; nor are two requests."""
    df = _hits_and_misses(handmade, **kw)
    assert math.isnan(df.loc["hit", "saved_ms_per_hit"])
    assert df.loc["hit", "value_note"].startswith(words), df.loc["hit", "value_note"]


def test_hit_rate_over_time(handmade):
    h = handmade
    h.request(1, 0, 10, prompt=100, cached=0).request(2, 500, 510, prompt=100, cached=50)
    h.request(3, 1000, 1010, prompt=100, cached=100)
    df = hit_rate_over_time(h.source(), window_s=1.0).set_index("window_start_s")
    assert df.loc[0.0, "token_hit_rate"] == pytest.approx(0.25) and df.loc[0.0, "request_hit_rate"] == 0.5
    assert df.loc[1.0, "token_hit_rate"] == 1.0
    with pytest.raises(ValueError):
        hit_rate_over_time(h.source(), window_s=0)


def test_best_achievable_rate_comes_from_the_manifest(handmade):
    h = handmade.request(1, 0, 10, prompt=100, cached=30).tokens(1, [10])
    assert math.isnan(prefix_hits(h.source()).iloc[0]["best_token_hit_rate"])
    manifest = {"config": {"bench": {PREFIX_BOUND_KEY: {"best_token_hit_rate": 0.4, "best_block_hit_rate": 0.35}}}}
    row = prefix_hits(h.source(manifest)).iloc[0]
    assert row["token_hit_rate"] == pytest.approx(0.3) and row["best_token_hit_rate"] == 0.4
    assert row["best_block_hit_rate"] == 0.35


def test_the_bench_records_the_bound_under_the_key_the_analyzer_reads():
    from tokentrace.app.bench import prefix

    assert prefix.PREFIX_BOUND_KEY == PREFIX_BOUND_KEY


def test_empty_store_gives_empty_frames(handmade):
    report = cache(handmade.source())
    assert report.tiers.empty and report.churn.empty and report.transfers.empty
    assert list(report.hit_value["num_requests"]) == [0, 0]
    assert report.prefix.iloc[0]["num_requests"] == 0
    assert report.hit_rate_over_time.empty
