"""The tensors behind the KV cache tiers: device, host memory and disk.

Every tier is one pool of fixed-size blocks with the same layout,
``(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)`` where the
``2`` axis is (K, V). A block therefore holds, for ``block_size`` consecutive
positions of one sequence, the keys and values of every layer.

* tier 0, device: the cache the model reads and writes (on the model's device);
* tier 1, host: a CPU tensor, pinned when the device is CUDA (fast transfers);
* tier 2, disk: a file-backed tensor (``torch.from_file``, shared mmap) under
  ``disk_path`` (a temporary folder by default); its file has a unique name and
  is removed on :meth:`KVStorage.close` (with the folder, if temporary).

Which block holds what is decided by the engine's block manager; this module
only moves bytes. All methods run on the engine thread, block until the copy is
complete and raise ValueError on bad ids.
"""

from __future__ import annotations

import operator
import os
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

import torch

from reference_server.model.config import ModelConfig

DEVICE_TIER = 0
HOST_TIER = 1
DISK_TIER = 2
TIER_NAMES = ("device", "host", "disk")

_DISK_PREFIX = "kv_blocks_"


def _is_index(value: object) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def kv_bytes_per_block(config: ModelConfig, block_size: int) -> int:
    """Bytes one block occupies in any tier: all layers, K and V."""
    elem = torch.empty((), dtype=config.torch_dtype).element_size()
    return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * elem


