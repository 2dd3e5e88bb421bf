"""How long the speculative-decoding analyses take, against the stage breakdown of the same run.

Writes a synthetic speculating run (``tests/dashboard/speculative_store.py``: one engine, speculative and plain
steps, mixed batches) of ``--requests`` requests to a temporary store, then times, each on a fresh
``run.analyze()`` after the shared token facts are built, ``speculation()`` (every table of its report) and
``stage_breakdown()``. Prints the rows, both wall times, and last ``speculation_vs_breakdown=<x>`` (how many
times the breakdown's time the speculative analyses take).

    .venv/bin/python benchmarks/speculative_analysis.py --requests 2000
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "dashboard"))

from speculative_store import write_speculative_run  # noqa: E402

import tokentrace  # noqa: E402
from analyzers.timing import token_steps, token_times  # noqa: E402


def _timed(analysis, call) -> float:
    token_times(analysis.source)  # the shared facts every analysis reuses: built before the clock starts
    token_steps(analysis.source)
    start = time.perf_counter()
    call(analysis)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=3, help="best of this many runs of each")
    args = p.parse_args()
    if args.requests < 1 or args.repeat < 1:
        p.error("--requests and --repeat must be at least 1")
    root = Path(tempfile.mkdtemp(prefix="tt-spec-bench-"))
    try:
        start = time.perf_counter()
        write_speculative_run(root, "bench", num_requests=args.requests, seed=1)
        run = tokentrace.open(root)
        print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
              f"load average {os.getloadavg()[0]:.1f}")
        print(f"run: {args.requests} requests, {run.num_rows('tokens'):,} tokens, {run.num_rows('spans'):,} spans, "
              f"{run.num_rows('spec_steps'):,} spec_steps rows (written in {time.perf_counter() - start:.1f} s)")
        spec = min(_timed(run.analyze(), lambda a: a.speculation()) for _ in range(args.repeat))
        breakdown = min(_timed(run.analyze(), lambda a: a.stage_breakdown()) for _ in range(args.repeat))
        print(f"speculation(): {spec:.3f} s; stage_breakdown(): {breakdown:.3f} s (best of {args.repeat})")
        print(f"speculation_vs_breakdown={spec / breakdown:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
