"""The HTTP/1.1 connections of the load generator: chunked decoding split at every byte, heads,
keep-alive reuse, a stale idle connection, bodies by length or by close, and bad HTTP,
against scripted raw-socket servers on loopback."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import pytest

from tokentrace.app.bench.connections import ConnectFailed, ConnectionPool, End, Want, _BadHttp, _Chunked, _parse_head

CHUNKED = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nTrailer: x\r\n\r\n"


def test_chunked_body_split_at_every_byte():
    for cut in range(1, len(CHUNKED)):
        for cut2 in range(cut, len(CHUNKED)):
            dec = _Chunked()
            body = b"".join(dec.feed(part) for part in (CHUNKED[:cut], CHUNKED[cut:cut2], CHUNKED[cut2:]))
            assert body == b"hello, world" and dec.done, (cut, cut2)


def test_chunked_body_one_byte_at_a_time_and_bad_framing():
    dec = _Chunked()
    assert b"".join(dec.feed(CHUNKED[i:i + 1]) for i in range(len(CHUNKED))) == b"hello, world" and dec.done
    for bad in (b"zz\r\n", b"5\r\nhelloXX", b"-1\r\n", b"1" * 2000):
        with pytest.raises(_BadHttp):
            _Chunked().feed(bad)


def test_head_names_are_lower_cased_and_repeats_joined():
    status, headers = _parse_head(b"HTTP/1.1 201 Created\r\nContent-Type: text/event-stream\r\nX-A: 1\r\nx-a: 2")
    assert status == 201 and headers == {"content-type": "text/event-stream", "x-a": "1, 2"}
    with pytest.raises(_BadHttp):
        _parse_head(b"SSH-2.0-OpenSSH")


class Sink:
    """Keeps what the pool hands over: status, headers, (body, t_ns) per read."""

    def __init__(self, want_after: Want = Want.MORE) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.reads: list[tuple[bytes, int]] = []
        self.want_after = want_after

    def on_head(self, status: int, headers: dict[str, str]) -> Want:
        self.status, self.headers = status, headers
        return Want.MORE

    def on_body(self, data: bytes, t_ns: int) -> Want:
        self.reads.append((data, t_ns))
        return self.want_after

    @property
    def body(self) -> bytes:
        return b"".join(d for d, _ in self.reads)


async def _ended(pool: ConnectionPool, data: bytes, sink: Sink) -> End:
    end, why = await pool.request(data, sink)
    assert bool(why) == (end in (End.LOST, End.BAD_HTTP)), (end, why)
    return end


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _serve_and_run(handler: Handler, client: Callable[[str], Awaitable[object]]) -> object:
    """Serve ``handler`` on a free loopback port and run ``client(base_url)`` on the same loop."""

    async def go() -> object:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await asyncio.wait_for(client(f"http://127.0.0.1:{port}"), timeout=20)

    return asyncio.run(go())


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    return head + await reader.readexactly(length)


def test_keep_alive_reuses_the_connection_and_sends_the_request_as_built():
    connections, requests = [], []

    async def handler(reader, writer):
        connections.append(writer)
        while not reader.at_eof():
            try:
                requests.append(await _read_request(reader))
            except asyncio.IncompleteReadError:
                break
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.write(CHUNKED)
            await writer.drain()
        writer.close()

    async def client(url):
        async with ConnectionPool(url + "/base/") as pool:
            sinks = [Sink(), Sink()]
            ends = [await _ended(pool, pool.encode_post("/v1/x", b'{"a":1}', {"X-Request-Id": f"k{i}"}), s)
                    for i, s in enumerate(sinks)]
            return ends, sinks

    ends, sinks = _serve_and_run(handler, client)
    assert ends == [End.COMPLETE, End.COMPLETE] and len(connections) == 1
    assert all(s.status == 200 and s.body == b"hello, world" for s in sinks)
    assert requests[0].startswith(b"POST /base/v1/x HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nContent-Length: 7\r\nX-Request-Id: k0\r\n\r\n{\"a\":1}" in requests[0]
    with pytest.raises(ValueError, match="line break"):
        ConnectionPool("http://h").encode_post("/", b"", {"Authorization": "Bearer x\r\nEvil: 1"})


def test_an_idle_connection_the_server_closed_is_replaced():
    num_connections = []

    async def handler(reader, writer):
        num_connections.append(1)
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # no keep-alive, without saying "Connection: close"

    async def client(url):
        async with ConnectionPool(url) as pool:
            sinks = [Sink(), Sink(), Sink()]
            ends = [await _ended(pool, pool.encode_post("/", b"", {}), sinks[0])]
            await asyncio.sleep(0.05)  # the server's close arrives while the connection is idle
            ends.append(await _ended(pool, pool.encode_post("/", b"", {}), sinks[1]))
            # At once: the close may arrive only after the request went out; then it is sent again.
            ends.append(await _ended(pool, pool.encode_post("/", b"", {}), sinks[2]))
            return ends, [s.body for s in sinks]

    assert _serve_and_run(handler, client) == ([End.COMPLETE] * 3, [b"ok"] * 3)
    assert len(num_connections) == 3


@pytest.mark.parametrize("response, end, body", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nabcde", End.COMPLETE, b"abcde"),
    (b"HTTP/1.1 200 OK\r\n\r\nuntil the end", End.COMPLETE, b"until the end"),  # no framing: ends with the connection
    (b"HTTP/1.1 204 No Content\r\n\r\n", End.COMPLETE, b""),  # no body by definition
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabc", End.LOST, b"abc"),  # cut mid-chunk
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nnope\r\n", End.BAD_HTTP, b""),
    (b"garbage\r\n\r\n", End.BAD_HTTP, b""),
    (b"", End.LOST, b""),  # closed without a response
])
def test_how_an_exchange_ends(response, end, body):
    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(response)
        await writer.drain()
        writer.close()

    async def client(url):
        sink = Sink()
        async with ConnectionPool(url) as pool:
            return await _ended(pool, pool.encode_post("/", b"{}", {}), sink), sink.body

    assert _serve_and_run(handler, client) == (end, body)


def test_silence_is_a_read_timeout_and_a_satisfied_sink_stops_reading():
    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n")
        await writer.drain()
        await asyncio.sleep(5)
        writer.close()

    async def client(url):
        async with ConnectionPool(url, read_timeout_s=0.2) as pool:
            timed_out = await _ended(pool, pool.encode_post("/", b"", {}), Sink())
            stopped = await _ended(pool, pool.encode_post("/", b"", {}), Sink(want_after=Want.CLOSE))
            return timed_out, stopped

    assert _serve_and_run(handler, client) == (End.READ_TIMEOUT, End.STOPPED)


def test_reads_are_stamped_in_arrival_order():
    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for part in (b"one", b"two", b"three"):
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def client(url):
        sink = Sink()
        async with ConnectionPool(url) as pool:
            await _ended(pool, pool.encode_post("/", b"", {}), sink)
        return sink.reads

    reads = _serve_and_run(handler, client)
    assert b"".join(d for d, _ in reads) == b"onetwothree"
    stamps = [t for _, t in reads]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)


def test_nothing_listening_is_a_connect_failure(dead_url):
    async def client():
        async with ConnectionPool(dead_url) as pool:
            await _ended(pool, pool.encode_post("/", b"", {}), Sink())

    with pytest.raises(ConnectFailed):
        asyncio.run(client())
