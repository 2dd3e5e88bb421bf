"""KV transfer over a real loopback socket: chunking, acks, events on both sides."""

from __future__ import annotations

import asyncio
import socket

from reference_server.serving.delays import DelayConfig
from reference_server.serving.kv_transfer import KVLinks, KVReceiver, send_kv
from reference_server.serving.wire import read_frame
from reference_server.serving.worker_hooks import KVTransferEnd, KVTransferStart, ObserverList

BLOCK = 64  # bytes per block in these tests
DATA = bytes(range(256)) * 5  # 20 blocks of 64 bytes


class Recorder:
    def __init__(self) -> None:
        self.events: list = []

    def on_kv_transfer_start(self, e: KVTransferStart) -> None:
        self.events.append(e)

    def on_kv_transfer_end(self, e: KVTransferEnd) -> None:
        self.events.append(e)


async def transfer(*, refuse: str | None = None, delays: DelayConfig | None = None, chunk_blocks: int = 8):
    got: list = []
    recv_rec, send_rec = Recorder(), Recorder()
    recv_obs, send_obs = ObserverList(), ObserverList()
    recv_obs.add(recv_rec)
    send_obs.add(send_rec)

    def on_complete(wid, meta, data):
        got.append((wid, meta, data))
        return refuse

    receiver = KVReceiver(instance="decode-0", on_complete=on_complete, observers=recv_obs)

    async def handle(reader, writer):
        while (frame := await read_frame(reader)) is not None:
            await receiver.on_frame(frame[0], frame[1], writer)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    outcome = await send_kv(wid="r1@0", meta=dict(request_id="r1", prompt=[1, 2]), data=DATA, num_blocks=20,
                            host="127.0.0.1", port=port, instance="prefill-0", peer="decode-0",
                            chunk_blocks=chunk_blocks, observers=send_obs, delays=delays)
    server.close()
    await server.wait_closed()
    return outcome, got, send_rec.events, recv_rec.events, receiver


def test_transfer_in_chunks_with_events_on_both_sides():
    outcome, got, sent, received, receiver = asyncio.run(transfer())
    assert outcome.ok and outcome.num_bytes == len(DATA) and outcome.num_chunks == 3  # 8 + 8 + 4 blocks
    assert got == [("r1@0", dict(request_id="r1", prompt=[1, 2]), DATA)]
    assert receiver.num_bytes_received == len(DATA)
    s_start, s_end = sent
    r_start, r_end = received
    assert (s_start.direction, s_start.num_bytes, s_start.num_blocks) == ("send", len(DATA), 20)
    assert (s_end.direction, s_end.num_bytes, s_end.num_chunks, s_end.ok) == ("send", len(DATA), 3, True)
    assert (r_start.direction, r_start.peer, r_start.request_id) == ("recv", "prefill-0", "r1")
    assert (r_end.num_bytes, r_end.num_chunks, r_end.ok) == (len(DATA), 3, True)
    # one host, one monotonic clock: the receive interval lies inside the send interval
    assert s_start.t_ns <= r_start.t_ns <= r_end.end_ns <= s_end.end_ns


def test_refused_transfer_reports_the_reason():
    outcome, got, sent, received, _ = asyncio.run(transfer(refuse="no such tenant"))
    assert not outcome.ok and outcome.message == "no such tenant"
    assert len(got) == 1 and not sent[-1].ok and not received[-1].ok


def test_unreachable_peer_is_an_outcome_not_an_exception():
    async def go():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        return await send_kv(wid="w", meta={}, data=DATA, num_blocks=20, host="127.0.0.1", port=port,
                             instance="p", peer="d")

    outcome = asyncio.run(go())
    assert not outcome.ok and "failed" in outcome.message and outcome.num_bytes == 0


def test_planted_delay_lies_inside_the_send_interval():
    outcome, _, sent, received, _ = asyncio.run(transfer(delays=DelayConfig.parse("kv_transfer=30ms")))
    assert outcome.ok
    assert received[0].t_ns - sent[0].t_ns >= 30_000_000
    assert sent[1].end_ns - sent[1].start_ns >= 30_000_000


