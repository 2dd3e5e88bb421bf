"""Test helpers: a traced reference deployment, an independent raw-socket client, busy CPUs.

* :func:`traced_server`: ``tokentrace run -- python -m reference_server ARGS`` as a real
  process group, stopped with SIGTERM (SIGKILL if it hangs);
* :func:`raw_stream`: one streamed completion over a bare TCP socket (no HTTP library,
  nothing of tokentrace): the client that is not ours. Its send is the kernel's transmit
  timestamp of the request's bytes (``SO_TIMESTAMPING``, Linux; else the time just before
  the ``sendall``); each chunk's arrival is the kernel's receive timestamp of the segment
  that brought its last byte (``SO_TIMESTAMPNS``; each read stops at an event's end), so the client's own scheduling on a busy machine stretches what it saw at
  neither end; the time its ``recv`` returned is kept too;
* :func:`busy_cpus`: processes spinning in a loop, each bounded in time, to oversubscribe
  the machine while a test runs.
"""

from __future__ import annotations

import json
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

from planted_runs import traced_deployment

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux (x86_64, aarch64): not named by Python
SO_TIMESTAMPING = getattr(socket, "SO_TIMESTAMPING", 37)  # likewise; also the type of its control messages
# Transmit timestamps taken before the packet scheduler and at the device, reported as software
# timestamps, without the packet itself: SOF_TIMESTAMPING_TX_SCHED | TX_SOFTWARE | SOFTWARE | OPT_TSONLY.
TX_TIMESTAMPS = (1 << 8) | (1 << 1) | (1 << 4) | (1 << 11)
ANCILLARY = 512  # room for every control message a read or an error-queue read may carry


def _keep_receive_timestamps_on() -> socket.socket | None:
    """A socket holding SO_TIMESTAMPNS for the process's lifetime: the kernel turns receive
    timestamping on asynchronously when the first socket asks for it, so segments arriving just
    after a client's own setsockopt could otherwise come unstamped."""
    try:
        keeper = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        keeper.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    except OSError:
        return None
    return keeper


_KEEPER = _keep_receive_timestamps_on()


@contextmanager
def serve_app(app: object, *, lifespan: str = "off", timeout_s: float = 30.0) -> Iterator[str]:
    """Serve the ASGI ``app`` with uvicorn on a free loopback port in a thread; yields its URL. ``lifespan``:
    uvicorn's setting ("on" when the app starts its backend there)."""
    import threading

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan=lifespan))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)  # waiting for uvicorn's start-up flag
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
        sock.close()


@contextmanager
def traced_server(store: Path, run: str, args: list[str], env: dict[str, str] | None = None,
                  model: str = "tiny") -> Iterator[str]:
    """``tokentrace run -- python -m reference_server ARGS`` with 512 KV blocks unless ``ARGS`` say otherwise
    (:func:`planted_runs.traced_deployment`); yields its URL; always cleaned up."""
    with traced_deployment(store, run, ["--num-device-blocks", "512", *args], env=env, model=model) as url:
        yield url


@dataclass(frozen=True)
class RawResult:
    """What the raw client saw of one streamed request (its monotonic clock, ns)."""

    key: str
    status: int
    send_ns: int  # when the kernel sent the request's bytes (else just before they went to the socket)
    chunk_ns: tuple[int, ...]  # each SSE data event with a completion choice: when its bytes arrived
    read_ns: tuple[int, ...]  # ... when the client's read of them returned
    done: bool  # the stream ended with [DONE]

    @property
    def last_ns(self) -> int:
        return self.chunk_ns[-1]


