"""Observer hook points of the engine: one event type per thing that happens.

A tracer subclasses :class:`EngineObserver` (every method is a no-op) and overrides
the events it wants, then ``engine.add_observer(obs)``. Contract:

* Observers are called synchronously on the engine thread, in the order events
  happen. They must not block (hand work to another thread) and should be fast:
  their time is the engine's time. They must not call back into the engine.
* An exception raised by an observer is caught and counted by the engine
  (``EngineStats.num_observer_errors``); it never breaks the engine.
* Every ``*_ns`` field is ``time.monotonic_ns()`` of the engine process (the engine
  monotonic clock); never wall-clock time.
* With no observer attached the engine pays one truthiness check per hook point:
  events are only built when someone listens. The exceptions are the events the
  scheduler makes while planning a step (``CacheLookup``, ``RequestPreempted``,
  ``RequestResumed``, ``Evicted``): they are the plan's own record of what happened
  (:class:`~reference_server.engine.scheduler.SchedulerOutput`), built every step.

Tiers are ints: 0 device, 1 host, 2 disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "BatchEntry", "CacheLookup", "Evicted", "EngineObserver", "EngineObserverProtocol", "RecordingObserver",
    "RequestAborted", "RequestAdded", "RequestFinished", "RequestPreempted", "RequestQueued",
    "RequestResumed", "RequestScheduled", "RetentionEvent", "SpeculativeStep", "StepEnd", "StepStart", "TierTransfer",
    "TokenEmitted",
]


@dataclass(frozen=True, slots=True)
class RequestAdded:
    request_id: str
    tenant: str
    slo_class: str
    arrival_ns: int  # when the request reached the server (caller's stamp), engine monotonic clock
    added_ns: int  # when the engine accepted it
    num_prompt_tokens: int
    session: str = ""  # the session (conversation) the request is a turn of; "" = none


@dataclass(frozen=True, slots=True)
class RequestQueued:
    request_id: str
    queued_ns: int  # entered the waiting queue
    num_waiting: int  # queue length including this request


# Built for every token when an observer listens: a plain slotted class, not frozen (a frozen one's
# __init__ sets each field through object.__setattr__, about 1 us more per event). Observers must not change it.
@dataclass(slots=True)
class RequestScheduled:
    """The request gets ``num_tokens`` tokens computed in ``step``: a prefill chunk
    starting at ``start_pos`` or (``is_prefill`` False) one decode token."""

    request_id: str
    step: int
    scheduled_ns: int
    start_pos: int
    num_tokens: int
    is_prefill: bool


@dataclass(frozen=True, slots=True)
class CacheLookup:
    """Prefix-cache lookup made at admission: ``num_hit_tokens`` of ``num_query_tokens``
    found; ``hit_blocks_per_tier`` = (device, host, disk) blocks; ``num_evicted_blocks``
    (``num_evicted_tokens``) right after the hit, the cache held once and evicted."""

    request_id: str
    step: int
    start_ns: int
    end_ns: int
    num_query_tokens: int
    num_hit_tokens: int
    hit_blocks_per_tier: tuple[int, int, int]
    num_evicted_blocks: int = 0
    num_evicted_tokens: int = 0


@dataclass(frozen=True, slots=True)
class TierTransfer:
    """KV blocks copied between tiers. ``kind``: load / swap_out / swap_in / offload /
    prefetch. ``request_id`` is ``None`` for offloads."""

    kind: str
    request_id: str | None
    step: int
    src_tier: int
    dst_tier: int
    num_blocks: int
    num_bytes: int
    start_ns: int
    end_ns: int


@dataclass(frozen=True, slots=True)
class Evicted:
    """Cached free blocks reused; offloaded to ``dst_tier`` first, or dropped (None)."""

    step: int
    tier: int
    num_blocks: int
    dst_tier: int | None
    ns: int


@dataclass(frozen=True, slots=True)
class RetentionEvent:
    """A decision of the session KV retention policy (:mod:`reference_server.engine.retention`).

    ``kind``: ``retain`` (``num_blocks`` of turn ``request_id`` were pinned for ``session``
    over ``[start_ns, end_ns)``), ``drop`` (the finished turn's cached blocks were
    forgotten at ``start_ns``) or ``carry`` (new turn ``request_id`` was admitted;
    ``num_blocks`` leading prompt blocks had been computed by the session's previous turn)."""

    kind: str
    session: str
    request_id: str
    step: int
    tier: int
    num_blocks: int
    num_tokens: int
    start_ns: int
    end_ns: int


@dataclass(frozen=True, slots=True)
class StepStart:
    step: int
    start_ns: int


# Built for every token when an observer listens: a plain slotted class, not frozen (a frozen one's
# __init__ sets each field through object.__setattr__, about 1 us more per event). Observers must not change it.
@dataclass(slots=True)
class BatchEntry:
    request_id: str
    num_prefill_tokens: int
    num_decode_tokens: int


@dataclass(frozen=True, slots=True)
class StepEnd:
    """One engine iteration. ``start_ns`` (scheduling begins) <= ``compute_start_ns``
    (forward pass begins, after tier copies) <= ``compute_end_ns`` (logits ready) <=
    ``end_ns`` (tokens sampled, detokenized and emitted). Queue lengths are after
    scheduling; block counts (device, host, disk) at the end of the step."""

    step: int
    start_ns: int
    compute_start_ns: int
    compute_end_ns: int
    end_ns: int
    batch: tuple[BatchEntry, ...]
    num_waiting: int
    num_running: int
    num_preempted: int
    num_blocks_used: tuple[int, int, int]
    num_blocks_total: tuple[int, int, int]

    @property
    def num_prefill_tokens(self) -> int:
        return sum(e.num_prefill_tokens for e in self.batch)

    @property
    def num_decode_tokens(self) -> int:
        return sum(e.num_decode_tokens for e in self.batch)


# Built for every token when an observer listens: a plain slotted class, not frozen (a frozen one's
# __init__ sets each field through object.__setattr__, about 1 us more per event). Observers must not change it.
@dataclass(slots=True)
class TokenEmitted:
    """Output token ``index`` (0-based) of a request. ``sampled_ns``: its id was known;
    ``emit_ns``: after detokenization, when the engine hands it out."""

    request_id: str
    step: int
    index: int
    token_id: int
    text_delta: str
    sampled_ns: int
    emit_ns: int


@dataclass(frozen=True, slots=True)
class SpeculativeStep:
    """A request's speculative step (:mod:`reference_server.engine.speculative`): ``source``
    (``model``, ``ngram`` or ``early_exit``) proposed ``num_proposed`` tokens over
    ``[draft_start_ns, draft_end_ns)`` (the step's draft phase, shared by the requests that
    speculated in it), the target checked them in the verify pass
    ``[verify_start_ns, verify_end_ns)`` (the step's forward pass, shared by the whole batch)
    and accepted ``num_accepted``; the step then emits tokens ``first_token_index`` ...
    ``first_token_index + num_accepted`` (fewer if the request finishes within them), each
    with its own :class:`TokenEmitted`. Sent after the verify pass, before those tokens.
    ``batch_size``: sequences in the verify pass; ``num_spec_seqs``: how many of them
    speculated. Requests of the step without this event decoded plainly."""

    request_id: str
    step: int
    source: str
    num_proposed: int
    num_accepted: int
    first_token_index: int
    draft_start_ns: int
    draft_end_ns: int
    verify_start_ns: int
    verify_end_ns: int
    batch_size: int
    num_spec_seqs: int


@dataclass(frozen=True, slots=True)
class RequestPreempted:
    request_id: str
    step: int
    mode: str  # "recompute" or "swap"
    ns: int


@dataclass(frozen=True, slots=True)
class RequestResumed:
    request_id: str
    step: int
    mode: str  # how it had been preempted
    ns: int


@dataclass(frozen=True, slots=True)
class RequestFinished:
    request_id: str
    step: int
    reason: str  # "stop" or "length"
    num_output_tokens: int
    num_cached_tokens: int
    finish_ns: int


@dataclass(frozen=True, slots=True)
class RequestAborted:
    request_id: str
    num_output_tokens: int
    ns: int


class EngineObserverProtocol(Protocol):
    """What the engine calls; :class:`EngineObserver` implements all of it as no-ops."""

    def on_request_added(self, event: RequestAdded) -> None: ...
    def on_request_queued(self, event: RequestQueued) -> None: ...
    def on_request_scheduled(self, event: RequestScheduled) -> None: ...
    def on_cache_lookup(self, event: CacheLookup) -> None: ...
    def on_tier_transfer(self, event: TierTransfer) -> None: ...
    def on_evicted(self, event: Evicted) -> None: ...
    def on_step_start(self, event: StepStart) -> None: ...
    def on_step_end(self, event: StepEnd) -> None: ...
    def on_token_emitted(self, event: TokenEmitted) -> None: ...
    def on_speculative_step(self, event: SpeculativeStep) -> None: ...
    def on_request_preempted(self, event: RequestPreempted) -> None: ...
    def on_request_resumed(self, event: RequestResumed) -> None: ...
    def on_request_finished(self, event: RequestFinished) -> None: ...
    def on_request_aborted(self, event: RequestAborted) -> None: ...
    def on_retention(self, event: RetentionEvent) -> None: ...


class EngineObserver:
    """Base observer: override what you need. Called on the engine thread; must not block."""

    def on_request_added(self, event: RequestAdded) -> None:
        return None

    def on_request_queued(self, event: RequestQueued) -> None:
        return None

    def on_request_scheduled(self, event: RequestScheduled) -> None:
        return None

    def on_cache_lookup(self, event: CacheLookup) -> None:
        return None

    def on_tier_transfer(self, event: TierTransfer) -> None:
        return None

    def on_evicted(self, event: Evicted) -> None:
        return None

    def on_step_start(self, event: StepStart) -> None:
        return None

    def on_step_end(self, event: StepEnd) -> None:
        return None

    def on_token_emitted(self, event: TokenEmitted) -> None:
        return None

    def on_speculative_step(self, event: SpeculativeStep) -> None:
        return None

    def on_request_preempted(self, event: RequestPreempted) -> None:
        return None

    def on_request_resumed(self, event: RequestResumed) -> None:
        return None

    def on_request_finished(self, event: RequestFinished) -> None:
        return None

    def on_request_aborted(self, event: RequestAborted) -> None:
        return None

    def on_retention(self, event: RetentionEvent) -> None:
        return None


class RecordingObserver(EngineObserver):
    """Keeps every event in memory, in order (for tests and notebooks; unbounded)."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def of_type(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]

    def for_request(self, request_id: str) -> list[Any]:
        return [e for e in self.events if getattr(e, "request_id", None) == request_id]

    def on_request_added(self, event: RequestAdded) -> None:
        self.events.append(event)

    def on_request_queued(self, event: RequestQueued) -> None:
        self.events.append(event)

    def on_request_scheduled(self, event: RequestScheduled) -> None:
        self.events.append(event)

    def on_cache_lookup(self, event: CacheLookup) -> None:
        self.events.append(event)

    def on_tier_transfer(self, event: TierTransfer) -> None:
        self.events.append(event)

    def on_evicted(self, event: Evicted) -> None:
        self.events.append(event)

    def on_step_start(self, event: StepStart) -> None:
        self.events.append(event)

    def on_step_end(self, event: StepEnd) -> None:
        self.events.append(event)

    def on_token_emitted(self, event: TokenEmitted) -> None:
        self.events.append(event)

    def on_speculative_step(self, event: SpeculativeStep) -> None:
        self.events.append(event)

    def on_request_preempted(self, event: RequestPreempted) -> None:
        self.events.append(event)

    def on_request_resumed(self, event: RequestResumed) -> None:
        self.events.append(event)

    def on_request_finished(self, event: RequestFinished) -> None:
        self.events.append(event)

    def on_request_aborted(self, event: RequestAborted) -> None:
        self.events.append(event)

    def on_retention(self, event: RetentionEvent) -> None:
        self.events.append(event)
