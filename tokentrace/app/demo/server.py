"""The demo's reference server: started under ``tokentrace run``, stopped so every process flushes.

:class:`TracedServer` runs::

    python -m tokentrace.app.cli run --store STORE --run RUN -- \\
        python -m reference_server --mode disagg --prefill 1 --decode 1 --port 0 ...

in a process group of its own (a new session), so a Ctrl-C in the terminal
reaches only the demo, which then stops the server in order (:meth:`TracedServer.stop`):
SIGINT to ``tokentrace run``, which forwards it to the launcher, which stops its
workers (each flushes its store writer); after a grace period SIGINT to the
whole group, then SIGKILL to whatever is left.

The server's stdout is read by a daemon thread (the ``READY http://HOST:PORT``
line, then drained so the pipe never fills); its stderr goes to a log file whose
tail is shown when the server fails to start. Nothing here imports the reference
server: it is a child process, exactly as a user would start it.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable

__all__ = ["ServerSpec", "ServerStartError", "TracedServer", "server_command"]

READY_PREFIX = "READY "
"""The launcher's line once the gateway listens: ``READY http://HOST:PORT``."""
_STDERR_TAIL_LINES = 30


class ServerStartError(RuntimeError):
    """The server exited or did not print READY in time; the message holds its stderr tail."""


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """What to start: where it traces to and how the reference server is configured."""

    store: Path
    run_id: str
    tenants_file: Path
    model: str = "trained"
    block_size: int = 16  # tokens per KV block
    num_device_blocks: int = 512  # per worker
    num_host_blocks: int = 256  # per worker: the host tier evicted prefix blocks go to
    scheduling_policy: str = "slo"  # deadline-aware: interactive before batch
    device: str | None = None  # None: the reference server's choice (cuda if available)
    speculative: str | None = None  # the server's --speculative: model, ngram or early_exit; None = off
    kv_retention: str = "lru"  # a finished session turn's KV: lru, keep, offload or drop (the server's --kv-retention)


def server_command(spec: ServerSpec) -> list[str]:
    """The argv: ``tokentrace run`` around a disaggregated reference server (1 prefill, 1 decode)."""
    server = [
        sys.executable, "-m", "reference_server", "--mode", "disagg", "--prefill", "1", "--decode", "1",
        "--port", "0", "--model", spec.model, "--tenants", str(spec.tenants_file),
        "--scheduling-policy", spec.scheduling_policy, "--block-size", str(spec.block_size),
        "--num-device-blocks", str(spec.num_device_blocks), "--num-host-blocks", str(spec.num_host_blocks),
    ]
    if spec.device:
        server += ["--device", spec.device]
    if spec.speculative:
        server += ["--speculative", spec.speculative]
    if spec.kv_retention != "lru":
        server += ["--kv-retention", spec.kv_retention]
    return [sys.executable, "-m", "tokentrace.app.cli", "run", "--store", str(spec.store), "--run", spec.run_id,
            "--", *server]


def _server_environment() -> dict[str, str]:
    """Our environment; each of the two workers gets half the cores unless the user chose."""
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // 2))
    return env


class TracedServer:
    """One traced reference-server deployment (a context manager: ``stop`` on exit).

    Methods are called from one thread (the demo's). ``start`` blocks until READY
    or raises :class:`ServerStartError`; ``stop`` blocks at most ``grace_s`` plus
    a few seconds and never raises.
    """

    def __init__(self, spec: ServerSpec, *, log_path: Path, command: list[str] | None = None) -> None:
        self.spec = spec
        self.log_path = log_path
        self.command = server_command(spec) if command is None else list(command)  # argv; tests swap it
        self.url: str | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._log: IO[str] | None = None

    @property
    def pid(self) -> int | None:
        """The process-group leader's pid (``tokentrace run``), None before ``start``."""
        return None if self._proc is None else self._proc.pid

    def start(self, *, timeout_s: float = 180.0, on_wait: Callable[[], None] | None = None) -> str:
        """Start the deployment and wait for READY; returns the gateway's base URL.

        ``on_wait`` is called about twice a second while waiting (to show progress)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w", encoding="utf-8")
        self._proc = subprocess.Popen(
            self.command, stdout=subprocess.PIPE, stderr=self._log, stdin=subprocess.DEVNULL,
            text=True, bufsize=1, start_new_session=True, env=_server_environment())
        threading.Thread(target=self._read_stdout, args=(self._proc.stdout,), name="demo-server-stdout",
                         daemon=True).start()
        self.url = self._wait_ready(timeout_s, on_wait)
        return self.url

    def _read_stdout(self, stream: IO[str] | None) -> None:
        if stream is None:
            return
        for line in stream:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def _wait_ready(self, timeout_s: float, on_wait: Callable[[], None] | None = None) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            if on_wait is not None:
                on_wait()
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop(grace_s=5.0)
                raise ServerStartError(f"the server printed no READY line within {timeout_s:.0f} s"
                                       + self._stderr_tail())
            try:
                line = self._lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                code = self._proc.wait() if self._proc is not None else None
                raise ServerStartError(f"the server exited (status {code}) before it was ready"
                                       + self._stderr_tail())
            if line.startswith(READY_PREFIX):
                return line[len(READY_PREFIX):].strip()

    def _stderr_tail(self) -> str:
        if self._log is not None:
            self._log.flush()
        try:
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        tail = "\n".join(lines[-_STDERR_TAIL_LINES:])
        return f"; its stderr ({self.log_path}):\n{tail}" if tail else f"; its stderr ({self.log_path}) is empty"

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, *, grace_s: float = 30.0) -> int | None:
        """Stop the deployment so every process flushes; the leader's exit status.

        SIGINT goes first to the group leader only (``tokentrace run`` forwards it to
        the launcher, which stops its workers in order: each flushes its store
        writer). A SIGINT to the whole group at once would reach the launcher twice
        (directly and forwarded), which uvicorn takes as a forced exit, and the
        workers could lose their last events. Whatever is still alive after
        ``grace_s`` gets SIGINT as a group, then SIGKILL.
        """
        proc = self._proc
        if proc is None:
            return None
        deadline = time.monotonic() + grace_s
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGINT)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
        if not self._wait_group_gone(timeout_s=max(deadline - time.monotonic(), 0.0)):
            self._signal_group(signal.SIGINT)
            if not self._wait_group_gone(timeout_s=5.0):
                self._signal_group(signal.SIGKILL)
        code = proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def kill(self) -> int | None:
        """SIGKILL to the whole group at once (no flushing); the leader's exit status."""
        if self._proc is None:
            return None
        self._signal_group(signal.SIGKILL)
        code = self._proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def _signal_group(self, sig: signal.Signals) -> None:
        if self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone already

    def _wait_group_gone(self, *, timeout_s: float) -> bool:
        """Poll until no process of the group is left (True) or ``timeout_s`` passed (False)."""
        if self._proc is None:
            return True
        deadline = time.monotonic() + timeout_s
        while True:
            self._proc.poll()  # reap the leader, or killpg(0) keeps finding its zombie
            try:
                os.killpg(self._proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def __enter__(self) -> TracedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
