"""What the engine hands out: per-step request outputs, offline completions, streamed
token deltas and a stats snapshot. All frozen values, safe to pass between threads."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Completion", "EngineStats", "RequestOutput", "TokenDelta"]


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One request's progress in one step: at most one new token (``token_id`` is the
    output token number ``token_index``), the text it completed (may be "", e.g. half a
    UTF-8 character, or text held back because it may start a stop string), and whether
    the request finished (``finish_reason``: "stop" or "length")."""

    request_id: str
    token_index: int
    token_id: int
    text_delta: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    emit_ns: int = -1  # engine monotonic clock: when the engine handed the token out (TokenEmitted.emit_ns)


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """One streamed token for :class:`~reference_server.engine.async_engine.AsyncEngine`
    consumers. ``finish_reason`` is set on the last one ("stop", "length" or "abort")."""

    token_id: int
    text: str
    index: int
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished offline request (``Engine.generate``)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    num_cached_tokens: int  # prompt tokens served by the prefix cache


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's queues, KV blocks and counters. Per-tier tuples are
    (device, host, disk). Counters only grow; rates and ratios are for the reader."""

    num_steps: int
    num_waiting: int
    num_running: int
    num_preempted: int
    num_blocks_used: tuple[int, int, int]
    num_blocks_cached: tuple[int, int, int]
    num_blocks_total: tuple[int, int, int]
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int
    num_prefix_hit_blocks: tuple[int, int, int]
    num_evicted_blocks: tuple[int, int, int]
    num_transferred_blocks: tuple[tuple[str, int], ...]  # (kind, blocks) per transfer kind
    num_preemptions_recompute: int
    num_preemptions_swap: int
    num_requests_finished: int
    num_requests_aborted: int
    num_prompt_tokens_computed: int
    num_generated_tokens: int
    num_observer_errors: int
