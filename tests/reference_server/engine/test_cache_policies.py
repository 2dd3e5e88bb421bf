"""KV cache policies: LRU order, offload targets, watermark admission, prefetch limits."""

from __future__ import annotations

import pytest

from reference_server.engine.cache_policies import (
    DropOnEvict,
    LRUEviction,
    OffloadOnEvict,
    PrefetchWaitingPrefixes,
    WatermarkAdmission,
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
