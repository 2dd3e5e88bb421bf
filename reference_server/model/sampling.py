"""Sampling parameters and the batched sampler (greedy, temperature, top-k, top-p).

Greedy rows (temperature 0) take the argmax and draw no random numbers. Random
rows draw their noise from their own ``torch.Generator`` when the request has a
seed, so a seeded request gives the same tokens whatever else is in the batch.
The engine reseeds that generator for every output token from the request's
seed and the token's index (:func:`seed_for_token`), so the draws for token ``i``
do not depend on how many draws came before on this engine: a seeded request
gives the same tokens when its prefill and decode run on different engines, or
when it resumes on another worker after the first one died.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick a request's next tokens and when to stop.

    Raises ValueError naming the field when ``max_tokens <= 0``,
    ``temperature < 0``, ``top_k < 0``, ``top_p`` outside (0, 1] or a stop
    string is empty.
    """

    max_tokens: int = 16  # output tokens at most
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0  # 1 = no nucleus cut
    seed: int | None = None  # per-request RNG seed; None = the process RNG
    stop: tuple[str, ...] = ()  # stop strings (not included in the output)
    ignore_eos: bool = False  # keep generating past the EOS token

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -(1 << 63) <= self.seed < 1 << 64):
            raise ValueError(f"seed must be an int in [-2**63, 2**64) or None, got {self.seed!r}")
        if not isinstance(self.stop, tuple) or not all(
                isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax (no randomness)."""
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a request body's options; ``stop`` may be a string or a list.

        Raises ValueError naming unknown keys or the invalid field. Keys whose
        value is None take the default.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling options must be an object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"unknown sampling option(s): {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}")
        kwargs = {k: v for k, v in d.items() if v is not None}
        stop = kwargs.get("stop")
        if isinstance(stop, str):
            kwargs["stop"] = (stop,)
        elif isinstance(stop, list):
            kwargs["stop"] = tuple(stop)
        return cls(**kwargs)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def make_generator(seed: int | None, device: str | torch.device) -> torch.Generator | None:
    """A generator on ``device`` seeded with ``seed``; None when ``seed`` is None."""
    if seed is None:
        return None
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


_MASK64 = (1 << 64) - 1


def seed_for_token(seed: int, index: int) -> int:
    """The generator seed for output token ``index`` of a request seeded with ``seed``.

    SplitMix64's finaliser over ``seed`` and ``index``: neighbouring seeds and indices
    give unrelated streams. A pure function, so any engine reproduces any token's draws.
    """
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Sampler:
    """Picks one token per logits row. Stateless; call from the engine thread."""

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None]) -> list[int]:
        """Token ids for each row of ``logits`` ``(n, vocab)``.

        ``params[i]`` and ``generators[i]`` belong to row ``i``; a generator must be
        on the logits' device. Raises ValueError on length mismatch.
        """
        num_rows = logits.shape[0]
        if len(params) != num_rows or len(generators) != num_rows:
            raise ValueError(
                f"sample: {num_rows} logits rows, {len(params)} params, "
                f"{len(generators)} generators")
        logits = logits.float()
        out = logits.argmax(dim=-1)  # (n,) greedy choice for every row
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            idx = torch.tensor(random_rows, dtype=torch.int64, device=logits.device)
            chosen = self._sample_random(
                logits[idx], [params[i] for i in random_rows],
                [generators[i] for i in random_rows])
            out[idx] = chosen
        return out.tolist()

    def _sample_random(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                       generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        probs, order = self.filtered_probs(logits, params)  # both (m, vocab), sorted desc
        # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p.
        # Each row draws its noise from its own generator.
        noise = torch.empty_like(probs)
        for row, gen in enumerate(generators):
            noise[row].exponential_(generator=gen)
        noise.clamp_(min=1e-20)  # a 0 draw would make 0/0 = NaN on a cut token
        picked = (probs / noise).argmax(dim=-1, keepdim=True)  # (m, 1) index into sorted
        return order.gather(1, picked).squeeze(1)  # (m,) token ids

    @staticmethod
    def filtered_probs(logits: torch.Tensor,
                       params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
        """Probabilities after temperature, top-k and top-p, in descending order.

        Returns ``(probs, order)``, both ``(m, vocab)``: ``probs[r, j]`` is the
        probability of token ``order[r, j]``; cut tokens have probability 0.
        """
        device = logits.device
        temps = torch.tensor([p.temperature for p in params], device=device)  # (m,)
        top_k = torch.tensor([p.top_k or logits.shape[1] for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)  # (m,)
        sorted_logits, order = (logits / temps[:, None]).sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[1], device=device)  # (vocab,)
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        # Rows with top_p == 1 skip the cut: float rounding could drop their tail.
        cut = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
        probs = probs.masked_fill(cut, 0.0)
        return probs / probs.sum(dim=-1, keepdim=True), order
