"""The engine's observers as one: a typed fan-out the engine calls directly.

:class:`ObserverFanOut` implements :class:`~reference_server.engine.hooks.EngineObserverProtocol`; each
hook calls the same hook of every attached observer, in the order they were attached, with no lookup by
name (a misspelt hook is a type error, not a silent miss). An observer that raises is counted in
``num_errors`` and the others are still called, as OpenTelemetry's multi span processor does: an observer
must never break the engine. Engine thread only (attaching replaces the tuple, so a hook in progress keeps
the observers it started with).
"""

from __future__ import annotations

from collections.abc import Iterator

from reference_server.engine.hooks import (
    CacheLookup,
    EngineObserverProtocol,
    Evicted,
    RequestAborted,
    RequestAdded,
    RequestFinished,
    RequestPreempted,
    RequestQueued,
    RequestResumed,
    RequestScheduled,
    RetentionEvent,
    SpeculativeStep,
    StepEnd,
    StepStart,
    TierTransfer,
    TokenEmitted,
)

__all__ = ["ObserverFanOut"]


class ObserverFanOut:
    """Every attached observer behind one :class:`EngineObserverProtocol`; ``bool()`` is whether any is attached,
    so the engine builds an event only when someone listens."""

    __slots__ = ("_observers", "num_errors")

    def __init__(self) -> None:
        self._observers: tuple[EngineObserverProtocol, ...] = ()
        self.num_errors = 0  # hooks that raised, over all observers

    def __bool__(self) -> bool:
        return bool(self._observers)

    def __len__(self) -> int:
        return len(self._observers)

    def __iter__(self) -> Iterator[EngineObserverProtocol]:
        return iter(self._observers)

    def __contains__(self, observer: object) -> bool:
        return any(o is observer for o in self._observers)

    def add(self, observer: EngineObserverProtocol) -> None:
        """Attach ``observer`` (called after those attached before it)."""
        self._observers = (*self._observers, observer)

    def remove(self, observer: EngineObserverProtocol) -> None:
        """Detach ``observer``; ``ValueError`` if it is not attached."""
        if observer not in self:
            raise ValueError("observer is not attached")
        self._observers = tuple(o for o in self._observers if o is not observer)

    def on_request_added(self, event: RequestAdded) -> None:
        for observer in self._observers:
            try:
                observer.on_request_added(event)
            except Exception:  # noqa: BLE001 - an observer never breaks the engine
                self.num_errors += 1

    def on_request_queued(self, event: RequestQueued) -> None:
        for observer in self._observers:
            try:
                observer.on_request_queued(event)
            except Exception:  # noqa: BLE001 - an observer never breaks the engine
                self.num_errors += 1

    def on_request_scheduled(self, event: RequestScheduled) -> None:
        for observer in self._observers:
            try:
                observer.on_request_scheduled(event)
            except Exception:  # noqa: BLE001 - an observer never breaks the engine
                self.num_errors += 1

    def on_cache_lookup(self, event: CacheLookup) -> None:
        for observer in self._observers:
            try:
                observer.on_cache_lookup(event)
            except Exception:  # noqa: BLE001 - an observer never breaks the engine
                self.num_errors += 1

    def on_tier_transfer(self, event: TierTransfer) -> None:
        for observer in self._observers:
            try:
                observer.on_tier_transfer(event)
            except Exception:  # noqa: BLE001 - an observer never breaks the engine
                self.num_errors += 1

    def on_evicted(self, event: Evicted) -> None:
        for observer in self._observers:
            try:
                observer.on_evicted(event)
            except Exception:  # noqa: BLE001 - an observer never breaks the engine
                self.num_errors += 1

    def on_step_start(self, event: StepStart) -> None:
        for observer in self._observers:
            try:
                observer.on_step_start(event)
            except Exception:  # noqa: BLE001 - an observer never breaks the engine
                self.num_errors += 1

    def on_step_end(self, event: StepEnd) -> None:
        for observer in self._observers:
            try:
                observer.on_step_end(event)
            except Exception:  # noqa: BLE001 - an observer never breaks the engine
                self.num_errors += 1

    def on_token_emitted(self, event: TokenEmitted) -> None:
        for observer in self._observers:
            try:
                observer.on_token_emitted(event)
            except Exception:  # noqa: BLE001 - an observer never breaks the engine
                self.num_errors += 1

    def on_speculative_step(self, event: SpeculativeStep) -> None:
        for observer in self._observers:
            try:
                observer.on_speculative_step(event)
            except Exception:  # noqa: BLE001 - an observer never breaks the engine
                self.num_errors += 1

    def on_request_preempted(self, event: RequestPreempted) -> None:
        for observer in self._observers:
            try:
                observer.on_request_preempted(event)
            except Exception:  # noqa: BLE001 - an observer never breaks the engine
                self.num_errors += 1

    def on_request_resumed(self, event: RequestResumed) -> None:
        for observer in self._observers:
            try:
                observer.on_request_resumed(event)
            except Exception:  # noqa: BLE001 - an observer never breaks the engine
                self.num_errors += 1

    def on_request_finished(self, event: RequestFinished) -> None:
        for observer in self._observers:
            try:
                observer.on_request_finished(event)
            except Exception:  # noqa: BLE001 - an observer never breaks the engine
                self.num_errors += 1

    def on_request_aborted(self, event: RequestAborted) -> None:
        for observer in self._observers:
            try:
                observer.on_request_aborted(event)
            except Exception:  # noqa: BLE001 - an observer never breaks the engine
                self.num_errors += 1

    def on_retention(self, event: RetentionEvent) -> None:
        for observer in self._observers:
            try:
                observer.on_retention(event)
            except Exception:  # noqa: BLE001 - an observer never breaks the engine
                self.num_errors += 1
