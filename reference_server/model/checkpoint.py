"""Local Hugging Face-format checkpoints: ``config.json`` + ``*.safetensors``.

A checkpoint folder holds ``config.json`` (Llama-style) and either one
``model.safetensors`` or shards listed in ``model.safetensors.index.json``
(``{"weight_map": {param_name: shard_file}}``). Parameter names are HF Llama's
(``model.layers.N.self_attn.q_proj.weight`` ...). Both functions run on the
caller's thread and block on file I/O.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from reference_server.model.config import ModelConfig

_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"
_LM_HEAD = "lm_head.weight"
_EMBED = "model.embed_tokens.weight"
# Older HF exports carry RoPE frequencies as a buffer; we recompute them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name of an HF Llama checkpoint for ``config`` and its shape."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        _EMBED: (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
        _LM_HEAD: (config.vocab_size, hidden),
    }
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        shapes.update({
            prefix + "self_attn.q_proj.weight": (q_size, hidden),
            prefix + "self_attn.k_proj.weight": (kv_size, hidden),
            prefix + "self_attn.v_proj.weight": (kv_size, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, q_size),
            prefix + "mlp.gate_proj.weight": (inter, hidden),
            prefix + "mlp.up_proj.weight": (inter, hidden),
            prefix + "mlp.down_proj.weight": (hidden, inter),
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
        })
    return shapes


def load_checkpoint(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a checkpoint folder; returns its config and a state dict in the config's dtype.

    Raises ValueError naming the problem: missing folder, no/malformed
    ``config.json``, no safetensors files, malformed index, unreadable shard,
    missing or unexpected tensors, shape mismatches.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"checkpoint folder {folder} does not exist")
    config = ModelConfig.from_hf_config(folder / "config.json")
    tensors: dict[str, torch.Tensor] = {}
    for shard in _shard_files(folder):
        try:
            tensors.update(load_file(shard))
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"cannot read {shard}: {exc}") from None
    for name in [n for n in tensors if n.endswith(_IGNORED_SUFFIXES)]:
        del tensors[name]
    if config.tie_word_embeddings and _LM_HEAD not in tensors and _EMBED in tensors:
        tensors[_LM_HEAD] = tensors[_EMBED]
    _check_tensors(folder, config, tensors)
    state = {name: t.to(config.torch_dtype) for name, t in tensors.items()}
    return config, state


def _shard_files(folder: Path) -> list[Path]:
    index = folder / _INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError,
                AttributeError) as exc:
            raise ValueError(f"{index}: malformed index ({exc!r})") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ValueError(f"{index}: shard files missing: {', '.join(missing)}")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint folder {folder} has no *.safetensors files")
    return files


def _check_tensors(folder: Path, config: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    shapes = expected_shapes(config)
    missing = sorted(set(shapes) - set(tensors))
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint {folder}: {len(missing)} tensors missing: {shown}")
    unexpected = sorted(set(tensors) - set(shapes))
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
        raise ValueError(f"checkpoint {folder}: unexpected tensors: {shown}")
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"checkpoint {folder}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                f"expected {shape}")


def save_checkpoint(path: str | Path, config: ModelConfig, model: torch.nn.Module, *,
                    max_shard_bytes: int | None = None) -> None:
    """Write ``model``'s weights and ``config`` as an HF-format folder at ``path``.

    With ``max_shard_bytes`` the tensors are split into several
    ``model-0000i-of-0000n.safetensors`` files plus ``model.safetensors.index.json``.
    Tied ``lm_head`` weights are stored once (under the embedding's name).
    """
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().to("cpu").contiguous()
             for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop(_LM_HEAD, None)
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n",
                                        encoding="utf-8")
    if max_shard_bytes is None:
        save_file(state, folder / _SINGLE_FILE, metadata={"format": "pt"})
        return
    shards = _split_shards(state, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / name, metadata={"format": "pt"})
        weight_map.update({tensor_name: name for tensor_name in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / _INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def _split_shards(state: dict[str, torch.Tensor],
                  max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards
