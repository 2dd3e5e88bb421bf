"""The simulated scheduler on tiny hand-made configurations (block size 4, a dozen blocks): exact chunks,
admissions, block counts and preemption victims, as the reference scheduler plans them."""

from __future__ import annotations

import pytest

from analyzers.whatif.engine_model import SimEngine, SimRequest


def _engine(**kw) -> SimEngine:
    opts = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_device_blocks=12)
    opts.update(kw)
    return SimEngine(**opts)


def _req(rid: int, prompt: int, output: int, *, arrival: int = 0, deadline: int = 0, cached: int = 0) -> SimRequest:
    return SimRequest(rid, arrival, prompt, output, cached, deadline_ns=deadline, seq_no=rid)


def _run_step(eng: SimEngine, t: int) -> list[tuple[int, int, bool]]:
    step = eng.plan()
    eng.complete(step, t)
    return [(r.rid, n, s) for r, n, s in step.chunks]


def test_a_long_prompt_is_prefilled_in_chunks_under_the_token_budget():
    eng = _engine(max_num_batched_tokens=8)
    a = _req(1, 20, 2)
    eng.add(a)
    plans = [_run_step(eng, t) for t in (10, 20, 30, 40)]
    assert plans == [[(1, 8, False)], [(1, 8, False)], [(1, 4, True)], [(1, 1, True)]]
    assert a.emit_ns == [30, 40] and a.done
    assert eng.num_used_blocks == 0 and not eng.has_work()  # finished: its 6 blocks freed


def test_decodes_go_first_then_prefill_chunks_share_what_is_left_of_the_budget():
    eng = _engine(max_num_batched_tokens=10)
    eng.add(_req(1, 4, 5))
    assert _run_step(eng, 1) == [(1, 4, True)]
    eng.add(_req(2, 30, 1, arrival=1))
    assert _run_step(eng, 2) == [(1, 1, True), (2, 9, False)]
    step = eng.plan()
    assert (step.num_prefill_tokens, step.num_decode_tokens, step.num_seqs) == (9, 1, 2)
    assert step.decode_context == 6  # request 1 holds 4 prompt + 2 sampled tokens


def test_max_num_seqs_caps_the_batch_and_the_rest_waits_in_arrival_order():
    eng = _engine(max_num_seqs=2)
    for rid in (1, 2, 3):
        eng.add(_req(rid, 4, 3, arrival=rid))
    assert _run_step(eng, 1) == [(1, 4, True), (2, 4, True)]
    assert [r.rid for r in eng.waiting] == [3]
    assert _run_step(eng, 2) == [(1, 1, True), (2, 1, True)]
    assert _run_step(eng, 3) == [(1, 1, True), (2, 1, True)]  # 1 and 2 finish: three tokens each
    assert _run_step(eng, 4) == [(3, 4, True)]


def test_admission_stops_at_the_first_request_whose_blocks_do_not_fit():
    eng = _engine(num_device_blocks=5)
    eng.add(_req(1, 12, 4, arrival=1))  # 3 blocks
    eng.add(_req(2, 12, 4, arrival=2))  # 3 blocks: only 2 left
    eng.add(_req(3, 4, 4, arrival=3))  # 1 block would fit, but FCFS does not jump the queue
    assert _run_step(eng, 1) == [(1, 12, True)]
    assert eng.num_used_blocks == 3 and [r.rid for r in eng.waiting] == [2, 3]


def test_a_request_that_needs_a_block_preempts_the_latest_arrival_by_recompute():
    eng = _engine(num_device_blocks=4)
    a, b = _req(1, 8, 10, arrival=1), _req(2, 7, 10, arrival=2)
    eng.add(a)
    eng.add(b)
    assert _run_step(eng, 1) == [(1, 8, True), (2, 7, True)]  # 2 + 2 blocks: the pool is full
    assert _run_step(eng, 2) == [(1, 1, True)]  # a's 9th token needs a 3rd block: b (latest) is preempted
    assert eng.num_preemptions == 1 and b.num_preemptions == 1
    assert b in eng.waiting and b.num_computed == 0 and b.num_blocks == 0
    assert a.num_blocks == 3 and eng.num_used_blocks == 3
    # b keeps its sampled token: it recomputes prompt + that token (8 tokens, 2 blocks) when blocks free up
    assert b.num_tokens == 8 and b.num_generated == 1