def raw_stream(url: str, key: str, body: dict, *, timeout_s: float = 120.0,
               first_read_after_s: float = 0.0) -> RawResult:
    """POST ``body`` to ``url`` + /v1/completions over a bare socket and read the SSE stream.

    The request goes out in one ``sendall``; ``send_ns`` is the kernel's earliest transmit
    timestamp of its bytes (the time read just before the ``sendall`` where the kernel gives
    none). Each read stops at the end of the first event waiting (seen with ``MSG_PEEK``), so
    a read that comes late, with several events waiting, still gives each event the kernel's
    receive timestamp of the segment that brought its last byte; an event's time is that of
    the read that completed it, and each read is also timed as it returns. (The kernel may
    merge segments waiting together in the receive queue under the latest one's timestamp,
    so a late read can still make an event look later than it came, never earlier.) HTTP/1.1 with
    ``Connection: close``; chunked transfer coding is undone. ``first_read_after_s``: a pause
    between sending and the first read (a client that reads late).
    """
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\nX-Request-Id: {key}\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPING, TX_TIMESTAMPS)
        except OSError:
            pass  # no transmit timestamps here: the time before the sendall stands
        offset_ns = _wall_to_mono_offset()  # one per stream: equal kernel stamps stay equal
        before_ns = time.monotonic_ns()
        sock.sendall(head + payload)
        send_ns = _sent_ns(sock, before_ns, offset_ns)
        if first_read_after_s > 0:
            time.sleep(first_read_after_s)
        reads: list[tuple[int, int, bytes]] = []
        while True:
            waiting = sock.recv(65536, socket.MSG_PEEK)
            if not waiting:
                break
            end = waiting.find(b"\n\n")  # read up to the first event's end: its own segment's timestamp
            data, ancillary, _, _ = sock.recvmsg(end + 2 if end >= 0 else len(waiting), ANCILLARY)
            t = time.monotonic_ns()
            if not data:
                break
            reads.append((_arrival_ns(ancillary, t, offset_ns), t, data))
    return _parse(key, send_ns, reads)


def _wall_to_mono_offset() -> int:
    """What to add to a kernel (wall-clock) time to put it on the monotonic clock: the wall
    clock read between two monotonic reads, the tightest of three tries, so a preemption between
    reads cannot skew it. Taken once per stream and applied to all of its stamps, so two events
    the kernel stamped alike keep one time (converting each anew could order them by a few ns
    of conversion jitter, the wrong way round)."""
    best = None
    for _ in range(3):
        m0 = time.monotonic_ns()
        w = time.time_ns()
        m1 = time.monotonic_ns()
        if best is None or m1 - m0 < best[0]:
            best = (m1 - m0, (m0 + m1) // 2 - w)
    return best[1]


def _arrival_ns(ancillary: list, read_ns: int, offset_ns: int) -> int:
    """The kernel's receive time of a read's last bytes on the monotonic clock (else ``read_ns``)."""
    for level, kind, value in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(value) >= 16:
            sec, nsec = struct.unpack("qq", value[:16])
            return min(read_ns, sec * 1_000_000_000 + nsec + offset_ns)
    return read_ns


def _sent_ns(sock: socket.socket, before_ns: int, offset_ns: int, *, wait_s: float = 0.05) -> int:
    """The kernel's earliest transmit timestamp of what was just sent, on the monotonic clock,
    from the socket's error queue; ``before_ns`` (the time read before sending) when none
    comes within ``wait_s`` (the stamps of a loopback send are queued before ``sendall`` returns)."""
    stamps: list[int] = []
    deadline = time.monotonic() + wait_s
    timeout = sock.gettimeout()
    sock.settimeout(0)  # with a timeout, Python waits for the socket to be readable before every recvmsg
    try:
        while True:
            try:
                _, ancillary, _, _ = sock.recvmsg(1, ANCILLARY, socket.MSG_ERRQUEUE)
            except (BlockingIOError, InterruptedError):
                if stamps or time.monotonic() >= deadline:
                    break
                time.sleep(0.001)  # an empty error queue: its stamps may still be on their way
                continue
            except OSError:
                break
            for level, kind, value in ancillary:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPING and len(value) >= 16:
                    sec, nsec = struct.unpack("qq", value[:16])  # the first of three: the software stamp
                    if sec or nsec:
                        stamps.append(sec * 1_000_000_000 + nsec + offset_ns)
    finally:
        sock.settimeout(timeout)
    sent = [t for t in stamps if t >= before_ns]
    return min(sent) if sent else before_ns


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
