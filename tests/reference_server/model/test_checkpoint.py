from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from reference_server.model.checkpoint import load_checkpoint, save_checkpoint
from reference_server.model.config import ModelConfig
from reference_server.model.llama import LlamaModel
from reference_server.model.runner import ModelRunner, SeqChunk

torch.set_num_threads(1)
TINY = ModelConfig.preset("tiny")
PROMPT = (256, 72, 101, 108, 108, 111, 44, 32, 119)
DATA = Path(__file__).parent / "data"


def _logits(runner: ModelRunner) -> torch.Tensor:
    return runner.execute([SeqChunk(PROMPT, 0, (0, 1, 2))])


@pytest.mark.parametrize("max_shard_bytes", [None, 40_000])
def test_round_trip_gives_identical_logits(tmp_path, max_shard_bytes) -> None:
    model = LlamaModel(TINY, seed=3)
    save_checkpoint(tmp_path, TINY, model, max_shard_bytes=max_shard_bytes)
    if max_shard_bytes:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    config, state = load_checkpoint(tmp_path)
    assert config == TINY
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name], tensor), name
    seeded = ModelRunner(TINY, block_size=4, num_device_blocks=4, seed=3, device="cpu")
    loaded = ModelRunner(None, block_size=4, num_device_blocks=4, checkpoint=tmp_path,
                         seed=99, device="cpu")
    assert loaded.config == TINY
    assert torch.equal(_logits(seeded), _logits(loaded))
    seeded.close()
    loaded.close()


def test_tied_embeddings_stored_once(tmp_path) -> None:
    config = dataclasses.replace(TINY, tie_word_embeddings=True)
    model = LlamaModel(config, seed=1)
    save_checkpoint(tmp_path, config, model)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    loaded_config, state = load_checkpoint(tmp_path)
    assert loaded_config.tie_word_embeddings
    assert torch.equal(state["lm_head.weight"], model.model.embed_tokens.weight)


def test_runner_rejects_mismatched_config(tmp_path) -> None:
    save_checkpoint(tmp_path, TINY, LlamaModel(TINY))
    other = dataclasses.replace(TINY, rope_theta=500.0)
    with pytest.raises(ValueError, match="rope_theta"):
        ModelRunner(other, num_device_blocks=4, checkpoint=tmp_path, device="cpu")


def test_dtype_conversion_on_load(tmp_path) -> None:
    config = dataclasses.replace(TINY, dtype="bfloat16")
    save_checkpoint(tmp_path, config, LlamaModel(TINY))  # float32 tensors on disk
    _, state = load_checkpoint(tmp_path)
    assert all(t.dtype == torch.bfloat16 for t in state.values())


def _saved(tmp_path):
    save_checkpoint(tmp_path, TINY, LlamaModel(TINY))
    return tmp_path


def test_missing_folder(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_missing_config(tmp_path) -> None:
    (_saved(tmp_path) / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json"):
        load_checkpoint(tmp_path)


def test_malformed_config(tmp_path) -> None:
    (_saved(tmp_path) / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match="malformed JSON"):
        load_checkpoint(tmp_path)


def test_no_weights(tmp_path) -> None:
    (_saved(tmp_path) / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_checkpoint(tmp_path)


def test_corrupt_weights(tmp_path) -> None:
    (_saved(tmp_path) / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot read"):
        load_checkpoint(tmp_path)


def test_missing_and_unexpected_tensors(tmp_path) -> None:
    path = _saved(tmp_path) / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match="missing: model.layers.1.mlp.up_proj.weight"):
        load_checkpoint(tmp_path)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 64)
    tensors["model.layers.1.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, path)
    with pytest.raises(ValueError, match="unexpected tensors: .*q_proj.bias"):
        load_checkpoint(tmp_path)


def test_shape_mismatch(tmp_path) -> None:
    path = _saved(tmp_path) / "model.safetensors"
    tensors = load_file(path)
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, path)
    with pytest.raises(ValueError, match="model.norm.weight has shape \\(65,\\)"):
        load_checkpoint(tmp_path)


def test_bad_index(tmp_path) -> None:
    save_checkpoint(tmp_path, TINY, LlamaModel(TINY), max_shard_bytes=40_000)
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["model.norm.weight"] = "model-99.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="shard files missing: model-99"):
        load_checkpoint(tmp_path)
    index.write_text("[]")
    with pytest.raises(ValueError, match="malformed index"):
        load_checkpoint(tmp_path)


def test_matches_hugging_face_transformers_logits() -> None:
    """A checkpoint saved by transformers 5.24 (see data/make_hf_golden.py) gives HF's logits,
    through chunked prefill and decode over scattered blocks."""
    golden = load_file(DATA / "hf_llama_golden_logits.safetensors")
    ids, expected = golden["token_ids"].tolist(), golden["logits"]
    runner = ModelRunner(None, block_size=4, num_device_blocks=12,
                         checkpoint=DATA / "hf_llama_golden", device="cpu")
    assert runner.config.rope_theta == 5000.0 and runner.config.num_kv_heads == 2
    table = (11, 2, 7, 0, 9, 4)
    rows = [runner.execute([SeqChunk(tuple(ids[:5]), 0, table, want_logits=False)]),
            runner.execute([SeqChunk(tuple(ids[5:14]), 5, table)])]
    rows += [runner.execute([SeqChunk((ids[p],), p, table)]) for p in range(14, len(ids))]
    torch.testing.assert_close(torch.cat(rows), expected[13:], atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        dense = runner.model.forward_dense(torch.tensor(ids))
    torch.testing.assert_close(dense, expected, atol=1e-4, rtol=1e-4)
    runner.close()
