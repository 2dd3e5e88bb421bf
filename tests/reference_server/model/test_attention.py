from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_server.model.attention import (
    GatherBuffers,
    build_attention_metadata,
    dense_attention_reference,
    paged_attention,
    write_kv,
)

torch.set_num_threads(1)

NUM_HEADS, NUM_KV, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 16, 4, 40

# (total tokens after this step, start_pos of the chunk, block table): a mixed batch
# of decode tokens and (chunked) prefills at non-block-aligned offsets, with
# non-contiguous, unordered block ids.
SEQUENCES = [
    (9, 8, (7, 0, 33)),  # decode at position 8 (a block boundary)
    (11, 5, (17, 3, 29)),  # prefill chunk [5, 11): starts mid-block, ends mid-block
    (1, 0, (39,)),  # decode of the very first token
    (7, 0, (12, 25)),  # whole prefill from 0
    (14, 13, (2, 38, 5, 21)),  # decode mid-block
    (6, 2, (30, 31)),  # short chunk [2, 6)
]


def _random_sequences(gen: torch.Generator):
    seqs = []
    for total, start, table in SEQUENCES:
        q = torch.randn(total, NUM_HEADS, HEAD_DIM, generator=gen)
        k = torch.randn(total, NUM_KV, HEAD_DIM, generator=gen)
        v = torch.randn(total, NUM_KV, HEAD_DIM, generator=gen)
        seqs.append((q, k, v, start, table))
    return seqs


def _slots(table, positions):
    return torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions])


def _run_paged(seqs, buffers=None, gen=None, decode_kernel=False):
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV, HEAD_DIM)
    # Garbage everywhere: any read of a slot outside a sequence's context shows up.
    k_cache = torch.randn(cache_shape, generator=gen) * 100
    v_cache = torch.randn(cache_shape, generator=gen) * 100
    for q, k, v, start, table in seqs:  # the already-cached prefix of each sequence
        if start:
            write_kv(k[:start], v[:start], k_cache, v_cache, _slots(table, range(start)))
    meta = build_attention_metadata(
        [q.shape[0] - start for q, _, _, start, _ in seqs], [s[3] for s in seqs],
        [s[4] for s in seqs], block_size=BLOCK_SIZE, device=torch.device("cpu"),
        buffers=buffers, decode_kernel=decode_kernel)
    q_new = torch.cat([q[start:] for q, _, _, start, _ in seqs])
    k_new = torch.cat([k[start:] for _, k, _, start, _ in seqs])
    v_new = torch.cat([v[start:] for _, _, v, start, _ in seqs])
    out = paged_attention(q_new, k_new, v_new, k_cache, v_cache, meta)
    return out, k_cache, v_cache


