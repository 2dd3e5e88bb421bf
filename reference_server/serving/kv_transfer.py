"""KV block transfer from a prefill worker to a decode worker, directly over a socket.

The prefill worker keeps one TCP connection per decode worker open (:class:`KVLinks`,
opened by the first transfer to that peer, opened again after it broke) and sends
each request's KV blocks over it in chunks of ``chunk_blocks`` blocks, one ``kv_push``
frame each (see :mod:`reference_server.serving.wire`); the first frame's header also
carries the request (``meta``: prompt, sampling, tenant, output tokens so far, ...).
Transfers to one peer share its connection, their frames interleaved whole, each
tagged with its ``wid``. The decode worker assembles the chunks per ``wid``; after the
last one it hands the request to its engine and answers one ``kv_ack`` frame for that
``wid`` (``ok`` false with a message when it refused). A transfer thus costs its bytes
and one acknowledgement, not a TCP handshake and a new connection task on each side.

Both sides report :class:`~reference_server.serving.worker_hooks.KVTransferStart` and
:class:`~reference_server.serving.worker_hooks.KVTransferEnd` with byte counts and
their own monotonic timestamps; the sender's end event also says when it began writing
its first chunk to the socket (``first_sent_ns``). The ``kv_transfer`` injected delay (if
planted) is slept on the sending side after the start event, so it lies inside the
transfer, before the first chunk.
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

__all__ = ["DEFAULT_CHUNK_BLOCKS", "KVLinks", "KVReceiver", "TransferOutcome", "send_kv"]

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


class _Link:
    """One open connection to a decode worker; its reader hands each ``kv_ack`` to the
    transfer waiting for that ``wid``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.acks: dict[str, asyncio.Future] = {}
        self.reader_task = asyncio.ensure_future(self._read_acks(reader))

    @property
    def usable(self) -> bool:
        return not self.reader_task.done() and not self.writer.is_closing()

    async def _read_acks(self, reader: asyncio.StreamReader) -> None:
        reason: BaseException = ConnectionResetError("the decode worker closed the connection")
        try:
            while (frame := await read_frame(reader)) is not None:
                header = frame[0]
                waiter = self.acks.get(str(header.get("wid")))
                if header.get("type") == "kv_ack" and waiter is not None and not waiter.done():
                    waiter.set_result(header)
        except (OSError, WireError) as exc:
            reason = exc
        finally:
            self.writer.close()
            for waiter in self.acks.values():
                if not waiter.done():
                    waiter.set_exception(reason)

    def close(self) -> None:
        self.reader_task.cancel()
        self.writer.close()


class KVLinks:
    """The sending worker's kept-open connections, one per decode worker (``host:port``).

    Event-loop thread only. ``num_connections`` counts connections opened (a broken one
    is replaced by the next transfer to that peer)."""

    def __init__(self) -> None:
        self._links: dict[tuple[str, int], _Link] = {}
        self._opening: dict[tuple[str, int], asyncio.Future] = {}
        self.num_connections = 0  # counter

    async def get(self, host: str, port: int) -> _Link:
        """The open connection to ``host:port``, connecting if there is none (``OSError``)."""
        key = (host, port)
        link = self._links.get(key)
        if link is not None and link.usable:
            return link
        opening = self._opening.get(key)
        if opening is None:  # one connect per peer, however many transfers wait for it
            opening = self._opening[key] = asyncio.ensure_future(self._open(host, port))
            opening.add_done_callback(lambda _f: self._opening.pop(key, None))
        return await asyncio.shield(opening)

    async def _open(self, host: str, port: int) -> _Link:
        reader, writer = await asyncio.open_connection(host, port)  # TCP_NODELAY set by asyncio: chunks leave at once
        self.num_connections += 1
        link = self._links[(host, port)] = _Link(reader, writer)
        return link

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()


async def send_kv(*, wid: str, meta: dict[str, Any], data: bytes, num_blocks: int, host: str, port: int,
                  instance: str, peer: str, chunk_blocks: int = DEFAULT_CHUNK_BLOCKS,
                  observers: ObserverList | None = None, delays: DelayConfig | None = None,
                  links: KVLinks | None = None) -> TransferOutcome:
    """Push ``data`` (``num_blocks`` blocks) for worker request ``wid`` to ``host:port``,
    over ``links``' connection to that peer (without ``links``, over a connection of its own,
    closed afterwards).

    Never raises for network trouble: a failed or refused transfer returns ``ok=False``
    with the reason. Runs on the sending worker's event loop."""
    if chunk_blocks < 1:
        raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
    rid = str(meta.get("request_id", wid))
    obs = observers if observers is not None else ObserverList()
    pool = links if links is not None else KVLinks()
    start_ns = time.monotonic_ns()  # sender monotonic clock, ns
    first_sent_ns = -1  # the first chunk was handed to the socket
    if obs:
        obs.emit("on_kv_transfer_start", KVTransferStart(rid, instance, peer, "send", num_blocks, len(data), start_ns))
    num_sent = num_chunks = 0
    ok, message = False, ""
    link: _Link | None = None
    try:
        if delays:
            await delays.delay("kv_transfer")
        link = await pool.get(host, port)
        ack = link.acks[wid] = asyncio.get_running_loop().create_future()
        block_bytes = len(data) // num_blocks if num_blocks else 0
        total_chunks = max(1, -(-num_blocks // chunk_blocks))
        for i in range(total_chunks):
            chunk = memoryview(data)[i * chunk_blocks * block_bytes:(i + 1) * chunk_blocks * block_bytes]
            header = {"type": "kv_push", "wid": wid, "chunk": i, "num_chunks": total_chunks,
                      "num_blocks": num_blocks, "num_bytes": len(data), "src": instance}
            if i == 0:
                header["meta"] = meta
                first_sent_ns = time.monotonic_ns()  # before the write: the peer may read it before it returns
            write_frame(link.writer, header, chunk)
            await link.writer.drain()
            num_sent += len(chunk)
            num_chunks += 1
        answer = await asyncio.wait_for(ack, _ACK_TIMEOUT_S)
        ok, message = bool(answer.get("ok")), str(answer.get("message", ""))
    except (OSError, WireError, asyncio.TimeoutError) as exc:
        message = f"KV transfer to {peer} failed: {exc!r}"
    finally:
        if link is not None:
            link.acks.pop(wid, None)
        if links is None:
            pool.close()
    end_ns = time.monotonic_ns()
    if obs:
        obs.emit("on_kv_transfer_end", KVTransferEnd(
            rid, instance, peer, "send", num_blocks, num_sent, num_chunks, start_ns, end_ns, ok, first_sent_ns))
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

    def in_progress(self, wid: str) -> bool:
        """Whether chunks of ``wid`` arrived and its last one has not."""
        return wid in self._partials

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
