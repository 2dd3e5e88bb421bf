"""Micro-benchmark: paged attention of the model runner against a dense-padded baseline (CPU).

Times one forward pass (``ModelRunner.execute``) on the ``small`` preset (random
weights, 1 torch thread) for:

* decode steps at batch 1, 16 and 48 with mixed, heavy-tailed context lengths
  (20..590 tokens, scattered KV blocks), and
* a prefill step of four prompts (126..500 tokens, one of them a continuation chunk).

Each is run with the current paged attention (decode rows through the compiled CPU
kernel, :mod:`reference_server.model.decode_kernel`, when Numba is installed), with the
PyTorch decode path it replaces where the kernel cannot run (``gather``: blocks gathered,
one SDPA call per length bucket), and with a *baseline* built in the same
process: the decode path of the original implementation, which pads every decode row
to the longest context of the batch, gathers those blocks and runs one masked SDPA
call, and prefill through SDPA with a full ``(chunk, context)`` mask and 3-D inputs.
The two are interleaved and the minimum of this process's CPU time over repetitions
is kept (other processes on a shared machine inflate wall time). The outputs of all
three are checked to agree within 1e-4.

Run: ``.venv/bin/python benchmarks/model.py`` (about a minute). The last line is
``paged_vs_dense_decode_step=<baseline / current time of the batch-48 decode step>``.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reference_server.model import (  # noqa: E402
    ModelConfig,  # noqa: E402
    attention,
    llama,
)
from reference_server.model.runner import ModelRunner, SeqChunk  # noqa: E402

BLOCK_SIZE = 16


def gather(cache: torch.Tensor, block_ids: torch.Tensor, name: str,
           buffers: attention.GatherBuffers | None) -> torch.Tensor:
    """Blocks ``block_ids`` ``(n,)`` of a cache, into a reused buffer as the original did."""
    if buffers is None:
        return cache.index_select(0, block_ids)
    shape = (block_ids.shape[0], *cache.shape[1:])  # (n, block_size, n_kv, hd)
    return torch.index_select(cache, 0, block_ids, out=buffers.get(name, shape, cache))


def padded_decode_view(chunks: list[SeqChunk], *, block_size: int,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The original implementation's view of a batch's decode (one-token) chunks, in batch
    order: their block tables padded with block 0 to the longest context, and the mask of
    each row's real keys. Returns tables ``(n_dec, max_blocks)`` int64 and mask
    ``(n_dec, 1, 1, max_blocks * block_size)`` bool, False on padding."""
    decodes = [c for c in chunks if len(c.token_ids) == 1]
    if not decodes:
        empty = torch.zeros((0, 1), dtype=torch.int64, device=device)
        return empty, torch.ones((0, 1, 1, 1), dtype=torch.bool, device=device)
    context_lens = [c.start_pos + 1 for c in decodes]
    max_blocks = -(-max(context_lens) // block_size)
    padded = [list(c.block_table[:max_blocks]) + [0] * (max_blocks - len(c.block_table[:max_blocks]))
              for c in decodes]
    tables = torch.tensor(padded, dtype=torch.int64, device=device)  # (n_dec, max_blocks)
    lens = torch.tensor(context_lens, dtype=torch.int64, device=device)  # (n_dec,)
    key_pos = torch.arange(max_blocks * block_size, device=device)  # (max_blocks * block_size,)
    mask = key_pos[None, :] < lens[:, None]  # (n_dec, max_blocks * block_size)
    return tables, mask[:, None, None, :]  # mask: (n_dec, 1, 1, max_blocks * block_size)


class DensePaddedAttention:
    """Baseline, a drop-in for ``llama.paged_attention`` over one batch: decode rows padded
    to the longest context (one masked SDPA call), prefill with a full mask (3-D). Make one
    per ``execute`` of ``chunks``: like the original, it builds its padded view once per step."""

    def __init__(self, chunks: list[SeqChunk], *, block_size: int, device: torch.device) -> None:
        self.tables, self.mask = padded_decode_view(chunks, block_size=block_size, device=device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: attention.AttentionMetadata) -> torch.Tensor:
        attention.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.decode_token_idx.numel():
            out.index_copy_(0, meta.decode_token_idx, self._decode(q, k_cache, v_cache, meta))
        for group in meta.prefills:
            out[group.token_start:group.token_end] = _dense_prefill(q, k_cache, v_cache, group, meta.buffers)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: attention.AttentionMetadata) -> torch.Tensor:
        """The decode rows' attention, ``(n_dec, n_heads, hd)``."""
        num_kv, head_dim = k_cache.shape[2], k_cache.shape[3]
        n_dec = self.tables.shape[0]
        keys = gather(k_cache, self.tables.reshape(-1), "k", meta.buffers).view(n_dec, -1, num_kv, head_dim)
        values = gather(v_cache, self.tables.reshape(-1), "v", meta.buffers).view(n_dec, -1, num_kv, head_dim)
        rows = q.index_select(0, meta.decode_token_idx)  # (n_dec, n_heads, hd)
        dec = F.scaled_dot_product_attention(
            rows.view(n_dec, num_kv, -1, head_dim), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=self.mask)  # (n_dec, n_kv, group, hd)
        return dec.reshape(rows.shape)


