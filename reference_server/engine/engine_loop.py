"""EngineLoop: one Engine stepped on its own thread, fed through an inbox.

The only driver of an :class:`~reference_server.engine.engine.Engine` on a thread:
:class:`~reference_server.engine.async_engine.AsyncEngine` adapts it to asyncio, and
the serving layer's in-process backend and worker processes use it directly.

One thread (the engine thread) owns the engine and runs ``step()`` while any request
is unfinished. Other threads never touch the engine: they queue requests, aborts and
calls in an inbox (a list under a condition variable) that the engine thread drains
before each step. When nothing is queued or running, the engine thread sleeps on the
condition variable (no busy waiting). Besides plain requests, a request can arrive
already prefilled (KV imported from another engine), resume after output tokens
delivered elsewhere, or leave after its first token with its KV exported (prefill
role of a disaggregated deployment; see :mod:`reference_server.engine.handoff`).

Results go to a :class:`RequestSink` per request, called on the engine thread; a sink
must not block (hand the value to an event loop with ``call_soon_threadsafe``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from typing import Any, Protocol

from reference_server.engine.engine import Engine
from reference_server.engine.handoff import PrefilledKV, admit_prefilled, export_prefilled, resume
from reference_server.engine.outputs import EngineStats, RequestOutput
from reference_server.engine.sequence import Sequence

__all__ = ["EngineLoop", "EngineStoppedError", "RequestSink"]

_THROTTLED_WAIT_S = 0.005  # re-check period while requests wait only for tenant buckets or free blocks


class EngineStoppedError(RuntimeError):
    """The engine loop stopped (or a step failed, the cause chained) while a request was open."""


class RequestSink(Protocol):
    """Where one request's results go. Engine thread; must not block or raise."""

    def on_output(self, output: RequestOutput) -> None: ...

    def on_handoff(self, state: PrefilledKV) -> None: ...

    def on_error(self, exc: BaseException) -> None: ...


