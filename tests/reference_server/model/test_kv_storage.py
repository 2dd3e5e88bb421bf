from __future__ import annotations

import pytest
import torch

from reference_server.model.config import ModelConfig
from reference_server.model.kv_storage import KVStorage, kv_bytes_per_block

torch.set_num_threads(1)
TINY = ModelConfig.preset("tiny")
BLOCK = 4


@pytest.fixture()
def storage(tmp_path):
    s = KVStorage(TINY, block_size=BLOCK, num_device_blocks=8, num_host_blocks=6,
                  num_disk_blocks=5, disk_path=tmp_path / "disk", device=torch.device("cpu"))
    yield s
    s.close()


def _fill_device(storage: KVStorage, seed: int) -> None:
    data = torch.randn(TINY.num_layers, 2, 8, BLOCK, TINY.num_kv_heads, TINY.head_dim,
                       generator=torch.Generator().manual_seed(seed))
    storage.import_blocks(list(range(8)), data.numpy().tobytes())


def test_bytes_per_block() -> None:
    # layers * (K, V) * block_size * n_kv * head_dim * 4 bytes
    assert kv_bytes_per_block(TINY, BLOCK) == 2 * 2 * BLOCK * 2 * 16 * 4


def test_device_host_disk_device_preserves_bytes(storage, tmp_path) -> None:
    _fill_device(storage, 0)
    original = storage.export_blocks([2, 5, 7])
    per_block = storage.bytes_per_block
    assert storage.copy(0, [2, 5, 7], 1, [4, 0, 1]) == 3 * per_block
    assert storage.copy(1, [4, 0, 1], 2, [3, 1, 4]) == 3 * per_block
    assert storage.disk_file.parent == tmp_path / "disk"
    assert storage.disk_file.stat().st_size == 5 * per_block
    _fill_device(storage, 1)  # overwrite the device tier
    assert storage.export_blocks([0, 1, 6]) != original
    assert storage.copy(2, [3, 1, 4], 0, [0, 1, 6]) == 3 * per_block
    assert storage.export_blocks([0, 1, 6]) == original


def test_copy_touches_only_destination_blocks(storage) -> None:
    _fill_device(storage, 2)
    before = storage.export_blocks(list(range(8)))
    storage.copy(0, [0], 1, [0])
    storage.copy(1, [0], 0, [3])  # block 3 := block 0
    after = storage.export_blocks(list(range(8)))
    per_block = storage.bytes_per_block
    blocks_before = torch.frombuffer(bytearray(before), dtype=torch.float32).view(
        TINY.num_layers, 2, 8, -1)
    blocks_after = torch.frombuffer(bytearray(after), dtype=torch.float32).view(
        TINY.num_layers, 2, 8, -1)
    assert torch.equal(blocks_after[:, :, 3], blocks_before[:, :, 0])
    unchanged = [i for i in range(8) if i != 3]
    assert torch.equal(blocks_after[:, :, unchanged], blocks_before[:, :, unchanged])
    assert len(after) == 8 * per_block


def test_export_import_round_trip_between_storages(storage) -> None:
    _fill_device(storage, 3)
    data = storage.export_blocks([6, 1])
    other = KVStorage(TINY, block_size=BLOCK, num_device_blocks=4, device=torch.device("cpu"))
    other.import_blocks([2, 0], data)
    assert other.export_blocks([2, 0]) == data
    assert other.export_blocks([1]) == bytes(other.bytes_per_block)  # untouched block is zero
    other.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, [0], 3, [0]), "unknown tier"),
        ((0, [0, 1], 1, [0]), "2 source ids but 1"),
        ((0, [8], 1, [0]), "out of range for tier 0"),
        ((0, [0], 2, [5]), "out of range for tier 2"),
        ((0, [0, 1], 1, [2, 2]), "repeated destination"),
        ((0, [-1], 1, [0]), "out of range"),
    ],
)
def test_copy_validation(storage, args, message) -> None:
    with pytest.raises(ValueError, match=message):
        storage.copy(*args)


def test_unconfigured_tier_and_import_size() -> None:
    s = KVStorage(TINY, block_size=BLOCK, num_device_blocks=2, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="host.*no blocks"):
        s.copy(0, [0], 1, [0])
    with pytest.raises(ValueError, match="expected"):
        s.import_blocks([0], b"123")
    assert s.copy(0, [], 0, []) == 0
    s.close()
    with pytest.raises(ValueError, match="closed"):
        s.export_blocks([0])


def test_close_removes_temporary_disk_folder() -> None:
    s = KVStorage(TINY, block_size=BLOCK, num_device_blocks=2, num_disk_blocks=2,
                  device=torch.device("cpu"))
    file = s.disk_file
    assert file is not None and file.exists()
    s.close()
    s.close()  # idempotent
    assert not file.parent.exists() and s.disk_file is None


def test_two_storages_share_a_disk_path(tmp_path) -> None:
    a, b = (KVStorage(TINY, block_size=BLOCK, num_device_blocks=2, num_disk_blocks=2,
                      disk_path=tmp_path, device=torch.device("cpu")) for _ in range(2))
    assert a.disk_file != b.disk_file
    a.import_blocks([0], b"\x01" * a.bytes_per_block)
    a.copy(0, [0], 2, [1])
    assert b.copy(2, [1], 0, [0]) == b.bytes_per_block
    assert b.export_blocks([0]) == bytes(b.bytes_per_block)  # b's disk tier is its own
    a_file = a.disk_file
    a.close()
    assert not a_file.exists() and b.disk_file.exists() and tmp_path.exists()
    b.close()


def test_bad_sizes() -> None:
    with pytest.raises(ValueError, match="num_device_blocks"):
        KVStorage(TINY, block_size=BLOCK, num_device_blocks=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="block_size"):
        KVStorage(TINY, block_size=0, num_device_blocks=1, device=torch.device("cpu"))
