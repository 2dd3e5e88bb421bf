"""ClusterBackend: engine workers as separate OS processes, routing, disaggregation, recovery.

Modes: ``colocated`` (``num_instances`` workers that each prefill and decode) and
``disagg`` (``num_prefill`` prefill workers and ``num_decode`` decode workers). In disagg
mode a request goes to a prefill worker (chosen by the router, prefix-aware by default)
together with the decode worker that will continue it (least loaded); the prefill worker
samples the first token, streams it back, and pushes the KV blocks straight to the decode
worker (:mod:`reference_server.serving.kv_transfer`), which streams the rest. The gateway
sees one stream: tokens are relayed in index order, duplicates dropped.

Recovery: a worker is dead on EOF of its control connection or after
``heartbeat_timeout_s`` without a pong. Its in-flight requests are sent again, earliest
``ttft_deadline_ns`` first, continuing after the tokens already delivered (the new worker
recomputes prompt + delivered tokens and samples the next one, so greedy and seeded
output is identical): a request with no token yet goes to the full path again; one with tokens
goes to a colocated worker, or in disagg mode to a decode worker. A request whose prefill
worker died after its KV reached the decode worker is not affected. When no worker of
the needed role is left, the stream ends with :class:`BackendUnavailable`, whose message
names the dead workers, why each died and whether it is being restarted.

Restarts: with ``restart_dead_workers`` (the default) a worker that died is started again
at once, then after 1, 2, 4 ... (at most 30) seconds while starting fails, until the
backend stops; ``/health`` answers 503 meanwhile. ``restart_worker(name)`` brings a dead
worker back by hand. All methods run on the event loop.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from reference_server.engine import EngineConfig
from reference_server.model import ModelConfig, Tokenizer, load_tokenizer
from reference_server.serving.backend import (
    BackendStats,
    BackendUnavailable,
    GenerateRequest,
    InstanceStats,
    TokenEvent,
    instance_stats_from_engine,
)
from reference_server.serving.cluster_worker import WorkerHandle, WorkerStartError
from reference_server.serving.config_codec import engine_config_to_json, sampling_to_dict
from reference_server.serving.delays import DelayConfig
from reference_server.serving.router import Candidate, Router
from reference_server.serving.worker_hooks import (
    KVTransferEnd,
    KVTransferStart,
    ObserverList,
    Redispatch,
    RouteDecision,
    WorkerRequestReceived,
    WorkerStarted,
    WorkerStopped,
)

__all__ = ["MODES", "ClusterBackend"]

MODES = ("colocated", "disagg")
_MAX_RESTART_WAIT_S = 30.0  # longest wait between two attempts to start a dead worker again
_RELAYED_EVENTS = {"KVTransferStart": KVTransferStart, "KVTransferEnd": KVTransferEnd,
                   "WorkerRequestReceived": WorkerRequestReceived}


@dataclass(slots=True)
class _Inflight:
    """The cluster's state of one request (event-loop thread)."""

    req: GenerateRequest
    queue: asyncio.Queue
    attempt: int = 0
    wid: str = ""
    next_index: int = 0  # next output index the gateway gets
    delivered: list[int] = field(default_factory=list)  # token ids delivered so far
    pending: dict[int, TokenEvent] = field(default_factory=dict)  # arrived out of order
    num_cached_tokens: int = 0
    workers: tuple[str, ...] = ()  # instances holding the current attempt
    prefill: str | None = None  # disagg: the prefill worker of the current attempt
    in_decode: bool = False  # disagg: the decode worker has the KV (the prefill worker is done)
    done: bool = False


