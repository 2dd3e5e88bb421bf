"""Train the bundled models: a small target and its draft, on text that ships with Python.

``python -m reference_server.model.train --out reference_server/weights`` trains, on the CPU,
two Llama-style byte-level models of this package (``trained``: 6 layers, hidden 128, about
1.1 M parameters; ``trained-draft``: 2 layers, hidden 64, about 0.13 M) and writes each as an
HF-format folder (``config.json`` + ``model.safetensors``, float16 tensors, run in float32).

Corpus: the English text of Python's own documentation topics (``pydoc_data.topics``, in
every CPython install), topics sorted by name, joined with blank lines, UTF-8 bytes. Every
20th topic is held out for the perplexity figure. Training windows are drawn from a seeded
generator and ``torch.manual_seed`` fixes the initial weights, so the same command on the
same torch build and thread count gives the same weights (floating-point reductions may
differ across machines).

The target also learns to predict from its first ``EARLY_EXIT_LAYER`` layers (an extra loss
through the final norm and the LM head, as LayerSkip trains early exit), so those layers serve
as a self-speculative draft.

The training forward below is the same computation as :class:`LlamaModel` (a test checks it
against ``forward_dense``), batched and with PyTorch's fused attention.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from reference_server.model.checkpoint import save_checkpoint
from reference_server.model.config import ModelConfig
from reference_server.model.llama import LlamaModel

__all__ = ["TrainSpec", "SPECS", "TARGET", "DRAFT", "EARLY_EXIT_LAYER", "corpus", "train", "evaluate", "forward_train"]

EARLY_EXIT_LAYER = 2
"""Layers the target's early-exit head reads (the self-speculative draft)."""

_BYTE = dict(vocab_size=259, eos_token_id=257, bos_token_id=256, rope_theta=10000.0, rms_norm_eps=1e-5,
             max_position=1024)
TARGET = ModelConfig(hidden_size=128, intermediate_size=320, num_layers=6, num_heads=4, num_kv_heads=2,
                     head_dim=32, **_BYTE)
DRAFT = ModelConfig(hidden_size=64, intermediate_size=192, num_layers=2, num_heads=2, num_kv_heads=1,
                    head_dim=32, **_BYTE)


@dataclass(frozen=True, slots=True)
class TrainSpec:
    """One model's training run."""

    name: str
    config: ModelConfig
    steps: int
    batch_size: int = 16  # windows per step
    seq_len: int = 128  # bytes per window
    lr: float = 4e-3  # peak AdamW learning rate (cosine decay after a short warm-up)
    early_exit_weight: float = 0.0  # weight of the early-exit loss (0 = none)
    seed: int = 0


SPECS = (
    TrainSpec("trained", TARGET, steps=300, early_exit_weight=0.5),
    TrainSpec("trained-draft", DRAFT, steps=300),
)


