"""AsyncEngine: the engine's step loop on a background thread, token streams for asyncio.

One thread (the engine thread) owns the :class:`Engine` and runs ``step()`` while any
request is unfinished. Other threads never touch the engine: ``generate`` validates
and tokenizes on the caller's thread, then hands the request over through an inbox
(a list under a condition variable) that the engine thread drains before each step;
aborts travel the same way. When nothing is queued or running, the engine thread
sleeps on the condition variable (no busy waiting). Tokens come back to each consumer
through its own ``asyncio.Queue``, filled with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Mapping, Sequence as Seq
from typing import Any

from reference_server.engine.config import EngineConfig
from reference_server.engine.engine import Engine
from reference_server.engine.outputs import TokenDelta
from reference_server.model import SamplingParams

__all__ = ["AsyncEngine", "EngineStoppedError"]

_THROTTLED_WAIT_S = 0.005  # re-check period while requests wait only for tenant token buckets to refill


class EngineStoppedError(RuntimeError):
    """The engine stopped (or its loop failed) while a stream was open."""


class AsyncEngine:
    """Drive an :class:`Engine` from asyncio. ``start``/``stop``/``generate`` are called
    on the event loop's thread; the engine itself runs on a private thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, Any]] = []  # ("add", Sequence) or ("abort", request_id)
        self._streams: dict[str, asyncio.Queue] = {}  # guarded by _cond
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None  # what killed the loop, if anything

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(Engine(config))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def start(self) -> None:
        """Start the engine thread (idempotent while running)."""
        if self.is_running:
            return
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the loop, abort what is left (freeing its blocks) and end open streams
        with :class:`EngineStoppedError`. Does not close the engine."""
        thread = self._thread
        if thread is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify()
        await asyncio.to_thread(thread.join)
        self._thread = None
        with self._cond:
            pending, self._inbox = self._inbox, []
            streams = dict(self._streams)
        for kind, payload in pending:
            if kind == "abort":
                self.engine.abort(payload)
        for request_id in streams:
            self.engine.abort(request_id)
            self._deliver(request_id, EngineStoppedError("the engine stopped"))

    async def generate(self, request_id: str, prompt: str | Seq[int], sampling: SamplingParams | Mapping[str, Any],
                       *, tenant: str | None = None, slo_class: str = "interactive",
                       arrival_ns: int | None = None) -> AsyncIterator[TokenDelta]:
        """Stream a request's tokens. Bad input raises ``ValueError`` on the first
        ``__anext__``; closing or cancelling the consumer aborts the request (its blocks
        are freed on the engine thread before its next step)."""
        if not self.is_running:
            raise EngineStoppedError("AsyncEngine is not started")
        seq = self.engine.prepare_request(request_id, prompt, sampling, tenant=tenant, slo_class=slo_class,
                                          arrival_ns=arrival_ns)
        queue: asyncio.Queue = asyncio.Queue()
        with self._cond:
            if request_id in self._streams:
                raise ValueError(f"duplicate request_id {request_id!r}")
            self._streams[request_id] = queue
            self._inbox.append(("add", seq))
            self._cond.notify()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        finally:
            with self._cond:
                self._streams.pop(request_id, None)
                if not finished:
                    self._inbox.append(("abort", request_id))
                    self._cond.notify()

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        engine = self.engine
        idle_wait: float | None = None
        while True:
            with self._cond:
                while not (self._inbox or self._stopping or (engine.has_unfinished() and idle_wait is None)):
                    if not self._cond.wait(timeout=idle_wait):
                        break  # throttle period over: try a step again
                if self._stopping:
                    return
                inbox, self._inbox = self._inbox, []
            self._apply(inbox)
            if not engine.has_unfinished():
                idle_wait = None
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # a failed step ends every stream with the error
                self.error = exc
                self._fail_all(exc)
                return
            for out in outputs:
                self._deliver(out.request_id, TokenDelta(out.token_id, out.text_delta, out.token_index,
                                                         out.finish_reason))
            idle_wait = _THROTTLED_WAIT_S if engine.num_scheduled_tokens_last_step == 0 else None

    def _apply(self, inbox: list[tuple[str, Any]]) -> None:
        for kind, payload in inbox:
            if kind == "abort":
                self.engine.abort(payload)
                continue
            try:
                self.engine.add_prepared(payload)
            except ValueError as exc:
                self._deliver(payload.request_id, exc)

    def _deliver(self, request_id: str, item: object) -> None:
        with self._cond:
            queue = self._streams.get(request_id)
        if queue is None or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            ids = list(self._streams)
        for request_id in ids:
            err = EngineStoppedError(f"engine step failed: {exc!r}")
            err.__cause__ = exc
            self._deliver(request_id, err)
