from __future__ import annotations

from reference_server.engine.tiers import BlockPool


def test_take_hands_out_plain_free_blocks_lowest_first_then_lru_victims():
    pool = BlockPool(0, 3)
    assert [pool.take() for _ in range(3)] == [(0, None), (1, None), (2, None)]
    assert pool.register(1, 111) and pool.register(2, 222)
    assert not pool.register(0, 111)  # key already held by block 1
    pool.release(2)
    pool.release(1)
    pool.release(0)
    assert pool.free_ids() == [0] and pool.evictable.order() == [2, 1]
    assert pool.num_free == 3 and pool.num_cached == 2
    assert pool.take() == (0, None)
    assert pool.take() == (2, 222)  # evicts the least recently freed keyed block
    assert pool.lookup(222) is None and pool.lookup(111) == 1


def test_acquire_revives_a_cached_free_block():
    pool = BlockPool(1, 2)
    block_id, _ = pool.take()
    pool.register(block_id, 7)
    pool.release(block_id)
    pool.acquire(block_id)
    pool.acquire(block_id)
    assert pool.blocks[block_id].ref_count == 2 and len(pool.evictable) == 0 and pool.num_used == 1
