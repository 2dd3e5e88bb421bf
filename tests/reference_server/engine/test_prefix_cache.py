from __future__ import annotations

from reference_server.engine.prefix_cache import PrefixMatch, extend_block_hashes


def test_chained_hashes_name_whole_prefixes():
    a = extend_block_hashes([], list(range(12)), 4)
    b = extend_block_hashes([], [*range(8), 99, 9, 10, 11], 4)
    c = extend_block_hashes([], [99, *range(1, 12)], 4)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert a[1] != c[1] and a[2] != c[2]  # same tokens in blocks 1, 2 but a different prefix


def test_extension_is_incremental_and_ignores_partial_blocks():
    tokens = list(range(10))
    hashes = extend_block_hashes([], tokens, 4)
    assert len(hashes) == 2
    tokens += [10, 11, 12]
    assert extend_block_hashes(hashes, tokens, 4) == extend_block_hashes([], tokens, 4)
    assert len(hashes) == 3


def test_prefix_match_counts():
    match = PrefixMatch(((0, 3), (0, 5), (1, 2), (2, 0)), block_size=4)
    assert match.num_tokens == 16
    assert match.num_blocks_per_tier == (2, 1, 1)
    assert match.num_lower_tier_blocks == 2