class EngineLoop:
    """Drive an :class:`Engine` on a background thread. Every public method may be
    called from any thread and returns without waiting for the engine, except ``call``'s
    future and ``stop``."""

    def __init__(self, engine: Engine, *, on_fatal: Callable[[BaseException], None] | None = None) -> None:
        """``on_fatal(exc)`` is called on the engine thread if a step raises (the loop
        then ends, every open request having got ``on_error``)."""
        self.engine = engine
        self._on_fatal = on_fatal
        self._cond = threading.Condition()
        self._inbox: list[tuple[Any, ...]] = []  # guarded by _cond
        self._sinks: dict[str, RequestSink] = {}  # engine thread only
        self._handoff: set[str] = set()  # requests that leave after their first new token
        self._pending_imports: list[tuple[Sequence, tuple[int, ...], bytes, RequestSink]] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # what killed the loop, if anything
        self.last_stats: EngineStats = engine.stats()  # refreshed on the engine thread

    # ------------------------------------------------------------------ control

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the engine thread (idempotent while it runs)."""
        if self.is_running:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (blocking until it ends), abort what is left (freeing its
        blocks) and end every open request with :class:`EngineStoppedError`. Does not
        close the engine."""
        thread = self._thread
        if thread is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify()
        thread.join()
        self._thread = None
        self._apply(self._take_inbox())
        for rid, sink in list(self._sinks.items()):
            self.engine.abort(rid)
            sink.on_error(EngineStoppedError("the engine stopped"))
        for _, _, _, sink in self._pending_imports:
            sink.on_error(EngineStoppedError("the engine stopped"))
        self._sinks.clear()
        self._handoff.clear()
        self._pending_imports.clear()

    def submit(self, seq: Sequence, sink: RequestSink, *, resume_tokens: Seq[int] = (),
               handoff: bool = False) -> None:
        """Queue ``seq`` (from ``Engine.prepare_request``). ``resume_tokens``: outputs
        already delivered elsewhere. ``handoff``: after its first new token, export its KV
        to ``sink.on_handoff`` and drop it here (prefill role). Errors (a duplicate id,
        say) go to ``sink.on_error``."""
        self._put(("add", seq, sink, tuple(resume_tokens), handoff))

    def submit_prefilled(self, seq: Sequence, output_token_ids: Seq[int], data: bytes, sink: RequestSink) -> None:
        """Queue a request whose KV (prompt + outputs but the last) is ``data``; it is
        admitted running as soon as the device tier has room (decode role)."""
        self._put(("import", seq, tuple(output_token_ids), data, sink))

    def abort(self, request_id: str) -> None:
        """Drop the request wherever it is (queued, running, waiting for room); its sink
        hears nothing more."""
        self._put(("abort", request_id))

    def call(self, fn: Callable[[Engine], Any]) -> Future:
        """Run ``fn(engine)`` on the engine thread between steps; its result in the future."""
        future: Future = Future()
        self._put(("call", fn, future))
        return future

    def _put(self, item: tuple[Any, ...]) -> None:
        with self._cond:
            self._inbox.append(item)
            self._cond.notify()

    def _take_inbox(self) -> list[tuple[Any, ...]]:
        with self._cond:
            inbox, self._inbox = self._inbox, []
        return inbox

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        engine, idle_wait = self.engine, None
        while True:
            with self._cond:
                while not (self._inbox or self._stopping or (self._has_work() and idle_wait is None)):
                    if not self._cond.wait(timeout=idle_wait):
                        break  # throttle period over: try a step again
                if self._stopping:
                    return
                inbox, self._inbox = self._inbox, []
            self._apply(inbox)
            self._admit_imports()
            if not engine.has_unfinished():
                idle_wait = _THROTTLED_WAIT_S if self._pending_imports else None
                self.last_stats = engine.stats()
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # a failed step ends every open request with the error
                self._fail(exc)
                return
            self.last_stats = engine.stats()  # before delivery: a consumer seeing its last token sees this
            if self._deliver(outputs):
                self.last_stats = engine.stats()
            idle_wait = _THROTTLED_WAIT_S if engine.num_scheduled_tokens_last_step == 0 else None

    def _has_work(self) -> bool:
        return self.engine.has_unfinished() or bool(self._pending_imports)

    def _fail(self, exc: Exception) -> None:
        self.error = exc
        for sink in self._sinks.values():
            err = EngineStoppedError(f"engine step failed: {exc!r}")
            err.__cause__ = exc
            sink.on_error(err)
        self._sinks.clear()
        if self._on_fatal is not None:
            self._on_fatal(exc)

    def _apply(self, inbox: list[tuple[Any, ...]]) -> None:
        for item in inbox:
            kind = item[0]
            if kind == "abort":
                self._abort(item[1])
            elif kind == "call":
                _, fn, future = item
                try:
                    future.set_result(fn(self.engine))
                except Exception as exc:
                    future.set_exception(exc)
            elif kind == "import":
                _, seq, outputs, data, sink = item
                self._pending_imports.append((seq, outputs, data, sink))
            else:
                _, seq, sink, resume_tokens, handoff = item
                self._add(seq, sink, resume_tokens, handoff)
        if inbox:
            self.last_stats = self.engine.stats()

    def _add(self, seq: Sequence, sink: RequestSink, resume_tokens: tuple[int, ...], handoff: bool) -> None:
        try:
            if resume_tokens:
                resume(self.engine, seq, resume_tokens)
            else:
                self.engine.add_prepared(seq)
        except ValueError as exc:
            sink.on_error(exc)
            return
        self._sinks[seq.request_id] = sink
        if handoff:
            self._handoff.add(seq.request_id)

    def _abort(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        self._handoff.discard(request_id)
        self._pending_imports = [p for p in self._pending_imports if p[0].request_id != request_id]
        self.engine.abort(request_id)

    def _admit_imports(self) -> None:
        """Admit waiting imports in arrival order while the device tier has room."""
        while self._pending_imports:
            seq, outputs, data, sink = self._pending_imports[0]
            try:
                admitted = admit_prefilled(self.engine, seq, outputs, data)
            except ValueError as exc:
                self._pending_imports.pop(0)
                sink.on_error(exc)
                continue
            if not admitted:
                return
            self._pending_imports.pop(0)
            self._sinks[seq.request_id] = sink

    def _deliver(self, outputs: list[RequestOutput]) -> bool:
        """Hand outputs to their sinks; returns whether any request was handed off."""
        handed_off = False
        for out in outputs:
            rid = out.request_id
            sink = self._sinks.get(rid)
            if sink is None:
                continue
            if rid in self._handoff and not out.finished:
                self._handoff.discard(rid)
                del self._sinks[rid]
                sink.on_output(out)
                sink.on_handoff(export_prefilled(self.engine, rid))
                handed_off = True
                continue
            sink.on_output(out)
            if out.finished:
                del self._sinks[rid]
                self._handoff.discard(rid)
        return handed_off
