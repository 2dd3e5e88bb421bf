"""``sitecustomize`` + ``instrument.autoinstrument``: on with the environment, free without it,
and never fatal to the traced program."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from instrument.child_env import CODE_ROOT, SITE_DIR, child_environment

PROBE = ("import sys, instrument; print('instrument.autoinstrument' in sys.modules, "
         "'reference_server' in sys.modules)")


def _python(code: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd="/")


def test_without_the_variable_nothing_is_imported() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENTRACE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), str(CODE_ROOT)])
    out = _python(PROBE, env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
    assert out.stderr == ""


def test_child_environment_puts_sitecustomize_first_and_keeps_the_rest(tmp_path: Path) -> None:
    env = child_environment(tmp_path, "run-1", 0.5, base={"PYTHONPATH": "/x", "KEEP": "1"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(SITE_DIR), str(CODE_ROOT), "/x"]
    assert env["TOKENTRACE_STORE"] == str(tmp_path.resolve()) and env["TOKENTRACE_RUN"] == "run-1"
    assert float(env["TOKENTRACE_SAMPLE"]) == 0.5 and env["KEEP"] == "1"
    out = _python(PROBE, env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]  # hook installed, nothing imported eagerly


def test_engine_built_under_the_hook_is_traced(tmp_path: Path) -> None:
    code = """
import torch; torch.set_num_threads(1)
from reference_server.engine import EngineConfig, Engine
from reference_server.model import SamplingParams
e = Engine(EngineConfig(model="tiny", device="cpu", block_size=4, num_device_blocks=64))
e.add_request("r1", "hello", SamplingParams(max_tokens=3, ignore_eos=True))
while e.has_unfinished():
    e.step()
"""
    out = _python(code, child_environment(tmp_path, "eng"))
    assert out.returncode == 0, out.stderr
    from tokentrace.store import open_run

    run = open_run(tmp_path, "eng")
    assert run.table("tokens").num_rows == 3
    assert run.table("requests").num_rows == 1


def test_a_store_that_cannot_be_created_warns_once_and_the_program_runs_on() -> None:
    code = """
import torch; torch.set_num_threads(1)
from reference_server.engine import EngineConfig, Engine
from reference_server.model import SamplingParams
e = Engine(EngineConfig(model="tiny", device="cpu", block_size=4, num_device_blocks=64))
Engine(EngineConfig(model="tiny", device="cpu", block_size=4, num_device_blocks=64))  # a second set-up try
done = e.generate(["hello"], SamplingParams(max_tokens=2, ignore_eos=True))
print("served", len(done))
"""
    env = child_environment("/proc/tokentrace-cannot-write-here", "ro")
    out = _python(code, env)
    assert out.returncode == 0, out.stderr
    assert "served" in out.stdout
    lines = [line for line in out.stderr.splitlines() if "tokentrace" in line]
    assert len(lines) == 1 and "without tracing" in lines[0], out.stderr


def test_sample_rate_from_the_environment_keeps_a_share_and_counts_the_rest(tmp_path: Path) -> None:
    code = """
import torch; torch.set_num_threads(1)
from reference_server.engine import EngineConfig, Engine
from reference_server.model import SamplingParams
e = Engine(EngineConfig(model="tiny", device="cpu", block_size=4, num_device_blocks=256))
e.generate([f"prompt {i}" for i in range(24)], SamplingParams(max_tokens=2, ignore_eos=True))
"""
    out = _python(code, child_environment(tmp_path, "sampled", 0.5))
    assert out.returncode == 0, out.stderr
    from tokentrace.store import SAMPLED_OUT, open_run

    run = open_run(tmp_path, "sampled")
    kept = run.table("requests").num_rows
    assert 0 < kept < 24  # head sampling by request id hash: about half
    assert run.counters()[SAMPLED_OUT] > 0
