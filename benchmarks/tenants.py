"""Benchmark: the tenant analyses and the report against the number of tenants (100 to 10 000).

For each tenant count in ``--tenants`` (default ``100,1000,5000,10000``) a run is generated in the
store's own layout by the store's own writer: ``--requests-per-tenant`` requests per tenant (default
2; at least ``--min-requests``, default 10 000) from one colocated engine, tenants drawn with a Zipf-like
skew (a few heavy tenants, a long tail of light ones, as a deployment with thousands of API keys has),
Poisson arrivals over ``--duration`` seconds, 4 output tokens each, the heaviest tenant bursting (ten times
its rate) in a tenth of the run while every request arriving then waits 30 ms longer. Then, each timed:

* ``tenants``: :meth:`RunAnalysis.tenants` (latency, shares and Jain's index per tenant);
* ``noisy_neighbours``: :meth:`RunAnalysis.noisy_neighbours` (the ranked aggressor x victim pairs it tests,
  their number printed);
* ``report``: ``tokentrace report STORE --format md,html,json`` as a user runs it (a child process, so the
  time includes start-up and rendering).

Stores are written under ``--dir`` (default: a temporary folder) and removed afterwards.
Run: ``.venv/bin/python benchmarks/tenants.py`` (about two minutes on two busy cores);
``--tenants 100,5000`` for a shorter one. Prints one line per tenant count (seconds of each step), says what
machine it ran on (with its load average: on a shared machine the wall time of a step grows with the
load, its CPU time, printed for the report, much less), and ends with
``report_seconds_at_<largest count>_tenants=<seconds>`` (wall time).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tokentrace.schema import INSTANCES, REQUESTS, SPANS, TOKENS, RequestStatus, Role, Stage, col  # noqa: E402
from tokentrace.store.writer import StoreWriter  # noqa: E402

MS = 1_000_000  # ns
ENGINE_ID = 7
NUM_TOKENS = 4  # output tokens per request
BURST_SHARE = 0.1  # share of the run in which the heaviest tenant bursts
BURST_DELAY_NS = 30 * MS  # extra wait of every request arriving during a burst


def _table(t, columns: dict) -> pa.Table:
    num = len(next(iter(columns.values())))
    return pa.table({c.name: (pa.array(columns[c.name], type=c.type) if c.name in columns
                              else pa.nulls(num, c.type)) for c in t.columns})


def generate(store: Path, run_id: str, *, num_tenants: int, num_requests: int, duration_s: float,
             seed: int = 0) -> None:
    """One run of ``num_requests`` requests from ``num_tenants`` tenants (module doc); deterministic for a seed."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, num_tenants + 1) ** 0.8  # Zipf-like: tenant 0 heaviest
    tenant = rng.choice(num_tenants, size=num_requests, p=weights / weights.sum())
    span_ns = int(duration_s * 1e9)
    arrival = rng.integers(0, span_ns, num_requests)
    burst_lo, burst_hi = int(span_ns * 0.45), int(span_ns * (0.45 + BURST_SHARE))
    extra = int(0.5 * num_requests * BURST_SHARE)  # the burst: tenant 0's requests packed into the window
    if extra + num_tenants > num_requests:
        raise ValueError(f"{num_requests} requests are too few for {num_tenants} tenants and a burst of {extra}")
    arrival[:extra] = rng.integers(burst_lo, burst_hi, extra)
    tenant[:extra] = 0
    tenant[extra:extra + num_tenants] = np.arange(num_tenants)  # every tenant has at least one request
    order = np.argsort(arrival, kind="stable")
    arrival, tenant = arrival[order], tenant[order]
    in_burst = (arrival >= burst_lo) & (arrival < burst_hi)
    queue = (rng.exponential(5 * MS, num_requests) + np.where(in_burst, BURST_DELAY_NS, 0)).astype(np.int64)
    prefill = rng.integers(5 * MS, 15 * MS, num_requests)
    first = arrival + queue + prefill
    itl = rng.integers(2 * MS, 6 * MS, (num_requests, NUM_TOKENS - 1))
    emit = np.concatenate([first[:, None], first[:, None] + np.cumsum(itl, axis=1)], axis=1)  # (R, NUM_TOKENS)
    rid = np.arange(1, num_requests + 1, dtype=np.int64)
    names = np.char.add("tenant-", tenant.astype(str)).astype(object)
    writer = StoreWriter(store, run_id=run_id, config={"benchmark": "tenants", "num_tenants": num_tenants})
    try:
        writer.write(INSTANCES, _table(INSTANCES, {
            col.INSTANCE_ID: [ENGINE_ID], col.ROLE: [int(Role.COLOCATED)], col.NAME: ["engine-0"],
            col.HOST: [platform.node()], col.PID: [os.getpid()], col.MONO_ANCHOR_NS: [0], col.WALL_ANCHOR_NS: [0],
            col.CLOCK_OFFSET_NS: [0]}))
        writer.write(REQUESTS, _table(REQUESTS, {
            col.REQUEST_ID: rid, col.REQUEST_KEY: np.char.add("req-", rid.astype(str)).astype(object),
            col.INSTANCE_ID: np.full(num_requests, ENGINE_ID), col.TENANT: names,
            col.SLO_CLASS: np.full(num_requests, "interactive", dtype=object), col.ARRIVAL_NS: arrival,
            col.FIRST_TOKEN_NS: first, col.FINISH_NS: emit[:, -1], col.NUM_PROMPT_TOKENS: np.full(num_requests, 64),
            col.NUM_CACHED_TOKENS: np.zeros(num_requests, np.int64), col.NUM_OUTPUT_TOKENS: np.full(num_requests,
                                                                                                   NUM_TOKENS),
            col.STATUS: np.full(num_requests, int(RequestStatus.OK), np.int8),
            col.ERROR: np.full(num_requests, "", dtype=object), col.TRACE_ID: np.full(num_requests, "", dtype=object)}))
        writer.write(TOKENS, _table(TOKENS, {
            col.REQUEST_ID: np.repeat(rid, NUM_TOKENS), col.TOKEN_INDEX: np.tile(np.arange(NUM_TOKENS), num_requests),
            col.EMIT_NS: emit.ravel(), col.STEP: np.full(num_requests * NUM_TOKENS, -1),
            col.INSTANCE_ID: np.full(num_requests * NUM_TOKENS, ENGINE_ID)}))
        starts = np.concatenate([arrival, arrival + queue])
        writer.write(SPANS, _table(SPANS, {
            col.REQUEST_ID: np.concatenate([rid, rid]),
            col.STAGE: np.repeat([int(Stage.SCHEDULE_QUEUE), int(Stage.PREFILL_COMPUTE)], num_requests),
            col.TOKEN_INDEX: np.zeros(2 * num_requests, np.int32), col.START_NS: starts,
            col.END_NS: np.concatenate([arrival + queue, first]), col.INSTANCE_ID: np.full(2 * num_requests, ENGINE_ID),
            col.STEP: np.full(2 * num_requests, -1)}))
    finally:
        writer.close()


