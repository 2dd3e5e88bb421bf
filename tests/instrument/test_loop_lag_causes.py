"""Why a served loop ran late, planted three ways in a real traced server process (``late_loop_app.py``):
a CPU-bound callback on its loop, a thread of its process spinning in Python (the GIL), and busy
processes that starve it of CPU. The truth is the test's own construction: what it planted and when.
The rows' CPU times are checked in the raw Parquet, then the analyzer's split and the diagnosis.

A starved host shows in every scenario on a shared machine: each share is of wall time, and a
spinning thread gets only its part of a busy CPU (at load 10 on 2 cores, a quarter of it). So the
planted work is CPU time (the spins count their thread's CPU), and the bounds compare the causes:
the planted one holds at least a twentieth of the late time and several times the wrong "server's code"
reading; only the starved host, planted at the lowest priority, must hold most of it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pyarrow.parquet as pq

from analyzers.diagnosis import Targets, diagnose
from analyzers.loop_lag import loop_lag
from analyzers.source import Source
from instrument.loop_lag import MAX_PERIOD_NS
from tokentrace.schema import LOOP_LAGS, col
from tokentrace.store import open_run

APP = Path(__file__).with_name("late_loop_app.py")
MS = 1_000_000
LOOP_CAUSES = ("event_loop_lag", "gil_contention", "cpu_starved")
SPIN_MS = MAX_PERIOD_NS / MS + 10  # CPU the blocking callback uses: longer than the sampler's longest period
SPINNER = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"


@contextmanager
def _server(store: Path, run: str, nice: int = 0) -> Iterator[str]:
    port_file = store.parent / f"{run}.port"
    proc = subprocess.Popen([sys.executable, str(APP), str(store), run, str(port_file), str(nice)])
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port_file.read_text()}"
    finally:
        proc.terminate()  # uvicorn shuts down; the store is flushed and closed
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _stream(url: str, key: str, num_tokens: int, gap_ms: float = 0) -> None:
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{url}/v1/completions", headers={"X-Request-Id": key},
                           json={"max_tokens": num_tokens, "gap_ms": gap_ms}) as resp:
            assert resp.status_code == 200
            for _ in resp.iter_lines():
                pass


def _plant(url: str, kind: str, ms: float) -> None:
    assert httpx.post(f"{url}/plant", json={"kind": kind, "ms": ms}, timeout=30).status_code == 200


def _scenario(tmp_path: Path, plant: Callable[[str], float | Callable[[], bool]], *,
              nice: int = 0) -> tuple[Source, int, int]:
    """Quick requests (a short gateway.accept for the run's median), then, with a long stream in flight so
    that the loop is sampled, ``plant`` (returns how long its disturbance lasts, s, or a function that says
    whether it still lasts) and probe requests sent while it lasts. Returns the run's source and the
    disturbance's bounds (monotonic ns)."""
    store = tmp_path / "store"
    with _server(store, "run", nice) as url:
        for i in range(6):
            _stream(url, f"quick-{i}", 2)
        background = threading.Thread(target=_stream, args=(url, "long", 50, 100), daemon=True)
        background.start()
        time.sleep(0.5)
        t0 = time.monotonic_ns()
        lasts = plant(url)
        if not callable(lasts):
            lasts = (lambda until: lambda: time.monotonic() < until)(time.monotonic() + lasts)
        probe = 0
        while probe == 0 or lasts():
            _stream(url, f"probe-{probe}", 2)
            probe += 1
        t1 = time.monotonic_ns()
        background.join(timeout=60)
    return Source.of_run(open_run(store / "run")), t0, t1


def _raw_rows(src_store: Path, t0: int, t1: int) -> list[dict]:
    rows = []
    for part in open_run(src_store).files(LOOP_LAGS.name):
        rows += pq.read_table(part).to_pylist()
    return [r for r in rows if t0 <= r[col.START_NS] and r[col.END_NS] <= t1 + 200 * MS]


def _checks(tmp_path: Path, src: Source, t0: int, t1: int) -> tuple[dict[str, float], dict[str, float]]:
    """From the raw Parquet: the planted stretch's late rows, their loop and other-thread CPU as shares of
    their windows (time-weighted). From the diagnosis: ms per loop cause over the probe requests."""
    rows = _raw_rows(tmp_path / "store" / "run", t0, t1)
    assert rows, "no late tick recorded while the loop was disturbed"
    assert all(r[col.ARMED_NS] is not None and r[col.ARMED_NS] <= r[col.START_NS] for r in rows)
    window = sum(r[col.END_NS] - r[col.ARMED_NS] for r in rows)
    raw = {"loop": sum(r[col.LOOP_CPU_NS] for r in rows) / window,
           "others": sum(r[col.PROCESS_CPU_NS] - r[col.LOOP_CPU_NS] for r in rows) / window}
    d = diagnose(src, targets=Targets(ttft_ms=1.0))
    probes = d.causes[d.causes[col.REQUEST_KEY].str.startswith("probe-") & d.causes["cause"].isin(LOOP_CAUSES)]
    named = {cause: float(probes.loc[probes["cause"] == cause, "ms"].sum()) for cause in LOOP_CAUSES}
    assert sum(named.values()) > 0, d.causes[[col.REQUEST_KEY, "cause", "ms", "evidence"]].to_string()
    shares = {k: v / sum(named.values()) for k, v in named.items()}
    print(f"{len(rows)} late rows, CPU shares of their windows {raw}; diagnosis shares of the probes' loop time {shares}")
    return raw, shares


def test_a_cpu_bound_callback_on_the_loop_is_blocking(tmp_path):
    def plant(url: str) -> float:
        _plant(url, "blocking", SPIN_MS)
        return 0.1  # probes sent while it spins wait for it

    src, t0, t1 = _scenario(tmp_path, plant)
    raw, named = _checks(tmp_path, src, t0, t1)
    # The tick pending when the spin began was armed before it (the loop arms its ticks itself) and is due
    # at most the longest period later, before the spin ends: it ran late after the spin, and its row's
    # loop CPU holds all of the spin's.
    rows = _raw_rows(tmp_path / "store" / "run", t0, t1)
    assert max(r[col.LOOP_CPU_NS] for r in rows) >= SPIN_MS * MS, rows
    assert raw["loop"] >= 3 * raw["others"], raw
    (inst,) = loop_lag(src).instances.to_dict("records")
    assert inst["blocking_ms"] > 0 and inst["unsplit_ms"] == 0
    assert named["event_loop_lag"] >= 0.05 and named["gil_contention"] <= named["event_loop_lag"] / 5, named


def test_a_thread_holding_the_gil_is_other_threads(tmp_path):
    def plant(url: str) -> Callable[[], bool]:
        _plant(url, "gil", 1000)
        # Probes until the spin has used its CPU: on a busy host that takes several times its CPU in wall
        # time, and probes sent only in its first second meet a loop late mostly for the host's other work.
        return lambda: httpx.get(f"{url}/spinning", timeout=30).json()["spinning"]

    src, t0, t1 = _scenario(tmp_path, plant)
    raw, named = _checks(tmp_path, src, t0, t1)
    assert raw["others"] >= 0.05 and raw["others"] >= 3 * raw["loop"], raw
    assert named["gil_contention"] >= 0.05 and named["event_loop_lag"] <= named["gil_contention"] / 3, named


def test_busy_processes_starving_the_host_are_starved(tmp_path):
    spinners: list[subprocess.Popen] = []

    def plant(url: str) -> float:
        spinners.extend(subprocess.Popen([sys.executable, "-c", SPINNER.format(s=4.0)]) for _ in range(4))
        return 3.5

    try:
        src, t0, t1 = _scenario(tmp_path, plant, nice=19)  # the server yields its CPU to the spinners
    finally:
        for p in spinners:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    raw, named = _checks(tmp_path, src, t0, t1)
    assert raw["loop"] <= 0.2 and raw["others"] <= 0.2, raw
    assert named["cpu_starved"] >= 0.6 and named["event_loop_lag"] <= 0.2, named
