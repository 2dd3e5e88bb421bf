"""One worker process spoken to over its wire protocol; a plugin installed from the
environment sees its engine and worker events (the hook a tracer uses)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from reference_server.engine import EngineConfig
from reference_server.serving.config_codec import engine_config_from_json, engine_config_to_json
from reference_server.serving.wire import read_frame, write_frame

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[3]
CONFIG = EngineConfig(model="tiny", block_size=4, num_device_blocks=64, device="cpu")
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

PLUGIN = '''
import json, os
from reference_server.engine import EngineObserver
from reference_server.serving.worker_hooks import WorkerObserver

class _Steps(EngineObserver):
    def __init__(self, path):
        self.path = path
    def on_request_finished(self, event):
        with open(self.path, "a") as f:
            f.write(json.dumps({"request_id": event.request_id, "reason": event.reason}) + "\\n")

class _Received(WorkerObserver):
    def __init__(self, path):
        self.path = path
    def on_worker_request_received(self, event):
        with open(self.path, "a") as f:
            f.write(json.dumps({"wid": event.wid, "traceparent": event.traceparent}) + "\\n")

def install(worker):
    path = os.environ["PLUGIN_OUT"]
    with open(path, "a") as f:
        f.write(json.dumps({"name": worker.name, "role": worker.role}) + "\\n")
    worker.engine.add_observer(_Steps(path))
    worker.add_observer(_Received(path))
'''


def test_engine_config_round_trips_through_json():
    assert engine_config_from_json(engine_config_to_json(CONFIG)) == CONFIG
    with pytest.raises(ValueError, match="unknown engine config field"):
        engine_config_from_json('{"nope": 1}')


async def talk(port: int) -> tuple[dict, list[dict], dict]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    write_frame(writer, {"type": "hello"})
    hello = (await read_frame(reader))[0]
    t_send = time.monotonic_ns()
    write_frame(writer, {"type": "ping", "id": 1, "t_send_ns": t_send})
    common = dict(type="generate", tenant="default", slo_class="interactive", arrival_ns=t_send, resume_tokens=[],
                  handoff_to=None)
    write_frame(writer, dict(common, wid="r@0", request_id="r", prompt=[256, 72, 105],
                             sampling=dict(max_tokens=4, ignore_eos=True), traceparent=TRACEPARENT))
    write_frame(writer, dict(common, wid="bad@0", request_id="bad", prompt=[999], sampling={}))
    frames, pong = [], None
    while len([f for f in frames if f["type"] == "token"]) < 4 or not any(f["type"] == "error" for f in frames):
        header = (await read_frame(reader))[0]
        if header["type"] == "pong":
            pong = header
        else:
            frames.append(header)
    write_frame(writer, {"type": "shutdown"})
    await writer.drain()
    assert await read_frame(reader) is None  # the worker closes the connection as it exits
    writer.close()
    return hello, frames, pong | {"t_recv": time.monotonic_ns()}


def test_worker_protocol_and_environment_plugin(tmp_path):
    (tmp_path / "my_tracer_plugin.py").write_text(PLUGIN)
    out = tmp_path / "plugin.jsonl"
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}", PLUGIN_OUT=str(out),
               REFERENCE_SERVER_WORKER_PLUGINS="my_tracer_plugin:install")
    proc = subprocess.Popen([sys.executable, "-m", "reference_server.serving.worker", "--name", "colocated-7",
                             "--config", engine_config_to_json(CONFIG)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        ready = proc.stdout.readline().split()
        assert ready[0] == "READY"
        hello, frames, pong = asyncio.run(talk(int(ready[1])))
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (hello["name"], hello["role"], hello["pid"]) == ("colocated-7", "colocated", proc.pid)
    tokens = [SimpleNamespace(**f) for f in frames if f["type"] == "token"]
    assert [t.index for t in tokens] == [0, 1, 2, 3] and tokens[-1].finish_reason == "length"
    assert {t.wid for t in tokens} == {"r@0"} and tokens[0].num_prompt_tokens == 3
    error = next(f for f in frames if f["type"] == "error")
    assert error["wid"] == "bad@0" and error["kind"] == "value" and "999" in error["message"]
    # one host, one monotonic clock: the worker's stamps lie inside the round trip
    p = SimpleNamespace(**pong)
    assert p.t_send_ns <= p.recv_ns <= p.send_ns <= p.t_recv
    assert p.stats["num_blocks_total"][0] == 64
    lines = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert lines[0] == {"name": "colocated-7", "role": "colocated"}
    assert dict(request_id="r", reason="length") in lines
    assert dict(wid="r@0", traceparent=TRACEPARENT) in lines


def test_bad_config_exits_2():
    done = subprocess.run([sys.executable, "-m", "reference_server.serving.worker", "--name", "x", "--config",
                           '{"block_size": 0}'], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "block_size" in done.stderr
