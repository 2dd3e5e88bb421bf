"""Workloads from real traces: the Azure LLM 2023 CSVs and the Mooncake JSONL.

A workload is a list of :class:`TraceRequest` (arrival offset, prompt length,
output length, optional prefix block ids), read from a trace file and scaled to
the machine it is replayed on. Scaling is explicit and reported
(:class:`Scaling`), never silent: ``time_scale`` stretches (>1) or compresses
(<1) arrival offsets, ``length_scale`` multiplies prompt and output lengths, and
``max_requests`` keeps the first N requests of the file.

Prompts for Mooncake traces are built so that equal hash ids give byte-identical
prompt blocks (:func:`build_prompt`): a prefix cache has something real to hit.
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Iterator, Sequence

__all__ = [
    "TraceRequest",
    "Scaling",
    "Workload",
    "read_azure_csv",
    "read_mooncake_jsonl",
    "load_trace",
    "build_prompt",
    "default_traces_dir",
    "best_prefix_hit_rate",
]

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens named by one Mooncake hash id in the original service."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace, after scaling."""

    arrival_s: float  # offset from the first request of the trace, seconds
    num_prompt_tokens: int
    num_output_tokens: int
    hash_ids: tuple[int, ...] = ()  # Mooncake prefix blocks, one per block_tokens tokens


@dataclass(frozen=True, slots=True)
class Scaling:
    """How a trace was adapted to this replay; printed and kept in the run's manifest."""

    source: str
    time_scale: float = 1.0
    length_scale: float = 1.0
    max_requests: int | None = None
    num_requests_in_file: int = 0
    block_tokens: int = MOONCAKE_BLOCK_TOKENS  # tokens per hash id after scaling

    def describe(self) -> str:
        kept = self.max_requests if self.max_requests is not None else self.num_requests_in_file
        kept = min(kept, self.num_requests_in_file)
        return (f"{Path(self.source).name}: first {kept} of {self.num_requests_in_file} requests, "
                f"arrival times x{self.time_scale:g}, lengths x{self.length_scale:g}")

    def as_dict(self) -> dict[str, object]:
        return {
            "source": Path(self.source).name, "time_scale": self.time_scale, "length_scale": self.length_scale,
            "max_requests": self.max_requests, "num_requests_in_file": self.num_requests_in_file,
            "block_tokens": self.block_tokens,
        }


@dataclass(frozen=True, slots=True)
class Workload:
    requests: tuple[TraceRequest, ...]
    scaling: Scaling

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0


def default_traces_dir() -> Path:
    """``../shared/data/traces`` beside the repository (or ``$TOKENTRACE_TRACES``)."""
    env = os.environ.get("TOKENTRACE_TRACES")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[4] / "shared" / "data" / "traces"


def _check_scales(time_scale: float, length_scale: float, max_requests: int | None) -> None:
    if not (time_scale > 0 and math.isfinite(time_scale)):
        raise ValueError(f"time_scale must be a positive number, got {time_scale}")
    if not (length_scale > 0 and math.isfinite(length_scale)):
        raise ValueError(f"length_scale must be a positive number, got {length_scale}")
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests must be at least 1, got {max_requests}")


def _scaled_len(n: int, length_scale: float) -> int:
    return max(1, round(n * length_scale))


def read_azure_csv(path: str | Path, *, time_scale: float = 1.0, length_scale: float = 1.0,
                   max_requests: int | None = None) -> Workload:
    """Read an Azure LLM inference trace (``TIMESTAMP,ContextTokens,GeneratedTokens``)."""
    _check_scales(time_scale, length_scale, max_requests)
    path = Path(path)
    rows: list[tuple[datetime, int, int]] = []
    total = 0
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None or [h.strip() for h in header[:3]] != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
                raise ValueError(f"{path}: not an Azure LLM trace (header {header!r})")
            for lineno, row in enumerate(reader, start=2):
                if not row:
                    continue
                total += 1
                if max_requests is not None and len(rows) >= max_requests:
                    continue
                try:
                    rows.append((_parse_azure_time(row[0]), int(row[1]), int(row[2])))
                except (ValueError, IndexError):
                    raise ValueError(f"{path}:{lineno}: malformed row {row!r}") from None
    except FileNotFoundError:
        raise ValueError(f"trace file not found: {path}") from None
    if not rows:
        raise ValueError(f"{path}: the trace has no requests")
    t0 = rows[0][0]
    reqs = tuple(
        TraceRequest((t - t0).total_seconds() * time_scale, _scaled_len(ctx, length_scale),
                     _scaled_len(gen, length_scale))
        for t, ctx, gen in rows
    )
    return Workload(reqs, Scaling(str(path), time_scale, length_scale, max_requests, total))


