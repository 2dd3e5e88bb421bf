"""Hook points of the HTTP gateway: one event type per thing that happens to a request (frozen, but for
the per-token :class:`ChunkWritten`, which observers must not change either).

A tracer subclasses :class:`GatewayObserver` (every method is a no-op), overrides the events
it wants and attaches it: ``create_app(..., observers=[obs])`` or
``app.state.gateway.add_observer(obs)``. Contract:

* Observers are called synchronously on the gateway's event-loop thread, in the order the
  events happen for a request. They must not block (hand work to another thread) and should
  be fast: their time is the request's time.
* An exception raised by an observer is caught and counted
  (:attr:`GatewayHooks.num_observer_errors`); it never breaks a request.
* Every ``*_ns`` field is ``time.monotonic_ns()`` of the gateway process (the gateway
  monotonic clock), the clock ``GenerateRequest.arrival_ns`` is on.
* With no observer attached the gateway pays one truthiness check per hook point: events
  are only built when someone listens.

Per request the order is: ``on_request_received`` -> ``on_request_parsed`` ->
``on_tokenized`` -> ``on_routed`` -> ``on_chunk_written`` per streamed token (or one
``on_response_written`` for a non-streaming answer) -> ``on_request_finished``. A request
rejected early (bad JSON, 401, ...) goes straight from received to finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "ChunkWritten", "TokenHeld", "GatewayHooks", "GatewayObserver", "GatewayObserverProtocol", "RecordingGatewayObserver",
    "RequestParsed", "RequestReceived", "ResponseWritten", "Routed", "Tokenized", "GatewayRequestFinished",
]


@dataclass(frozen=True, slots=True)
class RequestReceived:
    """The request line and headers arrived (the body is not read yet)."""

    request_id: str  # the id the gateway uses (client's X-Request-Id or a generated cmpl-...)
    t_ns: int
    path: str  # e.g. "/v1/chat/completions"
    tenant: str | None  # from the API key; None when the key is unknown (a 401 follows)
    slo_class_header: str | None  # X-SLO-Class as sent, if any
    client_request_id: str | None  # X-Request-Id as sent, if any
    traceparent: str | None  # W3C trace context header, forwarded to the backend untouched
    session_header: str | None = None  # X-Session-Id as sent, if any
    session_turn_header: str | None = None  # X-Session-Turn as sent, if any


@dataclass(frozen=True, slots=True)
class RequestParsed:
    """The body was read, parsed and validated."""

    request_id: str
    t_ns: int
    operation: str  # "text_completion" or "chat" (OpenTelemetry gen_ai.operation.name)
    model: str
    tenant: str
    slo_class: str
    stream: bool
    max_tokens: int  # as requested; 0 = the endpoint's default (resolved after tokenizing)
    user: str = ""  # the OpenAI ``user`` field, if any


@dataclass(frozen=True, slots=True)
class Tokenized:
    """Prompt (or chat template) turned into token ids: ``[start_ns, end_ns)``."""

    request_id: str
    start_ns: int
    end_ns: int
    num_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Routed:
    """The request was handed to the backend: ``[start_ns, end_ns)`` from the start of
    routing until the backend accepted it (chose ``instance``)."""

    request_id: str
    start_ns: int
    end_ns: int
    instance: str
    accepted_ns: int = -1  # when ``instance`` took the request, on ITS clock (-1 = not reported)


# Built for every token when an observer listens: a plain slotted class, not frozen (a frozen one's
# __init__ sets each field through object.__setattr__, about 1 us more per event). Observers must not change it.
@dataclass(slots=True)
class ChunkWritten:
    """One streamed token written to the client (stream mode only).

    A token whose text is still empty (the first bytes of a UTF-8 character) is
    not written on its own and gets no event: its text goes out with the next
    chunk, as vLLM's incremental detokenizer does.

    ``received_ns``: the backend's token event reached the gateway; ``[detok_start_ns,
    detok_end_ns)``: the gateway turned it into the SSE chunk (text delta, JSON);
    ``[write_start_ns, write_end_ns)``: the write to the client connection."""

    request_id: str
    index: int  # 0-based output token index
    token_id: int
    instance: str  # worker that produced the token
    received_ns: int
    detok_start_ns: int
    detok_end_ns: int
    write_start_ns: int
    write_end_ns: int
    num_bytes: int  # bytes of the SSE event
    emitted_ns: int = -1  # the worker's engine handed the token out, on ``instance``'s clock (-1 = n/a)
    has_content: bool = True  # the chunk carries text (False: only a finish reason)


@dataclass(frozen=True, slots=True)
class TokenHeld:
    """A streamed token with no text yet (the first bytes of a UTF-8 character) reached the
    gateway and was held back: its text goes out with the next chunk (stream mode only)."""

    request_id: str
    index: int  # 0-based output token index
    token_id: int
    instance: str  # worker that produced the token
    received_ns: int  # the backend's token event reached the gateway
    emitted_ns: int = -1  # the worker's engine handed the token out, on ``instance``'s clock (-1 = n/a)


@dataclass(frozen=True, slots=True)
class ResponseWritten:
    """A non-streaming answer's body was written: ``[write_start_ns, write_end_ns)``;
    ``last_token_ns`` is when its last token reached the gateway."""

    request_id: str
    last_token_ns: int
    write_start_ns: int
    write_end_ns: int
    num_bytes: int


@dataclass(frozen=True, slots=True)
class GatewayRequestFinished:
    """The request is over: answered, rejected, failed or abandoned by its client."""

    request_id: str
    t_ns: int
    status: int  # HTTP status code sent (0 when the client left before any response)
    outcome: str  # "stop" | "length" | "aborted" (client left) | "error" | "rejected"
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None  # message of the error sent, if any


class GatewayObserverProtocol(Protocol):
    """What the gateway calls; :class:`GatewayObserver` implements it with no-ops."""

    def on_request_received(self, event: RequestReceived) -> None: ...
    def on_request_parsed(self, event: RequestParsed) -> None: ...
    def on_tokenized(self, event: Tokenized) -> None: ...
    def on_routed(self, event: Routed) -> None: ...
    def on_chunk_written(self, event: ChunkWritten) -> None: ...
    def on_token_held(self, event: TokenHeld) -> None: ...
    def on_response_written(self, event: ResponseWritten) -> None: ...
    def on_request_finished(self, event: GatewayRequestFinished) -> None: ...


class GatewayObserver:
    """Base class: every hook is a no-op. Override what you need."""

    def on_request_received(self, event: RequestReceived) -> None:
        """The headers arrived."""

    def on_request_parsed(self, event: RequestParsed) -> None:
        """The body was parsed and validated."""

    def on_tokenized(self, event: Tokenized) -> None:
        """The prompt was tokenized."""

    def on_routed(self, event: Routed) -> None:
        """The backend accepted the request."""

    def on_chunk_written(self, event: ChunkWritten) -> None:
        """A streamed token was written."""

    def on_token_held(self, event: TokenHeld) -> None:
        """A streamed token without text yet was held back for the next chunk."""

    def on_response_written(self, event: ResponseWritten) -> None:
        """A non-streaming body was written."""

    def on_request_finished(self, event: GatewayRequestFinished) -> None:
        """The request is over."""


class RecordingGatewayObserver(GatewayObserver):
    """Keeps every event in order in :attr:`events` (an in-memory sink for tests)."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def for_request(self, request_id: str) -> list[Any]:
        return [e for e in self.events if e.request_id == request_id]

    def of_type(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]

    def on_request_received(self, event: RequestReceived) -> None:
        self.events.append(event)

    def on_request_parsed(self, event: RequestParsed) -> None:
        self.events.append(event)

    def on_tokenized(self, event: Tokenized) -> None:
        self.events.append(event)

    def on_routed(self, event: Routed) -> None:
        self.events.append(event)

    def on_chunk_written(self, event: ChunkWritten) -> None:
        self.events.append(event)

    def on_token_held(self, event: TokenHeld) -> None:
        self.events.append(event)

    def on_response_written(self, event: ResponseWritten) -> None:
        self.events.append(event)

    def on_request_finished(self, event: GatewayRequestFinished) -> None:
        self.events.append(event)


class GatewayHooks:
    """The gateway's list of observers. Call sites test :attr:`observers` (a tuple,
    replaced on change, so iteration never sees a half-updated list) before building
    an event, then call :meth:`emit`. Event-loop thread only."""

    def __init__(self, observers: tuple[Any, ...] = ()) -> None:
        self.observers: tuple[Any, ...] = tuple(observers)
        self.num_observer_errors = 0

    def add(self, observer: Any) -> None:
        self.observers = (*self.observers, observer)

    def remove(self, observer: Any) -> None:
        """Detach ``observer``; ``ValueError`` if it is not attached."""
        if not any(o is observer for o in self.observers):
            raise ValueError("observer is not attached")
        self.observers = tuple(o for o in self.observers if o is not observer)

    def emit(self, method: str, event: Any) -> None:
        """Call ``observer.<method>(event)`` on each observer; exceptions are counted."""
        for observer in self.observers:
            try:
                getattr(observer, method)(event)
            except Exception:  # an observer must never break a request
                self.num_observer_errors += 1
