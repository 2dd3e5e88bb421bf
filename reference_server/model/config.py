"""Model configuration: architecture sizes, presets, HF config loading, device choice.

A :class:`ModelConfig` describes a Llama-style decoder (RMSNorm, RoPE, SwiGLU,
grouped-query attention). It is a frozen value: build it from a preset
(``ModelConfig.preset("tiny")``), from a Hugging Face ``config.json``
(``ModelConfig.from_hf_config(path)``) or directly; every constructor validates.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

# Torch dtypes the model may run in, by the names HF configs use.
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

# Byte-level tokenizer layout shared by the presets: 256 byte ids, then bos, eos, pad.
_BYTE_VOCAB = 259
_BYTE_BOS = 256
_BYTE_EOS = 257


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture of a Llama-style decoder; validated on construction.

    Raises ValueError from ``__post_init__`` when sizes are not positive, when
    ``head_dim * num_heads != hidden_size``, when ``num_heads`` is not a multiple
    of ``num_kv_heads``, when ``head_dim`` is odd (RoPE rotates pairs) or when a
    token id or dtype is out of range.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # SwiGLU inner width
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA groups)
    head_dim: int
    max_position: int  # context window, tokens
    rope_theta: float
    rms_norm_eps: float
    eos_token_id: int
    bos_token_id: int | None
    dtype: str = "float32"  # one of float32, float16, bfloat16
    tie_word_embeddings: bool = False  # lm_head shares embed_tokens' weight

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.head_dim * self.num_heads != self.hidden_size:
            raise ValueError(
                f"ModelConfig: head_dim ({self.head_dim}) * num_heads ({self.num_heads}) "
                f"must equal hidden_size ({self.hidden_size})")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"ModelConfig: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ValueError("ModelConfig.rope_theta and rms_norm_eps must be > 0")
        for name in ("eos_token_id", "bos_token_id"):
            value = getattr(self, name)
            if value is None and name == "bos_token_id":
                continue
            if not isinstance(value, int) or not 0 <= value < self.vocab_size:
                raise ValueError(
                    f"ModelConfig.{name} must be an int in [0, {self.vocab_size}), got {value!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(
                f"ModelConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of weights, activations and the KV cache."""
        return _DTYPES[self.dtype]

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def preset_names(cls) -> tuple[str, ...]:
        """Names accepted by :meth:`preset`."""
        return tuple(_PRESETS)

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """A named configuration; raises ValueError listing presets when unknown.

        ``tiny``: for tests (2 layers, hidden 64), runs in milliseconds.
        ``small``: for demos and benchmarks on a CPU (8 layers, hidden 512, ~25M
        parameters): a batch-16 decode step takes tens of ms and a prefill costs
        clearly more per request than a decode step.
        Both use the byte tokenizer's vocabulary (259 ids: bytes, bos, eos, pad).
        """
        try:
            return cls(**_PRESETS[name])
        except KeyError:
            raise ValueError(
                f"unknown model preset {name!r}; known presets: {', '.join(_PRESETS)}") from None

    @classmethod
    def from_hf_config(cls, path: str | Path) -> ModelConfig:
        """Read a Llama-style Hugging Face ``config.json`` (a file or a folder holding one).

        Raises ValueError when the file is missing, is not valid JSON, lacks a
        required key, describes another architecture or uses RoPE scaling.
        """
        return cls.from_hf_dict(_read_config_json(Path(path)))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from the parsed contents of an HF ``config.json``; see :meth:`from_hf_config`."""
        model_type = raw.get("model_type", "llama")
        if model_type not in ("llama", "mistral"):
            raise ValueError(f"config.json: model_type {model_type!r} is not Llama-style")
        if raw.get("attention_bias") or raw.get("mlp_bias"):
            raise ValueError("config.json: attention_bias / mlp_bias are not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act {raw['hidden_act']!r} is not supported")
        try:
            hidden = raw["hidden_size"]
            num_heads = raw["num_attention_heads"]
            fields = {
                "vocab_size": raw["vocab_size"],
                "hidden_size": hidden,
                "intermediate_size": raw["intermediate_size"],
                "num_layers": raw["num_hidden_layers"],
                "num_heads": num_heads,
                "num_kv_heads": raw.get("num_key_value_heads") or num_heads,
                "head_dim": raw.get("head_dim") or hidden // num_heads,
                "max_position": raw["max_position_embeddings"],
                "rope_theta": _rope_theta(raw),
                "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
                "eos_token_id": _first_id(raw.get("eos_token_id")),
                "bos_token_id": _first_id(raw.get("bos_token_id")),
                "dtype": raw.get("torch_dtype") or raw.get("dtype") or "float32",
                "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
            }
        except KeyError as exc:
            raise ValueError(f"config.json: missing required key {exc.args[0]!r}") from None
        except TypeError as exc:
            raise ValueError(f"config.json: bad value type ({exc})") from None
        if fields["eos_token_id"] is None:
            raise ValueError("config.json: missing required key 'eos_token_id'")
        return cls(**fields)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` contents describing this model (inverse of from_hf_dict)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "eos_token_id": self.eos_token_id,
            "bos_token_id": self.bos_token_id,
            "torch_dtype": self.dtype,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
        }

    def differences(self, other: ModelConfig) -> list[str]:
        """Names of the fields whose values differ from ``other``'s."""
        mine, theirs = asdict(self), asdict(other)
        return [name for name in mine if mine[name] != theirs[name]]


def _rope_theta(raw: dict[str, Any]) -> float:
    """RoPE base from ``rope_theta`` or (transformers >= 5) ``rope_parameters``.

    Only plain RoPE is implemented: any scaling type other than "default"
    (llama3, yarn, linear, dynamic ...) raises ValueError.
    """
    theta = raw.get("rope_theta", 10000.0)
    for key in ("rope_scaling", "rope_parameters"):
        params = raw.get(key)
        if not params:
            continue
        if not isinstance(params, dict):
            raise ValueError(f"config.json: {key} must be an object")
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise ValueError(f"config.json: {key} type {kind!r} is not supported by this model")
        theta = params.get("rope_theta", theta)
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
        raise ValueError(f"config.json: rope_theta must be a number, got {theta!r}")
    return float(theta)


def _first_id(value: Any) -> int | None:
    """HF configs give eos ids as an int or a list of ints; take the first."""
    if isinstance(value, list):
        return value[0] if value else None
    return value


def _read_config_json(path: Path) -> dict[str, Any]:
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"no config.json at {file}")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file}: malformed JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return raw


_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=_BYTE_VOCAB, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, max_position=512, rope_theta=10000.0,
        rms_norm_eps=1e-5, eos_token_id=_BYTE_EOS, bos_token_id=_BYTE_BOS),
    "small": dict(
        vocab_size=_BYTE_VOCAB, hidden_size=512, intermediate_size=1408, num_layers=8,
        num_heads=8, num_kv_heads=4, head_dim=64, max_position=4096, rope_theta=10000.0,
        rms_norm_eps=1e-5, eos_token_id=_BYTE_EOS, bos_token_id=_BYTE_BOS),
}


def select_device(prefer: str | torch.device | None = None) -> torch.device:
    """The device to run on: ``prefer`` when given, else CUDA when available, else CPU.

    The automatic choice is made once per process and then reused, so every
    component agrees. Raises ValueError for an unknown or unavailable device.
    """
    if prefer is None:
        return _default_device()
    try:
        device = torch.device(prefer)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {prefer!r} ({exc})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {prefer!r} requested but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device type {device.type!r} is not supported (cpu or cuda)")
    return device


@functools.cache
def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
