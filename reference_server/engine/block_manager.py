"""The KV block manager: block tables, prefix sharing, eviction, tiers, copy plans.

It decides; it does not move data. Every decision that needs bytes moved between tiers
is appended, in order, to a list of :class:`CopyOp` that the engine drains after
scheduling and executes (``ModelRunner.copy_blocks``) before the forward pass. Executed
in order, the copies leave the tensors exactly as this bookkeeping describes them.

Tiers: 0 device (the cache the model reads), 1 host memory, 2 disk. The device tier
holds running requests' blocks, shared by reference count when their prefixes agree
(full blocks only, keyed by chained hashes). A freed block whose content is a known
prefix stays cached until the eviction policy reuses it; the offload policy may first
copy it one tier down (keeping its key) so a later request loads it instead of
recomputing. Lower tiers also hold swapped-out requests. Engine thread only.

The keys of blocks evicted from every tier are remembered (the most recent
``EVICTED_KEYS_PER_BLOCK`` x the tiers' blocks), so a lookup can tell a prefix the
cache once held and lost from one it never saw (``PrefixMatch.num_evicted_blocks``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from reference_server.engine.cache_policies import LRUEviction, OffloadOnEvict, WatermarkAdmission
from reference_server.engine.hooks import Evicted
from reference_server.engine.prefix_cache import PrefixMatch, extend_block_hashes
from reference_server.engine.tiers import DEVICE, DISK, HOST, BlockPool

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from reference_server.engine.cache_policies import DropOnEvict, EvictionPolicy
    from reference_server.engine.sequence import Sequence

__all__ = ["BlockManager", "BlockUsage", "CopyOp", "KVBlocks"]

TRANSFER_KINDS = ("load", "swap_out", "swap_in", "offload", "prefetch")
EVICTED_KEYS_PER_BLOCK = 8  # evicted keys remembered: 8x the blocks of all tiers (a key is 8 bytes)


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy whole blocks ``src_ids[i]`` of ``src_tier`` to ``dst_ids[i]`` of ``dst_tier``.

    ``kind`` is one of load / swap_out / swap_in / offload / prefetch; ``request_id``
    is ``None`` for offloads (they belong to no request).
    """

    kind: str
    request_id: str | None
    src_tier: int
    src_ids: tuple[int, ...]
    dst_tier: int
    dst_ids: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.src_ids)


