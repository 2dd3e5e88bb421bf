"""``python -m reference_server`` as a subprocess: serves, streams to the openai client,
and SIGTERM stops every process it started."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[3]


def children_of(pid: int) -> set[int]:
    """Direct child processes of ``pid`` (from /proc)."""
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.add(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for_sent_kv_bytes(url: str, timeout_s: float = 10.0) -> float:
    """The KV transfer bytes-sent counter of /metrics, once it is non-zero (or at the timeout)."""
    deadline, total = time.monotonic() + timeout_s, 0.0
    while time.monotonic() < deadline:
        lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
        sent = [ln for ln in lines if "transfer" in ln and "sent" in ln and not ln.startswith("#")]
        total = sum(float(ln.rsplit(" ", 1)[1]) for ln in sent if "_created" not in ln)
        if total > 0:
            break
        time.sleep(0.2)
    return total


def launch(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "reference_server", "--port", "0", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # READY http://127.0.0.1:PORT, or EOF if it failed
    if not line.startswith("READY "):
        proc.kill()
        raise AssertionError(f"launcher did not start: {line!r} {proc.stderr.read()}")
    return proc, line.split()[1]


def test_disagg_stack_serves_the_openai_client_and_stops_on_sigterm():
    proc, url = launch("--mode", "disagg", "--prefill", "1", "--decode", "1", "--block-size", "16",
                       "--router", "load")
    try:
        workers = children_of(proc.pid)
        assert len(workers) == 2
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert sorted(i["role"] for i in health["instances"]) == ["decode", "prefill"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=30)
        chunks = list(client.completions.create(model="tiny", prompt="Launch the stack.", max_tokens=9,
                                                temperature=0, stream=True))
        token_chunks = [c for c in chunks if c.choices]
        assert 1 <= len(token_chunks) <= 9  # a token completing no character goes out with the next chunk
        assert all(c.choices[0].text for c in token_chunks[:-1])
        assert chunks[-1].choices[0].finish_reason == "length"
        assert wait_for_sent_kv_bytes(url) > 0  # worker stats arrive with the next heartbeat
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    assert rc in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after its graceful shutdown
    deadline = time.monotonic() + 10
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in workers)


def test_workers_exit_when_the_launcher_is_killed():
    proc, _ = launch("--mode", "colocated", "--instances", "1")
    workers = children_of(proc.pid)
    assert len(workers) == 1
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 15
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in workers)


@pytest.mark.parametrize("args, message", [
    (["--router", "random"], "unknown router policy"),
    (["--delay", "nowhere=5ms"], "unknown delay stage"),
    (["--num-device-blocks", "0"], "num_device_blocks"),
    (["--speculative", "medusa"], "invalid choice"),
    (["--speculative", "ngram", "--num-speculative-tokens", "0"], "num_speculative_tokens"),
    (["--model", "trained", "--speculative", "early_exit", "--speculative-exit-layer", "6"], "early exit needs"),
])
def test_bad_options_exit_2_with_a_message(args, message):
    done = subprocess.run([sys.executable, "-m", "reference_server", "--port", "0", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def test_speculative_options_reach_the_engine_config():
    from reference_server.launcher import build_engine_config, parse_args

    config = build_engine_config(parse_args(["--model", "trained", "--speculative", "model",
                                             "--num-speculative-tokens", "3", "--speculative-budget", "6",
                                             "--speculative-draft-model", "tiny", "--speculative-exit-layer", "1",
                                             "--speculative-ngram-min", "3"]))
    assert (config.model, config.speculative, config.num_speculative_tokens, config.speculative_budget,
            config.speculative_draft_model, config.speculative_exit_layer, config.speculative_ngram_min) == (
        "trained", "model", 3, 6, "tiny", 1, 3)
    assert config.checkpoint_path is not None and config.checkpoint_path.endswith("trained")
    assert build_engine_config(parse_args([])).speculative is None  # off by default


def test_a_port_in_use_is_one_line_and_exit_2_before_any_worker_starts():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "reference_server", "--port", str(port), "--mode", "colocated",
                               "--instances", "1"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"


def test_ctrl_c_to_the_process_group_of_a_traced_disagg_server_stops_it_cleanly(tmp_path):
    """Ctrl-C reaches every process of the group (tokentrace run, the gateway, both workers), and
    tokentrace run forwards it once more: no traceback, exit 0, every process's trace flushed."""
    from tokentrace.store import open_run

    proc = subprocess.Popen([sys.executable, "-c", "from tokentrace.app.cli import main; main()", "run", "--store",
                             str(tmp_path), "--run", "ctrl-c", "--", sys.executable, "-m", "reference_server",
                             "--mode", "disagg", "--port", "0"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY "), proc.stderr.read()
        url = line.split()[1]
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "interrupt me", "max_tokens": 6,
                                                       "ignore_eos": True}, timeout=60)
        assert r.status_code == 200
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    run = open_run(tmp_path, "ctrl-c")
    writers = run.manifest["writers"]
    assert len(writers) == 3 and all(w["closed"] for w in writers)  # no worker was killed mid-flush
    names = {i["name"].split("-")[0] for i in run.instances()}
    assert names == {"gateway", "prefill", "decode"}
    assert run.num_rows("tokens") >= 6  # the decode worker's tokens reached the store


@pytest.mark.parametrize("listener", ["launcher", "server_thread"])
def test_the_gateways_connections_send_small_writes_at_once(listener):
    """Nagle off (TCP_NODELAY) on every accepted connection. With it on, a token stream on a
    kept-alive connection waits for the client's delayed ACK: every second request took +40 ms.
    asyncio turns it off only for sockets created as IPPROTO_TCP, which connections inherit."""
    import asyncio

    from reference_server.launcher import _bind
    from reference_server.serving.gateway_server import ServerThread

    if listener == "launcher":
        sock = _bind("127.0.0.1", 0)
    else:
        thread = ServerThread(object())
        sock = thread._sock
    seen: list[int] = []

    async def main() -> None:
        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        for _ in range(200):
            if seen:
                break
            await asyncio.sleep(0.01)
        writer.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())
    assert seen == [1]
