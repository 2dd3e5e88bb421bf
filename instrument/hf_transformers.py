"""A Hugging Face transformers model served by a Starlette/FastAPI app: every stage of every token.

Two parts, joined through the request's context (:func:`tokentrace.current_request`, which
:class:`instrument.asgi.TokenTraceMiddleware` sets for each traced request):

* ``tokentrace.instrument(model, store=...)`` (the :class:`TransformersAdapter`) times the
  model's forward passes: a pre- and a post-forward hook on the model, which note the pass's
  start and end for the generation running on the calling thread;
* :class:`TokenStreamer`, passed to ``model.generate(..., streamer=...)`` instead of
  ``TextIteratorStreamer``, made in the request's handler (where it takes the current request),
  yields one text delta per token (a token that ends inside a UTF-8 character waits for the
  next one) and records, for the delta it yields as token ``i`` (the ``i``-th token the
  middleware sees in the SSE stream):

  * token 0: ``gateway.tokenize`` from the end of the request body to the streamer's creation
    (the handler's own work: tokenizing, building the inputs), ``schedule.queue`` from then
    until the prefill pass starts (the generation thread starting, ``generate``'s set-up),
    ``prefill.compute`` for the prefill pass and the sampling of the first token;
  * tokens i >= 1: ``decode.queue`` from the previous token's hand-off until its forward pass
    starts (``generate``'s loop between steps), ``decode.compute`` for the pass and sampling;
  * every token: ``detokenize`` for the streamer's decoding of the new text, and
    ``stream.relay`` from the hand-off to the event loop until the response body send that
    carries the delta begins (the event loop picking it up, the app formatting the chunk); the
    middleware's ``stream.send`` takes it from there.

  The stages are consecutive intervals of one chain of timestamps, so they tile each token's
  latency. Iterate it with ``async for`` in the app (``for`` works too, on a thread that may
  block; the relay then ends when the delta is taken). Outside a traced request it only streams.

All times are this process's monotonic clock, ns (:func:`tokentrace.clock.now_ns`). Hooks and
``put``/``end`` run on the generation thread; they never raise into ``generate``: a failure is
logged once and the request goes on untraced.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any, AsyncIterator, Iterator

from tokentrace import api
from tokentrace.adapters import Attachment
from tokentrace.clock import now_ns
from tokentrace.recorder import Recorder
from tokentrace.schema import Role, Stage

__all__ = ["TokenStreamer", "TransformersAdapter", "ADAPTERS"]

log = logging.getLogger("tokentrace")

_END = object()  # the end of the stream, after the last delta
_generation = threading.local()  # .chain: the traced generation running on this thread, if any
_warned = False


def _warn_once(err: BaseException) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("tokentrace transformers adapter: tracing step failed (%s: %s); generation goes on untraced; "
                    "this warning is shown once", type(err).__name__, err)


class _Chain:
    """The timestamps of one traced generation (its generation thread only, except ``close_relay``)."""

    __slots__ = ("request", "boundary_ns", "forward_start_ns", "num_tokens", "index")

    def __init__(self, request: api.RequestContext, created_ns: int) -> None:
        self.request = request
        self.boundary_ns = created_ns  # where the next stage of the pending token starts
        self.forward_start_ns = -1  # the current forward pass's start; -1 when none is under way
        self.num_tokens = 0  # tokens sampled so far (the first one comes from the prefill pass)
        self.index = 0  # the index the next delta will have

    def span(self, stage: Stage, start_ns: int, end_ns: int) -> None:
        if end_ns > start_ns >= 0:
            self.request.span(stage, start_ns, end_ns, self.index)

    def on_token(self, put_ns: int) -> None:
        """A token was sampled; ``put_ns`` = when the streamer got it: record its wait and its pass."""
        start = self.forward_start_ns if self.forward_start_ns >= self.boundary_ns else self.boundary_ns
        compute = Stage.PREFILL_COMPUTE if self.num_tokens == 0 else Stage.DECODE_COMPUTE
        wait = Stage.SCHEDULE_QUEUE if self.num_tokens == 0 else Stage.DECODE_QUEUE
        self.span(wait, self.boundary_ns, start)
        self.span(compute, start, put_ns)
        self.boundary_ns = put_ns
        self.forward_start_ns = -1
        self.num_tokens += 1


class TokenStreamer:
    """A ``generate`` streamer yielding one text delta per token, traced (see the module doc).

    Make it in the request's handler (on the event loop, for ``async for``), pass it to
    ``generate`` (on any thread), iterate it in the response. ``timeout_s``: the longest wait
    for the next delta (``None``: no limit) before ``TimeoutError``.
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True, timeout_s: float | None = None) -> None:
        created_ns = now_ns()
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.timeout_s = timeout_s
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._async_queue: asyncio.Queue[Any] | None = asyncio.Queue() if self._loop is not None else None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ids: list[int] = []
        self._text = ""
        self._prompt_seen = False
        self._pending: tuple[int, int, int] | None = None  # (index, hand-off ns, taken ns) of the last delta
        self._error: BaseException | None = None  # what ended a generation started by start()
        request = api.current_request()
        self._chain = _Chain(request, created_ns) if request is not None else None
        if self._chain is not None:
            received = request.receive_end_ns() if request is not None else -1
            if 0 <= received < created_ns:
                self._chain.request.span(Stage.GATEWAY_TOKENIZE, received, created_ns, 0)

    def start(self, generate: Any, /, **kwargs: Any) -> threading.Thread:
        """Run ``generate(streamer=self, **kwargs)`` (``model.generate``) on a new daemon thread; an
        exception it raises ends the stream and is raised again to whoever iterates."""
        def run() -> None:
            try:
                generate(streamer=self, **kwargs)
            except BaseException as err:  # noqa: BLE001 - handed to the iterating side
                self._error = err
                self.end()

        thread = threading.Thread(target=run, name="tokentrace-generate", daemon=True)
        thread.start()
        return thread

    # -- the generation thread (transformers' BaseStreamer interface)

    def put(self, value: Any) -> None:
        """Called by ``generate``: first with the prompt's ids, then with each new token's (batch of one)."""
        put_ns = now_ns()
        if len(value.shape) > 1 and value.shape[0] > 1:
            raise ValueError("TokenStreamer streams one sequence: generate with a batch of one and no beams")
        if not self._prompt_seen:
            self._prompt_seen = True
            _generation.chain = self._chain  # the forward hooks of this thread time this generation
            return
        self._ids.extend(int(t) for t in value.reshape(-1).tolist())
        chain = self._chain
        if chain is not None:
            self._guard(chain.on_token, put_ns)
        text = self.tokenizer.decode(self._ids, skip_special_tokens=self.skip_special_tokens)
        if text.endswith("\ufffd") or len(text) <= len(self._text):
            return  # the token ends inside a character (or adds no text): its time joins the next token's
        delta, self._text = text[len(self._text):], text
        done_ns = now_ns()
        index = 0
        if chain is not None:
            index = chain.index
            self._guard(chain.span, Stage.DETOKENIZE, chain.boundary_ns, done_ns)
            chain.boundary_ns = done_ns
            chain.index += 1
        self._hand_over((delta, index, done_ns))

    def end(self) -> None:
        """Called by ``generate`` when it is done (also after an exception)."""
        _generation.chain = None
        self._hand_over(_END)

    def _hand_over(self, item: Any) -> None:
        if self._loop is not None and self._async_queue is not None:
            try:
                self._loop.call_soon_threadsafe(self._async_queue.put_nowait, item)
                return
            except RuntimeError:  # the loop is closed: nobody iterates asynchronously any more
                pass
        self._queue.put(item)

    @staticmethod
    def _guard(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001 - tracing never breaks generation
            _warn_once(err)

    # -- the app's side

    def _close_relay(self, taken_ns: int, *, at_send: bool) -> None:
        """Record the last delta's ``stream.relay``: to the send that carried it began (``at_send``), else
        to when it was taken."""
        pending, self._pending = self._pending, None
        if pending is None or self._chain is None:
            return
        index, handed_ns, taken = pending
        end = taken
        send_start = self._chain.request.last_send_start_ns
        if at_send and send_start >= taken:
            end = send_start
        if end > handed_ns:
            self._chain.request.span(Stage.STREAM_RELAY, handed_ns, end, index)

    def _take(self, item: Any) -> str:
        taken_ns = now_ns()
        self._close_relay(taken_ns, at_send=True)
        if item is _END:
            if self._error is not None:
                raise RuntimeError(f"generation failed: {type(self._error).__name__}: {self._error}") from self._error
            raise StopIteration
        delta, index, handed_ns = item
        self._pending = (index, handed_ns, taken_ns)
        return str(delta)

    def __aiter__(self) -> AsyncIterator[str]:
        return self

    async def __anext__(self) -> str:
        if self._async_queue is None:
            raise RuntimeError("iterate a TokenStreamer with `async for` only when it was made on the event loop")
        item = await asyncio.wait_for(self._async_queue.get(), self.timeout_s)
        try:
            return self._take(item)
        except StopIteration:
            raise StopAsyncIteration from None

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        try:
            item = self._queue.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no token within {self.timeout_s} s") from None
        if self._pending is not None:
            self._close_relay(self._pending[2], at_send=False)
        return self._take(item)


# ---------------------------------------------------------------- the model's forward passes


def _before_forward(module: Any, args: Any, kwargs: Any = None) -> None:
    chain: _Chain | None = getattr(_generation, "chain", None)
    if chain is not None:
        chain.forward_start_ns = now_ns()


class TransformersAdapter:
    """A transformers ``PreTrainedModel``: the start of each forward pass, for :class:`TokenStreamer`."""

    targets = ("transformers.PreTrainedModel (with instrument.hf_transformers.TokenStreamer in generate)",)

    def matches(self, target: Any) -> bool:
        if not type(target).__module__.startswith("transformers."):
            return False  # never import transformers for someone else's object
        from transformers import PreTrainedModel

        return isinstance(target, PreTrainedModel)

    def default_role(self, target: Any) -> Role:
        return Role.COLOCATED

    def default_name(self, target: Any) -> str | None:
        return None

    def attach(self, target: Any, recorder: Recorder, role: Role) -> Attachment:
        if not self.matches(target):
            raise TypeError(f"not a transformers model: {type(target).__name__}")
        handle = target.register_forward_pre_hook(_before_forward)
        return Attachment(target, handle.remove)

    def __repr__(self) -> str:
        return "TransformersAdapter()"


ADAPTERS = (TransformersAdapter(),)