def corpus() -> tuple[bytes, bytes]:
    """(training bytes, held-out bytes) of Python's documentation topics."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    train = [topics[n] for i, n in enumerate(names) if i % 20 != 0]
    held = [topics[n] for i, n in enumerate(names) if i % 20 == 0]
    return "\n\n".join(train).encode(), "\n\n".join(held).encode()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``(B, T, heads, head_dim)`` with tables ``(T, head_dim // 2)`` (HF halves convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def forward_train(model: LlamaModel, ids: torch.Tensor, *, exit_layer: int = 0) -> tuple[torch.Tensor, ...]:
    """Logits ``(B, T, vocab)`` of a batch of windows ``ids`` ``(B, T)``; with ``exit_layer``
    also the logits read after that many layers (final norm and LM head applied early)."""
    cfg, backbone = model.config, model.model
    batch, seq_len = ids.shape
    cos, sin = backbone.rotary_emb.cos[:seq_len], backbone.rotary_emb.sin[:seq_len]  # (T, hd // 2)
    x = backbone.embed_tokens(ids)  # (B, T, hidden)
    outs = []
    for i, layer in enumerate(backbone.layers):
        attn, h = layer.self_attn, layer.input_layernorm(x)
        q = _rope(attn.q_proj(h).view(batch, seq_len, cfg.num_heads, cfg.head_dim), cos, sin)
        k = _rope(attn.k_proj(h).view(batch, seq_len, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = attn.v_proj(h).view(batch, seq_len, cfg.num_kv_heads, cfg.head_dim)
        rep = cfg.num_queries_per_kv
        q, k, v = (t.transpose(1, 2) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, hd)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(batch, seq_len, cfg.hidden_size))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        if i + 1 == exit_layer:
            outs.append(model.lm_head(backbone.norm(x)))
    return (model.lm_head(backbone.norm(x)), *outs)


def _batch(data: torch.Tensor, gen: torch.Generator, spec: TrainSpec) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - spec.seq_len - 1, (spec.batch_size,), generator=gen)
    return torch.stack([data[s:s + spec.seq_len + 1] for s in starts.tolist()])  # (B, T + 1)


def train(spec: TrainSpec, train_bytes: bytes, *, log_every: int = 50) -> LlamaModel:
    """Train one model from its seed; prints the loss every ``log_every`` steps."""
    torch.manual_seed(spec.seed)
    model = LlamaModel(spec.config, seed=spec.seed)
    model.train()
    data = torch.tensor(list(train_bytes), dtype=torch.int64)
    gen = torch.Generator().manual_seed(spec.seed + 1)  # data order
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, spec.steps // 20)
    exit_layer = EARLY_EXIT_LAYER if spec.early_exit_weight else 0
    start = time.perf_counter()
    for step in range(spec.steps):
        lr = spec.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / spec.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        window = _batch(data, gen, spec)
        logits = forward_train(model, window[:, :-1], exit_layer=exit_layer)
        target = window[:, 1:].reshape(-1)
        loss = F.cross_entropy(logits[0].reshape(-1, logits[0].shape[-1]), target)
        total = loss
        if exit_layer:
            total = loss + spec.early_exit_weight * F.cross_entropy(
                logits[1].reshape(-1, logits[1].shape[-1]), target)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % log_every == 0 or step == spec.steps - 1:
            print(f"{spec.name} step {step} loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
    return model.eval()


@torch.no_grad()
def evaluate(model: LlamaModel, held_bytes: bytes, *, seq_len: int = 256, exit_layer: int = 0) -> float:
    """Mean cross-entropy (nats per byte) over non-overlapping held-out windows."""
    data = torch.tensor(list(held_bytes), dtype=torch.int64)
    n = (data.numel() - 1) // seq_len
    x = data[: n * seq_len].view(n, seq_len)
    y = data[1: n * seq_len + 1].view(n, seq_len)
    losses = []
    for i in range(0, n, 32):
        logits = forward_train(model, x[i:i + 32], exit_layer=exit_layer)[-1 if exit_layer else 0]
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[i:i + 32].reshape(-1),
                                      reduction="sum"))
    return float(torch.stack(losses).sum() / y.numel())


def _save(model: LlamaModel, folder: Path, spec: TrainSpec, stats: dict) -> None:
    half = LlamaModel(spec.config, seed=None)
    half.load_state_dict({k: v.to(torch.float16) for k, v in model.state_dict().items()})
    half.to(torch.float16)
    save_checkpoint(folder, spec.config, half)
    (folder / "training.json").write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write one checkpoint folder per model into")
    parser.add_argument("--steps", type=int, default=None, help="override the training steps of every model")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be >= 1")
    torch.set_num_threads(args.threads)
    train_bytes, held_bytes = corpus()
    for spec in SPECS:
        if args.steps is not None:
            spec = replace(spec, steps=args.steps)
        start = time.perf_counter()
        model = train(spec, train_bytes)
        seconds = time.perf_counter() - start
        rounded = LlamaModel(spec.config, seed=None)  # evaluate the float16 weights that ship
        rounded.load_state_dict({k: v.to(torch.float16).float() for k, v in model.state_dict().items()})
        rounded.eval()
        held = evaluate(rounded, held_bytes)
        stats = {
            "corpus": "pydoc_data.topics (every 20th topic held out)", "train_bytes": len(train_bytes),
            "held_out_bytes": len(held_bytes), "steps": spec.steps, "batch_size": spec.batch_size,
            "seq_len": spec.seq_len, "lr": spec.lr, "seed": spec.seed, "threads": args.threads,
            "params": sum(p.numel() for p in model.parameters()), "train_seconds": round(seconds),
            "held_out_nats_per_byte": round(held, 4), "held_out_perplexity": round(math.exp(held), 3),
            "torch": torch.__version__,
        }
        if spec.early_exit_weight:
            exit_nats = evaluate(rounded, held_bytes, exit_layer=EARLY_EXIT_LAYER)
            stats["early_exit_layer"] = EARLY_EXIT_LAYER
            stats["early_exit_held_out_perplexity"] = round(math.exp(exit_nats), 3)
        _save(model, args.out / spec.name, spec, stats)
        print(json.dumps({spec.name: stats}), flush=True)


if __name__ == "__main__":
    main()
