"""Per-request state: tokens, progress through the KV cache, status and stop checking.

A :class:`Sequence` is owned by the scheduler and mutated only on the engine thread.
Progress follows vLLM v1's unified model: ``num_computed_tokens`` tokens have their KV
in the device cache; a step computes ``token_ids[num_computed_tokens:...]``; when a
step reaches ``num_tokens`` the model's logits give the next output token. Decode is
the case of one new token; prefill (and recompute after preemption) computes many.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reference_server.engine.config import SLOClass

__all__ = ["FinishReason", "PreemptionMode", "Sequence", "SequenceStatus", "StopChecker"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # never scheduled yet
    RUNNING = "running"  # admitted, holds device blocks
    PREEMPTED = "preempted"  # back in the waiting queue, swapped out or to recompute
    FINISHED = "finished"


class PreemptionMode(str, enum.Enum):
    RECOMPUTE = "recompute"
    SWAP = "swap"


class FinishReason(str, enum.Enum):
    """Why a request ended (OpenAI's vocabulary: stop strings and EOS are both ``stop``)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class Sequence:
    """One request's mutable state. Engine thread only."""

    __slots__ = (
        "request_id", "seq_no", "token_ids", "num_prompt_tokens", "sampling", "tenant", "slo_class",
        "arrival_ns", "status", "num_computed_tokens", "prefill_end", "num_cached_tokens",
        "block_hashes", "preempt_mode", "finish_reason", "generator", "stop", "max_len", "session",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: Any,
        *,
        seq_no: int,
        tenant: str,
        slo_class: SLOClass,
        arrival_ns: int,
        max_len: int,
        session: str = "",
    ) -> None:
        self.request_id = request_id
        self.seq_no = seq_no  # arrival order, breaks ties between equal timestamps
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt then outputs
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling = sampling  # model.sampling.SamplingParams
        self.tenant = tenant
        self.slo_class = slo_class
        self.session = session  # the session (conversation) this request is a turn of; "" = none
        self.arrival_ns = arrival_ns  # engine monotonic clock, ns
        self.max_len = max_len  # prompt + output tokens cap (context window)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the device tier
        self.prefill_end = self.num_prompt_tokens  # chunks starting below this are prefill
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of token_ids
        self.preempt_mode: PreemptionMode | None = None
        self.finish_reason: FinishReason | None = None
        self.generator: Any = None  # torch.Generator for seeded sampling, set by the engine
        self.stop: StopChecker | None = None  # set by the engine (needs the tokenizer)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_swapped(self) -> bool:
        return self.status is SequenceStatus.PREEMPTED and self.preempt_mode is PreemptionMode.SWAP

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )


@dataclass(slots=True)
class StopChecker:
    """Accumulates detokenized text, finds stop strings, and holds back the tail of the
    text that could still turn out to be the start of a stop string, so streamed deltas always add up to
    the final text (which excludes the stop string, as in OpenAI's API)."""

    stop: tuple[str, ...]
    text: str = ""
    num_emitted_chars: int = 0

    def push(self, delta: str) -> tuple[str, bool]:
        """Append ``delta``; return (text to emit now, whether a stop string was hit)."""
        if not self.stop:  # nothing to look for, nothing to hold back
            self.text += delta
            self.num_emitted_chars = len(self.text)
            return delta, False
        start = max(0, len(self.text) - self._max_stop_len() + 1)  # a new match ends in delta
        self.text += delta
        hit = -1
        for s in self.stop:
            i = self.text.find(s, start)
            if i != -1 and (hit == -1 or i < hit):
                hit = i
        if hit != -1:
            self.text = self.text[:hit]
            return self.flush(), True
        end = len(self.text) - self._hold_back()
        if end <= self.num_emitted_chars:
            return "", False
        out = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return out, False

    def flush(self) -> str:
        """Everything not yet emitted (called when the request finishes)."""
        out = self.text[self.num_emitted_chars:]
        self.num_emitted_chars = len(self.text)
        return out

    def _max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=1)

    def _hold_back(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        for k in range(min(self._max_stop_len() - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
