"""A store that cannot be written never stops the traced program: a path under a file, a
read-only file system, a full one. Each is one warning line; the program serves on (untraced,
or with its lost rows counted), and the run's manifest says why when it can be written.

The read-only and full file systems are real: a tmpfs mounted in a private user and mount
namespace (``unshare -rm``), so no privilege is needed and nothing outlives the test. Where
the kernel or a container forbids such namespaces those tests are skipped, saying so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
RUN = f"{PY} -c 'from tokentrace.app.cli import main; main()' run"

ENGINE_PROGRAM = textwrap.dedent(
    """
    import torch; torch.set_num_threads(1)
    from reference_server.engine import EngineConfig, Engine
    from reference_server.model import SamplingParams
    e = Engine(EngineConfig(model="tiny", device="cpu", block_size=4, num_device_blocks=512))
    done = e.generate([f"request number {i} " * 3 for i in range(40)], SamplingParams(max_tokens=8, ignore_eos=True))
    print("served", len(done))
    """
)
READ_PROGRAM = textwrap.dedent(
    """
    import json, sys, warnings
    from tokentrace.store import open_run
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = open_run(sys.argv[1])
        out = {"counters": run.counters(), "errors": [w.get("errors", {}) for w in run.manifest["writers"]],
               "spans": run.num_rows("spans"), "steps": run.num_rows("steps")}
    out["warnings"] = [str(w.message) for w in caught]
    print("RESULT " + json.dumps(out))
    """
)


def _namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt 2>/dev/null "
                            "|| mount -t tmpfs -o size=64k tmpfs /tmp"], capture_output=True, timeout=30)
    return probe.returncode == 0


needs_namespaces = pytest.mark.skipif(not _namespaces_work(), reason="unshare -rm (user and mount namespaces) "
                                      "is not permitted here, so no private tmpfs can be mounted")


def _in_namespace(tmp_path: Path, script: str) -> subprocess.CompletedProcess:
    """``script`` (bash) as root of a new user and mount namespace, with ``$MNT`` an empty folder."""
    for name, text in (("engine.py", ENGINE_PROGRAM), ("read.py", READ_PROGRAM)):
        (tmp_path / name).write_text(text)
    (tmp_path / "mnt").mkdir()
    header = f"set -u\nMNT={tmp_path / 'mnt'}\nT={tmp_path}\ncd {REPO}\n"
    return subprocess.run(["unshare", "-rm", "bash", "-c", header + script], capture_output=True, text=True,
                          timeout=240, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)})


def _tokentrace_lines(stderr: str) -> list[str]:
    """tokentrace's lines on stderr but the run's first (where it traces into) and last (what it hooked)."""
    return [line for line in stderr.splitlines() if "tokentrace" in line and "tracing into" not in line
            and not line.startswith(("tokentrace: hooked ", "tokentrace: ... and "))]


def _result(stdout: str) -> dict:
    (line,) = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


def test_a_store_under_a_file_is_one_warning_and_the_command_runs_untraced(tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    done = subprocess.run([PY, "-c", "from tokentrace.app.cli import main; main()", "run", "--store", str(a_file / "st"),
                           "--", PY, "-c", "import os; print('served', 'TOKENTRACE_STORE' in os.environ)"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["served", "False"]
    assert done.stderr.splitlines() == [f"tokentrace: warning: cannot write the store at {a_file / 'st'} "
                                        f"(Not a directory); running the command untraced"]


@needs_namespaces
def test_a_read_only_store_is_one_warning_and_the_command_serves_untraced(tmp_path):
    done = _in_namespace(tmp_path, f"""
mount -t tmpfs -o size=1m tmpfs $MNT && mkdir $MNT/store && mount -o remount,ro $MNT
{RUN} --store $MNT/store -- {PY} $T/engine.py
echo "exit=$?"
""")
    assert "served 40" in done.stdout and "exit=0" in done.stdout, done.stderr
    assert "Traceback" not in done.stderr
    assert _tokentrace_lines(done.stderr) == [f"tokentrace: warning: cannot write the store at {tmp_path}/mnt/store "
                                              f"(Read-only file system); running the command untraced"]


@needs_namespaces
def test_a_read_only_store_with_a_killed_writers_journal_reads_its_parts_and_says_why(tmp_path):
    (tmp_path / "victim.py").write_text(textwrap.dedent("""
        import os, signal, sys, time
        from tokentrace.recorder import BufferedRecorder
        from tokentrace.store import StoreWriter
        w = StoreWriter(sys.argv[1], run_id="r")
        rec = BufferedRecorder(w, instance_id=w.instance_id, flush_interval_s=600, journal_interval_s=0.05)
        for i in range(10):
            rec.step(i, i, i + 1, 1, 0, 1, 0, 1, 0)
        rec.flush()  # ten steps in a part
        for i in range(10, 15):
            rec.step(i, i, i + 1, 1, 0, 1, 0, 1, 0)
        while not list(w.run_path.rglob("journal-*.arrows")):
            time.sleep(0.01)  # waits for the flush thread to journal them
        os.kill(os.getpid(), signal.SIGKILL)
        """))
    done = _in_namespace(tmp_path, f"""
mount -t tmpfs -o size=4m tmpfs $MNT
{PY} $T/victim.py $MNT/store
mount -o remount,ro $MNT
{PY} $T/read.py $MNT/store
""")
    result = _result(done.stdout)
    assert result["steps"] == 10  # the part; the journal waits for a writable store
    (warning,) = result["warnings"]
    assert "cannot be recovered in a read-only store" in warning and "write access" in warning


@needs_namespaces
def test_a_full_store_is_one_warning_the_program_serves_on_and_the_manifest_says_why(tmp_path):
    done = _in_namespace(tmp_path, f"""
mount -t tmpfs -o size=64k tmpfs $MNT
{RUN} --store $MNT/store -- {PY} $T/engine.py
echo "exit=$?"
{PY} $T/read.py $MNT/store
""")
    assert "served 40" in done.stdout and "exit=0" in done.stdout, done.stderr
    assert "Traceback" not in done.stderr
    (warning,) = _tokentrace_lines(done.stderr)
    assert "No space left on device" in warning and "counted" in warning
    result = _result(done.stdout)
    errors = {k: v for frag in result["errors"] for k, v in frag.items()}
    assert any("No space left on device" in v or "[Errno 28]" in v for v in errors.values()), errors
    assert result["counters"]["sink_errors"] > 0  # the rows it could not write are counted, not hidden
