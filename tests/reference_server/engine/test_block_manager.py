"""Block manager: exact block ids, ref counts, prefix sharing, LRU order, tiers.

Block size 4, a dozen blocks or fewer, as in vLLM's block manager tests."""

from __future__ import annotations

import pytest

from reference_server.engine.block_manager import BlockManager, CopyOp, _coalesce
from reference_server.engine.cache_policies import DropOnEvict, WatermarkAdmission
from reference_server.engine.hooks import Evicted


def computed(seq, n: int):
    """Pretend a step computed the sequence's first ``n`` tokens."""
    seq.num_computed_tokens = n
    return seq


def refs(bm: BlockManager, ids):
    return [bm.device.blocks[i].ref_count for i in ids]


def test_allocation_and_free_hand_out_exact_ids(make_seq):
    bm = BlockManager(block_size=4, num_device_blocks=12)
    a, b = make_seq("a", range(10)), make_seq("b", range(100, 105))
    assert bm.allocate_new(a, bm.match_prefix(a), 10).block_ids == (0, 1, 2)
    assert bm.allocate_new(b, bm.match_prefix(b), 5).block_ids == (3, 4)
    assert bm.device.num_free == 7
    assert bm.usage().num_used == (5, 0, 0)
    bm.free(a)
    assert bm.device.free_ids()[:4] == [0, 1, 2, 5]
    assert not bm.holds("a") and bm.holds("b")
    assert bm.usage().num_used == (2, 0, 0)


def test_allocate_slots_grows_table_and_fails_without_side_effects(make_seq):
    bm = BlockManager(block_size=4, num_device_blocks=3)
    a = make_seq("a", range(8))
    bm.allocate_new(a, bm.match_prefix(a), 8)
    computed(a, 8)
    a.token_ids.append(9)
    assert bm.allocate_slots(a, 1)
    assert bm.block_table("a") == (0, 1, 2)
    a.token_ids.extend(range(4))
    computed(a, 12)
    assert not bm.allocate_slots(a, 1)  # would need a 4th block
    assert bm.block_table("a") == (0, 1, 2)
    assert bm.device.num_free == 0


def test_prefix_blocks_are_shared_with_ref_counts(make_seq):
    bm = BlockManager(block_size=4, num_device_blocks=12)
    a = make_seq("a", range(10))
    bm.allocate_new(a, bm.match_prefix(a), 10)
    bm.commit(computed(a, 10))  # blocks 0 and 1 are full: keyed
    assert bm.usage().num_cached == (2, 0, 0)
    b = make_seq("b", [*range(8), 50, 51, 52])
    match = bm.match_prefix(b)
    assert match.hits == ((0, 0), (0, 1)) and match.num_tokens == 8
    assert bm.allocate_new(b, match, 3).block_ids == (0, 1, 3)
    assert b.num_computed_tokens == 8
    assert refs(bm, [0, 1, 2, 3]) == [2, 2, 1, 1]
    assert (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens) == (21, 8)


def test_prefix_match_leaves_the_last_token_to_compute(make_seq):
    bm = BlockManager(block_size=4, num_device_blocks=12)
    a = make_seq("a", range(9))
    bm.allocate_new(a, bm.match_prefix(a), 9)
    bm.commit(computed(a, 9))
    assert bm.match_prefix(make_seq("c", range(8))).hits == ((0, 0),)  # 2 full blocks, 1 usable
    assert bm.match_prefix(make_seq("d", [*range(4), 99, 5, 6, 7, 8])).hits == ((0, 0),)  # diverges in block 1


def test_prefix_caching_disabled_never_matches(make_seq):
    bm = BlockManager(block_size=4, num_device_blocks=12, enable_prefix_caching=False)
    a = make_seq("a", range(9))
    bm.allocate_new(a, bm.match_prefix(a), 9)
    bm.commit(computed(a, 9))
    assert bm.match_prefix(make_seq("b", range(9))).hits == ()
    assert bm.usage().num_cached == (0, 0, 0)


def test_lru_evicts_tail_blocks_first(make_seq):
    bm = BlockManager(block_size=4, num_device_blocks=12)
    a = make_seq("a", range(10))
    bm.allocate_new(a, bm.match_prefix(a), 10)
    bm.commit(computed(a, 10))
    b = make_seq("b", [*range(8), 50, 51, 52])
    bm.allocate_new(b, bm.match_prefix(b), 3)
    bm.free(b)
    bm.free(a)
    assert bm.device.evictable.order() == [1, 0]  # tail of a first, shared head last
    assert bm.device.num_free == 12
    d = make_seq("d", range(200, 248))
    table = bm.allocate_new(d, bm.match_prefix(d), 48).block_ids
    assert table == (2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 0)
    assert bm.take_evictions(step=3, ns=7) == (Evicted(3, 0, 2, None, 7),)
    assert bm.take_ops() == ()  # no lower tier: evicted blocks are dropped
    assert bm.match_prefix(make_seq("e", range(10))).hits == ()


