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

* one-token chunks (decode) are batched together: their blocks are gathered
  into ``(num_decode, max_blocks * block_size, n_kv, head_dim)`` and masked;
* longer chunks (prefill) run one by one with a ``(chunk_len, context_len)`` mask.

:func:`build_attention_metadata` computes every index and mask once per step;
each layer reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F


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
class AttentionMetadata:
    """Where a step's tokens go in the paged cache and what each may attend to.

    Built by :func:`build_attention_metadata`; immutable; valid for one forward pass.
    """

    slot_mapping: torch.Tensor  # (num_tokens,) int64 flat cache slot of each new token
    decode_token_idx: torch.Tensor  # (num_decode,) int64 rows of the one-token chunks
    decode_block_tables: torch.Tensor  # (num_decode, max_blocks) int64, padded with block 0
    decode_mask: torch.Tensor  # (num_decode, 1, 1, max_blocks * block_size) bool, False on padding
    prefills: tuple[PrefillGroup, ...]
    num_tokens: int
    buffers: GatherBuffers | None = None  # scratch for gathers; None = allocate each time


def build_attention_metadata(
    chunk_lens: Sequence[int],
    start_positions: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    *,
    block_size: int,
    device: torch.device,
    buffers: GatherBuffers | None = None,
) -> AttentionMetadata:
    """Index tensors for a batch of chunks, in the order given.

    Chunk ``i`` computes ``chunk_lens[i]`` new tokens at positions
    ``[start_positions[i], start_positions[i] + chunk_lens[i])`` of the sequence
    whose blocks are ``block_tables[i]``. The caller has validated lengths and
    block ids (see ModelRunner); this function does not check them again.
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
    decode_tables, decode_mask = _decode_indices(
        [start_positions[i] + 1 for i in decode_chunks],
        [block_tables[i] for i in decode_chunks], block_size, device)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        decode_token_idx=torch.tensor(decode_rows, dtype=torch.int64, device=device),
        decode_block_tables=decode_tables,
        decode_mask=decode_mask,
        prefills=tuple(prefills),
        num_tokens=row,
        buffers=buffers,
    )


def _prefill_group(row: int, length: int, start: int, table: Sequence[int],
                   block_size: int, device: torch.device) -> PrefillGroup:
    context_len = start + length
    num_blocks = -(-context_len // block_size)
    block_ids = torch.tensor(list(table[:num_blocks]), dtype=torch.int64, device=device)
    q_pos = torch.arange(start, context_len, device=device)  # (chunk_len,)
    k_pos = torch.arange(context_len, device=device)  # (context_len,)
    mask = k_pos[None, :] <= q_pos[:, None]  # (chunk_len, context_len)
    return PrefillGroup(row, row + length, block_ids, context_len, mask)


def _decode_indices(context_lens: list[int], tables: list[Sequence[int]], block_size: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if not context_lens:
        empty = torch.zeros((0, 1), dtype=torch.int64, device=device)
        return empty, torch.ones((0, 1, 1, 1), dtype=torch.bool, device=device)
    max_ctx = max(context_lens)
    max_blocks = -(-max_ctx // block_size)
    padded = [list(t[:max_blocks]) + [0] * (max_blocks - len(t[:max_blocks])) for t in tables]
    table_t = torch.tensor(padded, dtype=torch.int64, device=device)  # (n_dec, max_blocks)
    lens = torch.tensor(context_lens, dtype=torch.int64, device=device)  # (n_dec,)
    key_pos = torch.arange(max_blocks * block_size, device=device)  # (max_blocks * block_size,)
    mask = key_pos[None, :] < lens[:, None]  # (n_dec, max_blocks * block_size)
    return table_t, mask[:, None, None, :]  # mask: (n_dec, 1, 1, max_blocks * block_size)


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
    if not meta.prefills:  # a pure decode step: no scatter needed
        return _decode_attention(q, k_cache, v_cache, meta)
    out = torch.empty_like(q)
    if meta.decode_token_idx.numel():
        out.index_copy_(0, meta.decode_token_idx, _decode_attention(
            q.index_select(0, meta.decode_token_idx), k_cache, v_cache, meta))
    for group in meta.prefills:
        out[group.token_start:group.token_end] = _prefill_attention(
            q[group.token_start:group.token_end], k_cache, v_cache, group, meta.buffers)
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


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
    n_dec, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[2]
    group = num_heads // num_kv
    tables = meta.decode_block_tables  # (n_dec, max_blocks)
    keys = _gather_blocks(k_cache, tables, "k", meta.buffers).transpose(1, 2)
    values = _gather_blocks(v_cache, tables, "v", meta.buffers).transpose(1, 2)
    # keys, values: (n_dec, n_kv, max_blocks * block_size, head_dim)
    # The query heads sharing a KV head act as that head's "query length", so GQA
    # needs no repeated keys: (n_dec, n_kv, group, head_dim).
    queries = q.view(n_dec, num_kv, group, head_dim)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.decode_mask)
    return out.reshape(n_dec, num_heads, head_dim)  # (n_dec, n_heads, head_dim)


def _prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       group: PrefillGroup, buffers: GatherBuffers | None) -> torch.Tensor:
    ctx = group.context_len
    ids = group.block_ids[None]  # (1, num_blocks)
    keys = _gather_blocks(k_cache, ids, "k", buffers)[0, :ctx]  # (ctx, n_kv, head_dim)
    values = _gather_blocks(v_cache, ids, "v", buffers)[0, :ctx]  # (ctx, n_kv, head_dim)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),  # (heads, T, hd)
        attn_mask=group.mask, enable_gqa=True)  # (n_heads, chunk_len, head_dim)
    return out.transpose(0, 1)  # (chunk_len, n_heads, head_dim)


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
