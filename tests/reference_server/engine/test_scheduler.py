"""Scheduler decision tables: budgets, chunking, decode-first, quotas, classes, weights,
preemption victims, exact order. No model: a step "computes" what was planned and
samples token 7."""

from __future__ import annotations

import pytest

from reference_server.engine.block_manager import BlockManager, CopyOp
from reference_server.engine.config import TenantConfig
from reference_server.engine.scheduler import Scheduler
from reference_server.engine.scheduling_policies import FCFSPolicy, SLODeadlinePolicy, WeightedFairPolicy
from reference_server.engine.sequence import FinishReason, PreemptionMode, SequenceStatus

MS = 1_000_000  # ns


def make_scheduler(*, blocks=12, host=0, budget=16, max_seqs=8, policy=None, tenants=None, chunked=True,
                   mode=PreemptionMode.RECOMPUTE, caching=True):
    tenants = tenants or [TenantConfig("default")]
    bm = BlockManager(block_size=4, num_device_blocks=blocks, num_host_blocks=host, enable_prefix_caching=caching)
    return Scheduler(block_manager=bm, policy=policy or FCFSPolicy(), tenants={t.name: t for t in tenants},
                     max_num_batched_tokens=budget, max_num_seqs=max_seqs, enable_chunked_prefill=chunked,
                     preemption_mode=mode)


def step(sched, now_ns=0):
    """Plan and 'run' one step; return [(id, start, n, 'P'|'D', samples)]."""
    out = sched.schedule(now_ns, step=1)
    sched.update(out, {c.request_id: 7 for c in out.chunks if c.samples})
    return [(c.request_id, c.start_pos, c.num_tokens, "P" if c.is_prefill else "D", c.samples) for c in out.chunks]


def test_token_budget_chunks_a_long_prompt_across_steps(make_seq):
    s = make_scheduler(budget=8)
    s.add(make_seq("a", range(10)))
    s.add(make_seq("b", range(20, 23), arrival_ns=1))
    assert step(s) == [("a", 0, 8, "P", False)]
    assert step(s) == [("a", 8, 2, "P", True), ("b", 0, 3, "P", True)]
    assert step(s) == [("a", 10, 1, "D", True), ("b", 3, 1, "D", True)]
    assert s.running["a"].output_token_ids == [7, 7]


def test_decodes_go_before_running_prefill_chunks(make_seq):
    s = make_scheduler(budget=6)
    s.add(make_seq("a", range(3)))
    assert step(s) == [("a", 0, 3, "P", True)]
    s.add(make_seq("b", range(10, 20), arrival_ns=1))
    assert step(s) == [("a", 3, 1, "D", True), ("b", 0, 5, "P", False)]
    assert step(s) == [("a", 4, 1, "D", True), ("b", 5, 5, "P", True)]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget(make_seq):
    s = make_scheduler(budget=8, chunked=False)
    s.add(make_seq("a", range(3)))
    s.add(make_seq("b", range(10, 16), arrival_ns=1))
    s.add(make_seq("c", range(20, 22), arrival_ns=2))
    assert step(s) == [("a", 0, 3, "P", True)]  # b (6) does not fit in 5; c waits behind b (FCFS)
    assert step(s) == [("a", 3, 1, "D", True), ("b", 0, 6, "P", True)]
    assert step(s) == [("a", 4, 1, "D", True), ("b", 6, 1, "D", True), ("c", 0, 2, "P", True)]


def test_max_num_seqs_caps_the_batch(make_seq):
    s = make_scheduler(max_seqs=2)
    for i, rid in enumerate("abc"):
        s.add(make_seq(rid, range(i * 10, i * 10 + 2), arrival_ns=i))
    assert [c[0] for c in step(s)] == ["a", "b"]
    assert s.num_waiting == 1


def test_admission_stops_when_blocks_run_out(make_seq):
    s = make_scheduler(blocks=4, budget=64)
    s.add(make_seq("a", range(12)))
    s.add(make_seq("b", range(20, 28), arrival_ns=1))  # needs 2 blocks, 1 left
    s.add(make_seq("c", range(30, 32), arrival_ns=2))  # would fit, but FCFS keeps order
    assert [c[0] for c in step(s)] == ["a"]
    assert s.num_waiting == 2