def test_a_prefix_hit_takes_a_cached_free_block_out_of_the_lru(make_seq):
    bm = BlockManager(block_size=4, num_device_blocks=4)
    a = make_seq("a", range(9))
    bm.allocate_new(a, bm.match_prefix(a), 9)
    bm.commit(computed(a, 9))
    bm.free(a)
    b = make_seq("b", range(9))
    assert bm.allocate_new(b, bm.match_prefix(b), 1).block_ids == (0, 1, 2)
    assert len(bm.device.evictable) == 0 and refs(bm, [0, 1, 2]) == [1, 1, 1]


def offloaded_setup(make_seq, *, offload=None):
    """a's two full blocks get evicted by b and (by default) offloaded to the host."""
    bm = BlockManager(block_size=4, num_device_blocks=4, num_host_blocks=4, offload=offload)
    a = make_seq("a", range(9))
    bm.allocate_new(a, bm.match_prefix(a), 9)
    bm.commit(computed(a, 9))
    bm.free(a)
    b = make_seq("b", range(100, 116))
    assert bm.allocate_new(b, bm.match_prefix(b), 16).block_ids == (2, 3, 1, 0)
    return bm, b


def test_eviction_offloads_prefix_blocks_to_the_host_keeping_their_hash(make_seq):
    bm, b = offloaded_setup(make_seq)
    assert bm.take_ops() == (CopyOp("offload", None, 0, (1, 0), 1, (0, 1)),)
    assert bm.take_evictions(step=3, ns=7) == (Evicted(3, 0, 2, 1, 7),)
    assert bm.usage().num_cached == (0, 2, 0)
    bm.free(b)
    c = make_seq("c", range(9))
    match = bm.match_prefix(c)
    assert match.hits == ((1, 1), (1, 0)) and match.num_blocks_per_tier == (0, 2, 0)
    assert bm.allocate_new(c, match, 1).block_ids == (2, 3, 1)
    assert bm.take_ops() == (CopyOp("load", "c", 1, (1, 0), 0, (2, 3)),)
    assert c.num_computed_tokens == 8
    assert bm.match_prefix(make_seq("d", range(9))).hits == ((0, 2), (0, 3))  # now on device
    assert bm.num_hit_blocks == [0, 2, 0]


def test_a_lookup_counts_the_blocks_after_its_hit_that_the_cache_held_and_evicted(make_seq):
    bm = BlockManager(block_size=4, num_device_blocks=4)
    a = make_seq("a", range(9))  # two full blocks, keyed and cached once a is freed
    bm.allocate_new(a, bm.match_prefix(a), 9)
    bm.commit(computed(a, 9))
    bm.free(a)
    assert bm.match_prefix(make_seq("x", range(9))).num_evicted_blocks == 0  # still cached: a hit
    b = make_seq("b", range(100, 116))
    bm.allocate_new(b, bm.match_prefix(b), 16)  # takes all four blocks: a's two cached ones are evicted
    bm.free(b)
    again = bm.match_prefix(make_seq("c", [*range(9), 7, 7, 7]))
    assert again.hits == () and again.num_evicted_blocks == 2 and again.num_evicted_tokens == 8
    assert bm.match_prefix(make_seq("d", [*range(4), 9, 9, 9, 9, 9])).num_evicted_blocks == 1  # a's head only
    assert bm.match_prefix(make_seq("e", range(50, 59))).num_evicted_blocks == 0  # never seen


def test_a_prefix_offloaded_on_eviction_is_a_hit_not_an_evicted_prefix(make_seq):
    bm, b = offloaded_setup(make_seq)
    bm.free(b)
    match = bm.match_prefix(make_seq("c", range(9)))
    assert match.num_blocks_per_tier == (0, 2, 0) and match.num_evicted_blocks == 0


def test_drop_on_evict_forgets_the_prefix(make_seq):
    bm, _ = offloaded_setup(make_seq, offload=DropOnEvict())
    assert bm.take_ops() == ()
    assert bm.take_evictions(step=3, ns=7) == (Evicted(3, 0, 2, None, 7),)
    assert bm.match_prefix(make_seq("c", range(9))).hits == ()