def test_discard_drops_a_partial_transfer():
    async def go():
        rec = Recorder()
        obs = ObserverList()
        obs.add(rec)
        receiver = KVReceiver(instance="d", on_complete=lambda *a: None, observers=obs)
        writer = None  # the receiver writes only after the last chunk
        header = dict(type="kv_push", wid="w", chunk=0, num_chunks=2, num_blocks=2, num_bytes=8,
                      meta=dict(request_id="r"), src="p")
        await receiver.on_frame(header, b"1234", writer)  # type: ignore[arg-type]
        receiver.discard({"w"})
        return rec.events

    start, end = asyncio.run(go())
    assert start.num_bytes == 8 and end.num_bytes == 4 and end.num_chunks == 1 and not end.ok


def test_transfers_to_one_peer_share_one_kept_open_connection():
    # Eight concurrent transfers, then two more: one connection carries them all (chunks of different
    # requests interleaved), each acknowledged to its own sender; TCP_NODELAY is set on it.
    async def go():
        got: dict = {}
        accepted: list = []

        def on_complete(wid, meta, data):
            got[wid] = data
            return None if meta["ok"] else f"refused {wid}"

        receiver = KVReceiver(instance="decode-0", on_complete=on_complete)

        async def handle(reader, writer):
            accepted.append(writer)
            while (frame := await read_frame(reader)) is not None:
                await receiver.on_frame(frame[0], frame[1], writer)
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        links = KVLinks()
        payloads = {f"w{i}@0": bytes([i]) * (64 * (4 + i)) for i in range(10)}

        def send(wid):
            data = payloads[wid]
            return send_kv(wid=wid, meta=dict(request_id=wid[:-2], ok=wid != "w3@0"), data=data,
                           num_blocks=len(data) // 64, host="127.0.0.1", port=port, instance="prefill-0",
                           peer="decode-0", chunk_blocks=2, links=links)

        first = await asyncio.gather(*(send(f"w{i}@0") for i in range(8)))
        later = [await send("w8@0"), await send("w9@0")]
        sock = next(iter(links._links.values())).writer.get_extra_info("socket")
        nodelay = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        links.close()
        server.close()
        await server.wait_closed()
        return first + later, got, payloads, len(accepted), links.num_connections, nodelay

    outcomes, got, payloads, num_accepted, num_opened, nodelay = asyncio.run(go())
    assert (num_accepted, num_opened, nodelay) == (1, 1, 1)
    assert got == payloads
    assert [o.ok for o in outcomes] == [i != 3 for i in range(10)]
    assert outcomes[3].message == "refused w3@0"
    assert [o.num_chunks for o in outcomes] == [(4 + i + 1) // 2 for i in range(10)]


def test_a_broken_link_is_replaced_by_the_next_transfer():
    # The decode side drops the connection after each acknowledgement: the next transfer finds the
    # link closed and opens a new one instead of failing.
    async def go():
        receiver = KVReceiver(instance="decode-0", on_complete=lambda *a: None)

        async def handle(reader, writer):
            frame = await read_frame(reader)
            while frame is not None:
                await receiver.on_frame(frame[0], frame[1], writer)
                if frame[0]["chunk"] == frame[0]["num_chunks"] - 1:
                    break
                frame = await read_frame(reader)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        links = KVLinks()
        outcomes = []
        for i in range(3):
            outcomes.append(await send_kv(wid=f"w{i}", meta=dict(request_id=f"r{i}"), data=DATA, num_blocks=20,
                                          host="127.0.0.1", port=port, instance="p", peer="d", links=links))
            link = next(iter(links._links.values()))
            await asyncio.wait_for(link.reader_task, 10)  # the peer's close reached the link
        links.close()
        server.close()
        await server.wait_closed()
        return outcomes, links.num_connections

    outcomes, num_opened = asyncio.run(go())
    assert all(o.ok for o in outcomes) and num_opened == 3


def test_first_chunk_time_follows_the_planted_delay():
    outcome, _, sent, received, _ = asyncio.run(transfer(delays=DelayConfig.parse("kv_transfer=30ms")))
    end = sent[1]
    assert outcome.ok and end.first_sent_ns - end.start_ns >= 30_000_000
    assert end.first_sent_ns <= received[0].t_ns <= end.end_ns  # one host, one monotonic clock
