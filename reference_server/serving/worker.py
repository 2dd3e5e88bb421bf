"""A worker process: one engine (role colocated, prefill or decode) behind a TCP port.

Run as ``python -m reference_server.serving.worker --name decode-0 --role decode
--config '<EngineConfig JSON>' [--port 0] [--delay SPEC]``; it prints ``READY <port>``
on stdout once it serves, and exits when its controller connection closes, on a
``shutdown`` message, or on SIGTERM/SIGINT. It is a plain ``python -m`` child that
inherits the environment, so a tracer can be installed in it from outside
(``sitecustomize``, or ``REFERENCE_SERVER_WORKER_PLUGINS="pkg.mod:func,..."``: each
``func(worker)`` is called once before serving and may attach observers with
``worker.add_observer`` (:class:`WorkerObserver` events) and ``worker.engine.add_observer``
(:class:`EngineObserver` events).

Protocol (frames of :mod:`reference_server.serving.wire`; ``wid`` is the controller's id
of one attempt of a request, the engine itself uses the gateway's ``request_id``):

controller -> worker: ``hello``; ``ping`` {id, t_send_ns}; ``generate`` {wid, request_id,
prompt, sampling, tenant, slo_class, arrival_ns, resume_tokens, handoff_to: {name, host,
port} | null}; ``abort`` {wid, request_id}; ``shutdown``.
worker -> controller: ``hello_ok``; ``pong`` {id, t_send_ns, recv_ns, send_ns, stats};
``token`` {wid, index, token_id, text, finish_reason, num_prompt_tokens, num_cached_tokens};
``error`` {wid, kind: value|transfer_failed|internal, message}; ``kv_received`` {wid};
``event`` {name, event} (worker observer events relayed, worker clock).
prefill -> decode worker (one connection per decode worker, kept open): ``kv_push`` chunks,
each transfer answered by one ``kv_ack`` (see :mod:`reference_server.serving.kv_transfer`).

Every connection has ``TCP_NODELAY`` set (asyncio sets it on the TCP sockets its ``start_server`` and
``open_connection`` make from a host and port), so a frame is never held back waiting for the peer's
acknowledgement of the previous one. Once its engine is built, the worker moves
every object it holds into the collector's permanent generation (``gc.freeze``): a full
collection then walks only what was allocated while serving, not the model, tokenizer
and caches, so it no longer stops the process (its event loop and engine thread, the KV
it sends and receives) for hundreds of milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import importlib
import os
import signal
import sys
import time
from typing import Any

from reference_server.engine import Engine, EngineConfig, EngineLoop, RequestOutput
from reference_server.engine.handoff import PrefilledKV
from reference_server.serving.config_codec import engine_config_from_json, sampling_from_dict
from reference_server.serving.delays import DelayConfig, plant_engine_delays
from reference_server.serving.kv_transfer import DEFAULT_CHUNK_BLOCKS, KVLinks, KVReceiver, send_kv
from reference_server.serving.wire import WireError, read_frame, write_frame
from reference_server.serving.worker_hooks import (
    ObserverList,
    WorkerObserver,
    WorkerRequestReceived,
    WorkerStarted,
    WorkerStopped,
)

__all__ = ["ROLES", "Worker", "main"]

ROLES = ("colocated", "prefill", "decode")
PLUGINS_ENV = "REFERENCE_SERVER_WORKER_PLUGINS"
_TOMBSTONE_TTL_NS = 120 * 1_000_000_000  # how long an aborted wid is remembered (late KV pushes)


class _ControllerSink:
    """Engine-thread results of one attempt, handed to the worker's event loop."""

    __slots__ = ("worker", "wid")

    def __init__(self, worker: Worker, wid: str) -> None:
        self.worker, self.wid = worker, wid

    def on_output(self, output: RequestOutput) -> None:
        # The engine's own emit time travels with the token (worker monotonic clock).
        self.worker._threadsafe(self.worker._send_token, self.wid, output, output.emit_ns)

    def on_handoff(self, state: PrefilledKV) -> None:
        self.worker._threadsafe(self.worker._start_push, self.wid, state)

    def on_error(self, exc: BaseException) -> None:
        kind = "value" if isinstance(exc, ValueError) else "internal"
        self.worker._threadsafe(self.worker._send_error, self.wid, kind, str(exc))