def test_offload_cascades_host_evictions_to_disk_in_order(make_seq):
    bm = BlockManager(block_size=4, num_device_blocks=2, num_host_blocks=1, num_disk_blocks=2)
    a = make_seq("a", range(9))
    bm.allocate_new(a, bm.match_prefix(a), 8)
    bm.commit(computed(a, 8))  # device 0, 1 keyed
    bm.free(a)  # LRU: 1, 0
    b = make_seq("b", range(100, 108))
    bm.allocate_new(b, bm.match_prefix(b), 8)
    # evict 1 -> host 0; evict 0 -> host is full: host 0 goes to disk 0 first, then 0 -> host 0
    assert bm.take_ops() == (
        CopyOp("offload", None, 0, (1,), 1, (0,)),
        CopyOp("offload", None, 1, (0,), 2, (0,)),
        CopyOp("offload", None, 0, (0,), 1, (0,)),
    )
    bm.free(b)
    assert bm.match_prefix(make_seq("c", range(9))).hits == ((1, 0), (2, 0))


def test_swap_out_and_in_move_a_request_between_tiers(make_seq):
    bm = BlockManager(block_size=4, num_device_blocks=6, num_host_blocks=4)
    a, b = make_seq("a", range(6)), make_seq("b", range(50, 56))
    bm.allocate_new(a, bm.match_prefix(a), 6)
    bm.allocate_new(b, bm.match_prefix(b), 6)
    computed(a, 6)
    assert bm.swap_out(a)
    assert bm.take_ops() == (CopyOp("swap_out", "a", 0, (0, 1), 1, (0, 1)),)
    assert bm.swapped_blocks("a") == (1, (0, 1)) and bm.holds("a")
    assert bm.usage().num_used == (2, 2, 0)
    c = make_seq("c", range(70, 78))
    assert bm.allocate_new(c, bm.match_prefix(c), 8).block_ids == (0, 1)
    assert bm.swap_in(a)
    assert bm.take_ops() == (CopyOp("swap_in", "a", 1, (0, 1), 0, (4, 5)),)
    assert bm.block_table("a") == (4, 5) and bm.swapped_blocks("a") is None
    assert bm.usage().num_used == (6, 0, 0)
    assert a.num_computed_tokens == 6  # swap keeps progress


def test_swap_out_without_room_changes_nothing(make_seq):
    bm = BlockManager(block_size=4, num_device_blocks=6, num_host_blocks=1)
    a = make_seq("a", range(6))
    bm.allocate_new(a, bm.match_prefix(a), 6)
    assert not bm.swap_out(a)
    assert bm.block_table("a") == (0, 1) and bm.take_ops() == ()
    assert not BlockManager(block_size=4, num_device_blocks=6).can_swap_out(a)  # no lower tier at all


def test_free_releases_blocks_in_every_tier(make_seq):
    bm = BlockManager(block_size=4, num_device_blocks=6, num_host_blocks=4, num_disk_blocks=4)
    a, b = make_seq("a", range(6)), make_seq("b", range(6, 12))
    bm.allocate_new(a, bm.match_prefix(a), 6)
    bm.allocate_new(b, bm.match_prefix(b), 6)
    bm.swap_out(a)
    bm.free(a)
    bm.free(b)
    assert bm.usage().num_used == (0, 0, 0)
    assert [p.num_free for p in bm.pools] == [6, 4, 4]
    assert not bm.holds("a") and not bm.holds("b")


def test_prefetch_brings_a_lower_tier_prefix_into_free_device_blocks(make_seq):
    bm, b = offloaded_setup(make_seq)
    bm.take_ops()
    bm.free(b)
    c = make_seq("c", range(9))
    assert bm.prefetch(c, max_blocks=1) == 1
    assert bm.take_ops() == (CopyOp("prefetch", "c", 1, (1,), 0, (2,)),)
    assert bm.match_prefix(c).hits == ((0, 2), (1, 0))
    assert bm.device.evictable.order() == [2]  # cached free, reusable if needed


def test_watermark_keeps_blocks_back_from_admission(make_seq):
    bm = BlockManager(block_size=4, num_device_blocks=4, admission=WatermarkAdmission(1))
    a = make_seq("a", range(16))
    assert bm.allocate_new(a, bm.match_prefix(a), 16) is None
    assert bm.device.num_free == 4 and not bm.holds("a")
    assert bm.allocate_new(a, bm.match_prefix(a), 12).block_ids == (0, 1, 2)


def test_coalesce_merges_adjacent_copies_but_never_writes_a_block_twice():
    ops = [CopyOp("offload", None, 0, (1,), 1, (0,)), CopyOp("offload", None, 0, (2,), 1, (1,)),
           CopyOp("offload", None, 0, (3,), 1, (0,)), CopyOp("load", "x", 1, (0,), 0, (3,))]
    assert _coalesce(ops) == (
        CopyOp("offload", None, 0, (1, 2), 1, (0, 1)), CopyOp("offload", None, 0, (3,), 1, (0,)),
        CopyOp("load", "x", 1, (0,), 0, (3,)),
    )


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="num_device_blocks"):
        BlockManager(block_size=4, num_device_blocks=0)
