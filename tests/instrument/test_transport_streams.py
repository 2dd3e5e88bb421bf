"""uvicorn with the transport patch (:mod:`instrument.transport`), serving streams that clients leave early:
a stream ends when its own client leaves, never because an earlier connection on the same server closed (the
next accepted socket may reuse that connection's descriptor number)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import httpx

from instrument import transport

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the deployments helpers
from deployments import serve_app  # noqa: E402
from polling import wait_for  # noqa: E402

CHUNK_INTERVAL_S = 0.01
MAX_CHUNKS = 3000  # about 30 s: longer than any client here reads


class LeftStreams:
    """An ASGI app that streams ``data: <n>`` events until its client leaves. Per ``X-Request-Id`` it notes
    the request's first-byte time from the patch's scope extension, and how many chunks it had sent when
    ``http.disconnect`` came."""

    def __init__(self) -> None:
        self.first_byte_ns: dict[str, int] = {}
        self.left_after: dict[str, int] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        request_id = dict(scope["headers"])[b"x-request-id"].decode()
        self.first_byte_ns[request_id] = transport.first_byte_ns(scope)
        await receive()  # the empty body
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        watcher = asyncio.create_task(_disconnected(receive))
        sent = 0
        while not watcher.done() and sent < MAX_CHUNKS:
            await send({"type": "http.response.body", "body": b"data: %d\n\n" % sent, "more_body": True})
            sent += 1
            await asyncio.wait({watcher}, timeout=CHUNK_INTERVAL_S)
        if watcher.done():
            self.left_after[request_id] = sent
            return
        watcher.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def test_a_stream_stays_open_until_its_own_client_leaves() -> None:
    assert transport.install()
    app = LeftStreams()
    ids = [f"stream-{i}" for i in range(4)]
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        for i, request_id in enumerate(ids):
            if i:  # the server saw the previous client leave (and closed its socket) before this one connects
                assert wait_for(lambda: ids[i - 1] in app.left_after), app.left_after
            with http.stream("GET", "/", headers={"X-Request-Id": request_id}) as resp:
                lines = resp.iter_lines()  # one iterator for the whole block: see the gateway's disconnect test
                read = 0
                while read < 20:  # about 0.2 s of the stream; an ended stream raises here
                    if next(lines).startswith("data: "):
                        read += 1
                assert request_id not in app.left_after, app.left_after
            # leaving the block closes the connection mid-stream
            assert wait_for(lambda: request_id in app.left_after), app.left_after
    assert all(app.left_after[request_id] >= 20 for request_id in ids), app.left_after
    assert all(app.first_byte_ns[request_id] > 0 for request_id in ids), app.first_byte_ns  # the patch was on
