"""``tokentrace run``: environment for the command, exit status, signal forwarding."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tokentrace.app.cli.commands.run import run_traced

CLI = [sys.executable, "-c", "from tokentrace.app.cli import main; main()", "run"]


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


_TRACED_CHILD = """
import os, sys
from tokentrace.recorder import BufferedRecorder
from tokentrace.store import StoreWriter
w = StoreWriter(os.environ["TOKENTRACE_STORE"], run_id=os.environ["TOKENTRACE_RUN"])
rec = BufferedRecorder(w, instance_id=w.instance_id, flush_interval_s=600)
rec.instance(role=3, name="colocated-0")
rid = rec.request_begin("req-0", tenant="acme", arrival_ns=1_000, num_prompt_tokens=4)
for i in range(3):
    rec.span(rid, 9, 2_000 + 1_000 * i, 2_500 + 1_000 * i, token_index=i)
    rec.token(rid, i, emit_ns=2_500 + 1_000 * i, sent_ns=2_600 + 1_000 * i)
rec.request_end(rid, first_token_ns=2_600, finish_ns=5_000, num_output_tokens=3)
if sys.argv[1] == "close":
    rec.close()
else:
    rec.flush()
    os._exit(0)  # ends without closing its writer, as a killed process would
"""


@pytest.mark.parametrize(("how", "derive", "saved"), [("close", True, True), ("close", False, False),
                                                     ("crash", True, False)])
def test_a_finished_run_gets_its_analysis_facts_saved(tmp_path: Path, capsys: Any, how: str, derive: bool,
                                                      saved: bool) -> None:
    from analyzers.derivation import FACTS
    from tokentrace.store import open_run
    from tokentrace.store.derived import DERIVED_DIR

    status = run_traced([sys.executable, "-c", _TRACED_CHILD, how], store=tmp_path / "st", run="r-1", derive=derive)
    assert status == 0
    run = open_run(tmp_path / "st", "r-1")
    assert run.is_finished() is (how == "close")
    derived = sorted(p.stem for p in (run.path / DERIVED_DIR).glob("*.parquet"))
    assert derived == (sorted(f.name for f in FACTS) if saved else [])
    assert ("saved" in capsys.readouterr().err) is saved
