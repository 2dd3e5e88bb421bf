"""Engine end to end on the tiny model: the KV cache tricks never change the tokens.

Every comparison is greedy decoding against a plain run of the same request, so any
bookkeeping bug (a wrong block id, a stale prefix block, a lost swap) shows up as a
different token."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference_server.engine import Engine, EngineConfig, RecordingObserver, TenantConfig
from reference_server.engine.hooks import CacheLookup, RequestResumed, TierTransfer, TokenEmitted
from reference_server.model import ModelConfig, ModelRunner, SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPT = "The quick brown fox jumps over the lazy dog."  # 45 tokens with bos


def make_engine(**kw) -> Engine:
    base = dict(model="tiny", block_size=4, num_device_blocks=64, max_num_batched_tokens=256, device="cpu")
    base.update(kw)
    return Engine(EngineConfig(**base))


def reference(prompt=PROMPT, sampling=GREEDY) -> tuple[int, ...]:
    with make_engine(enable_prefix_caching=False) as e:
        return e.generate([prompt], sampling)[0].token_ids


def run_until_done(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


def test_generate_returns_completions_in_order():
    with make_engine() as e:
        out = e.generate(["abc", PROMPT], SamplingParams(max_tokens=5, ignore_eos=True))
        assert [c.request_id for c in out] == ["offline-0", "offline-1"]
        assert [len(c.token_ids) for c in out] == [5, 5]
        assert all(c.finish_reason == "length" for c in out)
        assert out[1].prompt_token_ids == tuple(e.tokenizer.encode(PROMPT))
        assert out[1].text == e.tokenizer.decode(out[1].token_ids)
        assert e.stats().num_blocks_used == (0, 0, 0)


def test_chunked_prefill_equals_unchunked():
    with make_engine(max_num_batched_tokens=8) as e:
        chunked = e.generate([PROMPT], GREEDY)[0].token_ids
        num_steps = e.stats().num_steps
    assert num_steps == 6 + len(chunked) - 1  # 45 prompt tokens in 6 chunks of <= 8
    assert chunked == reference()


def test_batched_requests_equal_solo_runs():
    prompts = [PROMPT, "hello", "A much longer prompt " * 3]
    with make_engine(max_num_batched_tokens=16) as e:
        together = [c.token_ids for c in e.generate(prompts, GREEDY)]
    assert together == [reference(p) for p in prompts]


def test_prefix_cache_hit_gives_the_same_tokens_and_reports_cached_tokens():
    with make_engine() as e:
        cold = e.generate([PROMPT], GREEDY)[0]
        warm = e.generate([PROMPT], GREEDY)[0]
        other = e.generate([PROMPT[:20] + " and something else"], GREEDY)[0]
        stats = e.stats()
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens == 44  # 45 prompt tokens: 11 full blocks, all but the last token
    assert warm.token_ids == cold.token_ids == reference()
    assert other.num_cached_tokens == 20  # bos + 19 chars = 5 blocks agree
    assert other.token_ids == reference(PROMPT[:20] + " and something else")
    assert stats.num_prefix_hit_tokens == 64 and stats.num_prefix_hit_blocks == (16, 0, 0)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forced_preemption_continues_with_identical_tokens(mode):
    with make_engine(num_host_blocks=32) as e:
        obs = RecordingObserver()
        e.add_observer(obs)
        e.add_request("r", PROMPT, GREEDY)
        for _ in range(5):
            e.step()
        assert e.preempt("r", mode=mode) == mode
        assert e.stats().num_preempted == 1
        if mode == "swap":
            assert e.stats().num_blocks_used[1:] == (13, 0)  # 45 prompt + 4 decoded positions: 13 blocks
        run_until_done(e)
        assert e.stats().num_blocks_used == (0, 0, 0)
    kinds = [t.kind for t in obs.of_type(TierTransfer)]
    resumed = [ev.mode for ev in obs.of_type(RequestResumed)]
    assert tuple(ev.token_id for ev in obs.of_type(TokenEmitted)) == reference()
    assert resumed == [mode]
    assert ("swap_out" in kinds and "swap_in" in kinds) == (mode == "swap")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_block_pressure_keeps_every_request_exact(mode):
    prompts = [f"request number {i} says hello" for i in range(6)]
    sampling = SamplingParams(max_tokens=16, ignore_eos=True)
    with make_engine(num_device_blocks=24, num_host_blocks=48, preemption_mode=mode) as e:
        out = [c.token_ids for c in e.generate(prompts, sampling)]
        stats = e.stats()
    assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0
    assert (stats.num_preemptions_swap > 0) == (mode == "swap")
    assert out == [reference(p, sampling) for p in prompts]
    assert stats.num_blocks_used == (0, 0, 0)


def test_offloaded_prefix_blocks_are_loaded_from_the_host():
    obs = RecordingObserver()
    with make_engine(num_device_blocks=16, num_host_blocks=32, prefetch_waiting=False) as e:
        e.add_observer(obs)
        first = e.generate([PROMPT], GREEDY)[0]
        e.generate(["x" * 56], GREEDY)  # needs every device block: PROMPT's blocks are offloaded
        offloads = [t for t in obs.of_type(TierTransfer) if t.kind == "offload"]
        again = e.generate([PROMPT], GREEDY)[0]
    assert offloads and all((t.src_tier, t.dst_tier) == (0, 1) for t in offloads)
    loads = [t for t in obs.of_type(TierTransfer) if t.kind == "load"]
    assert loads and loads[0].request_id == again.request_id and loads[0].src_tier == 1
    assert loads[0].num_bytes == loads[0].num_blocks * e.runner.bytes_per_block
    lookup = [c for c in obs.of_type(CacheLookup) if c.request_id == again.request_id][0]
    assert lookup.hit_blocks_per_tier[1] > 0 and again.num_cached_tokens == lookup.num_hit_tokens > 0
    assert again.token_ids == first.token_ids == reference()


def test_waiting_request_prefix_is_prefetched_from_the_host():
    obs = RecordingObserver()
    with make_engine(num_device_blocks=16, num_host_blocks=32, max_num_seqs=1) as e:
        e.add_observer(obs)
        e.generate([PROMPT], GREEDY)
        e.generate(["x" * 56], GREEDY)
        e.add_request("busy", "y" * 20, SamplingParams(max_tokens=4, ignore_eos=True))
        e.step()  # "busy" runs; max_num_seqs=1 keeps the next one waiting
        e.add_request("again", PROMPT, GREEDY)
        run_until_done(e)
    prefetches = [t for t in obs.of_type(TierTransfer) if t.kind == "prefetch"]
    assert prefetches and prefetches[0].request_id == "again" and prefetches[0].dst_tier == 0
    lookup = [c for c in obs.of_type(CacheLookup) if c.request_id == "again"][0]
    assert lookup.hit_blocks_per_tier[0] > 0  # the prefetched blocks were device hits


def test_abort_frees_blocks_in_every_tier():
    with make_engine(num_host_blocks=32) as e:
        e.add_request("a", PROMPT, GREEDY)
        e.add_request("b", PROMPT + "!", GREEDY)
        e.step()
        e.preempt("a", mode="swap")
        assert e.stats().num_blocks_used[1] > 0
        assert e.abort("a") and e.abort("b")
        assert not e.abort("a") and not e.abort("never-seen")
        stats = e.stats()
    assert stats.num_blocks_used == (0, 0, 0)
    assert not e.has_unfinished() and stats.num_requests_aborted == 2


def test_stop_string_ends_the_text_before_it():
    text = make_engine().generate([PROMPT], GREEDY)[0].text
    stop = text[4:6]
    with make_engine() as e:
        out = e.generate([PROMPT], dataclasses.replace(GREEDY, stop=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:text.find(stop)]


def test_eos_stops_unless_ignored():
    first = reference()[0]
    config = dataclasses.replace(ModelConfig.preset("tiny"), eos_token_id=first)
    runner = ModelRunner(config, block_size=4, num_device_blocks=64, device="cpu")
    engine = Engine(EngineConfig(model="tiny", block_size=4, num_device_blocks=64), runner=runner)
    stopped = engine.generate([PROMPT], SamplingParams(max_tokens=12))[0]
    ignored = engine.generate([PROMPT], GREEDY)[0]
    assert (stopped.finish_reason, stopped.token_ids, stopped.text) == ("stop", (first,), "")
    assert ignored.token_ids == reference()


def test_context_window_ends_generation_with_length():
    with make_engine(max_model_len=50) as e:
        out = e.generate([PROMPT], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 50 - 45


def test_seeded_sampling_is_reproducible_through_preemption():
    sampling = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    with make_engine() as e:
        plain = e.generate([PROMPT], sampling)[0].token_ids
        e.add_request("r", PROMPT, sampling)
        tokens = [o.token_id for _ in range(4) for o in e.step()]
        e.preempt("r", mode="recompute")
        while e.has_unfinished():
            tokens += [o.token_id for o in e.step()]
    assert len(set(plain)) > 1  # really sampled, not argmax
    assert tuple(tokens) == plain


def test_tenants_and_classes_are_accepted_and_quota_limits_concurrency():
    tenants = (TenantConfig("default"), TenantConfig("acme", max_concurrency=1))
    with make_engine(tenants=tenants) as e:
        e.add_request("a1", "one", GREEDY, tenant="acme", slo_class="batch")
        e.add_request("a2", "two", GREEDY, tenant="acme")
        e.step()
        assert (e.stats().num_running, e.stats().num_waiting) == (1, 1)
        run_until_done(e)
        assert e.stats().num_requests_finished == 2


def engine_state(e: Engine):
    return (e.stats(), dict(e.scheduler.waiting), dict(e.scheduler.running), dict(e._detok), e._next_seq_no)


@pytest.mark.parametrize("args,kwargs,message", [
    (("r2", "", GREEDY), {}, "prompt is empty"),
    (("r2", [], GREEDY), {}, "prompt is empty"),
    (("r2", "x" * 300, GREEDY), {}, "context window is 256"),
    (("r2", [1, 2, 999], GREEDY), {}, "prompt token 999"),
    (("r2", "hi", {"max_tokens": 0}), {}, "max_tokens"),
    (("r2", "hi", {"max_tokens": 4, "best_of": 2}), {}, "unknown sampling option.*best_of"),
    (("r2", "hi", 42), {}, "sampling must be"),
    (("r1", "hi", GREEDY), {}, "duplicate request_id 'r1'"),
    (("", "hi", GREEDY), {}, "request_id"),
    (("r2", "hi", GREEDY), {"tenant": "nobody"}, "unknown tenant 'nobody'"),
    (("r2", "hi", GREEDY), {"slo_class": "gold"}, "unknown slo_class 'gold'"),
])
def test_bad_input_raises_and_leaves_the_engine_untouched(args, kwargs, message):
    with make_engine() as e:
        e.add_request("r1", "hello", GREEDY)
        e.step()
        before = engine_state(e)
        with pytest.raises(ValueError, match=message):
            e.add_request(*args, **kwargs)
        assert engine_state(e) == before


def test_generate_validates_every_prompt_before_queueing_any():
    with make_engine() as e:
        before = engine_state(e)
        with pytest.raises(ValueError, match="prompt is empty"):
            e.generate(["fine", ""], GREEDY)
        assert engine_state(e) == before and not e.has_unfinished()


def check_block_invariants(bm) -> None:
    """Every block is exactly one of: plain free, cached free, or in use with a ref count
    equal to the number of block tables (device) or swap lists (lower tiers) holding it."""
    holders = [dict() for _ in bm.pools]
    for table in bm._tables.values():
        for b in table:
            holders[0][b] = holders[0].get(b, 0) + 1
    for tier, ids in bm._swapped.values():
        for b in ids:
            holders[tier][b] = holders[tier].get(b, 0) + 1
    for pool, held in zip(bm.pools, holders):
        free, cached = set(pool.free_ids()), set(pool.evictable.order())
        assert len(free) == len(pool.free_ids()) and not free & cached
        for block in pool.blocks:
            assert block.ref_count == held.get(block.block_id, 0), (pool.tier, block)
            if block.ref_count == 0:
                assert (block.block_id in free) != (block.block_id in cached)
                assert (block.block_id in cached) == (block.block_hash is not None)
            else:
                assert block.block_id not in free and block.block_id not in cached


PREFIXES = ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [40, 41, 42, 43, 44, 45, 46, 47])
op_strategy = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 2), st.integers(1, 24), st.integers(1, 8)),
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 20)),
    st.tuples(st.just("preempt"), st.integers(0, 20), st.sampled_from(["swap", "recompute"])),
)


@pytest.fixture(scope="module")
def solo_tokens():
    """Greedy tokens of a request run alone with no prefix cache (memoized)."""
    engine, memo = make_engine(enable_prefix_caching=False), {}

    def run(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
        if (prompt, max_tokens) not in memo:
            sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            memo[prompt, max_tokens] = engine.generate([list(prompt)], sampling)[0].token_ids
        return memo[prompt, max_tokens]

    yield run
    engine.close()


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op_strategy, min_size=5, max_size=30))
def test_random_add_step_abort_preempt_ends_with_every_block_free(solo_tokens, ops):
    """Random interleavings over tiny tiers (12 device, 6 host, 4 disk blocks) exercise
    sharing, eviction, offload cascades, loads, prefetch, swap and recompute; blocks stay
    consistent after every operation, all are free at the end, and every request that
    was not aborted produced exactly its solo tokens."""
    e = make_engine(num_device_blocks=12, num_host_blocks=6, num_disk_blocks=4, max_num_batched_tokens=16,
                    max_num_seqs=4)
    added: dict[str, tuple[tuple[int, ...], int]] = {}
    tokens: dict[str, list[int]] = {}
    aborted: set[str] = set()
    for op in ops:
        if op[0] == "add":
            _, prefix, length, max_tokens = op
            prompt = tuple((([] if prefix == 2 else PREFIXES[prefix]) + [100 + len(added) % 7] * length)[:36])
            rid = f"r{len(added)}"
            e.add_request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            added[rid], tokens[rid] = (prompt, max_tokens), []
        elif op[0] == "step":
            for out in e.step():
                tokens[out.request_id].append(out.token_id)
        elif added:
            rid = list(added)[op[1] % len(added)]
            if op[0] == "abort" and e.abort(rid):
                aborted.add(rid)
            elif op[0] == "preempt" and rid in e.scheduler.running:
                e.preempt(rid, mode=op[2])
        check_block_invariants(e.block_manager)
    while e.has_unfinished():
        for out in e.step():
            tokens[out.request_id].append(out.token_id)
        check_block_invariants(e.block_manager)
    stats = e.stats()
    e.close()
    assert stats.num_blocks_used == (0, 0, 0)
    assert stats.num_waiting == stats.num_running == stats.num_preempted == 0
    for rid, (prompt, max_tokens) in added.items():
        if rid not in aborted:
            assert tuple(tokens[rid]) == solo_tokens(prompt, max_tokens), rid
