"""The compiled CPU decode-attention kernel against SDPA and the PyTorch decode path."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_server.engine import Engine, EngineConfig
from reference_server.model import SamplingParams, decode_kernel
from reference_server.model.config import ModelConfig
from reference_server.model.runner import ModelRunner, SeqChunk

torch.set_num_threads(1)


def test_numba_is_installed_with_the_server_extra() -> None:
    # The kernel is what CPU deployments (and this suite) run; a silent fall back would hide a
    # broken install.
    assert decode_kernel.AVAILABLE
    assert decode_kernel.usable(torch.device("cpu"), torch.float32)
    assert not decode_kernel.usable(torch.device("cpu"), torch.bfloat16)
    assert not decode_kernel.usable(torch.device("meta"), torch.float32)


def test_decode_rows_lists_each_rows_blocks() -> None:
    rows = decode_kernel.decode_rows([5, 1, 8], [(9, 4, 7), (3,), (6, 0)], block_size=4)
    assert rows.block_ids.tolist() == [9, 4, 3, 6, 0]  # only the blocks a context reaches
    assert rows.offsets.tolist() == [0, 2, 3, 5]
    assert rows.context_lens.tolist() == [5, 1, 8]
    assert rows.max_len == 8


def _sdpa_row(q_row, keys, values):
    """q_row (n_heads, hd) over keys/values (length, n_kv, hd) -> (n_heads, hd)."""
    group = q_row.shape[0] // keys.shape[1]
    k = keys.transpose(0, 1).repeat_interleave(group, 0)  # (n_heads, length, hd)
    v = values.transpose(0, 1).repeat_interleave(group, 0)
    return F.scaled_dot_product_attention(q_row[:, None], k, v)[:, 0]


@settings(max_examples=40, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 3, 4, 16]), shape=st.sampled_from([(4, 4), (4, 2), (8, 2), (4, 1)]),
       head_dim=st.sampled_from([8, 64]))
def test_kernel_matches_sdpa_on_any_block_tables(data, block_size, shape, head_dim) -> None:
    num_heads, num_kv = shape  # MHA, GQA groups of 2 and 4, MQA
    lens = data.draw(st.lists(st.integers(1, 3 * block_size + 2), min_size=1, max_size=6))
    needed = [-(-n // block_size) for n in lens]
    perm = data.draw(st.permutations(range(sum(needed) + 2)))
    tables, used = [], 0
    for count in needed:
        tables.append(tuple(perm[used:used + count]))
        used += count
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    cache_shape = (len(perm), block_size, num_kv, head_dim)
    k_cache, v_cache = torch.randn(cache_shape, generator=gen) * 3, torch.randn(cache_shape, generator=gen)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    got = decode_kernel.paged_decode_attention(q, k_cache, v_cache,
                                               decode_kernel.decode_rows(lens, tables, block_size))
    expected = torch.stack([_sdpa_row(q[r], k_cache[list(t)].flatten(0, 1)[:n], v_cache[list(t)].flatten(0, 1)[:n])
                            for r, (n, t) in enumerate(zip(lens, tables))])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


TINY = ModelConfig.preset("tiny")


def _runners():
    made = {flag: ModelRunner(TINY, block_size=4, num_device_blocks=64, device="cpu", decode_kernel=flag)
            for flag in (True, False)}
    assert made[True].decode_kernel and not made[False].decode_kernel
    return made


def test_runner_logits_agree_with_the_pytorch_path_for_decode_and_mixed_steps() -> None:
    runners = _runners()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 14, 3)]
    tables = [(5, 17, 2), (8, 30, 41, 11), (60,)]
    prefill = [SeqChunk(tuple(p), 0, t) for p, t in zip(prompts, tables)]
    decode = [SeqChunk((7,), len(p), t) for p, t in zip(prompts, tables)]
    mixed = [decode[0], SeqChunk(tuple(prompts[1][:5]), 0, (33, 34)), decode[2]]
    for step in (prefill, decode, mixed):
        kernel, torch_path = (runners[flag].execute(step) for flag in (True, False))
        torch.testing.assert_close(kernel, torch_path, atol=1e-5, rtol=1e-5)
    for r in runners.values():
        r.close()


def test_engine_generates_the_same_greedy_tokens_with_either_decode_path() -> None:
    config = EngineConfig(model="tiny", block_size=4, num_device_blocks=96, max_num_batched_tokens=32, device="cpu")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 17, 30, 2, 11)]
    outputs = {}
    for flag in (True, False):
        runner = ModelRunner(TINY, block_size=4, num_device_blocks=96, device="cpu", decode_kernel=flag)
        with Engine(config, runner=runner) as engine:
            done = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        outputs[flag] = [c.token_ids for c in done]
    assert outputs[True] == outputs[False]
    assert all(len(t) == 12 for t in outputs[True])


def test_insisting_on_the_kernel_where_it_cannot_run_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="decode_kernel=True needs a CPU device, float32"):
        ModelRunner(dataclasses.replace(TINY, dtype="bfloat16"), block_size=4, num_device_blocks=8, device="cpu",
                    decode_kernel=True)
    r = ModelRunner(dataclasses.replace(TINY, dtype="bfloat16"), block_size=4, num_device_blocks=8, device="cpu")
    assert not r.decode_kernel  # the default falls back to the PyTorch path
    r.close()
