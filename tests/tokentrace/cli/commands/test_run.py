"""``tokentrace run``: environment for the command, exit status, signal forwarding."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tokentrace.cli.commands.run import run_traced

CLI = [sys.executable, "-c", "from tokentrace.cli import main; main()", "run"]


def test_command_gets_the_environment_and_its_exit_status_is_returned(tmp_path: Path) -> None:
    out = tmp_path / "env.txt"
    code = ("import os, sys; open(sys.argv[1], 'w').write(os.environ['TOKENTRACE_STORE'] + '|' + "
            "os.environ['TOKENTRACE_RUN'] + '|' + os.environ['TOKENTRACE_SAMPLE']); sys.exit(7)")
    status = run_traced([sys.executable, "-c", code, str(out)], store=tmp_path / "st", run="r-1", sample=0.25)
    assert status == 7
    store, run, sample = out.read_text().split("|")
    assert store == str((tmp_path / "st").resolve()) and run == "r-1" and float(sample) == 0.25


def test_bad_options_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="command"):
        run_traced([], store=tmp_path)
    with pytest.raises(ValueError, match="sample"):
        run_traced(["true"], store=tmp_path, sample=1.5)
    with pytest.raises(ValueError):
        run_traced(["true"], store=tmp_path, run="bad id/")
    proc = subprocess.run([*CLI, "--store", str(tmp_path), "--sample", "0", "--", "true"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "sample" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_program_exits_127(tmp_path: Path) -> None:
    assert run_traced(["/nonexistent/program"], store=tmp_path) == 127


def test_sigterm_is_forwarded_to_the_command(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    code = ("import pathlib, signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))\n"
            f"pathlib.Path({str(ready)!r}).write_text('x')\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([*CLI, "--store", str(tmp_path / "st"), "--", sys.executable, "-c", code],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ready.exists()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 42  # the command's own handler ran and set the status
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
