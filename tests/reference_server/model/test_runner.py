from __future__ import annotations

import dataclasses

import pytest
import torch

from reference_server.model.config import ModelConfig
from reference_server.model.kv_storage import kv_bytes_per_block
from reference_server.model.runner import ModelRunner, SeqChunk, num_blocks_for_memory

torch.set_num_threads(1)
TINY = ModelConfig.preset("tiny")
BLOCK = 4


@pytest.fixture()
def runner():
    r = ModelRunner(TINY, block_size=BLOCK, num_device_blocks=32, device="cpu")
    yield r
    r.close()


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_paged_incremental_decode_matches_dense(runner) -> None:
    seq_a, seq_b = _tokens(18, 0), _tokens(9, 1)
    table_a, table_b = (21, 3, 30, 7, 12), (9, 28, 1)  # non-contiguous, unordered
    with torch.no_grad():
        dense_a = runner.model.forward_dense(torch.tensor(seq_a))
        dense_b = runner.model.forward_dense(torch.tensor(seq_b))
    # step 1: A's first prefill chunk (no logits) + B's whole prompt
    # step 2: A's second chunk [6, 13) at a non-block-aligned offset + B decodes position 3
    # steps 3..: both decode, one token each
    steps = [[(seq_a, 0, 6, False, table_a), (seq_b, 0, 3, True, table_b)],
             [(seq_a, 6, 13, True, table_a), (seq_b, 3, 4, True, table_b)]]
    steps += [[(seq_a, p, p + 1, True, table_a), (seq_b, p - 9, p - 8, True, table_b)]
              for p in range(13, 18)]
    dense = {id(seq_a): dense_a, id(seq_b): dense_b}
    for step in steps:
        chunks = [SeqChunk(tuple(seq[s:e]), s, table, want) for seq, s, e, want, table in step]
        logits = runner.execute(chunks)
        expected = [dense[id(seq)][e - 1] for seq, s, e, want, table in step if want]
        assert logits.shape == (len(expected), TINY.vocab_size)
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, torch.stack(expected), atol=1e-4, rtol=1e-5)


def test_batch_composition_does_not_change_logits(runner) -> None:
    seq = _tokens(10, 2)
    alone = runner.execute([SeqChunk(tuple(seq), 0, (0, 1, 2))])
    other = SeqChunk(tuple(_tokens(7, 3)), 0, (5, 6))
    together = runner.execute([other, SeqChunk(tuple(seq), 0, (10, 11, 12))])
    torch.testing.assert_close(together[1], alone[0], atol=1e-5, rtol=1e-5)


def test_empty_batch(runner) -> None:
    assert runner.execute([]).shape == (0, TINY.vocab_size)


@pytest.mark.parametrize(
    ("chunk", "message"),
    [
        (SeqChunk((), 0, (0,)), "empty"),
        (SeqChunk((1, 2), -1, (0,)), "start_pos"),
        (SeqChunk((1,) * 5, 0, (0,)), "2 needed"),
        (SeqChunk((1,), 0, (32,)), "out of range"),
        (SeqChunk((1, 999), 0, (0,)), "token id"),
        (SeqChunk((1,), 512, tuple(range(32))), "context window"),
    ],
)
def test_bad_chunks_raise_and_leave_cache_untouched(runner, chunk, message) -> None:
    before = runner.storage.export_blocks(list(range(32)))
    good = SeqChunk((1, 2, 3), 0, (4,))
    with pytest.raises(ValueError, match=message):
        runner.execute([good, chunk])
    assert runner.storage.export_blocks(list(range(32))) == before


def test_attributes_and_copy_blocks(runner) -> None:
    assert runner.block_size == BLOCK and runner.device == torch.device("cpu")
    assert runner.bytes_per_block == kv_bytes_per_block(TINY, BLOCK)
    assert runner.bytes_per_block == 2 * 2 * BLOCK * 2 * 16 * 4  # L * KV * bs * n_kv * hd * 4B
    runner.execute([SeqChunk(tuple(_tokens(8, 4)), 0, (3, 9))])
    assert runner.copy_blocks(0, [3, 9], 0, [20, 21]) == 2 * runner.bytes_per_block
    assert runner.storage.export_blocks([20, 21]) == runner.storage.export_blocks([3, 9])


def test_copied_prefix_blocks_serve_a_new_sequence(runner) -> None:
    seq = _tokens(12, 5)
    full = runner.execute([SeqChunk(tuple(seq), 0, (0, 1, 2))])
    runner.copy_blocks(0, [0, 1], 0, [14, 15])  # reuse the first 8 positions' KV
    tail = runner.execute([SeqChunk(tuple(seq[8:]), 8, (14, 15, 16))])
    torch.testing.assert_close(tail, full, atol=1e-5, rtol=1e-5)


def test_num_blocks_for_memory() -> None:
    per_block = kv_bytes_per_block(TINY, 16)
    assert num_blocks_for_memory(TINY, 10 * per_block + 5, 16) == 10
    assert num_blocks_for_memory(TINY, per_block - 1, 16) == 0
    with pytest.raises(ValueError):
        num_blocks_for_memory(TINY, -1, 16)


def test_config_is_required_without_checkpoint() -> None:
    with pytest.raises(ValueError, match="config or a checkpoint"):
        ModelRunner(None, num_device_blocks=4)


def test_seed_changes_weights() -> None:
    chunk = SeqChunk(tuple(_tokens(5, 6)), 0, (0, 1))
    logits = []
    for seed in (0, 0, 1):
        r = ModelRunner(TINY, block_size=BLOCK, num_device_blocks=4, seed=seed, device="cpu")
        logits.append(r.execute([chunk]))
        r.close()
    assert torch.equal(logits[0], logits[1])
    assert not torch.allclose(logits[0], logits[2])


def test_bfloat16_runs() -> None:
    config = dataclasses.replace(TINY, dtype="bfloat16")
    r = ModelRunner(config, block_size=BLOCK, num_device_blocks=8, device="cpu")
    seq = _tokens(6, 7)
    logits = r.execute([SeqChunk(tuple(seq), 0, (0, 1))])
    with torch.no_grad():
        dense = r.model.forward_dense(torch.tensor(seq))[-1]
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits[0], dense, atol=0.15, rtol=0.05)
    r.close()
