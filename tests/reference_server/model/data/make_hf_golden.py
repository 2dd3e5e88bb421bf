"""Regenerate ``hf_llama_golden/`` and ``hf_llama_golden_logits.safetensors``.

A tiny checkpoint written by Hugging Face transformers, and the logits its own
``LlamaForCausalLM`` computes, so tests check parity with HF without transformers.

Run (needs transformers, which the project does not depend on):
    PYTHONPATH=/path/to/transformers python tests/reference_server/model/data/make_hf_golden.py
Generated with transformers 5.24.0 and torch 2.13.0 (CPU), float32.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

OUT = Path(__file__).parent / "hf_llama_golden"


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=5000.0, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)  # norms too, so their weights are exercised
    model.save_pretrained(OUT, safe_serialization=True)
    token_ids = torch.randint(0, 64, (24,))
    with torch.no_grad():
        logits = model(token_ids[None]).logits[0]  # (24, 64)
    save_file({"token_ids": token_ids, "logits": logits.contiguous()},
              OUT.parent / "hf_llama_golden_logits.safetensors")


if __name__ == "__main__":
    main()
