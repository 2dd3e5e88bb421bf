"""Paged attention over a block table, in plain PyTorch (CPU and CUDA).

KV cache layout per layer: ``k_cache`` and ``v_cache`` of shape
``(num_blocks, block_size, num_kv_heads, head_dim)``. Token position ``p`` of a
sequence lives in block ``block_table[p // block_size]`` at offset
``p % block_size``, i.e. at flat slot ``block_id * block_size + p % block_size``.

A step runs a mixed batch of *chunks*: a chunk is a run of new tokens of one
sequence starting at ``start_pos`` (the number of its tokens already in the
cache). Its queries attend to every cached earlier position plus causally within
the chunk. The new tokens' K/V are first written into the cache, then read back
with the rest of the context, so prefill, chunked prefill and decode share one
code path per layer:

* one-token chunks (decode) on the CPU in float32 go to the compiled kernel of
  :mod:`reference_server.model.decode_kernel`, which reads each row's blocks in
  place (no gather) when the runner enables it; otherwise they are grouped into
  a few *buckets* of similar
  context length (:func:`plan_decode_buckets`), so a short context is not padded
  to the longest one in the step. Each layer gathers every bucket's keys and
  values with one ``index_select`` over a flat block index (built once per step,
  shared by all layers, since block tables are the same in every layer) and runs
  one SDPA call per bucket, masked only when some row of the bucket is padded.
  Whole blocks are gathered, not single slots: on CPU, copying 16-slot runs is
  about twice as fast as 1-slot runs once the cache is out of the CPU caches;
* longer chunks (prefill) run one by one through SDPA's fused CPU/CUDA kernel,
  in tiles of queries each over only the keys it may see, masked by slices of a
  ``(chunk_len, context_len)`` mask; a chunk starting at position 0 needs no
  gather (its keys are exactly the new ones).

:func:`build_attention_metadata` computes every index and mask once per step;
each layer reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from reference_server.model.decode_kernel import DecodeRows, paged_decode_attention
from reference_server.model.decode_kernel import decode_rows as decode_rows_for_kernel


class GatherBuffers:
    """Reusable scratch tensors for gathered K/V blocks, kept across layers and steps.

    Gathering a decode batch's context is several MB per layer; allocating it
    fresh each time costs page faults (glibc returns large blocks to the OS),
    which on some hosts doubles a decode step. Buffers only grow. Not
    thread-safe: one per ModelRunner, used on the engine thread.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A contiguous tensor of ``shape`` (contents undefined) with ``like``'s dtype/device."""
        numel = 1
        for dim in shape:
            numel *= dim
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype \
                or buf.device != like.device:
            buf = torch.empty(max(numel, 2 * (buf.numel() if buf is not None else 0)),
                              dtype=like.dtype, device=like.device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)


@dataclass(frozen=True, slots=True)
class PrefillGroup:
    """Index tensors of one multi-token chunk (shared by all layers)."""

    token_start: int  # first row of this chunk in the flattened batch
    token_end: int  # one past its last row
    block_ids: torch.Tensor  # (ceil(context_len / block_size),) int64 blocks of positions [0, ctx)
    context_len: int  # tokens of context, including this chunk
    mask: torch.Tensor  # (chunk_len, context_len) bool, True = may attend


@dataclass(frozen=True, slots=True)
class DecodeBucket:
    """Decode rows of similar context length, attended with one SDPA call (all layers)."""

    token_rows: torch.Tensor  # (num_rows,) int64 rows of these one-token chunks in the batch
    offset: int  # first entry of this bucket in AttentionMetadata.decode_block_ids
    num_rows: int
    num_blocks: int  # blocks gathered per row: those of the longest context in the bucket
    max_len: int  # the longest context in the bucket, tokens
    # (num_rows, 1, 1, num_blocks * block_size) bool, True = real key; None when no key is
    # padding, or for a single row (its keys are then cut to max_len instead).
    mask: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where a step's tokens go in the paged cache and what each may attend to.

    Built by :func:`build_attention_metadata`; immutable; valid for one forward pass.
    """

    slot_mapping: torch.Tensor  # (num_tokens,) int64 flat cache slot of each new token
    decode_token_idx: torch.Tensor  # (num_decode,) int64 rows of the one-token chunks
    prefills: tuple[PrefillGroup, ...]
    num_tokens: int
    buffers: GatherBuffers | None = None  # scratch for gathers; None = allocate each time
    # Decode rows grouped by context length; bucket b's keys are the cache blocks
    # decode_block_ids[b.offset : b.offset + b.num_rows * b.num_blocks], row-major (row,
    # block); a row's padding blocks repeat its last block (masked out, but finite data).
    decode_buckets: tuple[DecodeBucket, ...] = ()
    decode_block_ids: torch.Tensor | None = None  # (sum of num_rows * num_blocks,) int64
    # Set instead of the buckets when the decode rows go to the compiled kernel.
    kernel_rows: DecodeRows | None = None


# Fixed cost of one more decode bucket per layer (an SDPA call, two index ops),
# in key slots of padding it is worth: roughly 60 us per bucket per layer against
# 0.45 us per gathered-and-attended key slot (small preset, 1 CPU thread); 32 and
# 512 were both slower than 128 on the Azure-trace steps of benchmarks/engine.py.
DEFAULT_BUCKET_OVERHEAD_SLOTS = 128


def build_attention_metadata(
    chunk_lens: Sequence[int],
    start_positions: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    *,
    block_size: int,
    device: torch.device,
    buffers: GatherBuffers | None = None,
    bucket_overhead_slots: int = DEFAULT_BUCKET_OVERHEAD_SLOTS,
    decode_kernel: bool = False,
) -> AttentionMetadata:
    """Index tensors for a batch of chunks, in the order given.

    Chunk ``i`` computes ``chunk_lens[i]`` new tokens at positions
    ``[start_positions[i], start_positions[i] + chunk_lens[i])`` of the sequence
    whose blocks are ``block_tables[i]``. The caller has validated lengths and
    block ids (see ModelRunner); this function does not check them again.
    ``bucket_overhead_slots`` tunes decode bucketing (see :func:`plan_decode_buckets`);
    it changes speed only, never results. ``decode_kernel``: attend the decode rows
    with :func:`~reference_server.model.decode_kernel.paged_decode_attention`
    (CPU, float32 caches; the caller checks ``decode_kernel.usable``) instead of buckets.
    """
    slot_mapping: list[int] = []
    decode_rows: list[int] = []
    decode_chunks: list[int] = []
    prefills: list[PrefillGroup] = []
    row = 0
    for i, (length, start) in enumerate(zip(chunk_lens, start_positions)):
        table = block_tables[i]
        for pos in range(start, start + length):
            slot_mapping.append(table[pos // block_size] * block_size + pos % block_size)
        if length == 1:
            decode_rows.append(row)
            decode_chunks.append(i)
        else:
            prefills.append(_prefill_group(row, length, start, table, block_size, device))
        row += length
    decode_lens = [start_positions[i] + 1 for i in decode_chunks]
    decode_tables = [block_tables[i] for i in decode_chunks]
    kernel_rows = None
    if decode_kernel and decode_rows:
        kernel_rows = decode_rows_for_kernel(decode_lens, decode_tables, block_size)
        buckets, decode_block_ids = (), None
    else:
        buckets, decode_block_ids = _decode_buckets(
            decode_rows, decode_lens, decode_tables, block_size, bucket_overhead_slots, device)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        decode_token_idx=torch.tensor(decode_rows, dtype=torch.int64, device=device),
        prefills=tuple(prefills),
        num_tokens=row,
        buffers=buffers,
        decode_buckets=buckets,
        decode_block_ids=decode_block_ids,
        kernel_rows=kernel_rows,
    )


def plan_decode_buckets(context_lens: Sequence[int], *, block_size: int,
                        overhead_slots: int) -> list[list[int]]:
    """Split decode rows into buckets minimising gathered key slots plus a per-bucket cost.

    Returns lists of indices into ``context_lens``, each in ascending index order;
    buckets are ordered by context length. A bucket costs ``rows * padded length
    + overhead_slots``, the padded length being its longest context rounded up to
    whole blocks; the split minimising the total is found exactly by dynamic
    programming over the rows sorted by length (O(n^2) for n rows). Rows with the
    same block count are never split. ``overhead_slots`` 0 gives one bucket per
    distinct block count. Raises ValueError when ``overhead_slots`` is negative or
    ``block_size`` is not positive.
    """
    if overhead_slots < 0 or block_size <= 0:
        raise ValueError(f"need overhead_slots >= 0 and block_size > 0, got "
                         f"{overhead_slots} and {block_size}")
    order = sorted(range(len(context_lens)), key=context_lens.__getitem__)
    padded = [-(-context_lens[i] // block_size) * block_size for i in order]
    # best[j]: cheapest split of the j shortest rows; cut[j]: start of its last bucket.
    best = [0] * (len(padded) + 1)
    cut = [0] * (len(padded) + 1)
    for j in range(1, len(padded) + 1):
        best[j], cut[j] = min(
            (best[i] + (j - i) * padded[j - 1] + overhead_slots, i)
            for i in range(j) if i == 0 or padded[i] != padded[i - 1])
    buckets: list[list[int]] = []
    j = len(padded)
    while j:
        buckets.append(sorted(order[cut[j]:j]))
        j = cut[j]
    return buckets[::-1]


def _decode_buckets(rows: list[int], context_lens: list[int], tables: list[Sequence[int]],
                    block_size: int, overhead_slots: int, device: torch.device,
                    ) -> tuple[tuple[DecodeBucket, ...], torch.Tensor | None]:
    """Buckets of decode rows and the flat block index of all their keys (see AttentionMetadata)."""
    if not rows:
        return (), None
    buckets: list[DecodeBucket] = []
    block_ids: list[int] = []
    plan = plan_decode_buckets(context_lens, block_size=block_size, overhead_slots=overhead_slots)
    for members in plan:
        lens = [context_lens[m] for m in members]
        max_len = max(lens)
        num_blocks = -(-max_len // block_size)
        offset = len(block_ids)
        for m in members:
            own = tables[m][:-(-context_lens[m] // block_size)]
            block_ids.extend(own)
            block_ids.extend([own[-1]] * (num_blocks - len(own)))  # padding: finite, masked
        mask = None
        if len(members) > 1 and min(lens) != num_blocks * block_size:
            key_pos = torch.arange(num_blocks * block_size, device=device)
            lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
            mask = (key_pos[None, :] < lens_t[:, None])[:, None, None, :]  # (n, 1, 1, nb * bs)
        token_rows = torch.tensor([rows[m] for m in members], dtype=torch.int64, device=device)
        buckets.append(DecodeBucket(token_rows, offset, len(members), num_blocks, max_len, mask))
    return tuple(buckets), torch.tensor(block_ids, dtype=torch.int64, device=device)


def _prefill_group(row: int, length: int, start: int, table: Sequence[int],
                   block_size: int, device: torch.device) -> PrefillGroup:
    context_len = start + length
    num_blocks = -(-context_len // block_size)
    block_ids = torch.tensor(list(table[:num_blocks]), dtype=torch.int64, device=device)
    q_pos = torch.arange(start, context_len, device=device)  # (chunk_len,)
    k_pos = torch.arange(context_len, device=device)  # (context_len,)
    mask = k_pos[None, :] <= q_pos[:, None]  # (chunk_len, context_len)
    return PrefillGroup(row, row + length, block_ids, context_len, mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys/values ``(num_tokens, n_kv, head_dim)`` at their flat cache slots."""
    num_kv, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Attention of a mixed batch over the paged cache; writes the new K/V first.

    q: ``(num_tokens, n_heads, head_dim)``; k, v: ``(num_tokens, n_kv, head_dim)``
    (RoPE already applied). Returns ``(num_tokens, n_heads, head_dim)``.
    """
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.kernel_rows is not None:
        if not meta.prefills:  # every row is a decode row, in order
            return paged_decode_attention(q, k_cache, v_cache, meta.kernel_rows)
        out = torch.empty_like(q)
        rows = meta.decode_token_idx
        out.index_copy_(0, rows, paged_decode_attention(q.index_select(0, rows), k_cache, v_cache,
                                                        meta.kernel_rows))
        return _prefills_into(out, q, k, v, k_cache, v_cache, meta)
    buckets = meta.decode_buckets
    if not meta.prefills and len(buckets) == 1:  # one bucket holds every row, in order
        return _decode_bucket_attention(q, *_gather_decode_kv(k_cache, v_cache, meta),
                                        buckets[0]).reshape(q.shape)
    out = torch.empty_like(q)
    if buckets:
        keys, values = _gather_decode_kv(k_cache, v_cache, meta)
        for bucket in buckets:
            rows = q.index_select(0, bucket.token_rows)  # (n, n_heads, head_dim)
            out.index_copy_(0, bucket.token_rows, _decode_bucket_attention(
                rows, keys, values, bucket).reshape(rows.shape))
    return _prefills_into(out, q, k, v, k_cache, v_cache, meta)


def _prefills_into(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Write each multi-token chunk's attention into its rows of ``out``; returns ``out``."""
    for group in meta.prefills:
        start, end = group.token_start, group.token_end
        out[start:end] = _prefill_attention(
            q[start:end], k[start:end], v[start:end], k_cache, v_cache, group,
            meta.buffers)[0].transpose(0, 1)  # (chunk_len, n_heads, head_dim)
    return out


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, name: str,
                   buffers: GatherBuffers | None) -> torch.Tensor:
    """Blocks ``block_ids`` ``(S, nb)`` of a cache -> ``(S, nb * block_size, n_kv, head_dim)``.

    index_select on whole blocks copies contiguous runs (much faster on CPU
    than advanced indexing per slot), into a reused buffer when given.
    """
    flat_ids = block_ids.reshape(-1)
    shape = (flat_ids.shape[0], *cache.shape[1:])  # (S * nb, block_size, n_kv, hd)
    if buffers is None:
        blocks = cache.index_select(0, flat_ids)
    else:
        blocks = torch.index_select(cache, 0, flat_ids, out=buffers.get(name, shape, cache))
    return blocks.view(block_ids.shape[0], -1, cache.shape[2], cache.shape[3])