class _Relay(WorkerObserver):
    """Forwards this worker's observer events to the controller."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def _relay(self, name: str, event: Any) -> None:
        self.worker._send({"type": "event", "name": name, "kind": type(event).__name__,
                           "event": dataclasses.asdict(event)})

    def on_kv_transfer_start(self, event: Any) -> None:
        self._relay("on_kv_transfer_start", event)

    def on_kv_transfer_end(self, event: Any) -> None:
        self._relay("on_kv_transfer_end", event)

    def on_worker_request_received(self, event: Any) -> None:
        self._relay("on_worker_request_received", event)


class Worker:
    """One engine served over TCP. Everything except the engine runs on one event loop."""

    def __init__(self, *, name: str, role: str, engine_config: EngineConfig, host: str = "127.0.0.1",
                 port: int = 0, delays: DelayConfig | None = None,
                 kv_chunk_blocks: int = DEFAULT_CHUNK_BLOCKS) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.name, self.role, self.host, self.port = name, role, host, port
        self.delays = delays if delays is not None else DelayConfig()
        self.kv_chunk_blocks = kv_chunk_blocks
        self.engine = Engine(engine_config)
        plant_engine_delays(self.engine, self.delays)
        self.engine_loop = EngineLoop(self.engine, on_fatal=self._on_engine_failure)
        self.exit_code = 0  # 1 after an engine failure
        self.observers = ObserverList()
        self.observers.add(_Relay(self))
        self.receiver = KVReceiver(instance=name, on_complete=self._on_kv_complete, observers=self.observers)
        self.kv_links = KVLinks()  # prefill role: the kept-open connection to each decode worker
        self._controller: asyncio.StreamWriter | None = None
        self._requests: dict[str, dict[str, Any]] = {}  # wid -> its generate header (prefill role needs it)
        self._accepted: dict[str, int] = {}  # wid -> when its generate frame was taken (until its first token)
        self._pushes: dict[str, asyncio.Task] = {}
        self._tombstones: dict[str, int] = {}  # aborted wid -> monotonic ns
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self.num_kv_bytes_sent = 0  # counter
        self.num_connections_accepted = 0  # counter: the controller's, plus one per prefill peer
        self.num_gc_frozen = 0  # objects moved to the collector's permanent generation at start

    def add_observer(self, observer: Any) -> None:
        """Attach a :class:`WorkerObserver` (called on the worker's event loop thread)."""
        self.observers.add(observer)

    def remove_observer(self, observer: Any) -> None:
        self.observers.remove(observer)

    # ------------------------------------------------------------------ lifecycle

    async def serve(self) -> None:
        """Serve until stopped; prints ``READY <port>`` once listening."""
        self._loop, self._stopped = asyncio.get_running_loop(), asyncio.Event()
        gc.collect()
        gc.freeze()  # the start-up heap (model, tokenizer, caches) is never walked by a collection again
        self.num_gc_frozen = gc.get_freeze_count()  # walks the frozen objects: once, not per heartbeat
        self.engine_loop.start()
        server = await asyncio.start_server(self._on_connection, self.host, self.port)
        self.port = server.sockets[0].getsockname()[1]
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(sig, self._stopped.set)
        self.observers.emit("on_worker_started", WorkerStarted(
            self.name, self.role, os.getpid(), self.port, time.monotonic_ns()))
        print(f"READY {self.port}", flush=True)
        try:
            await self._stopped.wait()
        finally:
            server.close()
            for task in self._pushes.values():
                task.cancel()
            self.kv_links.close()
            await asyncio.to_thread(self.engine_loop.stop)
            self.observers.emit("on_worker_stopped", WorkerStopped(
                self.name, self.role, "stopped", len(self._requests), time.monotonic_ns()))
            self.engine.close()

    def _on_engine_failure(self, exc: BaseException) -> None:
        """Engine thread: a step raised. The worker exits (status 1) so that the cluster
        sees it die and can restart it; its open requests already got the error."""
        print(f"worker {self.name}: engine step failed: {exc!r}", file=sys.stderr, flush=True)
        self.exit_code = 1
        if self._stopped is not None:
            self._threadsafe(self._stopped.set)

    def _threadsafe(self, fn: Any, *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed between the check and the call
            pass

    # ------------------------------------------------------------------ connections

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        kv_wids: set[str] = set()  # transfers in progress on this connection
        self.num_connections_accepted += 1
        try:
            while True:
                frame = await read_frame(reader)
                if frame is None:
                    break
                header, payload = frame
                if header["type"] == "kv_push":
                    wid = str(header.get("wid"))
                    kv_wids.add(wid)
                    await self.receiver.on_frame(header, payload, writer)
                    if not self.receiver.in_progress(wid):
                        kv_wids.discard(wid)
                else:
                    self._on_message(header, writer)
        except (WireError, OSError, asyncio.CancelledError):
            pass  # a broken peer, or the worker shutting down: the connection just ends
        finally:
            self.receiver.discard(kv_wids)
            writer.close()
            if writer is self._controller:  # the controller is gone: nobody to serve
                self._controller = None
                assert self._stopped is not None
                self._stopped.set()

    def _on_message(self, h: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        kind = h["type"]
        if kind == "hello":
            self._controller = writer
            write_frame(writer, {"type": "hello_ok", "name": self.name, "role": self.role, "pid": os.getpid(),
                                 "port": self.port, "max_model_len": self.engine.max_model_len})
        elif kind == "ping":
            recv_ns = time.monotonic_ns()  # worker monotonic clock, ns
            stats = dataclasses.asdict(self.engine_loop.last_stats)
            stats.update(num_kv_bytes_sent=self.num_kv_bytes_sent,
                         num_kv_bytes_received=self.receiver.num_bytes_received,
                         num_kv_connections=self.kv_links.num_connections,
                         num_connections_accepted=self.num_connections_accepted,
                         num_gc_frozen=self.num_gc_frozen)
            write_frame(writer, {"type": "pong", "id": h.get("id"), "t_send_ns": h.get("t_send_ns"),
                                 "recv_ns": recv_ns, "send_ns": time.monotonic_ns(), "stats": stats})
        elif kind == "generate":
            self._generate(h)
        elif kind == "abort":
            self._abort(str(h["wid"]), str(h["request_id"]))
        elif kind == "shutdown":
            assert self._stopped is not None
            self._stopped.set()

    def _send(self, header: dict[str, Any]) -> None:
        if self._controller is not None and not self._controller.is_closing():
            write_frame(self._controller, header)

    # ------------------------------------------------------------------ requests

    def _generate(self, h: dict[str, Any]) -> None:
        wid = str(h["wid"])
        try:
            seq = self.engine.prepare_request(
                str(h["request_id"]), h["prompt"], sampling_from_dict(h["sampling"]), tenant=h.get("tenant"),
                slo_class=h.get("slo_class", "interactive"), arrival_ns=h.get("arrival_ns"),
                session=str(h.get("session") or ""))
        except (ValueError, TypeError, KeyError) as exc:
            self._send_error(wid, "value", str(exc))
            return
        handoff = h.get("handoff_to") is not None
        if handoff:
            self._requests[wid] = h
        resume_tokens = h.get("resume_tokens") or ()
        accepted_ns = time.monotonic_ns()
        self._accepted[wid] = accepted_ns
        if self.observers:
            self.observers.emit("on_worker_request_received", WorkerRequestReceived(
                seq.request_id, self.name, wid, "generate", len(resume_tokens), h.get("traceparent"),
                accepted_ns))
        self.engine_loop.submit(seq, _ControllerSink(self, wid), resume_tokens=resume_tokens, handoff=handoff)

    def _abort(self, wid: str, request_id: str) -> None:
        now = time.monotonic_ns()
        self._tombstones = {w: t for w, t in self._tombstones.items() if now - t < _TOMBSTONE_TTL_NS}
        self._tombstones[wid] = now
        self._requests.pop(wid, None)
        self._accepted.pop(wid, None)
        task = self._pushes.pop(wid, None)
        if task is not None:
            task.cancel()
        self.receiver.discard({wid})
        self.engine_loop.abort(request_id)

    def _send_token(self, wid: str, out: RequestOutput, emitted_ns: int = -1) -> None:
        if out.finished:
            self._requests.pop(wid, None)
        # The first token frame of an attempt carries when this worker accepted it.
        accepted_ns = self._accepted.pop(wid, -1)
        self._send({"type": "token", "wid": wid, "index": out.token_index, "token_id": out.token_id,
                    "text": out.text_delta, "finish_reason": out.finish_reason,
                    "num_prompt_tokens": out.num_prompt_tokens, "num_cached_tokens": out.num_cached_tokens,
                    "emitted_ns": emitted_ns, "accepted_ns": accepted_ns})

    def _send_error(self, wid: str, kind: str, message: str) -> None:
        self._requests.pop(wid, None)
        self._accepted.pop(wid, None)
        self._send({"type": "error", "wid": wid, "kind": kind, "message": message})

    def _start_push(self, wid: str, state: PrefilledKV) -> None:
        h = self._requests.pop(wid, None)
        if h is None or wid in self._tombstones:
            return  # aborted meanwhile
        self._pushes[wid] = asyncio.ensure_future(self._push(wid, h, state))

    async def _push(self, wid: str, h: dict[str, Any], state: PrefilledKV) -> None:
        target = h["handoff_to"]
        meta = {k: h.get(k) for k in ("request_id", "prompt", "sampling", "tenant", "slo_class", "arrival_ns",
                                      "traceparent", "session")}
        meta.update(output_token_ids=list(state.output_token_ids), num_cached_tokens=state.num_cached_tokens)
        try:
            outcome = await send_kv(
                wid=wid, meta=meta, data=state.data, num_blocks=state.num_blocks, host=target["host"],
                port=int(target["port"]), instance=self.name, peer=str(target["name"]),
                chunk_blocks=self.kv_chunk_blocks, observers=self.observers, delays=self.delays,
                links=self.kv_links)
        finally:
            self._pushes.pop(wid, None)
        self.num_kv_bytes_sent += outcome.num_bytes
        if not outcome.ok and wid not in self._tombstones:
            self._send_error(wid, "transfer_failed", outcome.message)

    def _on_kv_complete(self, wid: str, meta: dict[str, Any], data: bytes) -> str | None:
        """Decode side: a transferred request is complete; hand it to the engine."""
        if wid in self._tombstones:
            return f"request {wid!r} was aborted"
        try:
            seq = self.engine.prepare_request(
                str(meta["request_id"]), meta["prompt"], sampling_from_dict(meta["sampling"]),
                tenant=meta.get("tenant"), slo_class=meta.get("slo_class", "interactive"),
                arrival_ns=meta.get("arrival_ns"), session=str(meta.get("session") or ""))
        except (ValueError, TypeError, KeyError) as exc:
            return str(exc)
        if self.observers:
            self.observers.emit("on_worker_request_received", WorkerRequestReceived(
                seq.request_id, self.name, wid, "prefilled", len(meta["output_token_ids"]), meta.get("traceparent"),
                time.monotonic_ns()))
        # Handed to the engine on the loop's next turn: the receiver reports the transfer's end (its last chunk's
        # time) right after this returns, so an observer knows it before the engine can step the request.
        asyncio.get_running_loop().call_soon(self._submit_prefilled, wid, seq, meta["output_token_ids"], data)
        self._send({"type": "kv_received", "wid": wid})
        return None

    def _submit_prefilled(self, wid: str, seq: Any, output_token_ids: Any, data: bytes) -> None:
        if wid not in self._tombstones:  # not aborted since its last chunk arrived
            self.engine_loop.submit_prefilled(seq, output_token_ids, data, _ControllerSink(self, wid))


def _load_plugins(worker: Worker) -> None:
    for spec in filter(None, (s.strip() for s in os.environ.get(PLUGINS_ENV, "").split(","))):
        module, _, func = spec.partition(":")
        getattr(importlib.import_module(module), func or "install")(worker)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reference_server.serving.worker")
    parser.add_argument("--name", required=True)
    parser.add_argument("--role", choices=ROLES, default="colocated")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--config", default="{}", help="EngineConfig as JSON")
    parser.add_argument("--delay", default="", help="delay spec, e.g. decode_step=2ms")
    parser.add_argument("--kv-chunk-blocks", type=int, default=DEFAULT_CHUNK_BLOCKS)
    args = parser.parse_args(argv)
    try:
        worker = Worker(name=args.name, role=args.role, engine_config=engine_config_from_json(args.config),
                        host=args.host, port=args.port, delays=DelayConfig.parse(args.delay),
                        kv_chunk_blocks=args.kv_chunk_blocks)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _load_plugins(worker)
    try:
        asyncio.run(worker.serve())
    except KeyboardInterrupt:  # Ctrl-C before serve() took over SIGINT: just stop
        return 130
    return worker.exit_code


if __name__ == "__main__":
    sys.exit(main())