def _parse_azure_time(text: str) -> datetime:
    # "2023-11-16 18:15:46.6805900": 7 fractional digits, more than fromisoformat takes.
    text = text.strip()
    if "." in text:
        head, frac = text.split(".", 1)
        text = f"{head}.{frac[:6]}"
    return datetime.fromisoformat(text)


def read_mooncake_jsonl(path: str | Path, *, time_scale: float = 1.0, length_scale: float = 1.0,
                        max_requests: int | None = None) -> Workload:
    """Read a Mooncake trace (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``).

    Lengths scale with ``length_scale`` and so does the block each hash id names
    (512 tokens in the original service), so shared prefixes stay shared.
    """
    _check_scales(time_scale, length_scale, max_requests)
    path = Path(path)
    reqs: list[TraceRequest] = []
    total = 0
    block_tokens = max(1, round(MOONCAKE_BLOCK_TOKENS * length_scale))
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                total += 1
                if max_requests is not None and len(reqs) >= max_requests:
                    continue
                try:
                    d = json.loads(line)
                    hash_ids = tuple(int(h) for h in d["hash_ids"])
                    prompt = _scaled_len(int(d["input_length"]), length_scale)
                    # Never shorter than the shared blocks it names (the last may be partial).
                    prompt = max(prompt, (len(hash_ids) - 1) * block_tokens + 1) if hash_ids else prompt
                    reqs.append(TraceRequest(float(d["timestamp"]) / 1000.0 * time_scale, prompt,
                                             _scaled_len(int(d["output_length"]), length_scale), hash_ids))
                except (ValueError, KeyError, TypeError):
                    raise ValueError(f"{path}:{lineno}: malformed Mooncake record") from None
    except FileNotFoundError:
        raise ValueError(f"trace file not found: {path}") from None
    if not reqs:
        raise ValueError(f"{path}: the trace has no requests")
    t0 = reqs[0].arrival_s
    reqs = [replace(r, arrival_s=r.arrival_s - t0) for r in reqs]
    return Workload(tuple(reqs), Scaling(str(path), time_scale, length_scale, max_requests, total, block_tokens))


def load_trace(path: str | Path, **scaling: float | int | None) -> Workload:
    """Read a trace by its extension: ``.csv`` (Azure) or ``.jsonl`` (Mooncake)."""
    suffix = Path(path).suffix.lower()
    if suffix == ".csv":
        return read_azure_csv(path, **scaling)  # type: ignore[arg-type]
    if suffix in (".jsonl", ".json"):
        return read_mooncake_jsonl(path, **scaling)  # type: ignore[arg-type]
    raise ValueError(f"unknown trace format {suffix!r} for {path}; expected .csv (Azure) or .jsonl (Mooncake)")


_ALPHABET = "abcdefghijklmnopqrstuvwxyz     ,.ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _block_text(hash_id: int, num_chars: int) -> str:
    rng = random.Random(hash_id * 1_000_003 + 17)
    return "".join(rng.choices(_ALPHABET, k=num_chars))


def build_prompt(req: TraceRequest, *, block_tokens: int, salt: int = 0) -> str:
    """A prompt of ``req.num_prompt_tokens`` byte-tokens whose blocks follow its hash ids.

    Block k of the prompt is a deterministic function of ``hash_ids[k]`` alone, so
    two requests sharing a hash-id prefix share byte-identical prompt prefixes
    (aligned to ``block_tokens``). The tail after the named blocks (and prompts
    of traces without hash ids) is unique per request via ``salt``.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    parts: list[str] = []
    remaining = req.num_prompt_tokens
    for h in req.hash_ids:
        if remaining <= 0:
            break
        n = min(block_tokens, remaining)
        parts.append(_block_text(h, n))
        remaining -= n
    if remaining > 0:
        parts.append(_block_text(-(salt + 1) * 7919, remaining))
    return "".join(parts)


def best_prefix_hit_rate(requests: Sequence[TraceRequest]) -> float:
    """Share of prompt blocks whose hash id appeared earlier (an unbounded cache's hit rate)."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for r in requests:
        for k in range(len(r.hash_ids)):
            prefix = r.hash_ids[: k + 1]
            total += 1
            if prefix in seen:
                hits += 1
            else:
                seen.add(prefix)
    return hits / total if total else 0.0