@pytest.mark.parametrize("policy,expected", [
    (FCFSPolicy(), ["batch1", "inter1", "batch2"]),
    (SLODeadlinePolicy(), ["inter1", "batch1", "batch2"]),
])
def test_admission_order_by_policy(make_seq, policy, expected):
    s = make_scheduler(budget=4, policy=policy)
    s.add(make_seq("batch1", range(0, 4), slo_class="batch", arrival_ns=0))
    s.add(make_seq("inter1", range(10, 14), slo_class="interactive", arrival_ns=100 * MS))
    s.add(make_seq("batch2", range(20, 24), slo_class="batch", arrival_ns=200 * MS))
    order = []
    for _ in range(3):
        out = step(s, now_ns=300 * MS)
        order += [rid for rid, _, _, kind, _ in out if kind == "P"]
        for rid, *_ in out:
            s.finish(s.running[rid], FinishReason.STOP)
    assert order == expected


def test_tenant_concurrency_quota_skips_without_blocking_others(make_seq):
    s = make_scheduler(tenants=[TenantConfig("t1", max_concurrency=1), TenantConfig("t2")])
    s.add(make_seq("t1a", range(4), tenant="t1", arrival_ns=0))
    s.add(make_seq("t1b", range(10, 14), tenant="t1", arrival_ns=1))
    s.add(make_seq("t2a", range(20, 24), tenant="t2", arrival_ns=2))
    assert [c[0] for c in step(s)] == ["t1a", "t2a"]
    assert [c[0] for c in step(s)] == ["t1a", "t2a"]
    s.finish(s.running["t1a"], FinishReason.STOP)
    assert [c[0] for c in step(s)] == ["t2a", "t1b"]


def test_tenant_token_bucket_refills_on_the_engine_clock(make_seq):
    s = make_scheduler(budget=64, tenants=[TenantConfig("t", max_tokens_per_s=10.0)])
    s.add(make_seq("a", range(25), tenant="t"))
    assert step(s, now_ns=0) == [("a", 0, 10, "P", False)]
    assert step(s, now_ns=0) == []  # bucket empty
    assert step(s, now_ns=500 * MS) == [("a", 10, 5, "P", False)]
    assert step(s, now_ns=5000 * MS) == [("a", 15, 10, "P", True)]  # refill capped at burst (10)
    assert s.tenants["t"].tokens == 0


def test_weighted_fair_serves_tokens_in_proportion_to_weights(make_seq):
    weights = {"a": 1.0, "b": 2.0}
    s = make_scheduler(budget=4, policy=WeightedFairPolicy(weights),
                       tenants=[TenantConfig("a", weight=1.0), TenantConfig("b", weight=2.0)])
    for i in range(6):
        s.add(make_seq(f"a{i}", range(100 * i, 100 * i + 4), tenant="a", arrival_ns=i))
    for i in range(6):
        s.add(make_seq(f"b{i}", range(1000 + 100 * i, 1000 + 100 * i + 4), tenant="b", arrival_ns=10 + i))
    order = []
    for _ in range(9):
        out = step(s)
        order += [rid for rid, *_ in out]
        for rid, *_ in out:
            s.finish(s.running[rid], FinishReason.STOP)
    assert order == ["a0", "b0", "b1", "a1", "b2", "b3", "a2", "b4", "b5"]
    assert s.policy.service == {"a": 12.0, "b": 24.0}


def test_fair_by_requests_counts_admissions_not_tokens(make_seq):
    policy = WeightedFairPolicy({"a": 1.0, "b": 1.0}, by="requests")
    s = make_scheduler(budget=16, max_seqs=1, policy=policy, tenants=[TenantConfig("a"), TenantConfig("b")])
    s.add(make_seq("a0", range(12), tenant="a", arrival_ns=0))
    s.add(make_seq("a1", range(20, 22), tenant="a", arrival_ns=1))
    s.add(make_seq("b0", range(30, 32), tenant="b", arrival_ns=2))
    step(s)
    s.finish(s.running["a0"], FinishReason.STOP)
    assert [c[0] for c in step(s)] == ["b0"]  # a has 1 request served, b none
    assert policy.service == {"a": 1.0, "b": 1.0}


def decode_three(make_seq, **kw):
    """Three requests whose 4-token prompts fill one block each, in 4 device blocks:
    their first decodes need 3 more blocks and only 1 is free."""
    s = make_scheduler(blocks=4, budget=16, **kw)
    s.add(make_seq("old", range(0, 4), slo_class="interactive", arrival_ns=0))
    s.add(make_seq("mid", range(10, 14), slo_class="batch", arrival_ns=1))
    s.add(make_seq("new", range(20, 24), slo_class="interactive", arrival_ns=2))
    assert sorted(c[0] for c in step(s)) == ["mid", "new", "old"]
    return s


