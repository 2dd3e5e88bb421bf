"""Frame encoding round trips, and malformed frames are refused."""

from __future__ import annotations

import asyncio
import struct

import pytest

from reference_server.serving.wire import MAX_HEADER_BYTES, WireError, encode_frame, read_frame


def feed(data: bytes, *, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def test_round_trip_of_several_frames():
    async def go():
        data = encode_frame({"type": "a", "n": 1}) + encode_frame({"type": "kv_push"}, b"\x00\x01" * 5)
        reader = feed(data)
        return [await read_frame(reader) for _ in range(3)]

    first, second, end = asyncio.run(go())
    assert first == ({"type": "a", "n": 1}, b"")
    assert second == ({"type": "kv_push"}, b"\x00\x01" * 5)
    assert end is None


@pytest.mark.parametrize("data, message", [
    (encode_frame({"type": "a"})[:-2], "inside a frame"),
    (struct.pack(">II", 3, 0) + b"abc", "not JSON"),
    (struct.pack(">II", 2, 0) + b"[]", "JSON object"),
    (struct.pack(">II", 2, 0) + b"{}", "string 'type'"),
    (struct.pack(">II", MAX_HEADER_BYTES + 1, 0), "too large"),
    (b"\x00\x00", "frame prefix"),
])
def test_malformed_frames_raise(data, message):
    async def go():
        return await read_frame(feed(data))

    with pytest.raises(WireError, match=message):
        asyncio.run(go())
