"""KV block transfer from a prefill worker to a decode worker, directly over a socket.

The prefill worker opens a TCP connection to the decode worker's port and sends the
request's KV blocks in chunks of ``chunk_blocks`` blocks, one ``kv_push`` frame each
(see :mod:`reference_server.serving.wire`); the first frame's header also carries the
request (``meta``: prompt, sampling, tenant, output tokens so far, ...). The decode
worker assembles the chunks; after the last one it hands the request to its engine
and answers one ``kv_ack`` frame (``ok`` false with a message when it refused).

Both sides report :class:`~reference_server.serving.worker_hooks.KVTransferStart` and
:class:`~reference_server.serving.worker_hooks.KVTransferEnd` with byte counts and
their own monotonic timestamps. The ``kv_transfer`` injected delay (if planted) is
slept on the sending side after the start event, so it lies inside the transfer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from reference_server.serving.delays import DelayConfig
from reference_server.serving.wire import WireError, read_frame, write_frame
from reference_server.serving.worker_hooks import KVTransferEnd, KVTransferStart, ObserverList

__all__ = ["DEFAULT_CHUNK_BLOCKS", "KVReceiver", "TransferOutcome", "send_kv"]

DEFAULT_CHUNK_BLOCKS = 16  # blocks per kv_push frame
_ACK_TIMEOUT_S = 30.0  # the receiver answers right after the last chunk; this only bounds a hung peer


@dataclass(frozen=True, slots=True)
class TransferOutcome:
    """How one transfer went, on the sending side (monotonic ns)."""

    ok: bool
    message: str
    num_bytes: int
    num_chunks: int
    start_ns: int
    end_ns: int


async def send_kv(*, wid: str, meta: dict[str, Any], data: bytes, num_blocks: int, host: str, port: int,
                  instance: str, peer: str, chunk_blocks: int = DEFAULT_CHUNK_BLOCKS,
                  observers: ObserverList | None = None, delays: DelayConfig | None = None) -> TransferOutcome:
    """Push ``data`` (``num_blocks`` blocks) for worker request ``wid`` to ``host:port``.

    Never raises for network trouble: a failed or refused transfer returns ``ok=False``
    with the reason. Runs on the sending worker's event loop."""
    if chunk_blocks < 1:
        raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
    rid = str(meta.get("request_id", wid))
    obs = observers if observers is not None else ObserverList()
    start_ns = time.monotonic_ns()  # sender monotonic clock, ns
    if obs:
        obs.emit("on_kv_transfer_start", KVTransferStart(rid, instance, peer, "send", num_blocks, len(data), start_ns))
    num_sent = num_chunks = 0
    ok, message = False, ""
    writer: asyncio.StreamWriter | None = None
    try:
        if delays:
            await delays.delay("kv_transfer")
        reader, writer = await asyncio.open_connection(host, port)
        block_bytes = len(data) // num_blocks if num_blocks else 0
        total_chunks = max(1, -(-num_blocks // chunk_blocks))
        for i in range(total_chunks):
            chunk = memoryview(data)[i * chunk_blocks * block_bytes:(i + 1) * chunk_blocks * block_bytes]
            header = {"type": "kv_push", "wid": wid, "chunk": i, "num_chunks": total_chunks,
                      "num_blocks": num_blocks, "num_bytes": len(data), "src": instance}
            if i == 0:
                header["meta"] = meta
            write_frame(writer, header, chunk)
            await writer.drain()
            num_sent += len(chunk)
            num_chunks += 1
        answer = await asyncio.wait_for(read_frame(reader), _ACK_TIMEOUT_S)
        if answer is None or answer[0].get("type") != "kv_ack":
            message = "the decode worker closed the connection without acknowledging"
        else:
            ok, message = bool(answer[0].get("ok")), str(answer[0].get("message", ""))
    except (OSError, WireError, asyncio.TimeoutError) as exc:
        message = f"KV transfer to {peer} failed: {exc!r}"
    finally:
        if writer is not None:
            writer.close()
    end_ns = time.monotonic_ns()
    if obs:
        obs.emit("on_kv_transfer_end", KVTransferEnd(
            rid, instance, peer, "send", num_blocks, num_sent, num_chunks, start_ns, end_ns, ok))
    return TransferOutcome(ok, message, num_sent, num_chunks, start_ns, end_ns)


@dataclass(slots=True)
class _Partial:
    meta: dict[str, Any]
    src: str
    num_chunks: int
    num_blocks: int
    num_bytes: int
    start_ns: int  # receiver monotonic clock, ns
    data: bytearray = field(default_factory=bytearray)
    next_chunk: int = 0


class KVReceiver:
    """The decode side: assembles ``kv_push`` frames per worker request id.

    ``on_complete(wid, meta, data)`` is called on the event loop with the whole payload
    once the last chunk arrived; it returns ``None`` when the request was accepted or a
    message saying why not (which goes back to the sender in the ``kv_ack``)."""

    def __init__(self, *, instance: str, on_complete: Callable[[str, dict[str, Any], bytes], str | None],
                 observers: ObserverList | None = None) -> None:
        self.instance = instance
        self._on_complete = on_complete
        self._observers = observers if observers is not None else ObserverList()
        self._partials: dict[str, _Partial] = {}
        self.num_bytes_received = 0  # counter, payload bytes

    async def on_frame(self, header: dict[str, Any], payload: bytes, writer: asyncio.StreamWriter) -> None:
        """Take one ``kv_push`` frame; answers the ``kv_ack`` on ``writer`` after the last."""
        wid, chunk = str(header.get("wid")), int(header.get("chunk", -1))
        part = self._partials.get(wid)
        if part is None:
            if chunk != 0 or not isinstance(header.get("meta"), dict):
                write_frame(writer, {"type": "kv_ack", "wid": wid, "ok": False,
                                     "message": f"KV transfer for {wid!r} did not start with chunk 0"})
                return
            part = _Partial(header["meta"], str(header.get("src", "")), int(header["num_chunks"]),
                            int(header["num_blocks"]), int(header["num_bytes"]), time.monotonic_ns())
            self._partials[wid] = part
            if self._observers:
                self._observers.emit("on_kv_transfer_start", KVTransferStart(
                    self._rid(part, wid), self.instance, part.src, "recv", part.num_blocks, part.num_bytes,
                    part.start_ns))
        if chunk != part.next_chunk:
            self._finish(wid, part, ok=False)
            write_frame(writer, {"type": "kv_ack", "wid": wid, "ok": False,
                                 "message": f"KV chunk {chunk} arrived, expected {part.next_chunk}"})
            return
        part.data += payload
        part.next_chunk += 1
        self.num_bytes_received += len(payload)
        if part.next_chunk < part.num_chunks:
            return
        problem = None
        if len(part.data) != part.num_bytes:
            problem = f"KV transfer for {wid!r} carried {len(part.data)} bytes, announced {part.num_bytes}"
        else:
            problem = self._on_complete(wid, part.meta, bytes(part.data))
        self._finish(wid, part, ok=problem is None)
        write_frame(writer, {"type": "kv_ack", "wid": wid, "ok": problem is None, "message": problem or ""})

    def discard(self, wids: set[str] | None = None) -> None:
        """Drop partial transfers (all, or those of ``wids``), e.g. when their connection
        closed or the request was aborted; each reports a failed end event."""
        for wid in list(self._partials if wids is None else wids & set(self._partials)):
            self._finish(wid, self._partials[wid], ok=False)

    def _finish(self, wid: str, part: _Partial, *, ok: bool) -> None:
        self._partials.pop(wid, None)
        if self._observers:
            self._observers.emit("on_kv_transfer_end", KVTransferEnd(
                self._rid(part, wid), self.instance, part.src, "recv", part.num_blocks, len(part.data),
                part.next_chunk, part.start_ns, time.monotonic_ns(), ok))

    @staticmethod
    def _rid(part: _Partial, wid: str) -> str:
        return str(part.meta.get("request_id", wid))
