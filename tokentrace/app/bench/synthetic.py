"""Synthetic workloads: prompt and output length distributions, shared system prompts.

Length distributions are written as ``KIND:PARAMS`` (the CLI's ``--input-len`` /
``--output-len``):

* ``fixed:128``: always 128;
* ``uniform:32-256``: uniform integers in [32, 256];
* ``lognormal:median=200,sigma=1.0[,max=4096]``: ``median * exp(sigma * Z)``, heavy-ish tail;
* ``pareto:min=50,alpha=1.5[,max=4096]``: classical Pareto with scale ``min``, heavy tail.

Every value is at least 1. ``max`` clamps the tail (shown in :meth:`LengthDist.describe`,
so the clamp is never silent). Lengths are in byte-level tokens: prompts are ASCII text,
one character per token on a byte tokenizer (approximately a token on others).

Shared system prompts: ``num_system_prompts`` distinct prompts of ``system_prompt_tokens``
tokens; a share ``system_prompt_share`` of the requests starts with one of them (chosen
uniformly), the rest have none. The user part follows (``input`` length).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tokentrace.app.bench.requests import TextRequest

__all__ = ["LENGTH_KINDS", "LengthDist", "SyntheticSpec", "synthetic_requests", "random_text"]

LENGTH_KINDS: tuple[str, ...] = ("fixed", "uniform", "lognormal", "pareto")
_ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ,.ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", dtype=np.uint8)


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A distribution of positive integer lengths (tokens)."""

    kind: str
    a: float  # fixed: value; uniform: low; lognormal: median; pareto: min (scale)
    b: float = 0.0  # uniform: high; lognormal: sigma; pareto: alpha
    max: int | None = None  # clamp, None = none

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"unknown length distribution {self.kind!r}; choose one of {', '.join(LENGTH_KINDS)}")
        if not (math.isfinite(self.a) and self.a >= 1):
            raise ValueError(f"{self.kind} length: first parameter must be >= 1, got {self.a}")
        if self.kind == "uniform" and not self.b >= self.a:
            raise ValueError(f"uniform length: high ({self.b}) must be >= low ({self.a})")
        if self.kind in ("lognormal", "pareto") and not (math.isfinite(self.b) and self.b > 0):
            raise ValueError(f"{self.kind} length: sigma/alpha must be positive, got {self.b}")
        if self.max is not None and self.max < 1:
            raise ValueError(f"length max must be >= 1, got {self.max}")

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        """Parse ``KIND:PARAMS`` (see module doc); a bare integer means ``fixed``. ``ValueError`` if bad."""
        text = spec.strip()
        if text.isdigit():
            return cls("fixed", float(text))
        kind, _, params = text.partition(":")
        kind = kind.strip().lower()
        try:
            if kind == "fixed":
                return cls("fixed", float(int(params)))
            if kind == "uniform":
                low, _, high = params.partition("-")
                return cls("uniform", float(int(low)), float(int(high)))
            named = _named_params(params)
            cap = int(named.pop("max")) if "max" in named else None
            if kind == "lognormal":
                dist = cls("lognormal", named.pop("median"), named.pop("sigma", 1.0), cap)
            elif kind == "pareto":
                dist = cls("pareto", named.pop("min"), named.pop("alpha", 1.5), cap)
            else:
                raise ValueError(f"unknown length distribution {kind!r}; choose one of {', '.join(LENGTH_KINDS)}")
        except (KeyError, ValueError) as e:  # a missing name, a bad number or a bad value
            raise ValueError(f"bad length distribution {spec!r} ({e}); examples: fixed:128, uniform:32-256, "
                             "lognormal:median=200,sigma=1.0,max=4096, pareto:min=50,alpha=1.5") from None
        if named:
            raise ValueError(f"bad length distribution {spec!r}: unknown parameter(s) {', '.join(named)}")
        return dist

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` lengths (int64, each >= 1, <= max if set)."""
        if self.kind == "fixed":
            out = np.full(n, self.a)
        elif self.kind == "uniform":
            out = rng.integers(int(self.a), int(self.b) + 1, n).astype(float)
        elif self.kind == "lognormal":
            out = self.a * np.exp(self.b * rng.standard_normal(n))
        else:
            out = self.a * (1.0 + rng.pareto(self.b, n))
        out = np.maximum(1, np.rint(out))
        if self.max is not None:
            out = np.minimum(out, self.max)
        return out.astype(np.int64)

    def describe(self) -> str:
        cap = f", clamped at {self.max}" if self.max is not None else ""
        if self.kind == "fixed":
            return f"fixed {int(self.a)}"
        if self.kind == "uniform":
            return f"uniform {int(self.a)}-{int(self.b)}"
        if self.kind == "lognormal":
            return f"lognormal median {self.a:g} sigma {self.b:g}{cap}"
        return f"pareto min {self.a:g} alpha {self.b:g}{cap}"


def _named_params(params: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in params.split(","):
        if not part.strip():
            continue
        name, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"expected name=value, got {part!r}")
        out[name.strip().lower()] = float(value)
    return out


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    """A synthetic workload: length distributions and shared system prompts."""

    input: LengthDist = LengthDist("fixed", 128)
    output: LengthDist = LengthDist("fixed", 32)
    num_system_prompts: int = 0
    system_prompt_share: float = 0.0  # fraction of requests that start with a shared system prompt
    system_prompt_tokens: int = 256

    def __post_init__(self) -> None:
        if self.num_system_prompts < 0:
            raise ValueError(f"num_system_prompts must be >= 0, got {self.num_system_prompts}")
        if not 0.0 <= self.system_prompt_share <= 1.0:
            raise ValueError(f"system_prompt_share must be in [0, 1], got {self.system_prompt_share}")
        if self.system_prompt_share > 0 and self.num_system_prompts == 0:
            raise ValueError("system_prompt_share > 0 needs num_system_prompts >= 1")
        if self.system_prompt_tokens < 1:
            raise ValueError(f"system_prompt_tokens must be >= 1, got {self.system_prompt_tokens}")

    def describe(self) -> str:
        text = f"synthetic: input {self.input.describe()}, output {self.output.describe()}"
        if self.num_system_prompts and self.system_prompt_share:
            text += (f", {self.system_prompt_share:.0%} of requests share one of {self.num_system_prompts} "
                     f"system prompts of {self.system_prompt_tokens} tokens")
        return text

    def as_dict(self) -> dict[str, object]:
        return {"input": self.input.describe(), "output": self.output.describe(),
                "num_system_prompts": self.num_system_prompts, "system_prompt_share": self.system_prompt_share,
                "system_prompt_tokens": self.system_prompt_tokens}


def random_text(num_chars: int, rng: np.random.Generator) -> str:
    """``num_chars`` random ASCII characters (letters, digits, spaces, punctuation)."""
    return _ALPHABET[rng.integers(0, _ALPHABET.size, num_chars)].tobytes().decode("ascii")


def synthetic_requests(spec: SyntheticSpec, num_requests: int, *, seed: int = 0) -> list[TextRequest]:
    """``num_requests`` requests drawn from ``spec``; deterministic for a given ``seed``.

    Equal system prompts are byte-identical strings, so a prefix cache can share them.
    """
    rng = np.random.default_rng(seed)
    systems = [random_text(spec.system_prompt_tokens, rng) for _ in range(spec.num_system_prompts)]
    inputs = spec.input.sample(num_requests, rng)
    outputs = spec.output.sample(num_requests, rng)
    shared = rng.random(num_requests) < spec.system_prompt_share
    which = rng.integers(0, max(1, len(systems)), num_requests)
    return [
        TextRequest(systems[which[i]] if shared[i] else "", random_text(int(inputs[i]), rng), int(outputs[i]))
        for i in range(num_requests)
    ]
