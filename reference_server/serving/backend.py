"""The gateway's view of serving: a Backend turns a tokenized request into a token stream.

The contract shared with the gateway (see ``/work/briefs/serving-interface.md``):

* :class:`GenerateRequest` in, an async iterator of :class:`TokenEvent` out, one event per
  output token, indices contiguous from 0 even when a worker dies and the request is
  redispatched; the last event carries ``finish_reason``.
* ``ValueError`` (bad input) is raised on the iterator's first ``__anext__`` (the gateway
  answers 400); :class:`BackendUnavailable` when no live worker of a needed role is left
  (503 before the first token, an error event after it).
* Closing the iterator early (client disconnect) aborts the request on every worker
  involved and frees all of its KV blocks.

Two implementations: :class:`LocalBackend` (one in-process engine, this module) and
:class:`~reference_server.serving.cluster.ClusterBackend` (worker processes).
All methods are called on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

from reference_server.engine import Engine, EngineConfig, EngineLoop
from reference_server.engine.async_engine import stream_outputs
from reference_server.model import SamplingParams, Tokenizer
from reference_server.serving.delays import DelayConfig, plant_engine_delays
from reference_server.serving.worker_hooks import ObserverList, RouteDecision

__all__ = [
    "Backend", "BackendStats", "BackendUnavailable", "GenerateRequest", "InstanceStats", "LocalBackend",
    "TokenEvent", "instance_stats_from_engine",
]


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One tokenized request as the gateway hands it to the backend."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    tenant: str
    slo_class: str
    arrival_ns: int  # gateway monotonic clock (time.monotonic_ns()), ns
    ttft_deadline_ns: int  # arrival + the class's TTFT target; EDF key for redispatch, ns
    traceparent: str | None = None  # W3C trace context, forwarded to workers untouched
    session: str = ""  # the session (conversation) the request is a turn of, for KV retention; "" = none


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One output token of a request's stream."""

    index: int  # 0-based output token index, contiguous even across redispatch
    token_id: int
    text: str  # detokenized delta (may be "")
    finish_reason: str | None  # "stop" | "length" | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from a prefix cache (by the prefill instance)
    instance: str  # name of the worker that produced it, e.g. "decode-0"
    # Hand-over times on ``instance``'s monotonic clock (-1 = not reported, e.g. in-process):
    emitted_ns: int = -1  # the worker's engine handed the token out
    accepted_ns: int = -1  # first token of an attempt only: the worker took the generate request


class BackendUnavailable(RuntimeError):
    """No live worker of a role the request needs; the message says which."""


@dataclass(frozen=True, slots=True)
class InstanceStats:
    """One engine instance. Per-tier tuples are (device, host, disk); counters only grow."""

    name: str
    role: str  # "colocated" | "prefill" | "decode"
    alive: bool
    num_waiting: int
    num_running: int
    num_preempted: int
    num_blocks_used: tuple[int, int, int]
    num_blocks_total: tuple[int, int, int]
    num_prefix_query_tokens: int  # counter
    num_prefix_hit_tokens: int  # counter
    num_kv_bytes_sent: int  # counter, KV transfer payload bytes
    num_kv_bytes_received: int  # counter
    num_requests_finished: int = 0  # counter
    num_generated_tokens: int = 0  # counter


@dataclass(frozen=True, slots=True)
class BackendStats:
    """A snapshot of every instance, plus the backend's own counters."""

    instances: tuple[InstanceStats, ...]
    num_redispatched: int = 0  # counter: requests sent again after their worker died

    def instance(self, name: str) -> InstanceStats:
        """The instance named ``name``; ``KeyError`` if there is none."""
        for inst in self.instances:
            if inst.name == name:
                return inst
        raise KeyError(name)

    @property
    def num_blocks_used(self) -> tuple[int, int, int]:
        """Blocks held by requests, per tier, summed over live instances."""
        live = [i.num_blocks_used for i in self.instances if i.alive]
        return tuple(sum(t[k] for t in live) for k in range(3))  # type: ignore[return-value]


class Backend(Protocol):
    """What the gateway needs from serving. Event-loop thread only."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]: ...

    def stats(self) -> BackendStats: ...

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    def add_observer(self, observer: Any) -> None: ...

    def remove_observer(self, observer: Any) -> None: ...


def instance_stats_from_engine(name: str, role: str, alive: bool, s: Any, *, kv_sent: int = 0,
                               kv_received: int = 0) -> InstanceStats:
    """Build :class:`InstanceStats` from an ``EngineStats`` (or its dict form)."""
    get = s.get if isinstance(s, dict) else (lambda k: getattr(s, k))
    return InstanceStats(
        name=name, role=role, alive=alive, num_waiting=get("num_waiting"), num_running=get("num_running"),
        num_preempted=get("num_preempted"), num_blocks_used=tuple(get("num_blocks_used")),
        num_blocks_total=tuple(get("num_blocks_total")), num_prefix_query_tokens=get("num_prefix_query_tokens"),
        num_prefix_hit_tokens=get("num_prefix_hit_tokens"), num_kv_bytes_sent=kv_sent,
        num_kv_bytes_received=kv_received, num_requests_finished=get("num_requests_finished"),
        num_generated_tokens=get("num_generated_tokens"))


class LocalBackend:
    """One colocated engine in this process (tests, ``--mode local``)."""

    def __init__(self, engine_config: EngineConfig, *, name: str = "colocated-0",
                 delays: DelayConfig | None = None) -> None:
        self.name = name
        self.engine = Engine(engine_config)
        if delays is not None:
            plant_engine_delays(self.engine, delays)
        self._loop = EngineLoop(self.engine)
        self._observers = ObserverList()
        self._started = False

    async def start(self) -> None:
        self._loop.start()
        self._started = True

    async def stop(self) -> None:
        if self._started:
            self._started = False
            await asyncio.to_thread(self._loop.stop)
        self.engine.close()

    @property
    def model_name(self) -> str:
        cfg = self.engine.config
        return os.path.basename(os.path.normpath(cfg.checkpoint)) if cfg.checkpoint else cfg.model

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def add_observer(self, observer: Any) -> None:
        """Attach a :class:`~reference_server.serving.worker_hooks.WorkerObserver`
        (routing events). For engine events use ``self.engine.add_observer``."""
        self._observers.add(observer)

    def remove_observer(self, observer: Any) -> None:
        self._observers.remove(observer)

    def stats(self) -> BackendStats:
        s = self._loop.last_stats
        return BackendStats((instance_stats_from_engine(self.name, "colocated", self._started, s),))

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Stream ``req``'s tokens; see the module docstring for the contract."""
        if not self._started:
            raise BackendUnavailable(f"backend {self.name!r} is not started")
        start_ns = time.monotonic_ns()
        seq = self.engine.prepare_request(req.request_id, req.prompt_token_ids, req.sampling, tenant=req.tenant,
                                          slo_class=req.slo_class, arrival_ns=req.arrival_ns, session=req.session)
        if self._observers:
            self._observers.emit("on_route", RouteDecision(
                req.request_id, "local", self.name, None, start_ns, time.monotonic_ns(), (), 0))
        async with aclosing(stream_outputs(self._loop, seq)) as outputs:  # closing it early aborts
            async for out in outputs:
                yield TokenEvent(out.token_index, out.token_id, out.text_delta, out.finish_reason,
                                 out.num_prompt_tokens, out.num_cached_tokens, self.name)
