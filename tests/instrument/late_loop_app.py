"""A traced streaming server whose event loop a test can make late, run as its own process.

``python late_loop_app.py STORE RUN PORT_FILE [NICE]``: serves on 127.0.0.1 (any free port, written
to ``PORT_FILE``) an SSE ``/v1/completions`` (``max_tokens`` chunks, ``gap_ms`` apart) behind the
tokentrace ASGI middleware, recording into run ``RUN`` of the store ``STORE``; ``NICE`` lowers the
process's priority by that much. Untraced ``POST /plant`` plants a late loop, as its JSON says:

* ``{"kind": "blocking", "ms": N}``: a callback on the loop spins until its thread has used N ms of CPU,
  from just after the response is written (a request sent once it is read waits for the spin);
* ``{"kind": "gil", "ms": N}``: a thread of this process spins in pure Python until it has used N ms of
  CPU, holding the GIL 50 ms at a time (the switch interval is raised to 50 ms while it runs); untraced
  ``GET /spinning`` says whether it still runs (``{"spinning": true}``).

Each spin counts its thread's CPU time, not the wall clock's, so that it does the same work however
busy the host is; it gives up after ``MAX_SPIN_S`` of wall time.

Exits (flushing the store) on SIGTERM or SIGINT, or after 120 s whatever happens.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

import tokentrace
from instrument.asgi import TokenTraceMiddleware

LIFETIME_S = 120.0  # the longest this server lives, whatever the test does
MAX_SPIN_S = 20.0  # a spin's wall-clock bound on a host too busy to give it its CPU time


def _spin(ms: float) -> None:
    cpu_end, wall_end = time.thread_time_ns() + int(ms * 1e6), time.monotonic() + MAX_SPIN_S
    while time.thread_time_ns() < cpu_end and time.monotonic() < wall_end:
        pass


_SPINNERS: list[threading.Thread] = []


def _spin_holding_the_gil(ms: float) -> None:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.05)
    try:
        _spin(ms)
    finally:
        sys.setswitchinterval(before)


async def _spinning(request: Request) -> JSONResponse:
    return JSONResponse({"spinning": any(t.is_alive() for t in _SPINNERS)})


async def _completions(request: Request) -> StreamingResponse:
    body = await request.json()
    n, gap_s = int(body["max_tokens"]), float(body.get("gap_ms", 0)) / 1e3

    async def events():
        for i in range(n):
            if gap_s:
                await asyncio.sleep(gap_s)
            yield b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": f"w{i}"}}]}).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _plant(request: Request) -> JSONResponse:
    body = await request.json()
    ms = float(body["ms"])
    if body["kind"] == "blocking":
        asyncio.get_running_loop().call_soon(_spin, ms)  # after this response is written: the next request waits
    elif body["kind"] == "gil":
        _SPINNERS.append(threading.Thread(target=_spin_holding_the_gil, args=(ms,), daemon=True))
        _SPINNERS[-1].start()
    else:
        return JSONResponse({"error": f"unknown kind {body['kind']!r}"}, status_code=400)
    return JSONResponse({"planted": body["kind"]})


def main() -> None:
    store, run, port_file = sys.argv[1:4]
    if len(sys.argv) > 4:
        os.nice(int(sys.argv[4]))
    app = TokenTraceMiddleware(Starlette(routes=[Route("/v1/completions", _completions, methods=["POST"]),
                                                 Route("/plant", _plant, methods=["POST"]),
                                                 Route("/spinning", _spinning, methods=["GET"])]))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # connections wait in the backlog until uvicorn serves them: the port is usable once written
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off"))
    threading.Timer(LIFETIME_S, lambda: setattr(server, "should_exit", True)).start()
    with tokentrace.instrument(store=store, run=run, role="gateway"):
        with open(port_file + ".tmp", "w") as f:
            f.write(str(sock.getsockname()[1]))
        os.replace(port_file + ".tmp", port_file)
        server.run(sockets=[sock])
        app.close()
    os._exit(0)  # the lifetime timer's thread


if __name__ == "__main__":
    main()
