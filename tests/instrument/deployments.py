"""Test helpers: a traced reference deployment, an independent raw-socket client, busy CPUs.

* :func:`traced_server`: ``tokentrace run -- python -m reference_server ARGS`` as a real
  process group, stopped with SIGTERM (SIGKILL if it hangs);
* :func:`raw_stream`: one streamed completion over a bare TCP socket (no HTTP library,
  nothing of tokentrace): the client that is not ours. Its send is timed just before the
  ``sendall``; each chunk's arrival is the kernel's receive timestamp of the last bytes of
  the read that completed it (``SO_TIMESTAMPNS``, Linux), so the client's own scheduling
  on a busy machine does not stretch what it saw; the time its ``recv`` returned is kept too;
* :func:`busy_cpus`: processes spinning in a loop, each bounded in time, to oversubscribe
  the machine while a test runs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[2]
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux (x86_64, aarch64): not named by Python


@contextmanager
def traced_server(store: Path, run: str, args: list[str], env: dict[str, str] | None = None,
                  model: str = "tiny") -> Iterator[str]:
    """``tokentrace run -- python -m reference_server ARGS``; yields its URL; always cleaned up."""
    cmd = [sys.executable, "-c", "from tokentrace.cli import main; main()", "run", "--store", str(store),
           "--run", run, "--", sys.executable, "-m", "reference_server", "--port", "0", "--model", model,
           "--device", "cpu", "--block-size", "4", "--num-device-blocks", "512", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})})
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("READY "), (line, proc.stderr.read() if proc.poll() is not None else "")  # type: ignore[union-attr]
        yield line.split()[1]
        proc.send_signal(signal.SIGTERM)  # forwarded by tokentrace run to the launcher
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@dataclass(frozen=True)
class RawResult:
    """What the raw client saw of one streamed request (its monotonic clock, ns)."""

    key: str
    status: int
    send_ns: int  # just before the request's bytes went to the socket
    chunk_ns: tuple[int, ...]  # each SSE data event with a completion choice: when its bytes arrived
    read_ns: tuple[int, ...]  # ... when the client's read of them returned
    done: bool  # the stream ended with [DONE]

    @property
    def last_ns(self) -> int:
        return self.chunk_ns[-1]


def raw_stream(url: str, key: str, body: dict, *, timeout_s: float = 120.0) -> RawResult:
    """POST ``body`` to ``url`` + /v1/completions over a bare socket and read the SSE stream.

    The request goes out in one ``sendall``; ``send_ns`` is read just before it. Each read
    is timed as it returns, before any parsing; an event's time is that of the read that
    completed it. HTTP/1.1 with ``Connection: close``; chunked transfer coding is undone.
    """
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\nX-Request-Id: {key}\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        send_ns = time.monotonic_ns()
        sock.sendall(head + payload)
        reads: list[tuple[int, int, bytes]] = []
        while True:
            data, ancillary, _, _ = sock.recvmsg(65536, socket.CMSG_SPACE(16))
            t = time.monotonic_ns()
            if not data:
                break
            reads.append((_arrival_ns(ancillary, t), t, data))
    return _parse(key, send_ns, reads)


def _arrival_ns(ancillary: list, read_ns: int) -> int:
    """The kernel's receive time of a read's last bytes on the monotonic clock (else ``read_ns``)."""
    for level, kind, value in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(value) >= 16:
            sec, nsec = struct.unpack("qq", value[:16])
            wall_ns, mono_ns = time.time_ns(), time.monotonic_ns()
            return min(read_ns, sec * 1_000_000_000 + nsec - wall_ns + mono_ns)
    return read_ns


def _parse(key: str, send_ns: int, reads: list[tuple[int, int, bytes]]) -> RawResult:
    """Status, and the times each SSE data event's last byte arrived and was read."""
    buf = b"".join(d for _, _, d in reads)
    head, _, _ = buf.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    ends, total = [], 0  # cumulative byte offset at the end of each read
    for arrived, read, d in reads:
        total += len(d)
        ends.append((total, arrived, read))
    body_start = len(head) + 4
    body = _dechunk(buf[body_start:]) if b"transfer-encoding: chunked" in head.lower() else buf[body_start:]
    # Map event positions back to wire offsets: chunked framing only adds bytes, so an event's
    # wire end is found by scanning the raw stream for its text after the previous event.
    chunk_ns, read_ns, done, pos = [], [], False, body_start
    for event in body.split(b"\n\n"):
        if not event.startswith(b"data: "):
            continue
        data = event[6:]
        pos = buf.find(data, pos) + len(data)
        arrived, read = next((a, r) for end, a, r in ends if end >= pos)
        if data == b"[DONE]":
            done = True
        elif b'"choices":[{' in data.replace(b" ", b""):
            chunk_ns.append(arrived)
            read_ns.append(read)
    return RawResult(key, status, send_ns, tuple(chunk_ns), tuple(read_ns), done)


def _dechunk(raw: bytes) -> bytes:
    out, i = [], 0
    while i < len(raw):
        line_end = raw.index(b"\r\n", i)
        size = int(raw[i:line_end].split(b";")[0], 16)
        if size == 0:
            break
        out.append(raw[line_end + 2:line_end + 2 + size])
        i = line_end + 2 + size + 2
    return b"".join(out)


@contextmanager
def busy_cpus(n: int, *, max_s: float = 300.0) -> Iterator[None]:
    """``n`` processes spinning on a core each until the block ends (or ``max_s``, whichever first)."""
    code = f"import time\nend = time.monotonic() + {max_s}\nwhile time.monotonic() < end:\n    pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()