def _gather_decode_kv(k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of every decode bucket: one index_select each, ``(total_blocks, bs, n_kv, hd)``."""
    block_ids = meta.decode_block_ids
    assert block_ids is not None, "decode buckets without a block index"
    keys = _gather_blocks(k_cache, block_ids[None], "k", meta.buffers)[0]
    values = _gather_blocks(v_cache, block_ids[None], "v", meta.buffers)[0]
    shape = (block_ids.shape[0], *k_cache.shape[1:])  # (total_blocks, bs, n_kv, hd)
    return keys.view(shape), values.view(shape)


def _decode_bucket_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                             bucket: DecodeBucket) -> torch.Tensor:
    """One bucket's decode rows ``q`` ``(n, n_heads, hd)`` -> ``(n, n_kv, group, hd)``.

    ``keys``/``values``: the gathered blocks of all buckets, ``(total_blocks, bs, n_kv, hd)``.
    """
    n, num_kv, head_dim = bucket.num_rows, keys.shape[2], keys.shape[3]
    span = slice(bucket.offset, bucket.offset + n * bucket.num_blocks)
    k = keys[span].view(n, -1, num_kv, head_dim)  # (n, num_blocks * bs, n_kv, hd)
    v = values[span].view(n, -1, num_kv, head_dim)
    if bucket.mask is None:  # one row (or no padding): cut to the real keys
        k, v = k[:, :bucket.max_len], v[:, :bucket.max_len]
    # The query heads sharing a KV head act as that head's "query length", so GQA
    # needs no repeated keys: (n, n_kv, group, head_dim).
    queries = q.view(n, num_kv, q.shape[1] // num_kv, head_dim)
    return F.scaled_dot_product_attention(
        queries, k.transpose(1, 2), v.transpose(1, 2), attn_mask=bucket.mask)


# Queries per SDPA call in a prefill chunk. CPU flash attention splits keys in runs
# of 512, so a causal chunk under ~512 tokens computes its whole square; tiles of
# 64 queries, each over only the keys it may see, took about a third less CPU time
# on a 500-token chunk (small preset, 1 thread).
PREFILL_QUERY_TILE = 64


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, group: PrefillGroup,
                       buffers: GatherBuffers | None) -> torch.Tensor:
    """One chunk: q ``(chunk_len, n_heads, hd)``, its new k, v ``(chunk_len, n_kv, hd)``.

    A chunk from position 0 attends only to its own keys: no gather. 4-D inputs
    keep SDPA on its fused (flash) kernel; 3-D ones fall back to the unfused
    math path on CPU. Returns ``(1, n_heads, chunk_len, head_dim)``.
    """
    chunk_len = q.shape[0]
    ctx = group.context_len
    if ctx == chunk_len:
        keys, values = k, v  # (ctx, n_kv, head_dim)
    else:
        ids = group.block_ids[None]  # (1, num_blocks)
        keys = _gather_blocks(k_cache, ids, "k", buffers)[0, :ctx]  # (ctx, n_kv, head_dim)
        values = _gather_blocks(v_cache, ids, "v", buffers)[0, :ctx]  # (ctx, n_kv, head_dim)
    queries = q.transpose(0, 1)[None]  # (1, n_heads, chunk_len, head_dim)
    keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]  # (1, n_kv, ctx, hd)
    if chunk_len <= PREFILL_QUERY_TILE and ctx == chunk_len:
        return F.scaled_dot_product_attention(queries, keys, values, is_causal=True,
                                              enable_gqa=True)
    out = q.new_empty((1, q.shape[1], chunk_len, q.shape[2]))
    start = ctx - chunk_len  # position of the chunk's first token
    for first in range(0, chunk_len, PREFILL_QUERY_TILE):
        last = min(chunk_len, first + PREFILL_QUERY_TILE)
        visible = start + last  # keys [0, visible) are all this tile may attend to
        out[:, :, first:last] = F.scaled_dot_product_attention(
            queries[:, :, first:last], keys[:, :, :visible], values[:, :, :visible],
            attn_mask=group.mask[first:last, :visible], enable_gqa=True)
    return out


def dense_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention over one whole sequence; the ground truth for tests.

    q: ``(T, n_heads, head_dim)``; k, v: ``(T, n_kv, head_dim)``. Returns
    ``(T, n_heads, head_dim)``. Explicit matmul + softmax, no paging, no SDPA.
    """
    seq_len, num_heads, head_dim = q.shape
    repeat = num_heads // k.shape[1]
    k = k.repeat_interleave(repeat, dim=1).transpose(0, 1)  # (n_heads, T, head_dim)
    v = v.repeat_interleave(repeat, dim=1).transpose(0, 1)  # (n_heads, T, head_dim)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) / head_dim ** 0.5  # (n_heads, T, T)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    out = scores.softmax(dim=-1) @ v  # (n_heads, T, head_dim)
    return out.transpose(0, 1)  # (T, n_heads, head_dim)