@pytest.mark.parametrize("policy,victim", [(FCFSPolicy(), "new"), (SLODeadlinePolicy(), "mid")])
def test_preemption_victim_by_policy(make_seq, policy, victim):
    s = decode_three(make_seq, policy=policy)
    out = s.schedule(0, step=1)
    assert [(p.request_id, p.step, p.mode) for p in out.preempted] == [(victim, 1, "recompute")]
    assert sorted(c.request_id for c in out.chunks) == sorted({"old", "mid", "new"} - {victim})
    assert s.waiting[victim].status is SequenceStatus.PREEMPTED and s.waiting[victim].num_computed_tokens == 0
    assert out.num_preempted == 1 and s.num_preemptions[PreemptionMode.RECOMPUTE] == 1


def test_recompute_resumes_through_the_prefix_cache(make_seq):
    s = decode_three(make_seq)
    step(s)  # "new" preempted, its full block stays cached
    s.finish(s.running["old"], FinishReason.STOP)
    out = s.schedule(0, step=1)
    assert [(r.request_id, r.step, r.mode) for r in out.resumed] == [("new", 1, "recompute")]
    (lookup,) = out.cache_lookups
    assert (lookup.request_id, lookup.step) == ("new", 1) and lookup.start_ns <= lookup.end_ns
    # its block was evicted when "mid" took it, so everything (prompt + output) is recomputed
    assert (lookup.num_query_tokens, lookup.num_hit_tokens) == (5, 0)
    chunk = next(c for c in out.chunks if c.request_id == "new")
    assert (chunk.start_pos, chunk.num_tokens, chunk.is_prefill, chunk.samples) == (0, 5, True, True)


def test_swap_preemption_and_resume(make_seq):
    s = decode_three(make_seq, host=4, mode=PreemptionMode.SWAP)
    out = s.schedule(0, step=1)
    assert [(p.request_id, p.mode) for p in out.preempted] == [("new", "swap")]
    # new's keyed block is then reused by "mid": offloaded to the host first
    assert out.copy_ops == (CopyOp("swap_out", "new", 0, (2,), 1, (0,)), CopyOp("offload", None, 0, (2,), 1, (1,)))
    s.update(out, {c.request_id: 7 for c in out.chunks if c.samples})
    s.finish(s.running["old"], FinishReason.STOP)
    s.finish(s.running["mid"], FinishReason.STOP)
    out = s.schedule(0, step=1)
    assert [(r.request_id, r.mode) for r in out.resumed] == [("new", "swap")]
    assert out.copy_ops[0] == CopyOp("swap_in", "new", 1, (0,), 0, (2,))
    chunk = out.chunks[0]
    assert (chunk.request_id, chunk.start_pos, chunk.num_tokens, chunk.is_prefill) == ("new", 4, 1, False)


def test_swap_falls_back_to_recompute_when_no_lower_tier(make_seq):
    s = decode_three(make_seq, mode=PreemptionMode.SWAP)
    out = s.schedule(0, step=1)
    assert [p.mode for p in out.preempted] == ["recompute"]


def test_abort_and_finish_free_blocks_and_counters(make_seq):
    s = make_scheduler(tenants=[TenantConfig("default", max_concurrency=2)])
    s.add(make_seq("a", range(6)))
    s.add(make_seq("b", range(10, 16), arrival_ns=1))
    step(s)
    assert s.abort("a").finish_reason is FinishReason.ABORT
    assert s.abort("a") is None
    s.finish(s.running["b"], FinishReason.LENGTH)
    assert not s.has_unfinished()
    assert s.block_manager.usage().num_used == (0, 0, 0)
    assert (s.tenants["default"].num_running, s.tenants["default"].num_active) == (0, 0)


def test_preempt_unknown_request_raises(make_seq):
    s = make_scheduler()
    with pytest.raises(ValueError, match="not running"):
        s.preempt("nope")


def test_fair_by_compute_time_charges_each_step_by_token_share(make_seq):
    policy = WeightedFairPolicy({"a": 1.0, "b": 2.0}, by="compute_time")
    s = make_scheduler(policy=policy, tenants=[TenantConfig("a", weight=1.0), TenantConfig("b", weight=2.0)])
    s.add(make_seq("a0", range(6), tenant="a"))
    s.add(make_seq("b0", range(10, 12), tenant="b", arrival_ns=1))
    out = s.schedule(0, step=1)
    s.update(out, {c.request_id: 7 for c in out.chunks if c.samples}, compute_ns=8_000)
    assert policy.service == {"a": 6_000.0, "b": 2_000.0}  # 6 and 2 of the step's 8 tokens
    assert policy.virtual_time == {"a": 6_000.0, "b": 1_000.0}
    assert [c.request_id for c in s.schedule(0, step=1).chunks] == ["b0", "a0"]  # running order follows the key
