"""The supervisor behind ``tokentrace run``: what it forwards, what dies with it, what it says it hooked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tokentrace.app.cli.supervise import hooked_lines, run_traced

CLI = [sys.executable, "-c", "from tokentrace.app.cli import main; main()", "run"]

# A command that writes its pid, notes each signal it gets in a file, and exits on SIGTERM.
_CHILD = """
import os, pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
def note(signum, frame):
    with open(out / "signals", "a") as f:
        f.write(signal.Signals(signum).name + "\\n")
    if signum == signal.SIGTERM:
        sys.exit(43)
for sig in (signal.SIGHUP, signal.SIGTERM):
    signal.signal(sig, note)
(out / "pid").write_text(str(os.getpid()))
deadline = time.monotonic() + 120  # never outlives the test by long, whatever happens
while time.monotonic() < deadline:
    time.sleep(0.05)
"""


def _wait_for(predicate: Any, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for a reaper does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _start(tmp_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen([*CLI, "--store", str(tmp_path / "st"), "--", sys.executable, "-c", _CHILD,
                             str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert _wait_for(lambda: (tmp_path / "pid").exists() and (tmp_path / "pid").read_text()), "the command started"
    return proc, int((tmp_path / "pid").read_text())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_the_command_stops_when_the_supervisor_is_killed(tmp_path: Path) -> None:
    proc, pid = _start(tmp_path)
    try:
        proc.kill()  # SIGKILL: the supervisor can do nothing itself
        proc.wait(timeout=30)
        assert _wait_for(lambda: not _alive(pid)), "the command kept running without its supervisor"
        assert (tmp_path / "signals").read_text().split() == ["SIGTERM"]  # a graceful stop, not a kill
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sighup_is_forwarded_to_the_command(tmp_path: Path) -> None:
    proc, pid = _start(tmp_path)
    try:
        proc.send_signal(signal.SIGHUP)
        assert _wait_for(lambda: (tmp_path / "signals").exists() and "SIGHUP" in (tmp_path / "signals").read_text())
        assert proc.poll() is None  # the supervisor itself stays
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 43
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_command_it_cannot_hook_is_said_at_exit(tmp_path: Path, capsys: Any) -> None:
    assert run_traced([sys.executable, "-c", "print('serving myself')"], store=tmp_path / "st", run="r-1") == 0
    err = capsys.readouterr().err
    assert "no server process of the command was hooked" in err
    assert "ASGI middleware" in err and "ingest-otlp" in err


_TRACED = """
import os
from tokentrace.recorder import BufferedRecorder
from tokentrace.store import StoreWriter
w = StoreWriter(os.environ["TOKENTRACE_STORE"], run_id=os.environ["TOKENTRACE_RUN"],
                config={"launcher": "tokentrace run"})
rec = BufferedRecorder(w, instance_id=w.instance_id, flush_interval_s=600)
rec.instance(role=2, name="decode-0")
rid = rec.request_begin("req-0", arrival_ns=1_000)
rec.span(rid, 9, 2_000, 2_500, token_index=0)
rec.request_end(rid, first_token_ns=2_600, finish_ns=3_000, num_output_tokens=1)
w.register_instance(w.instance_id, 2, "decode-0")
rec.close()
"""


def test_each_hooked_process_is_named_with_what_it_is(tmp_path: Path, capsys: Any) -> None:
    assert run_traced([sys.executable, "-c", _TRACED], store=tmp_path / "st", run="r-1", derive=False) == 0
    lines = hooked_lines(tmp_path / "st" / "r-1")
    assert len(lines) == 1, lines
    assert "a reference-server decode worker 'decode-0'; 1 request row(s), 1 stage span(s)" in lines[0]
    assert lines[0] in capsys.readouterr().err


def _group_members(pgid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            members.append(int(stat.parent.name))
    return members


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_killed_supervisor_takes_the_reference_deployment_with_it(tmp_path: Path) -> None:
    """kill -9 of `tokentrace run`: the gateway stops (SIGTERM) and stops its workers; nothing serves on."""
    proc = subprocess.Popen([*CLI, "--store", str(tmp_path / "st"), "--", sys.executable, "-m", "reference_server",
                             "--mode", "disagg", "--prefill", "1", "--decode", "1", "--model", "tiny", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        ready = ""
        deadline = time.monotonic() + 240
        while proc.stdout is not None and not ready.startswith("READY") and time.monotonic() < deadline:
            ready = proc.stdout.readline()
        assert ready.startswith("READY"), "the reference server did not start"
        assert len(_group_members(proc.pid)) >= 4  # supervisor, gateway, prefill and decode workers
        proc.kill()
        proc.wait(timeout=30)
        assert _wait_for(lambda: not _group_members(proc.pid), timeout_s=120), _group_members(proc.pid)
    finally:
        for pid in _group_members(proc.pid):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


_ASGI_APP = """
import socket, sys
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from instrument.asgi import TokenTraceMiddleware

async def completions(request):
    await request.json()
    return JSONResponse({"choices": [{"index": 0, "text": "hi"}]})

app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
app.add_middleware(TokenTraceMiddleware)  # the one line: no tokentrace.instrument() call
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen(16)  # connections wait in the backlog until uvicorn serves
print(sock.getsockname()[1], flush=True)
uvicorn.Server(uvicorn.Config(app, log_level="critical")).run(sockets=[sock])
"""


def test_an_asgi_app_with_the_middleware_is_traced_and_named(tmp_path: Path) -> None:
    import httpx

    from tokentrace.schema import REQUESTS
    from tokentrace.store import open_run

    proc = subprocess.Popen([*CLI, "--store", str(tmp_path / "st"), "--run", "r-1", "--", sys.executable, "-c",
                             _ASGI_APP], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        for n in range(3):
            response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"},
                                  headers={"X-Request-Id": f"req-{n}"}, timeout=30)
            assert response.status_code == 200
        proc.send_signal(signal.SIGINT)  # forwarded: uvicorn stops, the process's writer is closed at exit
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "an ASGI app, through tokentrace's middleware 'asgi-app-" in err, err
    assert "3 request row(s)" in err and "no server lane" not in err
    assert open_run(tmp_path / "st", "r-1").table(REQUESTS.name).num_rows == 3


def test_many_hooked_processes_are_counted_not_listed(tmp_path: Path) -> None:
    from tokentrace.store import StoreWriter

    for n in range(20):
        with StoreWriter(tmp_path / "st", run_id="r-1", config={"launcher": "tokentrace run"}) as writer:
            writer.register_instance(writer.instance_id, 3, f"colocated-{n}")
    lines = hooked_lines(tmp_path / "st" / "r-1")
    assert len(lines) == 12 and lines[-1] == "... and 9 more hooked process(es)"
    assert all("a reference-server worker" in line for line in lines[:-1])
