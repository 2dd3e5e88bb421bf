"""Block bookkeeping of one KV tier: ids, reference counts, hashes, free lists.

No tensors here: the data lives in the model runner's storage, and the block manager
turns the decisions made here into copy operations. Every operation is O(1):
plain free blocks sit on a stack, cached free blocks (ref count 0 but content and
hash still valid) in the eviction policy's structure, and hashes in a dict.
"""

from __future__ import annotations

from collections.abc import Callable

from reference_server.engine.cache_policies import EvictionPolicy, LRUEviction

__all__ = ["DEVICE", "DISK", "HOST", "TIER_NAMES", "Block", "BlockPool"]

DEVICE, HOST, DISK = 0, 1, 2
TIER_NAMES = ("device", "host", "disk")


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None  # prefix key when the block is full and cached

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hash={self.block_hash})"


class BlockPool:
    """The blocks of one tier. Engine thread only; internal misuse trips asserts."""

    def __init__(self, tier: int, num_blocks: int, *, eviction: Callable[[], EvictionPolicy] = LRUEviction) -> None:
        self.tier = tier
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack: block 0 handed out first
        self.evictable: EvictionPolicy = eviction()
        self._by_hash: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out (plain free plus cached free)."""
        return len(self._free) + len(self.evictable)

    @property
    def num_plain_free(self) -> int:
        """Free blocks holding nothing worth keeping."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    def lookup(self, block_hash: int) -> int | None:
        return self._by_hash.get(block_hash)

    def take(self) -> tuple[int, int | None]:
        """Hand out a block with ref count 1: a plain free one if any, else the eviction
        policy's victim, whose hash is dropped and returned (its data is still in place
        until overwritten, so the caller may copy it elsewhere first)."""
        if self._free:
            block_id = self._free.pop()
            evicted = None
        else:
            block_id = self.evictable.pop_victim()
            evicted = self.blocks[block_id].block_hash
            assert evicted is not None
            del self._by_hash[evicted]
            self.blocks[block_id].block_hash = None
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.ref_count = 1
        return block_id, evicted

    def take_plain(self) -> int:
        """Hand out a plain free block (the caller checked ``num_plain_free``)."""
        block_id = self._free.pop()
        self.blocks[block_id].ref_count = 1
        return block_id

    def acquire(self, block_id: int) -> None:
        """One more user of a cached block (prefix hit or pin)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.evictable.remove(block_id)
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        """One user fewer; at zero the block becomes cached free (if hashed) or free."""
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"double free of {block!r} in tier {self.tier}"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is not None:
                self.evictable.add(block_id)
            else:
                self._free.append(block_id)

    def register(self, block_id: int, block_hash: int) -> bool:
        """Key an in-use block by its prefix hash; False if another block has the key."""
        if block_hash in self._by_hash:
            return False
        block = self.blocks[block_id]
        assert block.ref_count > 0 and block.block_hash is None
        block.block_hash = block_hash
        self._by_hash[block_hash] = block_id
        return True

    def forget(self, block_id: int) -> bool:
        """Drop a cached free block's key, making it plain free; False (nothing changed)
        unless the block is cached and free."""
        block = self.blocks[block_id]
        if block.ref_count != 0 or block.block_hash is None:
            return False
        self.evictable.remove(block_id)
        del self._by_hash[block.block_hash]
        block.block_hash = None
        self._free.append(block_id)
        return True

    def free_ids(self) -> list[int]:
        """Plain free block ids, next handed out first (for tests)."""
        return self._free[::-1]
