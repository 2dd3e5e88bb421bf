"""Session KV retention on a tiny block manager (block size 4, 12 device blocks): exact pins, releases,
drops, offloads and carries, and the events that report them."""

from __future__ import annotations

import pytest

from reference_server.engine.block_manager import BlockManager
from reference_server.engine.config import EngineConfig
from reference_server.engine.retention import SessionRetention
from reference_server.engine.tiers import DEVICE, HOST
from reference_server.launcher import build_engine_config, parse_args

S = 1_000_000_000  # ns per second


def _finished_turn(bm: BlockManager, ret: SessionRetention, make_seq, request_id: str, tokens: list[int],
                   session: str):
    """A request admitted here that computed all of ``tokens`` (its full blocks keyed), ready to finish."""
    seq = make_seq(request_id, tokens)
    seq.session = session
    match = bm.match_prefix(seq)
    bm.allocate_new(seq, match, len(tokens) - match.num_tokens)
    ret.admitted(seq, match, 0)
    seq.num_computed_tokens = len(tokens)
    bm.commit(seq)
    return seq


@pytest.fixture()
def bm() -> BlockManager:
    return BlockManager(block_size=4, num_device_blocks=12, num_host_blocks=4)


def test_keep_pins_until_the_ttl_then_releases_with_a_retain_interval(bm, make_seq):
    ret = SessionRetention(bm, "keep", ttl_s=1.0)
    seq = _finished_turn(bm, ret, make_seq, "a0", list(range(10)), "s")  # 2 full blocks + 2 tokens
    ret.end_turn(seq, bm.free, 5)
    assert ret.num_pinned_blocks == 2 and bm.device.num_free == 10  # the partial third block is plain free
    ret.expire(5 + S // 2)
    assert ret.num_pinned_blocks == 2 and ret.take_events() == []
    ret.expire(5 + 2 * S)
    assert ret.num_pinned_blocks == 0 and bm.device.num_free == 12 and bm.device.num_cached == 2
    (event,) = ret.take_events()
    assert (event.kind, event.session, event.request_id, event.num_blocks, event.num_tokens, event.start_ns,
            event.end_ns) == ("retain", "s", "a0", 2, 8, 5, 5 + S)


def test_the_capacity_bound_releases_the_oldest_session_first(bm, make_seq):
    ret = SessionRetention(bm, "keep", max_pinned_blocks=3)
    ret.end_turn(_finished_turn(bm, ret, make_seq, "a0", list(range(8)), "s1"), bm.free, 10)
    ret.end_turn(_finished_turn(bm, ret, make_seq, "b0", list(range(100, 108)), "s2"), bm.free, 20)
    assert ret.num_pinned_blocks == 2
    (event,) = ret.take_events()
    assert (event.session, event.start_ns, event.end_ns) == ("s1", 10, 20)


def test_the_next_turn_reports_what_it_carried_and_ends_the_pin(bm, make_seq):
    ret = SessionRetention(bm, "keep")
    first = _finished_turn(bm, ret, make_seq, "a0", list(range(10)), "s")
    ret.end_turn(first, bm.free, 1)
    nxt = make_seq("a1", list(range(10)) + [50, 51, 52, 53, 54, 55, 56])  # 17 tokens: at most 4 blocks match
    nxt.session = "s"
    match = bm.match_prefix(nxt)
    assert match.num_blocks_per_tier == (2, 0, 0)
    bm.allocate_new(nxt, match, nxt.num_tokens - match.num_tokens)
    ret.admitted(nxt, match, 7)
    carry, retain = ret.take_events()
    assert (carry.kind, carry.request_id, carry.num_blocks, carry.num_tokens) == ("carry", "a1", 2, 8)
    assert (retain.kind, retain.end_ns) == ("retain", 7)
    assert ret.num_pinned_blocks == 0 and bm.device.blocks[bm.block_table("a1")[0]].ref_count == 1


@pytest.mark.parametrize(("policy", "host_cached", "ops"), [
    ("drop", 0, []),
    ("offload", 2, [("offload", DEVICE, HOST, 2)]),
])
def test_drop_and_offload_empty_the_device_tier_at_the_turn_end(bm, make_seq, policy, host_cached, ops):
    ret = SessionRetention(bm, policy)
    ret.end_turn(_finished_turn(bm, ret, make_seq, "a0", list(range(10)), "s"), bm.free, 3)
    assert bm.device.num_cached == 0 and bm.device.num_plain_free == 12
    assert bm.pools[HOST].num_cached == host_cached
    assert [(op.kind, op.src_tier, op.dst_tier, op.num_blocks) for op in bm.take_ops()] == ops
    (event,) = ret.take_events()
    assert (event.kind, event.num_blocks, event.start_ns) == ("drop", 2, 3)


def test_lru_leaves_blocks_cached_and_requests_without_a_session_untouched(bm, make_seq):
    ret = SessionRetention(bm, "lru")
    ret.end_turn(_finished_turn(bm, ret, make_seq, "a0", list(range(10)), "s"), bm.free, 3)
    keep = SessionRetention(bm, "keep")
    keep.end_turn(_finished_turn(bm, keep, make_seq, "x", list(range(200, 208)), ""), bm.free, 4)
    assert bm.device.num_cached == 4 and keep.num_pinned_blocks == 0
    assert ret.take_events() == [] and keep.take_events() == []


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"policy": "forever"}, "unknown KV retention policy 'forever'"),
    ({"policy": "keep", "ttl_s": 0}, "TTL must be positive"),
])
def test_bad_settings_are_refused(bm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        SessionRetention(bm, **kwargs)


def test_a_turn_prefilled_elsewhere_is_freed_as_usual(bm, make_seq):
    """A decode worker's turn (its KV transferred in, never admitted through this prefix cache) is not pinned:
    the session's next turn is prefilled where this one was."""
    ret = SessionRetention(bm, "keep")
    seq = make_seq("d0", list(range(10)))
    seq.session = "s"
    bm.allocate_new(seq, bm.match_prefix(seq), 10)
    seq.num_computed_tokens = 10
    bm.commit(seq)
    ret.end_turn(seq, bm.free, 1)
    assert ret.num_pinned_blocks == 0 and bm.device.num_free == 12 and ret.take_events() == []


def test_offload_without_a_lower_tier_leaves_the_blocks_cached(make_seq):
    bm = BlockManager(block_size=4, num_device_blocks=12)
    ret = SessionRetention(bm, "offload")
    ret.end_turn(_finished_turn(bm, ret, make_seq, "a0", list(range(10)), "s"), bm.free, 3)
    assert bm.device.num_cached == 2 and bm.take_ops() == () and ret.take_events() == []


def test_pins_yield_to_a_request_that_needs_blocks(bm, make_seq):
    """12 device blocks, 4 pinned by two sessions: a new 40-token request (10 blocks) is admitted after the
    scheduler releases the oldest pin, not refused."""
    ret = SessionRetention(bm, "keep")
    ret.end_turn(_finished_turn(bm, ret, make_seq, "a0", list(range(8)), "s1"), bm.free, 1)
    ret.end_turn(_finished_turn(bm, ret, make_seq, "b0", list(range(100, 108)), "s2"), bm.free, 2)
    assert ret.num_pinned_blocks == 4 and bm.device.num_free == 8
    big = make_seq("c0", list(range(200, 240)))
    match = bm.match_prefix(big)
    assert bm.allocate_new(big, match, 40) is None
    assert ret.may_release_oldest(9) and ret.num_pinned_blocks == 2
    assert bm.allocate_new(big, match, 40) is not None  # s1's two blocks were reused (evicted)
    (event,) = ret.take_events()
    assert (event.session, event.end_ns) == ("s1", 9)
    assert ret.may_release_oldest(10) and not ret.may_release_oldest(11)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kv_retention": "always"}, "kv_retention must be one of"),
    ({"kv_retention_ttl_s": -1.0}, "kv_retention_ttl_s must be positive"),
    ({"kv_retention_max_blocks": -2}, "kv_retention_max_blocks must be >= 0"),
])
def test_the_engine_config_refuses_bad_retention_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_the_launcher_passes_the_retention_settings():
    args = parse_args(["--kv-retention", "keep", "--kv-retention-ttl", "2.5", "--kv-retention-max-blocks", "40"])
    config = build_engine_config(args)
    assert (config.kv_retention, config.kv_retention_ttl_s, config.kv_retention_max_blocks) == ("keep", 2.5, 40)