class ClusterBackend:
    """A :class:`~reference_server.serving.backend.Backend` over worker processes."""

    def __init__(self, engine_config: EngineConfig, *, mode: str = "colocated", num_instances: int = 2,
                 num_prefill: int = 1, num_decode: int = 1, router: str = "prefix_aware",
                 delays: DelayConfig | str | None = None, kv_chunk_blocks: int = 16, host: str = "127.0.0.1",
                 heartbeat_interval_s: float = 0.2, heartbeat_timeout_s: float = 2.0,
                 restart_dead_workers: bool = True) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        counts = {"colocated": num_instances} if mode == "colocated" else {"prefill": num_prefill,
                                                                            "decode": num_decode}
        for role, n in counts.items():
            if n < 1:
                raise ValueError(f"need at least one {role} worker, got {n}")
        self.mode, self.config = mode, engine_config
        self.router = Router(router, block_size=engine_config.block_size)
        spec = str(delays) if isinstance(delays, DelayConfig) else str(DelayConfig.parse(delays))
        cfg_json = engine_config_to_json(engine_config)
        self._handle_args = dict(config_json=cfg_json, delay_spec=spec, kv_chunk_blocks=kv_chunk_blocks, host=host,
                                 heartbeat_interval_s=heartbeat_interval_s, heartbeat_timeout_s=heartbeat_timeout_s)
        self.workers: dict[str, WorkerHandle] = {}
        for role, n in counts.items():
            for i in range(n):
                self.workers[f"{role}-{i}"] = self._make_handle(f"{role}-{i}", role)
        self._by_wid: dict[str, _Inflight] = {}
        self.restart_dead_workers = restart_dead_workers
        self._restarts: dict[str, asyncio.Task] = {}  # worker name -> its restart in progress
        self._stopping = False
        self.num_restarts = 0  # counter: workers started again after dying
        self._observers = ObserverList()
        checkpoint = engine_config.checkpoint_path  # a bundled model by name, too
        self._tokenizer = load_tokenizer(checkpoint)
        model_config = (ModelConfig.from_hf_config(checkpoint) if checkpoint
                        else ModelConfig.preset(engine_config.model))
        self._max_model_len = engine_config.resolve_max_model_len(model_config.max_position)
        self.num_redispatched = 0  # counter

    def _make_handle(self, name: str, role: str) -> WorkerHandle:
        return WorkerHandle(name=name, role=role, on_frame=self._on_frame, on_dead=self._on_dead,
                            on_clock=self._on_clock, **self._handle_args)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ lifecycle, properties

    async def start(self) -> None:
        """Spawn every worker and wait until all serve (``WorkerStartError`` otherwise,
        after stopping those that came up)."""
        results = await asyncio.gather(*(h.start() for h in self.workers.values()), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.stop()
            raise errors[0]
        for handle in self.workers.values():
            self._emit_started(handle)

    async def stop(self) -> None:
        """Stop every worker process; open streams end with ``BackendUnavailable``."""
        self._stopping = True
        restarts = list(self._restarts.values())
        for task in restarts:
            task.cancel()
        await asyncio.gather(*restarts, return_exceptions=True)
        await asyncio.gather(*(h.stop() for h in self.workers.values()))
        for st in list(self._by_wid.values()):
            self._fail(st, BackendUnavailable("the backend stopped"))

    async def restart_worker(self, name: str) -> None:
        """Start a new process for the dead worker ``name``; it rejoins routing.
        ``ValueError`` if there is no such worker or it is alive."""
        old = self.workers.get(name)
        if old is None:
            raise ValueError(f"no worker named {name!r}; workers: {', '.join(self.workers)}")
        if old.alive:
            raise ValueError(f"worker {name!r} is alive")
        pending = self._restarts.get(name)
        if pending is not None and pending is not asyncio.current_task():
            del self._restarts[name]
            pending.cancel()  # a start it had under way is killed by WorkerHandle.start
            await asyncio.gather(pending, return_exceptions=True)
        handle = self._make_handle(name, old.role)
        await handle.start()
        self.workers[name] = handle
        self.router.forget(name)
        self._emit_started(handle)

    def worker_pid(self, name: str) -> int | None:
        return self.workers[name].pid

    @property
    def model_name(self) -> str:
        cfg = self.config
        return os.path.basename(os.path.normpath(cfg.checkpoint)) if cfg.checkpoint else cfg.model

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def add_observer(self, observer: Any) -> None:
        """Attach a :class:`~reference_server.serving.worker_hooks.WorkerObserver`."""
        self._observers.add(observer)

    def remove_observer(self, observer: Any) -> None:
        self._observers.remove(observer)

    def stats(self) -> BackendStats:
        insts: list[InstanceStats] = []
        for name, h in self.workers.items():
            s = h.stats
            if s:
                insts.append(instance_stats_from_engine(name, h.role, h.alive, s, kv_sent=s["num_kv_bytes_sent"],
                                                        kv_received=s["num_kv_bytes_received"]))
            else:  # no heartbeat answered yet: nothing in use, capacity from the config
                cfg = self.config
                total = (cfg.num_device_blocks, cfg.num_host_blocks, cfg.num_disk_blocks)
                insts.append(InstanceStats(name, h.role, h.alive, 0, 0, 0, (0, 0, 0), total, 0, 0, 0, 0))
        return BackendStats(tuple(insts), self.num_redispatched)

    # ------------------------------------------------------------------ requests

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Stream ``req``'s tokens (see :mod:`reference_server.serving.backend`)."""
        self._validate(req)
        st = _Inflight(req, asyncio.Queue())
        self._dispatch(st, exclude=())
        try:
            while True:
                item = await st.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if not st.done:
                self._abort_attempt(st)
                st.done = True

    def _validate(self, req: GenerateRequest) -> None:
        if not req.prompt_token_ids:
            raise ValueError("prompt is empty")
        if len(req.prompt_token_ids) >= self._max_model_len:
            raise ValueError(f"prompt has {len(req.prompt_token_ids)} tokens but the context window is "
                             f"{self._max_model_len} tokens, and at least one must be left for output")
        self.config.tenant(req.tenant)
        self.config.slo_class(req.slo_class)

    def _candidates(self, role: str, exclude: tuple[str, ...]) -> list[Candidate]:
        out = []
        for name, h in self.workers.items():
            if h.role == role and h.alive and name not in exclude:
                s = h.stats
                used = s.get("num_blocks_used", (0,))[0] if s else 0
                total = s.get("num_blocks_total", (1,))[0] if s else 1
                out.append(Candidate(name, len(h.inflight), s.get("num_waiting", 0) if s else 0, used, total))
        if not out:
            raise BackendUnavailable(f"no live {role} worker is left{self._why_none(role)}")
        return out

    def _why_none(self, role: str) -> str:
        """`` (colocated-0 died: heartbeat_timeout, restarting)``: why no worker of ``role`` serves."""
        dead = [f"{name} died: {h.death_reason or 'not started'}"
                f"{', restarting' if name in self._restarts else ''}"
                for name, h in self.workers.items() if h.role == role and not h.alive]
        return f" ({'; '.join(dead)})" if dead else ""

    def _dispatch(self, st: _Inflight, *, exclude: tuple[str, ...]) -> RouteDecision:
        """Send the request's next attempt (raises ``BackendUnavailable``, sending nothing,
        when a needed role has no live worker)."""
        start_ns = time.monotonic_ns()  # backend monotonic clock, ns
        req, resume = st.req, list(st.delivered)
        prompt = req.prompt_token_ids
        decode: str | None = None
        if self.mode == "colocated":
            first, scores = self.router.choose(self._candidates("colocated", exclude), prompt)
        elif resume:
            first, scores = self.router.choose(self._candidates("decode", exclude), prompt, use_prefix=False)
        else:
            prefill = self._candidates("prefill", exclude)
            decodes = self._candidates("decode", exclude)
            first, scores = self.router.choose(prefill, prompt)
            decode, _ = self.router.choose(decodes, prompt, use_prefix=False)
        self.router.record(first, prompt)
        st.wid = f"{req.request_id}@{st.attempt}"
        self._by_wid[st.wid] = st
        st.pending.clear()
        st.prefill = first if decode is not None else None
        st.in_decode = decode is None and self.mode == "disagg"
        st.workers = (first,) if decode is None else (first, decode)
        handoff = None
        if decode is not None:
            d = self.workers[decode]
            handoff = {"name": decode, "host": d.host, "port": d.port}
        for name in st.workers:
            self.workers[name].inflight.add(st.wid)
        self.workers[first].send({
            "type": "generate", "wid": st.wid, "request_id": req.request_id, "prompt": list(prompt),
            "sampling": sampling_to_dict(req.sampling), "tenant": req.tenant, "slo_class": req.slo_class,
            "arrival_ns": req.arrival_ns, "resume_tokens": resume, "handoff_to": handoff,
            "traceparent": req.traceparent, "session": req.session})
        decision = RouteDecision(req.request_id, self.router.policy, first, decode, start_ns, time.monotonic_ns(),
                                 scores, st.attempt)
        if self._observers:
            self._observers.emit("on_route", decision)
        return decision

    def _release(self, st: _Inflight) -> None:
        self._by_wid.pop(st.wid, None)
        for name in st.workers:
            h = self.workers.get(name)
            if h is not None:
                h.inflight.discard(st.wid)

    def _abort_attempt(self, st: _Inflight) -> None:
        for name in st.workers:
            self.workers[name].send({"type": "abort", "wid": st.wid, "request_id": st.req.request_id})
        self._release(st)

    def _fail(self, st: _Inflight, exc: BaseException) -> None:
        self._release(st)
        if not st.done:
            st.done = True
            st.queue.put_nowait(exc)

    # ------------------------------------------------------------------ worker messages

    def _on_frame(self, handle: WorkerHandle, h: dict[str, Any]) -> None:
        kind = h["type"]
        if kind == "event":
            cls = _RELAYED_EVENTS.get(h.get("kind", ""))
            if cls is not None and self._observers:
                self._observers.emit(h["name"], cls(**h["event"]))
            return
        st = self._by_wid.get(str(h.get("wid")))
        if st is None or st.done:
            return  # a stale attempt or a finished request
        if kind == "token":
            self._on_token(st, handle, h)
        elif kind == "kv_received":
            st.in_decode = True
            if st.prefill is not None:
                self.workers[st.prefill].inflight.discard(st.wid)
        elif kind == "error":
            if h.get("kind") == "value":
                self._abort_attempt(st)
                self._fail(st, ValueError(h.get("message", "bad request")))
            elif h.get("kind") == "transfer_failed":
                self._redispatch(st, failed=st.workers[-1])
            else:
                self._abort_attempt(st)
                self._fail(st, RuntimeError(f"worker {handle.name} failed: {h.get('message')}"))

    def _on_token(self, st: _Inflight, handle: WorkerHandle, h: dict[str, Any]) -> None:
        index = int(h["index"])
        if index < st.next_index:
            return  # already delivered by an earlier attempt
        if handle.name == st.prefill or self.mode == "colocated" or index == 0:
            st.num_cached_tokens = max(st.num_cached_tokens, int(h["num_cached_tokens"]))
        st.pending[index] = TokenEvent(index, int(h["token_id"]), h["text"], h["finish_reason"],
                                       len(st.req.prompt_token_ids), 0, handle.name,
                                       int(h.get("emitted_ns", -1)), int(h.get("accepted_ns", -1)))
        while st.next_index in st.pending:
            ev = st.pending.pop(st.next_index)
            ev = replace(ev, num_cached_tokens=st.num_cached_tokens)
            st.next_index += 1
            st.delivered.append(ev.token_id)
            st.queue.put_nowait(ev)
            if ev.finish_reason is not None:
                st.done = True
                self._release(st)
                return

    # ------------------------------------------------------------------ recovery

    def _on_dead(self, handle: WorkerHandle, reason: str) -> None:
        affected = [self._by_wid[w] for w in handle.inflight if w in self._by_wid]
        self._observers.emit("on_worker_stopped", WorkerStopped(
            handle.name, handle.role, reason, len(affected), time.monotonic_ns()))
        self.router.forget(handle.name)
        affected = [st for st in affected if not (st.prefill == handle.name and st.in_decode)]
        for st in sorted(affected, key=lambda s: (s.req.ttft_deadline_ns, s.req.arrival_ns)):
            self._redispatch(st, failed=handle.name)
        if self.restart_dead_workers and not self._stopping and handle.name not in self._restarts:
            self._restarts[handle.name] = asyncio.ensure_future(self._restart_until_up(handle.name))

    async def _restart_until_up(self, name: str) -> None:
        """Start dead worker ``name`` again: at once, then with a doubling wait (at most
        ``_MAX_RESTART_WAIT_S``) while its start fails, until it serves or the backend stops."""
        wait_s = 0.0
        try:
            while not self._stopping:
                if wait_s:
                    await asyncio.sleep(wait_s)
                wait_s = min(max(2 * wait_s, 1.0), _MAX_RESTART_WAIT_S)
                if self.workers[name].alive:
                    return
                try:
                    await self.restart_worker(name)
                except (WorkerStartError, OSError, ValueError):
                    continue
                self.num_restarts += 1
                return
        finally:
            if self._restarts.get(name) is asyncio.current_task():
                del self._restarts[name]

    def _redispatch(self, st: _Inflight, *, failed: str) -> None:
        """Send ``st`` again, avoiding ``failed``; end it when no worker is left."""
        if st.done:
            return
        self._abort_attempt(st)
        st.attempt += 1
        t_ns = time.monotonic_ns()
        try:
            decision = self._dispatch(st, exclude=(failed,))
        except BackendUnavailable as exc:
            self._observers.emit("on_redispatch", Redispatch(
                st.req.request_id, failed, None, len(st.delivered), st.req.ttft_deadline_ns, t_ns))
            self._fail(st, BackendUnavailable(f"{exc} (request {st.req.request_id} was on {failed}, which died)"))
            return
        self.num_redispatched += 1
        self._observers.emit("on_redispatch", Redispatch(
            st.req.request_id, failed, decision.instance, len(st.delivered), st.req.ttft_deadline_ns, t_ns))

    def _on_clock(self, sample: Any) -> None:
        if self._observers:
            self._observers.emit("on_clock_sample", sample)

    def _emit_started(self, handle: WorkerHandle) -> None:
        if self._observers:
            self._observers.emit("on_worker_started", WorkerStarted(
                handle.name, handle.role, handle.pid or 0, handle.port, time.monotonic_ns()))
