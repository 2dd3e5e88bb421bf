"""The manual API: module-level functions that forward to the bound recorder.

Instrumented code calls these without knowing whether tracing is on. Until
:func:`bind` is called (``tokentrace.instrument`` does it) every function is a
no-op costing one function call and one attribute check; after it, each
forwards to the bound :class:`~tokentrace.recorder.Recorder` and inherits its
contract: any thread, never blocks, never raises, times are
``time.monotonic_ns()`` integers (``tokentrace.clock.now_ns``).

The binding lives in one slotted holder object rather than in rebound module
functions, so ``from tokentrace.api import span`` taken before ``bind`` still
records afterwards.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from types import TracebackType
from typing import Callable

from tokentrace.clock import now_ns
from tokentrace.recorder import Recorder
from tokentrace.schema import RequestStatus

__all__ = [
    "bind",
    "unbind",
    "current",
    "request_begin",
    "request_end",
    "span",
    "stage",
    "token_emitted",
    "token_sent",
    "step",
    "cache_event",
    "RequestContext",
    "current_request",
    "enter_request",
    "leave_request",
]


class _Binding:
    __slots__ = ("recorder",)

    def __init__(self) -> None:
        self.recorder: Recorder | None = None


_state = _Binding()


def bind(recorder: Recorder) -> None:
    """Send every manual-API call to ``recorder`` from now on (replaces any previous one)."""
    if not isinstance(recorder, Recorder):
        raise TypeError(f"bind() expects a tokentrace Recorder, got {type(recorder).__name__}")
    _state.recorder = recorder


def unbind() -> None:
    """Make the manual API a no-op again (the recorder itself is not closed)."""
    _state.recorder = None


def current() -> Recorder | None:
    """The bound recorder, or None."""
    return _state.recorder


def request_begin(key: str, *, tenant: str = "", slo_class: str = "", arrival_ns: int | None = None,
                  num_prompt_tokens: int = -1, trace_id: str = "", session: str = "", session_turn: int = -1) -> int:
    """Note a request's arrival (default: now); returns its ``request_id``.

    Unbound, it returns ``-1`` without hashing the key: ids only matter
    while tracing, and every other function ignores them then.
    """
    r = _state.recorder
    if r is None:
        return -1
    return r.request_begin(key, tenant=tenant, slo_class=slo_class,
                           arrival_ns=now_ns() if arrival_ns is None else arrival_ns,
                           num_prompt_tokens=num_prompt_tokens, trace_id=trace_id, session=session,
                           session_turn=session_turn)


def request_end(request_id: int, *, finish_ns: int | None = None, status: int = RequestStatus.OK,
                first_token_ns: int = -1, num_output_tokens: int = -1, num_cached_tokens: int = -1,
                error: str = "") -> None:
    """Write the request's row (``finish_ns`` default: now)."""
    r = _state.recorder
    if r is not None:
        r.request_end(request_id, finish_ns=now_ns() if finish_ns is None else finish_ns,
                      status=status, first_token_ns=first_token_ns,
                      num_output_tokens=num_output_tokens, num_cached_tokens=num_cached_tokens,
                      error=error)


def span(request_id: int, stage: int, start_ns: int, end_ns: int, token_index: int = -1,
         step: int = -1, num_bytes: int = -1, tier: int = -1, batch_size: int = -1) -> None:
    """Record a complete stage interval ``[start_ns, end_ns)``."""
    r = _state.recorder
    if r is not None:
        r.span(request_id, stage, start_ns, end_ns, token_index, step, num_bytes, tier, batch_size)


def token_emitted(request_id: int, index: int, t_ns: int | None = None, step: int = -1) -> None:
    """The engine produced output token ``index`` at ``t_ns`` (default: now)."""
    r = _state.recorder
    if r is not None:
        r.token(request_id, index, emit_ns=now_ns() if t_ns is None else t_ns, step=step)


def token_sent(request_id: int, index: int, t_ns: int | None = None) -> None:
    """Output token ``index``'s delta was written to the client at ``t_ns`` (default: now)."""
    r = _state.recorder
    if r is not None:
        r.token(request_id, index, sent_ns=now_ns() if t_ns is None else t_ns)


