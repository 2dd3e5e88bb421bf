"""Heartbeat and worker supervision with real processes: a stalled gateway (``SIGSTOP``, 3 s,
``SIGCONT``) keeps its healthy workers, also with streams in flight and both cores busy, traced
or not; workers that do die are started again and the service says so meanwhile."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests" / "instrument"))  # busy_cpus
sys.path.insert(0, str(Path(__file__).resolve().parent))  # children_of, alive
from deployments import busy_cpus  # noqa: E402
from test_launcher import alive, children_of  # noqa: E402

pytestmark = pytest.mark.timeout(300)
ARGS = ["--port", "0", "--model", "tiny", "--device", "cpu", "--block-size", "4", "--num-device-blocks", "512",
        "--mode", "colocated", "--instances", "2"]
BODY = {"model": "tiny", "prompt": "Stall the gateway, keep the workers.", "max_tokens": 24, "stream": True,
        "ignore_eos": True}


@contextmanager
def deployment(tmp_path: Path, traced: bool) -> Iterator[tuple[str, int]]:
    """The reference stack (under ``tokentrace run`` when ``traced``): its URL and the gateway's pid."""
    server = [sys.executable, "-m", "reference_server", *ARGS]
    cmd = ([sys.executable, "-c", "from tokentrace.app.cli import main; main()", "run", "--store", str(tmp_path),
            "--run", "stall", "--", *server] if traced else server)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("READY "), (line, proc.stderr.read() if proc.poll() is not None else "")  # type: ignore[union-attr]
        gateway = proc.pid
        if traced:  # tokentrace run's one child is the launcher, which serves the gateway
            (gateway,) = children_of(proc.pid)
        yield line.split()[1], gateway
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def _stream(client: httpx.AsyncClient, url: str) -> tuple[int, bool]:
    async with client.stream("POST", url + "/v1/completions", json=BODY | {"max_tokens": 96}) as r:
        text = "".join([chunk async for chunk in r.aiter_text()])
    return r.status_code, "data: [DONE]" in text


def _streams_across_a_stall(url: str, gateway: int, n: int) -> list[tuple[int, bool]]:
    """``n`` concurrent streams; once they are under way the gateway stops for 3 s."""
    async def go() -> list[tuple[int, bool]]:
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(timeout=240, limits=limits) as client:
            tasks = [asyncio.ensure_future(_stream(client, url)) for _ in range(n)]
            await asyncio.sleep(1.0)
            os.kill(gateway, signal.SIGSTOP)
            await asyncio.sleep(3.0)
            os.kill(gateway, signal.SIGCONT)
            return list(await asyncio.gather(*tasks))
    return asyncio.run(go())


@pytest.mark.parametrize("traced", [False, True], ids=["untraced", "traced"])
def test_a_stalled_gateway_keeps_its_workers(tmp_path: Path, traced: bool) -> None:
    with deployment(tmp_path, traced) as (url, gateway):
        workers = children_of(gateway)
        assert len(workers) == 2
        with busy_cpus(2, max_s=200):
            outcomes = _streams_across_a_stall(url, gateway, 128)
            assert outcomes == [(200, True)] * 128
            for _ in range(2):  # two more stalls, idle this time
                os.kill(gateway, signal.SIGSTOP)
                time.sleep(3.0)
                os.kill(gateway, signal.SIGCONT)
                time.sleep(1.0)  # the heartbeat's first tick after the stall, and its pong
            health = httpx.get(url + "/health", timeout=60)
            assert health.status_code == 200, health.text
            assert all(i["alive"] for i in health.json()["instances"])
            assert children_of(gateway) == workers and all(alive(p) for p in workers)  # never killed nor replaced
            r = httpx.post(url + "/v1/completions", json=BODY, timeout=120)
            assert r.status_code == 200 and "data: [DONE]" in r.text


def test_dead_workers_are_started_again_and_the_wait_is_explained(tmp_path: Path) -> None:
    with deployment(tmp_path, traced=False) as (url, gateway):
        workers = children_of(gateway)
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health", timeout=30).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.02)
        health = httpx.get(url + "/health", timeout=30)
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=120)
        if r.status_code == 503:  # the restart is under way: the answer says which worker died, why, and what now
            message = r.json()["error"]["message"]
            assert "no live colocated worker" in message and "died" in message and "restarting" in message, message
        else:
            assert health.status_code == 503 and health.json()["status"] == "unavailable", health.text
        deadline = time.monotonic() + 180
        while httpx.get(url + "/health", timeout=30).status_code != 200:
            assert time.monotonic() < deadline, "the workers were not started again"
            time.sleep(0.2)
        restarted = children_of(gateway)
        assert len(restarted) == 2 and not restarted & workers
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=120)
        assert r.status_code == 200 and "data: [DONE]" in r.text
        assert json.loads(r.text.split("data: ")[1])["choices"]