@pytest.mark.parametrize("decode_kernel", [False, True], ids=["torch-decode", "kernel-decode"])
def test_mixed_batch_matches_dense_reference(decode_kernel: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    seqs = _random_sequences(gen)
    out, _, _ = _run_paged(seqs, gen=gen, decode_kernel=decode_kernel)
    row = 0
    for q, k, v, start, _ in seqs:
        expected = dense_attention_reference(q, k, v)[start:]
        got = out[row:row + expected.shape[0]]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        row += expected.shape[0]
    assert row == out.shape[0]


def test_new_kv_written_at_their_slots() -> None:
    gen = torch.Generator().manual_seed(1)
    seqs = _random_sequences(gen)
    _, k_cache, v_cache = _run_paged(seqs, gen=gen)
    flat_k = k_cache.view(-1, NUM_KV, HEAD_DIM)
    flat_v = v_cache.view(-1, NUM_KV, HEAD_DIM)
    for _, k, v, _, table in seqs:
        slots = _slots(table, range(k.shape[0]))
        assert torch.equal(flat_k[slots], k)
        assert torch.equal(flat_v[slots], v)


def test_reused_gather_buffers_give_same_result() -> None:
    buffers = GatherBuffers()
    for seed in (2, 3):  # second call reuses (and may shrink into) the buffers
        seqs = _random_sequences(torch.Generator().manual_seed(seed))
        plain, _, _ = _run_paged(seqs, gen=torch.Generator().manual_seed(9))
        buffered, _, _ = _run_paged(seqs, buffers, gen=torch.Generator().manual_seed(9))
        assert torch.equal(plain, buffered)
    decode_only = [s for s in _random_sequences(torch.Generator().manual_seed(4))
                   if s[0].shape[0] - s[3] == 1]
    out, _, _ = _run_paged(decode_only, buffers, gen=torch.Generator().manual_seed(9))
    for i, (q, k, v, start, _) in enumerate(decode_only):
        torch.testing.assert_close(out[i], dense_attention_reference(q, k, v)[start],
                                   atol=1e-5, rtol=1e-5)


def test_metadata_indices() -> None:
    meta = build_attention_metadata(
        [1, 3, 1], [5, 2, 0], [(9, 4), (1, 8), (6,)], block_size=4,
        device=torch.device("cpu"))
    # seq0 pos 5 -> block 4 offset 1; seq1 pos 2, 3 -> block 1, pos 4 -> block 8;
    # seq2 pos 0 -> block 6.
    assert meta.slot_mapping.tolist() == [17, 6, 7, 32, 24]
    assert meta.decode_token_idx.tolist() == [0, 4]
    # Both decode rows in one bucket of 2 blocks each; seq2's padding repeats its own block.
    (bucket,) = meta.decode_buckets
    assert (bucket.token_rows.tolist(), bucket.offset, bucket.num_rows, bucket.num_blocks, bucket.max_len) == (
        [0, 4], 0, 2, 2, 6)
    assert meta.decode_block_ids.tolist() == [9, 4, 6, 6]
    assert bucket.mask[:, 0, 0].tolist() == [[True] * 6 + [False] * 2, [True] + [False] * 7]
    (group,) = meta.prefills
    assert (group.token_start, group.token_end, group.context_len) == (1, 4, 5)
    assert group.mask.tolist() == [[True] * 3 + [False] * 2, [True] * 4 + [False],
                                   [True] * 5]


def test_dense_reference_is_causal() -> None:
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(6, 4, 8, generator=gen)
    k = torch.randn(6, 2, 8, generator=gen)
    v = torch.randn(6, 2, 8, generator=gen)
    full = dense_attention_reference(q, k, v)
    prefix = dense_attention_reference(q[:3], k[:3], v[:3])
    torch.testing.assert_close(full[:3], prefix)  # later tokens do not leak backwards
    # first token attends only to itself: output = its value, per GQA group
    torch.testing.assert_close(full[0], v[0].repeat_interleave(2, dim=0))


@settings(max_examples=25, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 3, 4, 8]))
def test_random_mixed_batches_match_dense(data, block_size: int) -> None:
    """Any split of sequences into (cached prefix, new chunk), any block placement."""
    num_seqs = data.draw(st.integers(1, 4))
    lengths = [data.draw(st.integers(1, 20)) for _ in range(num_seqs)]
    starts = [data.draw(st.integers(0, n - 1)) for n in lengths]
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + 2
    perm = data.draw(st.permutations(range(num_blocks)))
    tables, used = [], 0
    for count in needed:  # disjoint, scattered block ids per sequence
        tables.append(tuple(perm[used:used + count]))
        used += count
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    shape = (num_blocks, block_size, NUM_KV, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    seqs = []
    for n, start, table in zip(lengths, starts, tables):
        q = torch.randn(n, NUM_HEADS, HEAD_DIM, generator=gen)
        k = torch.randn(n, NUM_KV, HEAD_DIM, generator=gen)
        v = torch.randn(n, NUM_KV, HEAD_DIM, generator=gen)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                              for p in range(start)], dtype=torch.int64)
        write_kv(k[:start], v[:start], k_cache, v_cache, slots)
        seqs.append((q, k, v, start))
    meta = build_attention_metadata(
        [q.shape[0] - s for q, _, _, s in seqs], starts, tables, block_size=block_size,
        device=torch.device("cpu"), buffers=GatherBuffers(), decode_kernel=data.draw(st.booleans()))
    out = paged_attention(torch.cat([q[s:] for q, _, _, s in seqs]),
                          torch.cat([k[s:] for _, k, _, s in seqs]),
                          torch.cat([v[s:] for _, _, v, s in seqs]), k_cache, v_cache, meta)
    expected = torch.cat([dense_attention_reference(q, k, v)[s:] for q, k, v, s in seqs])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def _long_mixed_batch(bucket_overhead_slots: int, decode_kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode rows of very different context lengths (several length buckets) and prefill
    chunks longer than one query tile, with and without a cached prefix."""
    block_size = 4
    # (total tokens after this step, start of the new chunk)
    shapes = [(3, 2), (41, 40), (90, 89), (151, 150), (150, 0), (170, 20)]
    needed = [-(-n // block_size) for n, _ in shapes]
    gen = torch.Generator().manual_seed(7)
    perm = torch.randperm(sum(needed) + 3, generator=gen).tolist()
    shape = (len(perm), block_size, NUM_KV, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen) * 100, torch.randn(shape, generator=gen) * 100
    seqs, tables, used = [], [], 0
    for (n, start), count in zip(shapes, needed):
        table = tuple(perm[used:used + count])
        used += count
        q, k, v = (torch.randn(n, h, HEAD_DIM, generator=gen) for h in (NUM_HEADS, NUM_KV, NUM_KV))
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(start)],
                             dtype=torch.int64)
        write_kv(k[:start], v[:start], k_cache, v_cache, slots)
        seqs.append((q, k, v, start))
        tables.append(table)
    meta = build_attention_metadata(
        [n - s for n, s in shapes], [s for _, s in shapes], tables, block_size=block_size,
        device=torch.device("cpu"), buffers=GatherBuffers(), bucket_overhead_slots=bucket_overhead_slots,
        decode_kernel=decode_kernel)
    out = paged_attention(torch.cat([q[s:] for q, _, _, s in seqs]), torch.cat([k[s:] for _, k, _, s in seqs]),
                          torch.cat([v[s:] for _, _, v, s in seqs]), k_cache, v_cache, meta)
    expected = torch.cat([dense_attention_reference(q, k, v)[s:] for q, k, v, s in seqs])
    return out, expected


def test_decode_buckets_and_tiled_long_prefill_match_dense() -> None:
    for overhead in (0, 128, 10_000):  # one bucket per length, the default, a single bucket
        out, expected = _long_mixed_batch(overhead)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_decode_kernel_with_tiled_long_prefill_matches_dense() -> None:
    out, expected = _long_mixed_batch(128, decode_kernel=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