def _timed(fn) -> tuple[float, object]:
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


def measure(store: Path) -> dict[str, float]:
    import tokentrace

    analysis = tokentrace.open(store).analyze()
    t_tenants, _ = _timed(analysis.tenants)
    t_noisy, pairs = _timed(analysis.noisy_neighbours)
    out_dir = store / "_report"
    started, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "tokentrace.app.cli", "report", str(store), "--format", "md,html,json",
                           "--out", str(out_dir)], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    t_report = time.perf_counter() - started
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_report = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"tokentrace report failed ({proc.returncode}): {proc.stderr.strip()}")
    return {"tenants_s": t_tenants, "noisy_neighbours_s": t_noisy, "pairs_tested": float(len(pairs)),
            "report_s": t_report, "report_cpu_s": cpu_report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tenants", default="100,1000,5000,10000", help="Comma-separated tenant counts.")
    parser.add_argument("--requests-per-tenant", type=float, default=2.0)
    parser.add_argument("--min-requests", type=int, default=10_000)
    parser.add_argument("--duration", type=float, default=600.0, help="Seconds of arrivals in each run.")
    parser.add_argument("--dir", type=Path, default=None, help="Where to write the stores (default: a temp folder).")
    args = parser.parse_args()
    counts = [int(x) for x in args.tenants.split(",") if x.strip()]
    if not counts or min(counts) < 2:
        parser.error("--tenants needs counts of at least 2")
    base = Path(tempfile.mkdtemp(prefix="tenants-bench-", dir=args.dir))
    print(f"machine: {platform.node()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
          f"python {platform.python_version()}")
    results = {}
    try:
        for num_tenants in counts:
            store = base / f"t{num_tenants}"
            num_requests = max(args.min_requests, int(args.requests_per_tenant * num_tenants))
            t_gen, _ = _timed(lambda: generate(store, "run", num_tenants=num_tenants, num_requests=num_requests,
                                               duration_s=args.duration))
            r = measure(store)
            results[num_tenants] = r
            print(f"tenants={num_tenants:>6} requests={num_requests:>7}  generate {t_gen:6.2f} s  "
                  f"tenants() {r['tenants_s']:6.2f} s  noisy_neighbours() {r['noisy_neighbours_s']:6.2f} s "
                  f"({int(r['pairs_tested'])} pairs tested)  report {r['report_s']:6.2f} s "
                  f"({r['report_cpu_s']:.2f} s of CPU)", flush=True)
            shutil.rmtree(store, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    largest = max(results)
    print(f"report_seconds_at_{largest}_tenants={results[largest]['report_s']:.2f}")


if __name__ == "__main__":
    main()