@dataclass(frozen=True, slots=True)
class KVBlocks:
    """A request's device block table (block ``i`` holds positions ``[i*bs, (i+1)*bs)``)."""

    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlockUsage:
    """Per tier (device, host, disk): blocks in use by requests, blocks holding a cached
    prefix (in use or not), and blocks in total."""

    num_used: tuple[int, int, int]
    num_cached: tuple[int, int, int]
    num_total: tuple[int, int, int]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Block tables of all requests, over a device tier and optional host/disk tiers."""

    def __init__(
        self,
        *,
        block_size: int,
        num_device_blocks: int,
        num_host_blocks: int = 0,
        num_disk_blocks: int = 0,
        enable_prefix_caching: bool = True,
        eviction: Callable[[], EvictionPolicy] = LRUEviction,
        offload: OffloadOnEvict | DropOnEvict | None = None,
        admission: WatermarkAdmission | None = None,
    ) -> None:
        if block_size < 1 or num_device_blocks < 1 or num_host_blocks < 0 or num_disk_blocks < 0:
            raise ValueError("block_size and num_device_blocks must be >= 1, lower tiers >= 0")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        sizes = (num_device_blocks, num_host_blocks, num_disk_blocks)
        self.pools = tuple(BlockPool(tier, n, eviction=eviction) for tier, n in enumerate(sizes))
        self._sizes = sizes
        self.offload = offload if offload is not None else OffloadOnEvict()
        self.admission = admission if admission is not None else WatermarkAdmission(0)
        self._tables: dict[str, list[int]] = {}  # request id -> device block ids
        self._num_committed: dict[str, int] = {}  # request id -> leading blocks already keyed
        self._swapped: dict[str, tuple[int, list[int]]] = {}  # request id -> (tier, block ids)
        self._ops: list[CopyOp] = []
        self._evictions: list[tuple[int, int | None]] = []  # (tier, dst_tier) per reused cached block
        self._evicted_keys: OrderedDict[int, None] = OrderedDict()  # keys evicted from every tier, oldest first
        self._max_evicted_keys = EVICTED_KEYS_PER_BLOCK * sum(sizes)
        # Counters (monotonic, never reset): tokens looked up / found in the prefix cache,
        # hit blocks per tier, blocks moved per transfer kind.
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_hit_blocks = [0, 0, 0]
        self.num_transferred_blocks = dict.fromkeys(TRANSFER_KINDS, 0)
        self.num_evicted_blocks = [0, 0, 0]

    # ------------------------------------------------------------------ queries

    @property
    def device(self) -> BlockPool:
        return self.pools[DEVICE]

    @property
    def swap_tier(self) -> int | None:
        """Where swapped-out requests go: host if it has blocks, else disk, else nowhere."""
        if self._sizes[HOST] > 0:
            return HOST
        return DISK if self._sizes[DISK] > 0 else None

    def block_table(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._tables[request_id])

    def swapped_blocks(self, request_id: str) -> tuple[int, tuple[int, ...]] | None:
        """(tier, block ids) of a swapped-out request, else ``None``."""
        entry = self._swapped.get(request_id)
        return None if entry is None else (entry[0], tuple(entry[1]))

    def holds(self, request_id: str) -> bool:
        """Whether the request holds blocks in any tier."""
        return request_id in self._tables or request_id in self._swapped

    def usage(self) -> BlockUsage:
        p = self.pools
        return BlockUsage(
            num_used=(p[0].num_used, p[1].num_used, p[2].num_used),
            num_cached=(p[0].num_cached, p[1].num_cached, p[2].num_cached),
            num_total=self._sizes,
        )

    def take_ops(self) -> tuple[CopyOp, ...]:
        """The copies planned since the last call, in execution order, coalesced."""
        ops, self._ops = self._ops, []
        return _coalesce(ops)

    def take_evictions(self, *, step: int, ns: int) -> tuple[Evicted, ...]:
        """The cached blocks reused since the last call, as hook events stamped with
        ``step`` and ``ns`` (engine monotonic clock); consecutive reuses of one tier
        with the same destination are merged into one event."""
        evictions, self._evictions = self._evictions, []
        merged: list[Evicted] = []
        for tier, dst_tier in evictions:
            last = merged[-1] if merged else None
            if last is not None and (last.tier, last.dst_tier) == (tier, dst_tier):
                merged[-1] = Evicted(step, tier, last.num_blocks + 1, dst_tier, ns)
            else:
                merged.append(Evicted(step, tier, 1, dst_tier, ns))
        return tuple(merged)

    # ------------------------------------------------------------------ prefix cache

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """Leading full blocks of ``seq`` found in any tier (device preferred), and how many
        blocks right after them the cache held once and evicted. At least one token is always
        left to compute, since its logits give the next token. No side effects besides
        extending ``seq.block_hashes``."""
        if not self.enable_prefix_caching:
            return PrefixMatch((), self.block_size)
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[tuple[int, int]] = []
        for block_hash in seq.block_hashes[:max_blocks]:
            for pool in self.pools:
                block_id = pool.lookup(block_hash)
                if block_id is not None:
                    hits.append((pool.tier, block_id))
                    break
            else:
                break
        num_evicted = 0
        for block_hash in seq.block_hashes[len(hits):max_blocks]:
            if block_hash not in self._evicted_keys:
                break  # chained keys: a block never seen ends the prefix the cache could have held
            num_evicted += 1
        return PrefixMatch(tuple(hits), self.block_size, num_evicted)

    def commit(self, seq: Sequence) -> None:
        """Key the blocks that became full of computed tokens, so later requests share them."""
        if not self.enable_prefix_caching:
            return
        rid = seq.request_id
        num_full = seq.num_computed_tokens // self.block_size
        done = self._num_committed.get(rid, 0)
        if num_full <= done:
            return
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size)
        table, device = self._tables[rid], self.pools[DEVICE]
        for i in range(done, num_full):
            if device.blocks[table[i]].block_hash is None:
                device.register(table[i], seq.block_hashes[i])
        self._num_committed[rid] = num_full

    # ------------------------------------------------------------------ allocation

    def allocate_new(self, seq: Sequence, match: PrefixMatch, num_new_tokens: int) -> KVBlocks | None:
        """Admit a request with no device blocks: share its device hits, load its
        lower-tier hits, and allocate blocks for ``num_new_tokens`` more tokens. Returns
        ``None`` (and changes nothing) if the admission policy says there is no room.
        On success ``seq.num_computed_tokens`` becomes ``match.num_tokens``."""
        rid, device = seq.request_id, self.pools[DEVICE]
        hits = match.hits
        num_hit_cached_free = sum(1 for t, b in hits if t == DEVICE and device.blocks[b].ref_count == 0)
        num_total = _cdiv(match.num_tokens + num_new_tokens, self.block_size)
        num_needed = match.num_lower_tier_blocks + num_total - len(hits)
        if not self.admission.can_admit(num_needed, device.num_free - num_hit_cached_free):
            return None
        for tier, block_id in hits:  # pin first, so allocations below cannot evict them
            self.pools[tier].acquire(block_id)
        table: list[int] = []
        for i, (tier, block_id) in enumerate(hits):
            if tier == DEVICE:
                table.append(block_id)
                continue
            dst = self._take_block(DEVICE)
            self._ops.append(CopyOp("load", rid, tier, (block_id,), DEVICE, (dst,)))
            self.num_transferred_blocks["load"] += 1
            device.register(dst, seq.block_hashes[i])
            self.pools[tier].release(block_id)
            table.append(dst)
        table.extend(self._take_block(DEVICE) for _ in range(num_total - len(hits)))
        self._tables[rid] = table
        self._num_committed[rid] = len(hits)
        seq.num_computed_tokens = match.num_tokens
        self.num_prefix_query_tokens += seq.num_tokens
        self.num_prefix_hit_tokens += match.num_tokens
        for tier, n in enumerate(match.num_blocks_per_tier):
            self.num_hit_blocks[tier] += n
        return KVBlocks(tuple(table))

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow a running request's table to cover ``num_new_tokens`` more tokens.
        False (and nothing changed) if the device tier has too few free blocks."""
        table = self._tables[seq.request_id]
        num_needed = _cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(table)
        if num_needed > self.pools[DEVICE].num_free:
            return False
        table.extend(self._take_block(DEVICE) for _ in range(num_needed))
        return True

    def allocate_lookahead_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Like :meth:`allocate_slots`, for positions a speculative verify pass writes after the
        step's plan was made: only plain free blocks are taken, never an evicted cached one
        (whose offload copy would run after the pass had overwritten it). False (nothing
        changed) when too few are free."""
        table = self._tables[seq.request_id]
        num_needed = _cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(table)
        device = self.pools[DEVICE]
        if num_needed > device.num_plain_free:
            return False
        table.extend(device.take_plain() for _ in range(num_needed))
        return True

    def free(self, seq: Sequence) -> None:
        """Release every block the request holds, in every tier. Tail blocks are
        released first so that, cached, they are evicted before the shared head."""
        rid = seq.request_id
        table = self._tables.pop(rid, None)
        if table is not None:
            for block_id in reversed(table):
                self.pools[DEVICE].release(block_id)
        self._num_committed.pop(rid, None)
        swapped = self._swapped.pop(rid, None)
        if swapped is not None:
            tier, ids = swapped
            for block_id in reversed(ids):
                self.pools[tier].release(block_id)

    # ------------------------------------------------------------------ session retention

    def committed_blocks(self, request_id: str) -> list[tuple[int, int]]:
        """(device block id, prefix key) of the request's leading keyed blocks, in order."""
        table = self._tables.get(request_id)
        if table is None:
            return []
        device, out = self.pools[DEVICE], []
        for block_id in table[: self._num_committed.get(request_id, 0)]:
            key = device.blocks[block_id].block_hash
            if key is None:  # another block holds this key (a duplicate computed concurrently)
                break
            out.append((block_id, key))
        return out

    def offload_blocks(self, blocks: list[tuple[int, int]], request_id: str) -> list[int]:
        """Copy device blocks (id, key) one tier down, keyed, unless already there; stops
        when the lower tier is full. Returns the device block ids whose content the lower
        tier now holds (copied or already there); none without a lower tier."""
        dst_tier = OffloadOnEvict().target_tier(DEVICE, self._sizes)
        if dst_tier is None:
            return []
        lower, held, done = self.pools[dst_tier], [], 0
        for block_id, key in blocks:
            if lower.lookup(key) is None:
                if lower.num_free == 0:
                    break
                dst = self._take_block(dst_tier)
                self._ops.append(CopyOp("offload", request_id, DEVICE, (block_id,), dst_tier, (dst,)))
                lower.register(dst, key)
                lower.release(dst)
                done += 1
            held.append(block_id)
        self.num_transferred_blocks["offload"] += done
        return held

    def forget_cached(self, block_ids: Iterable[int]) -> int:
        """Drop the keys of those device blocks that are cached and free. Returns how many."""
        device, num = self.pools[DEVICE], 0
        for block_id in block_ids:
            key = device.blocks[block_id].block_hash
            if device.forget(block_id):
                num += 1
                if not any(pool.lookup(key) is not None for pool in self.pools[1:]):
                    self._forget_key(key)  # type: ignore[arg-type]  # forget() succeeds only on a keyed block
        return num

    # ------------------------------------------------------------------ swap, prefetch

    def can_swap_out(self, seq: Sequence) -> bool:
        tier = self.swap_tier
        table = self._tables.get(seq.request_id)
        return tier is not None and bool(table) and self.pools[tier].num_free >= len(table)

    def swap_out(self, seq: Sequence) -> bool:
        """Copy the request's device blocks to the swap tier and release them. False (and
        nothing changed) if there is no room; the caller then recomputes instead."""
        if not self.can_swap_out(seq):
            return False
        rid, tier = seq.request_id, self.swap_tier
        assert tier is not None
        table = self._tables.pop(rid)
        dst = [self._take_block(tier) for _ in table]
        self._ops.append(CopyOp("swap_out", rid, DEVICE, tuple(table), tier, tuple(dst)))
        self.num_transferred_blocks["swap_out"] += len(table)
        for block_id in reversed(table):
            self.pools[DEVICE].release(block_id)
        self._num_committed.pop(rid, None)
        self._swapped[rid] = (tier, dst)
        return True

    def swap_in(self, seq: Sequence) -> bool:
        """Bring a swapped-out request's blocks back to the device tier (admission policy
        applies). False (and nothing changed) if there is no room."""
        rid = seq.request_id
        tier, src = self._swapped[rid]
        if not self.admission.can_admit(len(src), self.pools[DEVICE].num_free):
            return False
        del self._swapped[rid]
        dst = [self._take_block(DEVICE) for _ in src]
        self._ops.append(CopyOp("swap_in", rid, tier, tuple(src), DEVICE, tuple(dst)))
        self.num_transferred_blocks["swap_in"] += len(src)
        for block_id in reversed(src):
            self.pools[tier].release(block_id)
        self._tables[rid] = dst
        self._num_committed[rid] = 0
        self.commit(seq)
        return True

    def prefetch(self, seq: Sequence, *, max_blocks: int, evict: bool = True) -> int:
        """Copy up to ``max_blocks`` of the request's lower-tier prefix hits into device
        blocks, left there as cached free blocks (its admission then hits the device).
        ``evict``: may reuse cached free device blocks (LRU victims, offloaded as usual);
        otherwise only plain free ones. Returns blocks copied."""
        device = self.pools[DEVICE]
        match = self.match_prefix(seq)
        todo = [(i, t, b) for i, (t, b) in enumerate(match.hits) if t != DEVICE][:max_blocks]
        if not todo:
            return 0
        for tier, block_id in match.hits:  # pin sources and device hits against the evictions below
            self.pools[tier].acquire(block_id)
        dsts: list[int] = []
        for i, tier, block_id in todo:
            if (device.num_free if evict else device.num_plain_free) == 0:
                break
            dst = self._take_block(DEVICE) if evict else device.take_plain()
            self._ops.append(CopyOp("prefetch", seq.request_id, tier, (block_id,), DEVICE, (dst,)))
            device.register(dst, seq.block_hashes[i])
            dsts.append(dst)
        for block_id in reversed(dsts):
            device.release(block_id)
        for tier, block_id in reversed(match.hits):
            self.pools[tier].release(block_id)
        self.num_transferred_blocks["prefetch"] += len(dsts)
        return len(dsts)

    # ------------------------------------------------------------------ internals

    def _take_block(self, tier: int) -> int:
        """A block of ``tier`` with ref count 1; if that evicts a cached prefix block,
        the offload policy may first copy it one tier down (recursively)."""
        block_id, evicted = self.pools[tier].take()
        if evicted is None:
            return block_id
        self.num_evicted_blocks[tier] += 1
        dst_tier = self.offload.target_tier(tier, self._sizes)
        offloaded_to = None
        if dst_tier is not None:
            lower = self.pools[dst_tier]
            if lower.lookup(evicted) is not None:
                offloaded_to = dst_tier  # already there
            elif lower.num_free > 0:
                dst = self._take_block(dst_tier)
                self._ops.append(CopyOp("offload", None, tier, (block_id,), dst_tier, (dst,)))
                self.num_transferred_blocks["offload"] += 1
                lower.register(dst, evicted)
                lower.release(dst)
                offloaded_to = dst_tier
        self._evictions.append((tier, offloaded_to))
        if offloaded_to is None:
            self._forget_key(evicted)
        return block_id

    def _forget_key(self, key: int) -> None:
        """Remember that the cache lost the prefix ``key`` names (bounded: the oldest keys go first)."""
        self._evicted_keys[key] = None
        self._evicted_keys.move_to_end(key)
        if len(self._evicted_keys) > self._max_evicted_keys:
            self._evicted_keys.popitem(last=False)


def _coalesce(ops: list[CopyOp]) -> tuple[CopyOp, ...]:
    """Merge adjacent ops of the same kind, request and tier pair, unless that would
    write one destination block twice in a single batched copy."""
    out: list[CopyOp] = []
    dsts: set[int] = set()
    for op in ops:
        last = out[-1] if out else None
        if (
            last is not None
            and (last.kind, last.request_id, last.src_tier, last.dst_tier)
            == (op.kind, op.request_id, op.src_tier, op.dst_tier)
            and dsts.isdisjoint(op.dst_ids)
        ):
            out[-1] = CopyOp(op.kind, op.request_id, op.src_tier, last.src_ids + op.src_ids,
                             op.dst_tier, last.dst_ids + op.dst_ids)
            dsts.update(op.dst_ids)
        else:
            out.append(op)
            dsts = set(op.dst_ids)
    return tuple(out)
