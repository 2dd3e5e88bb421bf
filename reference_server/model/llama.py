"""A Llama-style decoder: RMSNorm, rotary position embeddings, SwiGLU, grouped-query attention.

Parameter names match Hugging Face's ``LlamaForCausalLM``
(``model.layers.N.self_attn.q_proj.weight`` and so on), so HF-format checkpoints
load with ``load_state_dict``; tests check logits against transformers' own.

The serving forward (:meth:`LlamaModel.forward`) takes a *flattened* batch of
chunks: ``token_ids`` and ``positions`` of shape ``(num_tokens,)``, an
:class:`~reference_server.model.attention.AttentionMetadata` and the per-layer
paged KV cache; it writes the new keys/values into the cache. :meth:`forward_dense`
runs one whole sequence without any cache, for tests.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from reference_server.model.attention import (
    AttentionMetadata,
    dense_attention_reference,
    paged_attention,
)
from reference_server.model.config import ModelConfig

# (k_cache, v_cache), each (num_blocks, block_size, n_kv, head_dim)
KVCache = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 for stability."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE in the HF Llama convention (rotate halves, not interleaved pairs)."""

    def __init__(self, head_dim: int, max_position: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
        # (max_position, head_dim // 2); buffers are not saved in checkpoints.
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape ``(num_tokens, n_heads, head_dim)`` by its ``positions``."""
        cos = self.cos[positions][:, None, :]  # (num_tokens, 1, head_dim // 2)
        sin = self.sin[positions][:, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)  # each (num_tokens, n_heads, head_dim // 2)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return rotated.to(x.dtype)


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with RoPE over the paged KV cache."""

    def __init__(self, config: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self._rope = (rope,)  # a tuple so the shared module is not registered once per layer

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | None, cache: KVCache | None) -> torch.Tensor:
        """``x``: ``(num_tokens, hidden)``. ``meta`` None means dense causal, no cache."""
        num_tokens = x.shape[0]
        rope = self._rope[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)  # (T, n_heads, hd)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, n_kv, hd)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, n_kv, hd)
        q, k = rope(q, positions), rope(k, positions)
        if meta is None:
            out = dense_attention_reference(q, k, v)
        else:
            assert cache is not None, "the paged path needs a KV cache"
            out = paged_attention(q, k, v, cache[0], cache[1], meta)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))  # (T, hidden)


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)  # each (num_tokens, intermediate)
        if torch.is_grad_enabled():  # autograd needs the unmodified activations
            return self.down_proj(F.silu(gate) * up)
        # In place, bitwise the same: no two fresh (num_tokens, intermediate) tensors,
        # whose first-touch page faults cost several times the arithmetic on CPU.
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rope)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | None, cache: KVCache | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, meta, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBackbone(nn.Module):
    """Embeddings, decoder layers and final norm (HF's ``model.`` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position, config.rope_theta)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.rotary_emb) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    """Llama-style causal LM with HF parameter names; seeded random weights by default.

    ``LlamaModel(config, seed=0)`` always builds the same weights for the same
    config and seed (on any device), so a server without a checkpoint is still
    deterministic; ``seed=None`` skips that init (for loading a checkpoint).
    Not thread-safe; call from one thread.
    """

    def __init__(self, config: ModelConfig, *, seed: int | None = 0) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if seed is not None:  # None: weights are about to be loaded from a checkpoint
            self.init_weights(seed)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def place(self, device: torch.device) -> LlamaModel:
        """Move to ``device`` and cast parameters to the config's dtype.

        RoPE tables stay float32 (a plain ``.to(dtype)`` would round them too).
        """
        self.to(device=device)
        for param in self.parameters():
            param.data = param.data.to(self.config.torch_dtype)
        return self

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Seeded random init: embeddings N(0, 1), linears N(0, 1/fan_in), norms 1.

        The scales keep activations O(1) and give logits a spread of a few units,
        so greedy decoding of a random model rarely meets near-ties.
        """
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            std = 1.0 if "embed_tokens" in name else param.shape[1] ** -0.5
            param.copy_(torch.randn(param.shape, generator=gen) * std)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: Sequence[KVCache], *,
                num_layers: int | None = None) -> torch.Tensor:
        """Hidden states ``(num_tokens, hidden)`` of a flattened batch of chunks.

        ``token_ids``, ``positions``: ``(num_tokens,)`` int64. Writes each layer's
        new K/V into ``kv_caches[layer]`` at ``meta.slot_mapping``. ``num_layers``
        runs only the first layers (early exit: the final norm still applies).
        """
        n = self.config.num_layers if num_layers is None else num_layers
        x = self.model.embed_tokens(token_ids)  # (num_tokens, hidden)
        for layer, cache in zip(self.model.layers[:n], kv_caches[:n], strict=True):
            x = layer(x, positions, meta, cache)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``(rows, vocab)`` from final hidden states ``(rows, hidden)``."""
        return self.lm_head(hidden).float()

    def forward_dense(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``(T, vocab)`` of one whole sequence ``(T,)`` by dense causal attention.

        The reference the paged path is tested against; uses no KV cache.
        """
        positions = torch.arange(token_ids.shape[0], device=token_ids.device)  # (T,)
        x = self.model.embed_tokens(token_ids)  # (T, hidden)
        for layer in self.model.layers:
            x = layer(x, positions, None, None)
        return self.compute_logits(self.model.norm(x))