def test_a_request_preempted_by_recompute_finds_its_own_blocks_still_cached_when_readmitted():
    eng = _engine(num_device_blocks=6)
    a, b = _req(1, 8, 4, arrival=1), _req(2, 12, 10, arrival=2)
    eng.add(a)
    eng.add(b)
    assert _run_step(eng, 1) == [(1, 8, True), (2, 12, True)]  # 2 + 3 blocks
    assert _run_step(eng, 2) == [(1, 1, True)]  # a takes the last free block; b's 4th block preempts b
    assert b.num_preemptions == 1 and eng.num_used_blocks == 3 and len(eng.cached) == 3  # b's 3 full blocks
    assert _run_step(eng, 3) == [(1, 1, True)]  # b needs 4 blocks (13 tokens), 3 are free
    assert _run_step(eng, 4) == [(1, 1, True)]  # a's 4th token: a finishes
    # b's 12 computed tokens are still cached (3 blocks): only its sampled token is computed again
    assert _run_step(eng, 5) == [(2, 1, True)]
    assert b.num_blocks == 4 and eng.num_used_blocks == 4


def test_blocks_are_taken_plain_first_then_cached_ones_tail_first_and_a_readmission_finds_the_head_left():
    eng = _engine(num_device_blocks=6)
    a, b = _req(1, 8, 3, arrival=1), _req(2, 12, 10, arrival=2)
    eng.add(a)
    eng.add(b)
    _run_step(eng, 1)
    _run_step(eng, 2)  # b preempted: its blocks 2, 1, 0 cached in that order (tail first)
    assert list(eng.cached) == [(2, 2), (2, 1), (2, 0)]
    eng.add(_req(3, 1, 1, arrival=0))  # ahead of b in FCFS order; no plain block is free
    assert _run_step(eng, 3) == [(1, 1, True), (3, 1, True)]  # its block evicts b's tail; b (4 blocks) waits
    assert (2, 2) not in eng.cached and b in eng.waiting
    # a finished (its 2 full blocks cached after b's), request 3 left a plain block: b finds its 2 head blocks
    assert list(eng.cached) == [(2, 1), (2, 0), (1, 1), (1, 0)]
    assert _run_step(eng, 4) == [(2, 5, True)]  # 13 tokens, 8 of them cached
    assert list(eng.cached) == [(1, 1), (1, 0)]  # plain blocks taken first: a's stay cached


def test_nothing_is_admitted_in_a_step_that_preempted():
    eng = _engine(num_device_blocks=4)
    eng.add(_req(1, 8, 10, arrival=1))
    eng.add(_req(2, 7, 10, arrival=2))
    _run_step(eng, 1)
    eng.add(_req(3, 1, 1, arrival=3))
    assert [rid for rid, _, _ in _run_step(eng, 2)] == [1]  # request 3 would fit in the freed blocks


def test_slo_policy_admits_the_earliest_deadline_first():
    eng = _engine(max_num_seqs=1, scheduling_policy="slo")
    eng.add(_req(1, 4, 1, arrival=1, deadline=1000))
    eng.add(_req(2, 4, 1, arrival=2, deadline=500))
    assert _run_step(eng, 1) == [(2, 4, True)]
    assert _run_step(eng, 2) == [(1, 4, True)]


def test_cached_prompt_blocks_are_not_recomputed():
    eng = _engine()
    r = _req(1, 14, 1, cached=10)
    eng.add(r)
    assert _run_step(eng, 1) == [(1, 6, True)]  # 2 whole cached blocks (8 tokens): 6 left to compute
    assert r.emit_ns == [1]


def test_without_chunked_prefill_a_prompt_over_the_budget_is_never_planned():
    eng = _engine(max_num_batched_tokens=8, chunked_prefill=False)
    eng.add(_req(1, 9, 1))
    assert eng.plan().chunks == ()


def test_a_handed_over_request_starts_decoding_with_its_kv_in_place():
    eng = _engine()
    r = _req(1, 10, 3)
    r.num_generated = 1
    assert eng.add_running(r)
    assert eng.num_used_blocks == 3  # 10 prompt tokens + 0 computed past them: ceil(10 / 4)
    assert _run_step(eng, 5) == [(1, 1, True)]


@pytest.mark.parametrize("bad", [dict(max_num_seqs=0), dict(num_device_blocks=0), dict(scheduling_policy="lifo")])
def test_bad_configurations_are_value_errors(bad):
    with pytest.raises(ValueError):
        _engine(**bad)
