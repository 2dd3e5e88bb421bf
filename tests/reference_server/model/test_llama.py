from __future__ import annotations

import dataclasses
import math

import torch

from reference_server.model.checkpoint import expected_shapes
from reference_server.model.config import ModelConfig
from reference_server.model.llama import LlamaModel, RMSNorm, RotaryEmbedding

torch.set_num_threads(1)
TINY = ModelConfig.preset("tiny")


def test_parameter_names_and_shapes_match_hf_llama() -> None:
    model = LlamaModel(TINY)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert shapes == expected_shapes(TINY)
    assert "model.layers.1.self_attn.q_proj.weight" in shapes


def test_gqa_projection_shapes() -> None:
    attn = LlamaModel(TINY).model.layers[0].self_attn
    hd = TINY.head_dim
    assert attn.q_proj.weight.shape == (TINY.num_heads * hd, TINY.hidden_size)
    assert attn.k_proj.weight.shape == (TINY.num_kv_heads * hd, TINY.hidden_size)
    assert attn.v_proj.weight.shape == (TINY.num_kv_heads * hd, TINY.hidden_size)
    assert attn.o_proj.weight.shape == (TINY.hidden_size, TINY.num_heads * hd)


def test_seeded_init_is_deterministic() -> None:
    a, b, c = LlamaModel(TINY, seed=0), LlamaModel(TINY, seed=0), LlamaModel(TINY, seed=1)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(),
                                  c.state_dict().values()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_rope_matches_explicit_rotation_and_is_relative() -> None:
    head_dim, theta = 8, 10000.0
    rope = RotaryEmbedding(head_dim, 64, theta)
    x = torch.randn(1, 1, head_dim, generator=torch.Generator().manual_seed(0))
    pos = 5
    out = rope(x, torch.tensor([pos]))[0, 0]
    half = head_dim // 2
    for i in range(half):  # HF convention: pairs (i, i + half)
        angle = pos / theta ** (2 * i / head_dim)
        a, b = x[0, 0, i].item(), x[0, 0, i + half].item()
        assert math.isclose(out[i].item(), a * math.cos(angle) - b * math.sin(angle),
                            abs_tol=1e-5)
        assert math.isclose(out[i + half].item(), b * math.cos(angle) + a * math.sin(angle),
                            abs_tol=1e-5)
    assert torch.allclose(rope(x, torch.tensor([0])), x)  # position 0 is the identity
    q = torch.randn(1, 1, head_dim, generator=torch.Generator().manual_seed(1))
    k = torch.randn(1, 1, head_dim, generator=torch.Generator().manual_seed(2))

    def score(m: int, n: int) -> float:
        return (rope(q, torch.tensor([m])) * rope(k, torch.tensor([n]))).sum().item()

    assert math.isclose(score(9, 4), score(30, 25), abs_tol=1e-4)  # depends on m - n only
    assert not math.isclose(score(9, 4), score(9, 5), abs_tol=1e-4)


def test_rms_norm_normalises() -> None:
    norm = RMSNorm(16, 1e-6)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(3)) * 7
    y = norm(x)
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(3), atol=1e-4, rtol=1e-4)


def test_dense_forward_shapes_and_causality() -> None:
    model = LlamaModel(TINY)
    ids = torch.tensor([256, 72, 105, 33, 10, 200])
    with torch.no_grad():
        full = model.forward_dense(ids)
        prefix = model.forward_dense(ids[:4])
    assert full.shape == (6, TINY.vocab_size) and full.dtype == torch.float32
    torch.testing.assert_close(full[:4], prefix, atol=1e-5, rtol=1e-5)
    assert full.std() > 0.1  # logits are spread out, not near-ties


def test_tied_embeddings_share_weight() -> None:
    model = LlamaModel(dataclasses.replace(TINY, tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_place_casts_parameters_keeps_rope_float32() -> None:
    config = dataclasses.replace(TINY, dtype="bfloat16")
    model = LlamaModel(config).place(torch.device("cpu"))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.rotary_emb.cos.dtype == torch.float32
