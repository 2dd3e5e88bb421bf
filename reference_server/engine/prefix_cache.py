"""Prefix-cache keys: chained block hashes, and the result of a prefix lookup.

Block ``i`` of a sequence is keyed by ``hash((key(i - 1), tokens of block i))``, so a
key names a whole prefix, not just one block's tokens: two requests share block ``i``
only if they agree on every token up to its end. Only full blocks get a key.
Python's ``hash`` of a tuple of ints is deterministic (no hash randomisation for ints),
so keys are stable across processes; a 64-bit collision is possible in principle and
accepted here, as in vLLM's default (non-sha256) mode.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

__all__ = ["ROOT_HASH", "PrefixMatch", "extend_block_hashes"]

ROOT_HASH = 0x7E57_AB1E  # parent key of block 0


def extend_block_hashes(hashes: list[int], token_ids: Seq[int], block_size: int) -> list[int]:
    """Append keys for the full blocks of ``token_ids`` not yet in ``hashes`` (in place).

    ``token_ids`` must only ever grow between calls (it does: prompt, then outputs).
    Returns ``hashes`` for convenience.
    """
    num_full = len(token_ids) // block_size
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(len(hashes), num_full):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        hashes.append(parent)
    return hashes


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Result of a prefix lookup: where each leading full block of the prompt was found.

    ``hits[i]`` is ``(tier, block_id)`` for block ``i`` (tier 0 device, 1 host, 2 disk);
    the match stops at the first block found in no tier. ``num_evicted_blocks``: the
    leading blocks right after the hits that the cache held once (an earlier request
    computed them) and has since evicted from every tier: the request computes them again.
    """

    hits: tuple[tuple[int, int], ...]
    block_size: int
    num_evicted_blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.hits) * self.block_size

    @property
    def num_evicted_tokens(self) -> int:
        return self.num_evicted_blocks * self.block_size

    @property
    def num_blocks_per_tier(self) -> tuple[int, int, int]:
        counts = [0, 0, 0]
        for tier, _ in self.hits:
            counts[tier] += 1
        return counts[0], counts[1], counts[2]

    @property
    def num_lower_tier_blocks(self) -> int:
        return sum(1 for tier, _ in self.hits if tier != 0)

