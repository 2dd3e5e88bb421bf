"""Hook points of the serving layer: KV transfer, worker lifecycle, routing, redispatch.

Two places emit these events, both to :class:`WorkerObserver` objects:

* inside a worker process (:mod:`reference_server.serving.worker`): KV transfer start
  and end on the sending (prefill) and the receiving (decode) side, worker started and
  stopped. Timestamps are on that worker's monotonic clock (``time.monotonic_ns()``).
  A tracer running in the worker attaches with ``Worker.add_observer`` (see the worker's
  plugin hook, ``REFERENCE_SERVER_WORKER_PLUGINS``); the worker's engine observers
  (``EngineObserver``) are reachable the same way through ``Worker.engine``.
* in the process that owns the backend (the gateway's process): ``Backend.add_observer``
  receives routing decisions, redispatches, worker death and restarts, clock samples
  (ping exchanges, for clock-offset estimation) and the request-received and KV transfer
  events the workers report, relayed unchanged (so their timestamps stay on the worker's clock: pair them
  with the :class:`ClockSample` events of the same instance).

Observers are called on one thread (the worker's event loop or engine thread, or the
backend's event loop), must not block, and must not raise: an exception is swallowed
and counted (``ObserverList.num_errors``), never propagated into serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "ClockSample", "KVTransferEnd", "KVTransferStart", "ObserverList", "Redispatch", "RouteDecision",
    "WorkerObserver", "WorkerRequestReceived", "WorkerStarted", "WorkerStopped",
]


@dataclass(frozen=True, slots=True)
class KVTransferStart:
    """A request's KV blocks start moving. ``direction`` is "send" on the prefill side
    (``t_ns``: before the first chunk is written) and "recv" on the decode side (``t_ns``:
    when the first chunk's header arrived). Clock: ``instance``'s monotonic, ns."""

    request_id: str
    instance: str  # the side reporting
    peer: str  # the other side
    direction: str  # "send" | "recv"
    num_blocks: int
    num_bytes: int  # payload bytes of the whole transfer
    t_ns: int


@dataclass(frozen=True, slots=True)
class KVTransferEnd:
    """A request's KV transfer ended on one side. "send": the last chunk was written and
    acknowledged by the receiver; "recv": the last chunk arrived and the request went to
    the engine. The engine writes the blocks into its device tier before its next step, as
    soon as it has room; the decode engine's ``EngineObserver.on_request_added`` for the
    request fires right after that write (the "blocks imported" moment). ``ok`` is False when it failed or
    was aborted. ``first_sent_ns`` ("send" only, else -1): when the sender began writing its
    first chunk to the socket; ``[start_ns, first_sent_ns)`` is the sender's own part (any planted
    ``kv_transfer`` delay, connecting, its event loop's turn). Clock: ``instance``'s monotonic, ns."""

    request_id: str
    instance: str
    peer: str
    direction: str
    num_blocks: int
    num_bytes: int  # payload bytes actually moved
    num_chunks: int
    start_ns: int
    end_ns: int
    ok: bool
    first_sent_ns: int = -1


@dataclass(frozen=True, slots=True)
class WorkerRequestReceived:
    """A worker took a request: ``kind`` "generate" (a new request, or a resumed one when
    ``num_resumed_tokens`` > 0) or "prefilled" (its KV arrived from a prefill worker).
    ``wid`` names the attempt (``<request_id>@<n>``); ``traceparent`` is the gateway's W3C
    trace context, passed through untouched. ``t_ns``: the worker's monotonic clock."""

    request_id: str
    instance: str
    wid: str
    kind: str
    num_resumed_tokens: int
    traceparent: str | None
    t_ns: int


@dataclass(frozen=True, slots=True)
class WorkerStarted:
    """A worker is up and serving. ``t_ns`` on the reporting process's monotonic clock."""

    instance: str
    role: str  # "colocated" | "prefill" | "decode"
    pid: int
    port: int
    t_ns: int


@dataclass(frozen=True, slots=True)
class WorkerStopped:
    """A worker stopped. ``reason``: "stopped" (asked to), "connection_lost" (EOF on its
    control connection), "heartbeat_timeout" (no ping answer in time), "exited"."""

    instance: str
    role: str
    reason: str
    num_inflight: int  # requests it was serving at that moment
    t_ns: int


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where a request (or a redispatched one) was sent. ``instance`` runs its prefill
    (prefill or colocated worker); ``decode_instance`` continues it in disaggregated mode.
    ``scores`` holds the policy's per-candidate score (lower is better) for inspection.
    Clock: the backend process's monotonic, ns."""

    request_id: str
    policy: str
    instance: str
    decode_instance: str | None
    start_ns: int
    end_ns: int
    scores: tuple[tuple[str, float], ...]
    attempt: int  # 0 for the first dispatch, n for the n-th redispatch


@dataclass(frozen=True, slots=True)
class Redispatch:
    """A request left a dead worker and is sent again, continuing at output token
    ``num_delivered_tokens``. ``to_instance`` is None when no worker of the needed role
    was left (the request then ends with ``BackendUnavailable``)."""

    request_id: str
    from_instance: str
    to_instance: str | None
    num_delivered_tokens: int
    ttft_deadline_ns: int
    t_ns: int


@dataclass(frozen=True, slots=True)
class ClockSample:
    """One ping exchange with a worker (NTP-style): the backend sent at ``t_send_ns`` and
    got the answer at ``t_recv_ns`` (backend clock); the worker received it at
    ``worker_recv_ns`` and answered at ``worker_send_ns`` (worker clock). The estimated
    offset (worker minus backend) is ``((wr - ts) + (ws - tr)) / 2``; trust the samples
    with the smallest round trip ``(tr - ts) - (ws - wr)``."""

    instance: str
    t_send_ns: int
    worker_recv_ns: int
    worker_send_ns: int
    t_recv_ns: int

    @property
    def offset_ns(self) -> float:
        return ((self.worker_recv_ns - self.t_send_ns) + (self.worker_send_ns - self.t_recv_ns)) / 2

    @property
    def round_trip_ns(self) -> int:
        return (self.t_recv_ns - self.t_send_ns) - (self.worker_send_ns - self.worker_recv_ns)


class WorkerObserver:
    """Base class with a no-op method per event; override what you need."""

    def on_kv_transfer_start(self, event: KVTransferStart) -> None:
        pass

    def on_kv_transfer_end(self, event: KVTransferEnd) -> None:
        pass

    def on_worker_request_received(self, event: WorkerRequestReceived) -> None:
        pass

    def on_worker_started(self, event: WorkerStarted) -> None:
        pass

    def on_worker_stopped(self, event: WorkerStopped) -> None:
        pass

    def on_route(self, event: RouteDecision) -> None:
        pass

    def on_redispatch(self, event: Redispatch) -> None:
        pass

    def on_clock_sample(self, event: ClockSample) -> None:
        pass


class ObserverList:
    """The observers attached at one place. ``emit`` is one truthiness check when empty.

    ``add``/``remove`` replace the list (copy on write), so an emit running on another
    thread never sees it change under it."""

    __slots__ = ("observers", "num_errors")

    def __init__(self) -> None:
        self.observers: tuple[Any, ...] = ()
        self.num_errors = 0  # exceptions raised by observers, swallowed

    def __bool__(self) -> bool:
        return bool(self.observers)

    def add(self, observer: Any) -> None:
        self.observers = (*self.observers, observer)

    def remove(self, observer: Any) -> None:
        """Detach ``observer``; ``ValueError`` if it is not attached."""
        if observer not in self.observers:
            raise ValueError("observer is not attached")
        self.observers = tuple(o for o in self.observers if o is not observer)

    def emit(self, method: str, event: Any) -> None:
        """Call ``method(event)`` on every observer that has it; never raises."""
        for observer in self.observers:
            fn = getattr(observer, method, None)
            if fn is None:
                continue
            try:
                fn(event)
            except Exception:  # an observer must never break serving
                self.num_errors += 1