def step(step: int, start_ns: int, end_ns: int, num_seqs: int, num_prefill_tokens: int,
         num_decode_tokens: int, num_waiting: int, num_running: int, num_preempted: int,
         blocks_used_device: int = -1, blocks_total_device: int = -1, blocks_used_host: int = -1,
         blocks_total_host: int = -1, blocks_used_disk: int = -1, blocks_total_disk: int = -1) -> None:
    """Record one engine iteration (see ``Recorder.step``)."""
    r = _state.recorder
    if r is not None:
        r.step(step, start_ns, end_ns, num_seqs, num_prefill_tokens, num_decode_tokens,
               num_waiting, num_running, num_preempted, blocks_used_device, blocks_total_device,
               blocks_used_host, blocks_total_host, blocks_used_disk, blocks_total_disk)


def cache_event(kind: int, tier: int, num_blocks: int, start_ns: int, end_ns: int,
                request_id: int = -1, num_tokens: int = -1, num_bytes: int = -1,
                step: int = -1) -> None:
    """Record one KV cache event (see ``Recorder.cache_event``)."""
    r = _state.recorder
    if r is not None:
        r.cache_event(kind, tier, num_blocks, start_ns, end_ns, request_id, num_tokens, num_bytes, step)


class _StageTimer:
    """Context manager recording ``[enter, exit)`` as one span on ``recorder``."""

    __slots__ = ("_recorder", "_request_id", "_stage", "_token_index", "_start_ns")

    def __init__(self, recorder: Recorder, request_id: int, stage: int, token_index: int) -> None:
        self._recorder = recorder
        self._request_id = request_id
        self._stage = stage
        self._token_index = token_index
        self._start_ns = -1

    def __enter__(self) -> _StageTimer:
        self._start_ns = now_ns()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # Recorded even when the block raises: the time was spent in the stage.
        self._recorder.span(self._request_id, self._stage, self._start_ns, now_ns(), self._token_index)


class _NoStage:
    """What :func:`stage` returns while unbound: enter and exit do nothing."""

    __slots__ = ()

    def __enter__(self) -> _NoStage:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


_NO_STAGE = _NoStage()


def stage(request_id: int, stage: int, token_index: int = -1) -> _StageTimer | _NoStage:
    """Context manager timing a block as one interval of ``stage`` (``now_ns`` at enter and exit).

    The recorder bound when the block is entered receives the span, even if
    the binding changes inside the block. Exceptions from the block propagate.
    """
    r = _state.recorder
    if r is None:
        return _NO_STAGE
    return _StageTimer(r, request_id, stage, token_index)


@dataclass(slots=True, eq=False)
class RequestContext:
    """The traced request the running code serves: what engine code needs to join its stages to it.

    Made by whatever traces the request's arrival (the ASGI middleware, ``TokenTraceMiddleware``)
    and found with :func:`current_request` anywhere in the request's context: the app's handler,
    the tasks it starts (``asyncio`` copies the context), ``asyncio.to_thread``. A thread started
    with ``threading.Thread`` does not inherit it: take it in the handler and hand it over. Its
    stages go to the recorder that records the request, under its ``request_id``.
    """

    request_id: int  # the requests row's id (schema.request_id_of(key, tenant))
    key: str  # the request's key: its X-Request-Id header, or the id drawn for it
    recorder: Recorder = field(repr=False)
    tenant: str = ""
    slo_class: str = ""
    receive_end: Callable[[], int] | None = field(default=None, repr=False)  # when the body had been read
    last_send_start_ns: int = field(default=-1, repr=False)  # the latest response body send began; -1: none yet

    def receive_end_ns(self) -> int:
        """When the whole request body had been read (monotonic ns), or -1 while unknown."""
        return self.receive_end() if self.receive_end is not None else -1

    def span(self, stage: int, start_ns: int, end_ns: int, token_index: int = -1, step: int = -1) -> None:
        """Record ``[start_ns, end_ns)`` of ``stage`` for this request (token ``token_index``; -1: the request)."""
        self.recorder.span(self.request_id, stage, start_ns, end_ns, token_index, step)

    def stage(self, stage: int, token_index: int = -1) -> _StageTimer:
        """Context manager timing a block as one interval of ``stage`` of this request."""
        return _StageTimer(self.recorder, self.request_id, stage, token_index)



_request: ContextVar[RequestContext | None] = ContextVar("tokentrace_request", default=None)


def current_request() -> RequestContext | None:
    """The traced request this code runs for (see :class:`RequestContext`), or None outside one."""
    return _request.get()


def enter_request(context: RequestContext) -> Token[RequestContext | None]:
    """Make ``context`` the current request of this context (for tracers of a request's arrival);
    pass the result to :func:`leave_request` when the request is done."""
    return _request.set(context)


def leave_request(token: Token[RequestContext | None]) -> None:
    """Undo :func:`enter_request`."""
    _request.reset(token)
