"""Fault suite of the command line: every bad path, host, endpoint or unwritable output is exit 2 and one
``error:`` line on stderr, never a traceback, an exit 1 or a success message for a write that failed; outputs
never replace what is not a regular file and never leave a part behind.

Each case runs the installed entry point in a real process (real sockets, real files, a character device made
with ``mknod`` like ``/dev/full``, a file size limit standing in for a full disk).
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tokentrace

REPO = Path(__file__).resolve().parents[4]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
EXIT_USAGE = 2
NOT_UTF8 = os.fsdecode(b"store-\xff\xfe")  # a folder name that is not UTF-8 (surrogate-escaped in Python)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """A real run: the tiny reference engine, traced, serving 4 requests of 4 tokens."""
    from reference_server.engine.config import EngineConfig
    from reference_server.engine.engine import Engine
    from reference_server.model import SamplingParams

    root = tmp_path_factory.mktemp("cli-faults")
    engine = Engine(EngineConfig(model="tiny", block_size=4, num_device_blocks=64))
    handle = tokentrace.instrument(engine, store=root / "store", run="real")
    for i in range(4):
        engine.add_request(f"req-{i}", f"prompt {i}", SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    handle.close()
    engine.close()
    return root / "store"


def tokentrace_cli(*args: str, limit_file_bytes: int | None = None, timeout: float = 300,
                   stdout: Path | None = None) -> subprocess.CompletedProcess:
    def limited() -> None:  # a disk that fills after limit_file_bytes: writes past it fail (EFBIG)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_bytes, limit_file_bytes))

    cmd = [sys.executable, "-c", "from tokentrace.app.cli import main; main()", *args]
    if stdout is not None:  # standard output is that file (a device)
        with open(stdout, "w") as out:
            done = subprocess.run(cmd, cwd=REPO, env=ENV, stdout=out, stderr=subprocess.PIPE, text=True,
                                  timeout=timeout, errors="replace")
        return subprocess.CompletedProcess(done.args, done.returncode, "", done.stderr)
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout,
                          errors="replace", preexec_fn=limited if limit_file_bytes else None)


def assert_usage_error(done: subprocess.CompletedProcess, *, says: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == EXIT_USAGE, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr + done.stdout
    assert [line for line in lines if not line.startswith("warning:")] == [lines[-1]], done.stderr
    assert lines[-1].startswith("error: ") and says in lines[-1], lines[-1]
    assert "wrote " not in done.stderr and "sent " not in done.stderr  # no success said for a failed write


@pytest.fixture
def char_device(tmp_path) -> Path:
    """A character device like /dev/full (major 1, minor 7): every write fails with ENOSPC."""
    path = tmp_path / "full"
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
    except (PermissionError, OSError) as err:
        pytest.skip(f"cannot make a device node here: {err}")
    return path


@pytest.mark.parametrize("command", [["runs"], ["inspect"], ["report"], ["export"], ["dashboard"]])
def test_a_store_path_that_is_not_utf8_is_one_line(store, tmp_path, command):
    bad = tmp_path / NOT_UTF8
    bad.mkdir()
    os.symlink(store / "real", bad / "real")
    assert_usage_error(tokentrace_cli(*command, str(bad)), says="is not valid UTF-8")


def test_export_to_a_device_writes_in_place_fails_and_leaves_the_device(store, char_device):
    done = tokentrace_cli("export", str(store), "--out", str(char_device))
    assert_usage_error(done, says=f"cannot write {char_device}: No space left on device")
    assert stat.S_ISCHR(os.stat(char_device).st_mode)  # still the device, not a file renamed over it
    assert [p.name for p in char_device.parent.iterdir()] == ["full"]  # no temporary file left


def test_export_to_a_device_that_takes_the_bytes_succeeds(store, tmp_path):
    null = tmp_path / "null"
    try:
        os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except (PermissionError, OSError) as err:
        pytest.skip(f"cannot make a device node here: {err}")
    done = tokentrace_cli("export", str(store), "--out", str(null))
    assert done.returncode == 0, done.stderr
    assert stat.S_ISCHR(os.stat(null).st_mode) and "wrote " in done.stderr


@pytest.mark.parametrize("command", [["runs"], ["inspect"], ["report"], ["export"]])
def test_standard_output_that_takes_nothing_is_one_line(store, char_device, command):
    done = tokentrace_cli(*command, str(store), stdout=char_device)  # as `> /dev/full`
    assert_usage_error(done, says="cannot write to standard output: No space left on device")


def test_a_report_on_a_full_disk_leaves_no_partial_file(store, tmp_path):
    out = tmp_path / "reports"
    done = tokentrace_cli("report", str(store), "--format", "md,html", "--out", str(out),
                          limit_file_bytes=200_000)  # the Markdown fits, the self-contained HTML does not
    lines = done.stderr.strip().splitlines()
    assert done.returncode == EXIT_USAGE and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert lines == [f"wrote {out / 'report.md'}", f"error: cannot write {out / 'report.html'}: File too large"]
    assert sorted(p.name for p in out.iterdir()) == ["report.md"]  # whole, and no temporary file


@pytest.mark.parametrize("where", ["file", "device"])
def test_report_out_that_is_not_a_folder_is_one_line(store, tmp_path, char_device, where):
    target = char_device if where == "device" else tmp_path / "a-file"
    if where == "file":
        target.write_text("x")
    done = tokentrace_cli("report", str(store), "--format", "md,json", "--out", str(target))
    assert_usage_error(done, says="cannot create the --out folder")
    assert stat.S_ISCHR(os.stat(char_device).st_mode)


def test_a_refused_otlp_endpoint_is_one_line(store):
    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        done = tokentrace_cli("export", str(store), "--format", "otlp", "--endpoint",
                              f"http://127.0.0.1:{port}/v1/traces")
    assert_usage_error(done, says="cannot reach the OTLP endpoint")


@pytest.mark.parametrize("endpoint, says", [
    ("http://no.such.host.invalid:4318/v1/traces", "unknown host"),
    ("http:///v1/traces", "names no host"),
    ("ftp://127.0.0.1/v1/traces", "--format otlp needs --endpoint"),
])
def test_bad_otlp_endpoints_are_one_line(store, endpoint, says):
    assert_usage_error(tokentrace_cli("export", str(store), "--format", "otlp", "--endpoint", endpoint), says=says)


def test_dashboard_on_an_unknown_host_or_a_taken_port_is_one_line(store):
    assert_usage_error(tokentrace_cli("dashboard", str(store), "--host", "no.such.host.invalid"),
                       says="--host no.such.host.invalid: unknown host")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert_usage_error(tokentrace_cli("dashboard", str(store), "--port", str(port)),
                           says=f"cannot listen on 127.0.0.1:{port}")


def test_ingest_otlp_into_a_store_under_a_file_is_one_line(tmp_path):
    (tmp_path / "a-file").write_text("x")
    done = tokentrace_cli("ingest-otlp", "--store", str(tmp_path / "a-file" / "store"), "--listen", "127.0.0.1:0",
                          timeout=120)
    assert_usage_error(done, says="cannot write the store")


@pytest.mark.parametrize("command", [["runs"], ["inspect"], ["report"], ["export"]])
def test_an_unreadable_or_missing_store_is_one_line(tmp_path, command):
    assert_usage_error(tokentrace_cli(*command, str(tmp_path / "missing")), says="missing")