def _dense_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   group: attention.PrefillGroup, buffers: attention.GatherBuffers | None) -> torch.Tensor:
    """One prefill chunk through SDPA with its full ``(chunk, context)`` mask, 3-D inputs:
    ``(chunk_len, n_heads, hd)``."""
    num_kv, head_dim = k_cache.shape[2], k_cache.shape[3]
    ctx = group.context_len
    keys = gather(k_cache, group.block_ids, "k", buffers).view(-1, num_kv, head_dim)[:ctx]
    values = gather(v_cache, group.block_ids, "v", buffers).view(-1, num_kv, head_dim)[:ctx]
    chunk = q[group.token_start:group.token_end]
    res = F.scaled_dot_product_attention(
        chunk.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
        attn_mask=group.mask, enable_gqa=True)  # (n_heads, chunk_len, hd)
    return res.transpose(0, 1)


def decode_batch(num_rows: int, num_blocks: int, rng: random.Random) -> list[SeqChunk]:
    """Decode chunks with heavy-tailed contexts (20..590) on scattered, disjoint blocks."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    chunks = []
    for _ in range(num_rows):
        context = min(590, 20 + int(rng.paretovariate(1.2) * 40))
        needed = -(-context // BLOCK_SIZE)
        table, free = tuple(free[:needed]), free[needed:]
        chunks.append(SeqChunk((rng.randrange(256),), context - 1, table))
    return chunks


def prefill_batch(num_blocks: int, rng: random.Random) -> list[SeqChunk]:
    """Four prompt chunks as a 512-token step schedules them (one continues a prompt)."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    chunks = []
    for length, start in ((126, 0), (145, 0), (500, 0), (235, 278)):
        needed = -(-(start + length) // BLOCK_SIZE)
        table, free = tuple(free[:needed]), free[needed:]
        tokens = tuple(rng.randrange(256) for _ in range(length))
        chunks.append(SeqChunk(tokens, start, table))
    return chunks


def cpu_ms(fn: Callable[[], object]) -> float:
    start = time.process_time()
    fn()
    return (time.process_time() - start) * 1000


def compare(runner: ModelRunner, chunks: list[SeqChunk], reps: int) -> dict[str, float]:
    """Minimum CPU ms of one execute per variant, interleaved; checks that the outputs agree.

    ``current``: the runner as configured (decode rows through the compiled kernel where it
    can run); ``gather``: the PyTorch decode path (blocks gathered, SDPA per length bucket);
    ``baseline``: :class:`DensePaddedAttention` (its padded view built inside the timing).
    """
    current_fn, current_kernel = llama.paged_attention, runner.decode_kernel

    def baseline() -> DensePaddedAttention:
        return DensePaddedAttention(chunks, block_size=runner.block_size, device=runner.device)

    # name -> (makes the attention function for one execute, decode kernel on)
    variants = {"current": (lambda: current_fn, current_kernel), "gather": (lambda: current_fn, False),
                "baseline": (baseline, False)}
    best = {name: float("inf") for name in variants}
    outputs = {}

    def run(name: str) -> None:
        make_attention, runner.decode_kernel = variants[name]
        llama.paged_attention = make_attention()
        outputs[name] = runner.execute(chunks)

    try:
        for rep in range(reps + 1):  # the first round warms up (and compiles) and is not timed
            order = list(variants) if rep % 2 else list(variants)[::-1]
            for name in order:
                elapsed = cpu_ms(lambda: run(name))
                if rep:
                    best[name] = min(best[name], elapsed)
    finally:
        llama.paged_attention, runner.decode_kernel = current_fn, current_kernel
    for name in ("gather", "baseline"):
        torch.testing.assert_close(outputs["current"], outputs[name], atol=1e-4, rtol=1e-4)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions of each case")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, {platform.processor() or 'cpu'}, "
          f"python {platform.python_version()}, torch {torch.__version__} ({args.threads} thread), "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}, model preset {args.model!r}")
    rng = random.Random(args.seed)
    num_blocks = 2048
    runner = ModelRunner(ModelConfig.preset(args.model), block_size=BLOCK_SIZE,
                         num_device_blocks=num_blocks, device="cpu", seed=args.seed)
    with torch.inference_mode():
        for layer_k, layer_v in runner.storage.layer_caches():  # finite, non-zero context
            layer_k.normal_()
            layer_v.normal_()
    ratio = 0.0
    cases = [(f"decode batch {n}", decode_batch(n, num_blocks, rng)) for n in (1, 16, 48)]
    cases.append(("prefill 4 chunks, 1006 tokens", prefill_batch(num_blocks, rng)))
    print(f"decode attention of the current runner: {'compiled kernel' if runner.decode_kernel else 'PyTorch'}")
    print(f"{'case':>30}  {'contexts':>22}  {'paged ms':>9}  {'gather ms':>9}  {'baseline ms':>11}  ratio")
    for label, chunks in cases:
        contexts = [c.start_pos + len(c.token_ids) for c in chunks]
        ms = compare(runner, chunks, args.reps)
        span = f"{min(contexts)}..{max(contexts)} (mean {sum(contexts) / len(contexts):.0f})"
        print(f"{label:>30}  {span:>22}  {ms['current']:9.1f}  {ms['gather']:9.1f}  {ms['baseline']:11.1f}  "
              f"{ms['baseline'] / ms['current']:.2f}x")
        if label == "decode batch 48":
            ratio = ms["baseline"] / ms["current"]
    runner.close()
    print(f"paged_vs_dense_decode_step={ratio:.2f}")


if __name__ == "__main__":
    main()
