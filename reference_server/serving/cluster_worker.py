"""The cluster's handle on one worker process: spawn, connect, heartbeat, death.

A :class:`WorkerHandle` starts ``python -m reference_server.serving.worker`` as a child
process (inheriting the environment, so tracers installed through it reach the worker),
waits for its ``READY <port>`` line, connects its control connection and says ``hello``.
Then two tasks run on the backend's event loop: a reader that hands every frame to the
cluster (pongs are handled here: stats, clock samples) and a heartbeat that pings every
``heartbeat_interval_s``. The worker is declared dead, once, on EOF or a read error on
the control connection, or when it showed no sign of life (no frame of any kind: pong,
token, event) for ``heartbeat_timeout_s`` of *this* process's running time, and
``on_dead`` is called at once (its requests are sent elsewhere). Running time, because
the silence must be the worker's: while this process is stopped (``SIGSTOP``, a
debugger, a swapped-out host) or its event loop is held up, no pong can be read, so each
heartbeat tick counts at most two ping intervals however late it fires. A gateway that
stalls for 3 s thus resumes, pings, reads the pong and carries on; a worker that stalls
is declared dead after ``heartbeat_timeout_s`` of ticks that found it silent. A hung worker (no pong)
is killed right away; one that closed its connection is exiting on its own (a Ctrl-C
reached it too, or its engine failed), so it gets ``exit_grace_s`` to finish exiting (a
tracer flushes its events at exit) before it is killed. Either way it is reaped.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reference_server.serving.wire import WireError, read_frame, write_frame
from reference_server.serving.worker_hooks import ClockSample

__all__ = ["WorkerHandle", "WorkerStartError"]

_REPO_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding reference_server/


class WorkerStartError(RuntimeError):
    """A worker process did not come up (exited, or no READY line in time)."""


class WorkerHandle:
    """One worker process and its control connection. Event-loop thread only."""

    def __init__(self, *, name: str, role: str, config_json: str, delay_spec: str = "", kv_chunk_blocks: int = 16,
                 host: str = "127.0.0.1", heartbeat_interval_s: float = 0.2, heartbeat_timeout_s: float = 1.0,
                 exit_grace_s: float = 10.0,
                 on_frame: Callable[[WorkerHandle, dict[str, Any]], None],
                 on_dead: Callable[[WorkerHandle, str], None],
                 on_clock: Callable[[ClockSample], None] | None = None) -> None:
        self.name, self.role, self.host = name, role, host
        self._argv = [sys.executable, "-m", "reference_server.serving.worker", "--name", name, "--role", role,
                      "--host", host, "--port", "0", "--config", config_json, "--delay", delay_spec,
                      "--kv-chunk-blocks", str(kv_chunk_blocks)]
        self.heartbeat_interval_s, self.heartbeat_timeout_s = heartbeat_interval_s, heartbeat_timeout_s
        self.exit_grace_s = exit_grace_s
        self._on_frame, self._on_dead, self._on_clock = on_frame, on_dead, on_clock
        self.proc: asyncio.subprocess.Process | None = None
        self.port = 0
        self.alive = False
        self.stopping = False
        self.inflight: set[str] = set()  # wids the cluster has outstanding here
        self.stats: dict[str, Any] = {}  # the worker's last reported stats (EngineStats fields + kv counters)
        self._writer: asyncio.StreamWriter | None = None
        self._tasks: list[asyncio.Task] = []
        self._last_pong_ns = 0  # backend monotonic clock, ns
        self._num_frames = 0  # frames read from the worker: its progress, as this process saw it
        self._ping_id = 0
        self.death_reason = ""  # why it was declared dead ("" while alive)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    async def start(self, *, timeout_s: float = 180.0) -> None:
        """Spawn the process and connect. ``WorkerStartError`` if it does not come up."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, env.get("PYTHONPATH", "")) if p)
        self.proc = await asyncio.create_subprocess_exec(
            *self._argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, env=env)
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)  # type: ignore[union-attr]
            parts = line.decode(errors="replace").split()
            if len(parts) != 2 or parts[0] != "READY":
                raise WorkerStartError(f"worker {self.name} did not start (said {line!r})")
            self.port = int(parts[1])
            reader, self._writer = await asyncio.open_connection(self.host, self.port)
            write_frame(self._writer, {"type": "hello"})
            answer = await asyncio.wait_for(read_frame(reader), timeout_s)
            if answer is None or answer[0].get("type") != "hello_ok":
                raise WorkerStartError(f"worker {self.name} did not answer hello")
        except (asyncio.TimeoutError, OSError, WireError, ValueError) as exc:
            self._kill()
            raise WorkerStartError(f"worker {self.name} did not start: {exc!r}") from None
        except BaseException:
            self._kill()
            raise
        self.alive = True
        self._last_pong_ns = time.monotonic_ns()
        self._tasks = [asyncio.ensure_future(self._read_loop(reader)), asyncio.ensure_future(self._heartbeat()),
                       asyncio.ensure_future(self._drain_stdout())]

    def send(self, header: dict[str, Any]) -> bool:
        """Queue a frame to the worker; False if it is not alive."""
        if not self.alive or self._writer is None or self._writer.is_closing():
            return False
        write_frame(self._writer, header)
        return True

    async def stop(self, *, timeout_s: float = 10.0) -> None:
        """Ask the worker to shut down, wait for it (killing it after ``timeout_s``)."""
        self.stopping = True
        self.send({"type": "shutdown"})
        self.alive = False
        for task in self._tasks:
            task.cancel()
        if self.proc is not None and self.proc.returncode is None:
            try:
                await asyncio.wait_for(self.proc.wait(), timeout_s)
            except asyncio.TimeoutError:
                self._kill()
                await self.proc.wait()
        if self._writer is not None:
            self._writer.close()

    def declare_dead(self, reason: str, *, exiting: bool = False) -> None:
        """Mark the worker dead (once) and tell the cluster; kill its process now, or, when it
        is ``exiting`` on its own (it closed its connection), after ``exit_grace_s``."""
        if not self.alive or self.stopping:
            return
        self.alive = False
        self.death_reason = reason
        if not exiting:
            self._kill()
        if self._writer is not None:
            self._writer.close()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        if self.proc is not None:
            self._tasks.append(asyncio.ensure_future(self._reap(self.exit_grace_s if exiting else 0.0)))
        self._on_dead(self, reason)

    async def _reap(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for the process to exit, then kill it; reap it either way."""
        assert self.proc is not None
        try:
            await asyncio.wait_for(self.proc.wait(), grace_s)
        except asyncio.TimeoutError:
            self._kill()
            await self.proc.wait()

    def _kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        reason, exiting = "connection_lost", True  # EOF: the worker closed it, i.e. it is exiting
        try:
            while True:
                frame = await read_frame(reader)
                if frame is None:
                    break
                self._num_frames += 1
                header = frame[0]
                if header["type"] == "pong":
                    self._on_pong(header)
                else:
                    self._on_frame(self, header)
        except (WireError, OSError) as exc:
            reason, exiting = f"connection_lost ({exc!r})", False
        self.declare_dead(reason, exiting=exiting)

    def _on_pong(self, h: dict[str, Any]) -> None:
        now = time.monotonic_ns()
        self._last_pong_ns = now
        self.stats = h.get("stats") or self.stats
        if self._on_clock is not None and isinstance(h.get("t_send_ns"), int):
            self._on_clock(ClockSample(self.name, h["t_send_ns"], h["recv_ns"], h["send_ns"], now))

    async def _heartbeat(self) -> None:
        """Ping every interval; dead after ``heartbeat_timeout_s`` of silence counted in ticks
        (each at most two intervals long: time this process did not run is not the worker's)."""
        timeout_ns = int(self.heartbeat_timeout_s * 1e9)
        max_tick_ns = 2 * int(self.heartbeat_interval_s * 1e9)
        silent_ns = 0  # backend monotonic clock, ns: silence of the worker while this loop ran
        seen = self._num_frames
        last_tick_ns = time.monotonic_ns()
        while self.alive:
            self._ping_id += 1
            self.send({"type": "ping", "id": self._ping_id, "t_send_ns": time.monotonic_ns()})
            await asyncio.sleep(self.heartbeat_interval_s)
            now = time.monotonic_ns()
            tick_ns, last_tick_ns = now - last_tick_ns, now
            if self._num_frames != seen:  # it answered, or streamed: alive
                seen, silent_ns = self._num_frames, 0
                continue
            silent_ns += min(tick_ns, max_tick_ns)
            if silent_ns > timeout_ns:
                self.declare_dead("heartbeat_timeout")
                return

    async def _drain_stdout(self) -> None:
        """Keep reading the worker's stdout so a chatty worker never blocks on a full pipe."""
        stdout = self.proc.stdout if self.proc is not None else None
        while stdout is not None and await stdout.read(65536):
            pass
