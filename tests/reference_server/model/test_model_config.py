from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from reference_server.model.config import ModelConfig, select_device


def test_presets_are_valid_and_distinct() -> None:
    tiny = ModelConfig.preset("tiny")
    small = ModelConfig.preset("small")
    assert tiny.num_layers == 2 and tiny.hidden_size == 64
    assert tiny.num_heads == 4 and tiny.num_kv_heads == 2 and tiny.max_position == 512
    assert small.num_layers == 8 and small.hidden_size == 512 and small.max_position == 4096
    assert tiny.num_queries_per_kv == 2
    assert tiny.torch_dtype == torch.float32
    assert set(ModelConfig.preset_names()) == {"tiny", "small"}


def test_unknown_preset_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="tiny.*small|small.*tiny"):
        ModelConfig.preset("huge")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"head_dim": 8}, "head_dim"),
        ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"num_layers": 0}, "num_layers"),
        ({"eos_token_id": 10_000}, "eos_token_id"),
        ({"bos_token_id": -1}, "bos_token_id"),
        ({"dtype": "int8"}, "dtype"),
        ({"rope_theta": 0.0}, "rope_theta"),
    ],
)
def test_validation_names_the_problem(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(ModelConfig.preset("tiny"), **change)


def test_hf_config_round_trip(tmp_path) -> None:
    config = dataclasses.replace(ModelConfig.preset("tiny"), tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    assert ModelConfig.from_hf_config(tmp_path) == config
    assert ModelConfig.from_hf_config(tmp_path / "config.json") == config


def test_hf_config_defaults_and_eos_list(tmp_path) -> None:
    raw = {
        "model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 128,
        "eos_token_id": [7, 8], "bos_token_id": 1,
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = ModelConfig.from_hf_config(tmp_path)
    assert config.num_kv_heads == 4 and config.head_dim == 8
    assert config.eos_token_id == 7 and config.rope_theta == 10000.0


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no config.json"),
        ("{not json", "malformed JSON"),
        ('{"model_type": "llama"}', "missing required key"),
        ('{"model_type": "gpt2"}', "not Llama-style"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_hf_config_errors(tmp_path, content: str | None, message: str) -> None:
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(tmp_path)


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_rope_scaling_is_rejected(tmp_path, key: str) -> None:
    raw = ModelConfig.preset("tiny").to_hf_dict() | {key: {"rope_type": "llama3"}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=f"{key} type 'llama3'"):
        ModelConfig.from_hf_config(tmp_path)


def test_transformers_v5_rope_parameters(tmp_path) -> None:
    raw = ModelConfig.preset("tiny").to_hf_dict()
    del raw["rope_theta"]
    raw["rope_parameters"] = {"rope_theta": 5000.0, "rope_type": "default"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert ModelConfig.from_hf_config(tmp_path).rope_theta == 5000.0


def test_select_device() -> None:
    assert select_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert select_device().type == expected
    assert select_device() is select_device()  # decided once
    with pytest.raises(ValueError, match="device"):
        select_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            select_device("cuda")
