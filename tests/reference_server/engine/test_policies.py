from __future__ import annotations

import pytest

from reference_server.engine.policies import (
    DropOnEvict, FCFSPolicy, LRUEviction, OffloadOnEvict, PrefetchWaitingPrefixes, SLODeadlinePolicy,
    WatermarkAdmission, WeightedFairPolicy, make_scheduling_policy,
)


def test_lru_pops_least_recently_added_and_supports_removal():
    lru = LRUEviction()
    for b in (5, 3, 9):
        lru.add(b)
    lru.remove(3)
    lru.add(3)
    assert lru.order() == [5, 9, 3] and 9 in lru and len(lru) == 3
    assert [lru.pop_victim() for _ in range(3)] == [5, 9, 3]


@pytest.mark.parametrize("sizes,src,expected", [
    ((8, 4, 4), 0, 1), ((8, 0, 4), 0, 2), ((8, 4, 4), 1, 2), ((8, 4, 4), 2, None), ((8, 0, 0), 0, None),
])
def test_offload_goes_to_the_next_lower_tier_with_blocks(sizes, src, expected):
    assert OffloadOnEvict().target_tier(src, sizes) == expected
    assert DropOnEvict().target_tier(src, sizes) is None


def test_watermark_admission():
    assert WatermarkAdmission(2).can_admit(3, 5)
    assert not WatermarkAdmission(2).can_admit(4, 5)
    with pytest.raises(ValueError):
        WatermarkAdmission(-1)
    with pytest.raises(ValueError):
        PrefetchWaitingPrefixes(-1)


def test_ordering_keys(make_seq):
    early_batch = make_seq("a", [1], slo_class="batch", arrival_ns=0)
    late_inter = make_seq("b", [1], slo_class="interactive", arrival_ns=1_000_000_000)
    fcfs, slo = FCFSPolicy(), SLODeadlinePolicy()
    assert fcfs.waiting_key(early_batch) < fcfs.waiting_key(late_inter)
    assert slo.waiting_key(late_inter) < slo.waiting_key(early_batch)  # 1.5 s < 30 s deadline
    assert slo.victim_key(early_batch) > slo.victim_key(late_inter)  # lower priority goes first


def test_weighted_fair_virtual_time_and_rejoin(make_seq):
    fair = WeightedFairPolicy({"a": 1.0, "b": 4.0})
    fair.on_scheduled(make_seq("x", [1], tenant="a"), 8, is_new=True)
    fair.on_scheduled(make_seq("y", [1], tenant="b"), 8, is_new=True)
    assert fair.virtual_time == {"a": 8.0, "b": 2.0} and fair.service == {"a": 8.0, "b": 8.0}
    fair.virtual_time["b"] = 0.0
    fair.on_tenant_active("b", ["a"])  # b was idle: starts at the active minimum, no banked credit
    assert fair.virtual_time["b"] == 8.0


def test_make_scheduling_policy_names():
    assert isinstance(make_scheduling_policy("slo", weights={}), SLODeadlinePolicy)
    with pytest.raises(ValueError, match="known: fcfs, slo, fair"):
        make_scheduling_policy("lottery", weights={})
