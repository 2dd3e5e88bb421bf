"""Paged decode attention on the CPU as one compiled loop (Numba), reading the KV blocks in place.

The PyTorch decode path (:mod:`reference_server.model.attention`) gathers every
decode row's KV blocks into a contiguous buffer and runs SDPA over it: the keys
and values are read, written and read again, and SDPA's flash kernel is built
for long query blocks, not for the one token (times the GQA group) a decode
row has. This kernel walks each row's block table and reads every cached key and
value once, straight from the paged cache:

    for each decode row r, KV head h and query head j of its group:
        s[j, p] = scale * q[r, h, j] . K[block(p), p % block_size, h]   for p < len_r
        w[j]    = softmax(s[j])                                           (max-subtracted)
        out[r, h, j] = sum_p w[j, p] * V[block(p), p % block_size, h]

Float32 only (the math is float32 throughout, as SDPA's is on CPU), single
threaded (``nogil``: the engine thread runs it while others may hold the GIL).
Results agree with SDPA to float32 rounding (about 1e-7), not bit for bit.

:data:`AVAILABLE` says whether Numba imported; :func:`usable` is the one check a
runner makes at start, and :func:`warm_up` compiles the loop then (a second or two,
or a few hundred ms from Numba's on-disk cache next to this file), so that no
request's first decode step waits for the compiler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

try:  # an optional speed-up: without Numba the PyTorch path runs
    import numba
except ImportError:  # pragma: no cover - numba is part of the [server] extra
    numba = None

__all__ = ["AVAILABLE", "DecodeRows", "usable", "warm_up", "decode_rows", "paged_decode_attention"]

AVAILABLE: bool = numba is not None
"""Whether the compiled kernel can run in this process (Numba importable)."""


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode attention for a model on ``device`` in ``dtype`` can use this kernel."""
    return AVAILABLE and device.type == "cpu" and dtype == torch.float32


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """Where each decode row's keys are: built once per step, shared by all layers.

    Row ``i`` attends to the first ``context_lens[i]`` positions of the blocks
    ``block_ids[offsets[i]:offsets[i + 1]]`` (in order).
    """

    block_ids: np.ndarray  # (sum of blocks per row,) int64
    offsets: np.ndarray  # (num_rows + 1,) int64
    context_lens: np.ndarray  # (num_rows,) int64, tokens of context including the new one
    max_len: int


def warm_up() -> None:
    """Compile the kernel (or load it from Numba's cache) now, on a one-row, one-slot input.

    Every call has the same argument types, so this is the only compilation a process sees.
    """
    cache = torch.zeros((1, 1, 1, 2), dtype=torch.float32)  # one block of one slot, one KV head
    paged_decode_attention(torch.zeros((1, 1, 2), dtype=torch.float32), cache, cache, decode_rows([1], [(0,)], 1))


def decode_rows(context_lens: Sequence[int], tables: Sequence[Sequence[int]], block_size: int) -> DecodeRows:
    """:class:`DecodeRows` for rows with these context lengths and block tables (validated by the caller)."""
    ids: list[int] = []
    offsets = [0]
    for length, table in zip(context_lens, tables):
        ids.extend(table[:-(-length // block_size)])
        offsets.append(len(ids))
    return DecodeRows(np.asarray(ids, dtype=np.int64), np.asarray(offsets, dtype=np.int64),
                      np.asarray(context_lens, dtype=np.int64), max(context_lens, default=0))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           rows: DecodeRows) -> torch.Tensor:
    """Attention of decode rows ``q`` ``(n, n_heads, head_dim)`` over the paged cache -> same shape.

    ``k_cache``/``v_cache``: ``(num_blocks, block_size, n_kv, head_dim)`` float32 on the CPU,
    already holding each row's new key and value. Blocks on the engine thread until done.
    """
    # A strided cache would need another compiled specialisation (mid-request) and run slower.
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "the KV caches must be contiguous"
    n, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[2]
    queries = q.contiguous().view(n, num_kv, num_heads // num_kv, head_dim)  # (n, n_kv, group, hd)
    out = torch.empty_like(queries)
    group = num_heads // num_kv
    scores = np.empty((num_kv, group, rows.max_len), dtype=np.float32)  # scratch for one row
    acc = np.empty((num_kv, group, head_dim), dtype=np.float32)
    _kernel(queries.numpy(), k_cache.numpy(), v_cache.numpy(), rows.block_ids, rows.offsets,
            rows.context_lens, np.float32(1.0 / math.sqrt(head_dim)), out.numpy(), scores, acc)
    return out.view(n, num_heads, head_dim)


def _attend(q, k_cache, v_cache, block_ids, offsets, lens, scale, out, scores, acc):  # pragma: no cover - compiled
    """The loop behind :func:`paged_decode_attention` (Numba nopython; arrays as documented there).

    Each row's blocks are streamed in order, every cached slot (all KV heads, contiguous)
    read once for the keys and once for the values: sequential memory access, which is
    what the loop's speed depends on once the cache is larger than the CPU caches.
    """
    n, num_kv, group, head_dim = q.shape
    block_size = k_cache.shape[1]
    for r in range(n):
        length = lens[r]
        first = offsets[r]
        num_blocks = (length + block_size - 1) // block_size
        for b in range(num_blocks):  # scores of every (head, query) against each key
            block = block_ids[first + b]
            for slot in range(min(block_size, length - b * block_size)):
                p = b * block_size + slot
                for h in range(num_kv):
                    key = k_cache[block, slot, h]
                    for j in range(group):
                        query = q[r, h, j]
                        s = np.float32(0.0)
                        for d in range(head_dim):
                            s += query[d] * key[d]
                        scores[h, j, p] = s * scale
        for h in range(num_kv):  # softmax in place, max subtracted
            for j in range(group):
                top = scores[h, j, 0]
                for p in range(1, length):
                    top = max(top, scores[h, j, p])
                total = np.float32(0.0)
                for p in range(length):
                    e = np.float32(math.exp(scores[h, j, p] - top))
                    scores[h, j, p] = e
                    total += e
                inv = np.float32(1.0) / total
                for p in range(length):
                    scores[h, j, p] *= inv
        acc[:, :, :] = 0.0
        for b in range(num_blocks):  # weighted values
            block = block_ids[first + b]
            for slot in range(min(block_size, length - b * block_size)):
                p = b * block_size + slot
                for h in range(num_kv):
                    value = v_cache[block, slot, h]
                    for j in range(group):
                        w = scores[h, j, p]
                        for d in range(head_dim):
                            acc[h, j, d] += w * value[d]
        for h in range(num_kv):
            for j in range(group):
                for d in range(head_dim):
                    out[r, h, j, d] = acc[h, j, d]


# fastmath lets the dot products and sums vectorize (reassociation); boundscheck off: the
# runner validated every block id and length before the step.
_kernel = (numba.njit(cache=True, fastmath=True, nogil=True, boundscheck=False)(_attend)
           if numba is not None else None)
