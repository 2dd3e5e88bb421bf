"""AsyncEngine: token streams for asyncio over an :class:`EngineLoop`.

A thin adapter: the engine thread, its inbox and its sleeping are the
:class:`~reference_server.engine.engine_loop.EngineLoop`'s. ``generate`` validates and
tokenizes on the caller's thread, submits the request to the loop and streams its
tokens back through an ``asyncio.Queue`` that the engine thread fills with
``loop.call_soon_threadsafe`` (:func:`stream_outputs`, also used by the serving
layer's in-process backend).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from collections.abc import Sequence as Seq
from contextlib import aclosing
from typing import Any

from reference_server.engine.config import EngineConfig
from reference_server.engine.engine import Engine
from reference_server.engine.engine_loop import EngineLoop, EngineStoppedError
from reference_server.engine.handoff import PrefilledKV
from reference_server.engine.outputs import RequestOutput, TokenDelta
from reference_server.engine.sequence import Sequence
from reference_server.model import SamplingParams

__all__ = ["AsyncEngine", "EngineStoppedError", "stream_outputs"]


class AsyncEngine:
    """Drive an :class:`Engine` from asyncio. ``start``/``stop``/``generate`` are called
    on the event loop's thread; the engine itself runs on the loop's private thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._loop = EngineLoop(engine)
        self._open: set[str] = set()  # request ids with an open stream (event loop thread)

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(Engine(config))

    @property
    def is_running(self) -> bool:
        return self._loop.is_running

    @property
    def error(self) -> BaseException | None:
        """What killed the engine thread (a step's exception), if anything."""
        return self._loop.error

    async def start(self) -> None:
        """Start the engine thread (idempotent while running)."""
        self._loop.start()

    async def stop(self) -> None:
        """Stop the engine thread, abort what is left (freeing its blocks) and end open
        streams with :class:`EngineStoppedError`. Does not close the engine."""
        await asyncio.to_thread(self._loop.stop)

    async def generate(self, request_id: str, prompt: str | Seq[int], sampling: SamplingParams | Mapping[str, Any],
                       *, tenant: str | None = None, slo_class: str = "interactive",
                       arrival_ns: int | None = None, session: str = "") -> AsyncIterator[TokenDelta]:
        """Stream a request's tokens. Bad input (and a ``request_id`` whose stream is
        still open) raises ``ValueError`` on the first ``__anext__``; closing or
        cancelling the consumer aborts the request (its blocks are freed on the engine
        thread before its next step)."""
        if not self.is_running:
            raise EngineStoppedError("AsyncEngine is not started")
        seq = self.engine.prepare_request(request_id, prompt, sampling, tenant=tenant, slo_class=slo_class,
                                          arrival_ns=arrival_ns, session=session)
        if request_id in self._open:
            raise ValueError(f"duplicate request_id {request_id!r}")
        self._open.add(request_id)
        try:
            async with aclosing(stream_outputs(self._loop, seq)) as outputs:
                async for out in outputs:
                    yield TokenDelta(out.token_id, out.text_delta, out.token_index, out.finish_reason)
        finally:
            self._open.discard(request_id)


async def stream_outputs(loop: EngineLoop, seq: Sequence) -> AsyncIterator[RequestOutput]:
    """Submit ``seq`` (from ``Engine.prepare_request``) to ``loop`` on the first
    ``__anext__`` and yield its outputs until the one that finishes it. An error from
    the loop (bad request, stopped or failed engine) is raised to the consumer; closing
    or cancelling the consumer before the last output aborts the request. Call on an
    event loop's thread."""
    sink = _AsyncioSink(asyncio.get_running_loop())
    loop.submit(seq, sink)
    finished = False
    try:
        while True:
            item = await sink.queue.get()
            if isinstance(item, BaseException):
                finished = True  # the loop has already dropped the request
                raise item
            finished = item.finished
            yield item
            if finished:
                return
    finally:
        if not finished:
            loop.abort(seq.request_id)


class _AsyncioSink:
    """A :class:`~reference_server.engine.engine_loop.RequestSink` that hands each result
    to one consumer's asyncio queue (engine thread -> event loop thread)."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def _put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody listens any more
            pass

    def on_output(self, output: RequestOutput) -> None:
        self._put(output)

    def on_handoff(self, state: PrefilledKV) -> None:
        self._put(RuntimeError("unexpected handoff: the request was not submitted for handoff"))

    def on_error(self, exc: BaseException) -> None:
        self._put(exc)