class KVStorage:
    """Block pools for the device, host and disk tiers, and copies between them.

    Not thread-safe: use from the engine thread only. ``close()`` releases the
    pools and removes the disk file (and the temporary folder if it made one).
    """

    def __init__(self, config: ModelConfig, *, block_size: int, num_device_blocks: int,
                 num_host_blocks: int = 0, num_disk_blocks: int = 0,
                 disk_path: str | Path | None = None, device: torch.device) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if num_device_blocks <= 0:
            raise ValueError(f"num_device_blocks must be > 0, got {num_device_blocks}")
        if num_host_blocks < 0 or num_disk_blocks < 0:
            raise ValueError("num_host_blocks and num_disk_blocks must be >= 0")
        self.config = config
        self.block_size = block_size
        self.device = torch.device(device)
        self.bytes_per_block = kv_bytes_per_block(config, block_size)
        self._block_shape = (block_size, config.num_kv_heads, config.head_dim)
        dtype = config.torch_dtype
        self._pools: list[torch.Tensor | None] = [
            torch.zeros(self._pool_shape(num_device_blocks), dtype=dtype, device=self.device),
            self._make_host_pool(num_host_blocks) if num_host_blocks else None,
            None,
        ]
        self._temp_dir: Path | None = None
        self._disk_file: Path | None = None
        if num_disk_blocks:
            self._pools[DISK_TIER] = self._make_disk_pool(num_disk_blocks, disk_path)
        self._closed = False

    def _pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        # (num_layers, 2, num_blocks, block_size, n_kv, head_dim)
        return (self.config.num_layers, 2, num_blocks, *self._block_shape)

    def _make_host_pool(self, num_blocks: int) -> torch.Tensor:
        pin = self.device.type == "cuda"
        return torch.zeros(self._pool_shape(num_blocks), dtype=self.config.torch_dtype,
                           pin_memory=pin)

    def _make_disk_pool(self, num_blocks: int, disk_path: str | Path | None) -> torch.Tensor:
        if disk_path is None:
            self._temp_dir = Path(tempfile.mkdtemp(prefix="kv_disk_tier_"))
            folder = self._temp_dir
        else:
            folder = Path(disk_path)
            folder.mkdir(parents=True, exist_ok=True)
        # A unique name, so several processes may share one disk_path.
        fd, name = tempfile.mkstemp(prefix=_DISK_PREFIX, suffix=".bin", dir=folder)
        os.close(fd)
        self._disk_file = Path(name)
        shape = self._pool_shape(num_blocks)
        numel = 1
        for dim in shape:
            numel *= dim
        # shared=True maps the file: writes to the tensor go to the file.
        pool = torch.from_file(str(self._disk_file), shared=True, size=numel,
                               dtype=self.config.torch_dtype)
        return pool.view(shape)

    @property
    def disk_file(self) -> Path | None:
        """The file backing the disk tier (None without one, or after close)."""
        return None if self._closed else self._disk_file

    def num_blocks(self, tier: int) -> int:
        """Blocks in ``tier`` (0 when the tier is not configured)."""
        self._check_tier_index(tier)
        pool = self._pools[tier]
        return 0 if pool is None else pool.shape[2]

    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, (k_cache, v_cache) views ``(num_blocks, block_size, n_kv, hd)`` of tier 0."""
        pool = self._pool(DEVICE_TIER)
        return [(pool[layer, 0], pool[layer, 1]) for layer in range(pool.shape[0])]

    def copy(self, src_tier: int, src_ids: Sequence[int], dst_tier: int,
             dst_ids: Sequence[int]) -> int:
        """Copy whole blocks ``src_ids`` of ``src_tier`` into ``dst_ids`` of ``dst_tier``.

        Tiers: 0 device, 1 host, 2 disk. Copies are real and complete on return
        (synchronous even on CUDA). Returns the number of bytes copied. Raises
        ValueError on unknown/unconfigured tiers, length mismatch, ids out of
        range or repeated destination ids.
        """
        src = self._pool(src_tier)
        dst = self._pool(dst_tier)
        if len(src_ids) != len(dst_ids):
            raise ValueError(
                f"copy: {len(src_ids)} source ids but {len(dst_ids)} destination ids")
        self._check_ids(src_tier, src_ids, unique=False)
        self._check_ids(dst_tier, dst_ids, unique=True)
        if not src_ids:
            return 0
        src_idx = torch.tensor(list(src_ids), dtype=torch.int64, device=src.device)
        dst_idx = torch.tensor(list(dst_ids), dtype=torch.int64, device=dst.device)
        blocks = src.index_select(2, src_idx)  # (L, 2, n, block_size, n_kv, hd), a copy
        dst.index_copy_(2, dst_idx, blocks.to(dst.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return len(src_ids) * self.bytes_per_block

    def export_blocks(self, ids: Sequence[int]) -> bytes:
        """Raw bytes of device blocks ``ids``, layout ``(L, 2, len(ids), block_size, n_kv, hd)``.

        The inverse of :meth:`import_blocks` on a storage of the same config and
        block size (e.g. in another process, after a socket transfer).
        """
        pool = self._pool(DEVICE_TIER)
        self._check_ids(DEVICE_TIER, ids, unique=False)
        idx = torch.tensor(list(ids), dtype=torch.int64, device=pool.device)
        blocks = pool.index_select(2, idx).cpu().contiguous()
        return blocks.view(torch.uint8).numpy().tobytes()

    def import_blocks(self, ids: Sequence[int], data: bytes) -> None:
        """Write ``data`` from :meth:`export_blocks` into device blocks ``ids``.

        Raises ValueError when the byte count is not ``len(ids) * bytes_per_block``.
        """
        pool = self._pool(DEVICE_TIER)
        self._check_ids(DEVICE_TIER, ids, unique=True)
        expected = len(ids) * self.bytes_per_block
        if len(data) != expected:
            raise ValueError(
                f"import_blocks: got {len(data)} bytes, expected {expected} "
                f"({len(ids)} blocks x {self.bytes_per_block} bytes)")
        if not ids:
            return
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        shape = (self.config.num_layers, 2, len(ids), *self._block_shape)
        blocks = raw.view(self.config.torch_dtype).view(shape)
        idx = torch.tensor(list(ids), dtype=torch.int64, device=pool.device)
        pool.index_copy_(2, idx, blocks.to(pool.device))

    def close(self) -> None:
        """Release every pool and remove disk files; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pools = [None, None, None]
        if self._disk_file is not None:
            self._disk_file.unlink(missing_ok=True)
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)

    def _check_tier_index(self, tier: int) -> None:
        if tier not in (DEVICE_TIER, HOST_TIER, DISK_TIER):
            raise ValueError(f"unknown tier {tier!r}; tiers are 0 device, 1 host, 2 disk")

    def _pool(self, tier: int) -> torch.Tensor:
        if self._closed:
            raise ValueError("KVStorage is closed")
        self._check_tier_index(tier)
        pool = self._pools[tier]
        if pool is None:
            raise ValueError(f"tier {tier} ({TIER_NAMES[tier]}) has no blocks configured")
        return pool

    def _check_ids(self, tier: int, ids: Sequence[int], *, unique: bool) -> None:
        limit = self.num_blocks(tier)
        for block_id in ids:
            if isinstance(block_id, bool) or not _is_index(block_id) \
                    or not 0 <= block_id < limit:
                raise ValueError(
                    f"block id {block_id!r} out of range for tier {tier} "
                    f"({TIER_NAMES[tier]}, {limit} blocks)")
        if unique and len(set(ids)) != len(ids):
            raise ValueError(f"repeated destination block ids for tier {tier}: {list(ids)}")
