"""Scheduling policies: ordering and victim keys, weighted fair virtual time, names."""

from __future__ import annotations

import pytest

from reference_server.engine.scheduling_policies import (
    FCFSPolicy,
    SLODeadlinePolicy,
    WeightedFairPolicy,
    make_scheduling_policy,
)


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
