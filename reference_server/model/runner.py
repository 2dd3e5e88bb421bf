"""ModelRunner: runs one forward pass of a mixed batch over the paged KV cache.

The engine hands the runner a list of :class:`SeqChunk` per step (prefill
chunks and decode tokens of different requests, each with its block table) and
gets back the logits of the chunks that asked for them. The runner owns the
model weights and the KV tiers (:class:`KVStorage`); it knows nothing about
requests, scheduling or block allocation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from reference_server.model import decode_kernel as _decode_kernel
from reference_server.model.attention import GatherBuffers, build_attention_metadata
from reference_server.model.checkpoint import load_checkpoint
from reference_server.model.config import ModelConfig, select_device
from reference_server.model.kv_storage import KVStorage, kv_bytes_per_block
from reference_server.model.llama import LlamaModel


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """New tokens of one sequence to compute in this step.

    ``token_ids[0]`` sits at position ``start_pos`` (= how many of the sequence's
    tokens already have their KV in the cache). ``block_table`` lists the device
    block ids covering positions ``[0, start_pos + len(token_ids))``, in order.
    ``want_logits`` is False for non-final prefill chunks (no logits row returned).
    ``num_logits``: rows returned for the chunk's last tokens (a speculative verify chunk
    asks for one per position; 1 otherwise).
    """

    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    want_logits: bool = True
    num_logits: int = 1


MAX_VERIFY_ROWS = 16
"""A chunk that wants logits at every position (a speculative verify chunk) of at most this
many tokens runs as that many one-token rows through the decode kernel: each row attends to
the positions up to its own, after every row's keys and values were written, which is the
chunk's causal attention; on the CPU it is cheaper than the prefill path, and its arithmetic
is plain decoding's."""


def _verify_as_decode_rows(chunks: Sequence[SeqChunk]) -> list[SeqChunk]:
    out: list[SeqChunk] = []
    for c in chunks:
        n = len(c.token_ids)
        if c.want_logits and 1 < n == c.num_logits <= MAX_VERIFY_ROWS:
            out.extend(SeqChunk((t,), c.start_pos + i, c.block_table) for i, t in enumerate(c.token_ids))
        else:
            out.append(c)
    return out


def num_blocks_for_memory(config: ModelConfig, num_bytes: int, block_size: int) -> int:
    """How many KV blocks of ``block_size`` tokens fit in ``num_bytes``."""
    if num_bytes < 0 or block_size <= 0:
        raise ValueError("num_bytes must be >= 0 and block_size > 0")
    return num_bytes // kv_bytes_per_block(config, block_size)


class ModelRunner:
    """Model weights + KV tiers + the forward pass for a batch of chunks.

    ``config`` may be None when ``checkpoint`` is given (the checkpoint's
    config is used); when both are given they must agree (ValueError naming
    the differing fields). Weights are seeded-random (``seed``) without a
    checkpoint. The device is chosen once here (:func:`select_device`), and so is
    the decode attention: ``decode_kernel`` None uses the compiled CPU kernel
    (:mod:`~reference_server.model.decode_kernel`) wherever it can run (CPU,
    float32, Numba installed), True insists on it (ValueError where it cannot run),
    False keeps the PyTorch path; the kernel is compiled here, before the first step.
    Not thread-safe: every method is called from the engine thread and blocks
    until its work is done.
    """

    def __init__(self, config: ModelConfig | None, *, block_size: int = 16,
                 num_device_blocks: int, num_host_blocks: int = 0, num_disk_blocks: int = 0,
                 disk_path: str | None = None, device: str | torch.device | None = None,
                 checkpoint: str | Path | None = None, seed: int = 0,
                 decode_kernel: bool | None = None) -> None:
        state_dict = None
        if checkpoint is not None:
            ckpt_config, state_dict = load_checkpoint(checkpoint)
            if config is not None and config != ckpt_config:
                raise ValueError(
                    f"config differs from the checkpoint's in: "
                    f"{', '.join(config.differences(ckpt_config))}")
            config = ckpt_config
        if config is None:
            raise ValueError("ModelRunner needs a config or a checkpoint")
        self.config = config
        self.device = select_device(device)
        usable = _decode_kernel.usable(self.device, config.torch_dtype)
        if decode_kernel and not usable:
            raise ValueError(
                f"decode_kernel=True needs a CPU device, float32 weights and Numba installed; have "
                f"{self.device.type}, {config.dtype}, Numba {'installed' if _decode_kernel.AVAILABLE else 'missing'}")
        self.decode_kernel = usable if decode_kernel is None else decode_kernel  # decided once
        if self.decode_kernel:
            _decode_kernel.warm_up()  # compile at start, not in a request's first decode step
        self.block_size = block_size
        model = LlamaModel(config, seed=None if state_dict is not None else seed)
        if state_dict is not None:
            model.load_state_dict(state_dict, strict=True)
        self.model = model.place(self.device).eval()
        self.storage = KVStorage(
            config, block_size=block_size, num_device_blocks=num_device_blocks,
            num_host_blocks=num_host_blocks, num_disk_blocks=num_disk_blocks,
            disk_path=disk_path, device=self.device)
        self.bytes_per_block = self.storage.bytes_per_block
        self._kv_caches = self.storage.layer_caches()
        self._num_device_blocks = num_device_blocks
        self._buffers = GatherBuffers()

    def execute(self, chunks: Sequence[SeqChunk], *, num_layers: int | None = None) -> torch.Tensor:
        """One forward pass over all ``chunks``; writes their K/V into the device tier.

        Returns float32 logits ``(rows, vocab_size)``: ``num_logits`` rows (the last
        tokens', in position order) per chunk with ``want_logits``, in chunk order (on
        the runner's device). ``num_layers`` runs only the first layers (early exit;
        the other layers' cache is untouched).
        Raises ValueError on bad chunks (empty, out-of-range token or block ids,
        block table too short, past the context window) before touching the cache.
        """
        for chunk in chunks:
            self._check_chunk(chunk)
        if not chunks:
            return torch.empty((0, self.config.vocab_size), device=self.device)
        if num_layers is not None and not 1 <= num_layers <= self.config.num_layers:
            raise ValueError(f"num_layers must be in [1, {self.config.num_layers}], got {num_layers}")
        with torch.inference_mode():
            return self._forward(chunks, num_layers)

    def _forward(self, chunks: Sequence[SeqChunk], num_layers: int | None = None) -> torch.Tensor:
        if self.decode_kernel and any(c.num_logits > 1 for c in chunks):
            chunks = _verify_as_decode_rows(chunks)
        token_ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        for chunk in chunks:
            token_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, chunk.start_pos + len(chunk.token_ids)))
            if chunk.want_logits:
                logit_rows.extend(range(len(token_ids) - chunk.num_logits, len(token_ids)))
        meta = build_attention_metadata(
            [len(c.token_ids) for c in chunks], [c.start_pos for c in chunks],
            [c.block_table for c in chunks], block_size=self.block_size, device=self.device,
            buffers=self._buffers, decode_kernel=self.decode_kernel)
        hidden = self.model(
            torch.tensor(token_ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            meta, self._kv_caches, num_layers=num_layers)  # (num_tokens, hidden)
        rows = torch.tensor(logit_rows, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(hidden[rows])  # (num_logit_rows, vocab)

    def _check_chunk(self, chunk: SeqChunk) -> None:
        length = len(chunk.token_ids)
        if length == 0:
            raise ValueError("SeqChunk.token_ids is empty")
        if not 1 <= chunk.num_logits <= length:
            raise ValueError(f"SeqChunk.num_logits must be in [1, {length}], got {chunk.num_logits}")
        if chunk.start_pos < 0:
            raise ValueError(f"SeqChunk.start_pos must be >= 0, got {chunk.start_pos}")
        end = chunk.start_pos + length
        if end > self.config.max_position:
            raise ValueError(
                f"SeqChunk reaches position {end}, past the context window "
                f"({self.config.max_position} tokens)")
        needed = -(-end // self.block_size)
        if len(chunk.block_table) < needed:
            raise ValueError(
                f"SeqChunk.block_table has {len(chunk.block_table)} blocks, "
                f"{needed} needed for {end} positions of block size {self.block_size}")
        for block_id in chunk.block_table[:needed]:
            if not 0 <= block_id < self._num_device_blocks:
                raise ValueError(
                    f"SeqChunk block id {block_id} out of range "
                    f"(device tier has {self._num_device_blocks} blocks)")
        if min(chunk.token_ids) < 0 or max(chunk.token_ids) >= self.config.vocab_size:
            raise ValueError(
                f"SeqChunk token id out of range [0, {self.config.vocab_size})")

    def copy_blocks(self, src_tier: int, src_ids: Sequence[int], dst_tier: int,
                    dst_ids: Sequence[int]) -> int:
        """Copy whole KV blocks between tiers; returns bytes copied (see KVStorage.copy)."""
        return self.storage.copy(src_tier, src_ids, dst_tier, dst_ids)

    def close(self) -> None:
        """Release the KV tiers (and their disk files); idempotent."""
        self.storage.close()
        self._kv_caches = []
