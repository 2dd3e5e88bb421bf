"""The model side of the reference server: a Llama-style decoder over a paged KV cache.

Public API (what the engine uses):

* :class:`ModelConfig` (presets ``tiny`` / ``small``, HF ``config.json``) and :func:`select_device`;
* :class:`ModelRunner` / :class:`SeqChunk`: one forward pass of a mixed batch of
  prefill chunks and decode tokens; :func:`num_blocks_for_memory`;
* :class:`KVStorage`: the device / host / disk block pools and copies between them;
* :class:`SamplingParams`, :class:`Sampler`, :func:`make_generator`, :func:`seed_for_token`;
* :class:`Tokenizer`, :class:`ByteTokenizer`, :class:`HFTokenizer`,
  :class:`IncrementalDetokenizer`, :func:`load_tokenizer`, :func:`apply_chat_template`;
* :func:`load_checkpoint` / :func:`save_checkpoint` for HF-format folders;
* :mod:`~reference_server.model.bundled` (the trained models shipped with the package, by name),
  :mod:`~reference_server.model.draft` (draft models of speculative decoding) and
  :mod:`~reference_server.model.train` (how the bundled models were trained).
"""

from __future__ import annotations

from reference_server.model.checkpoint import load_checkpoint, save_checkpoint
from reference_server.model.config import ModelConfig, select_device
from reference_server.model.kv_storage import (
    DEVICE_TIER,
    DISK_TIER,
    HOST_TIER,
    KVStorage,
    kv_bytes_per_block,
)
from reference_server.model.llama import LlamaModel
from reference_server.model.runner import ModelRunner, SeqChunk, num_blocks_for_memory
from reference_server.model.sampling import Sampler, SamplingParams, make_generator, seed_for_token
from reference_server.model.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    Tokenizer,
    apply_chat_template,
    load_tokenizer,
)

__all__ = [
    "DEVICE_TIER", "DISK_TIER", "HOST_TIER",
    "ByteTokenizer", "HFTokenizer", "IncrementalDetokenizer", "KVStorage", "LlamaModel",
    "ModelConfig", "ModelRunner", "Sampler", "SamplingParams", "SeqChunk", "Tokenizer",
    "apply_chat_template", "kv_bytes_per_block", "load_checkpoint", "load_tokenizer",
    "make_generator", "num_blocks_for_memory", "save_checkpoint", "seed_for_token", "select_device",
]
