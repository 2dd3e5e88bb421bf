"""Tracing overhead on the reference server: full token-level tracing vs none, interleaved A/B.

One process serves the reference gateway app with an in-process engine
(``LocalBackend``) on uvicorn; a client on another thread keeps ``--concurrency``
streaming completions in flight. Rounds alternate bare / traced (``tokentrace.instrument(app,
store=...)`` attached before the round, closed - flushed and detached - after it), so slow
drift of a shared machine hits both arms alike. Per round: output tokens per second of
wall time and the client-side inter-token latency p50 (median over requests of each
request's mean time between SSE chunks).

Prints one line per round, the medians per arm, the share of the process's CPU time the
recorder's flush thread took in traced rounds (CPU time, not wall time: it does not move with
the load of a shared machine, so it isolates what the flush and the crash journal cost), the
machine, and last::

    instrumented_vs_bare_throughput=<median over rounds of traced tokens/s / bare tokens/s>

Target: >= 0.98 (at most 2% overhead). Run: ``python benchmarks/overhead.py [--model tiny]
[--flush-interval-s 1] [--journal-interval-s 0]`` (defaults: the ``small`` preset, a 5 s flush
period and a 0.25 s crash journal as ``tokentrace run`` uses; the ``tiny`` preset makes a token
so cheap (~0.4 ms on 2 CPU cores) that the tracer's ~10 us per token shows as ~3%).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import torch  # noqa: E402

import tokentrace  # noqa: E402
from reference_server.engine import EngineConfig  # noqa: E402
from reference_server.serving.backend import LocalBackend  # noqa: E402
from reference_server.serving.gateway import GatewayConfig, create_app  # noqa: E402
from reference_server.serving.gateway_server import serve_in_thread  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8, help="rounds per arm (interleaved)")
    p.add_argument("--requests", type=int, default=16, help="requests per round")
    p.add_argument("--concurrency", type=int, default=8, help="streams in flight")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--model", default="small", help="model preset (tiny, small)")
    p.add_argument("--flush-interval-s", type=float, default=5.0,
                   help="recorder flush period (tokentrace run's default; the recorder's own is 1 s)")
    p.add_argument("--journal-interval-s", type=float, default=0.25,
                   help="crash-journal period (tokentrace run's default); 0 turns the journal off")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    return p.parse_args(argv)


async def _one(client: httpx.AsyncClient, i: int, model: str, max_tokens: int, gaps: list[float]) -> int:
    body = {"model": model, "prompt": f"request {i}: " + "the quick brown fox " * 4, "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True, "temperature": 0}
    n, first, last = 0, 0.0, 0.0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                last = time.perf_counter()
                first = first or last
                n += 1
    if n > 1:  # mean gap of the request: chunks read in one burst make single gaps meaningless
        gaps.append((last - first) / (n - 1))
    return n


async def _round(url: str, args: argparse.Namespace) -> tuple[float, float]:
    """(output tokens per second, client ITL p50 in ms) of one round."""
    gaps: list[float] = []
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async def guarded(i: int) -> int:
            async with sem:
                return await _one(client, i, args.model, args.max_tokens, gaps)

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(guarded(i) for i in range(args.requests)))
        wall = time.perf_counter() - t0
    return sum(counts) / wall, statistics.median(gaps) * 1e3


def _flush_thread_clock() -> int | None:
    """The CPU-time clock of the recorder's flush thread (Linux), or None."""
    thread = next((t for t in threading.enumerate() if t.name == "tokentrace-flush"), None)
    if thread is None or thread.ident is None or not hasattr(time, "pthread_getcpuclockid"):
        return None
    return time.pthread_getcpuclockid(thread.ident)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = EngineConfig(model=args.model, device=args.device, block_size=16, num_device_blocks=1024,
                       max_num_seqs=64, max_num_batched_tokens=2048)
    app = create_app(LocalBackend(cfg), config=GatewayConfig())
    results: dict[str, list[tuple[float, float]]] = {"bare": [], "traced": []}
    flush_cpu_s = process_cpu_s = 0.0  # traced rounds: the flush thread's CPU time, the whole process's
    with tempfile.TemporaryDirectory() as store, serve_in_thread(app) as server:
        asyncio.run(_round(server.url, args))  # warm-up: model, allocator, connections
        for r in range(args.rounds):
            for arm in (("bare", "traced") if r % 2 == 0 else ("traced", "bare")):
                journal = args.journal_interval_s or None
                handle = (tokentrace.instrument(app, store=store, run=f"ab-{r}", flush_interval_s=args.flush_interval_s,
                                                journal_interval_s=journal)
                          if arm == "traced" else None)
                clock = _flush_thread_clock() if handle is not None else None
                cpu0 = (time.clock_gettime(clock) if clock is not None else 0.0, time.process_time())
                try:
                    tput, itl = asyncio.run(_round(server.url, args))
                finally:
                    if handle is not None:
                        if clock is not None:
                            flush_cpu_s += time.clock_gettime(clock) - cpu0[0]
                            process_cpu_s += time.process_time() - cpu0[1]
                        handle.close()
                        dropped = handle.counters["dropped"] + handle.counters["sink_errors"]
                        if dropped:
                            print(f"warning: traced round {r} lost {dropped} events", file=sys.stderr)
                results[arm].append((tput, itl))
                print(f"round {r} {arm:6s} tokens/s={tput:9.1f} itl_p50_ms={itl:7.3f}")
    med = {arm: (statistics.median(t for t, _ in v), statistics.median(i for _, i in v)) for arm, v in results.items()}
    for arm, (tput, itl) in med.items():
        print(f"{arm:6s} median tokens/s={tput:9.1f} itl_p50_ms={itl:7.3f}")
    # Each round's traced/bare pair ran back to back: the median of the pair ratios cancels
    # the slow drift of a shared machine better than a ratio of medians.
    pairs = list(zip(results["traced"], results["bare"]))
    tput_ratio = statistics.median(t / b for (t, _), (b, _) in pairs)
    itl_ratio = statistics.median(t / b for (_, t), (_, b) in pairs)
    if process_cpu_s:
        print(f"flush thread CPU in traced rounds: {flush_cpu_s * 1e3:.0f} ms of {process_cpu_s:.1f} s "
              f"({100 * flush_cpu_s / process_cpu_s:.2f}% of the process)")
    device = torch.cuda.get_device_name() if args.device == "cuda" and torch.cuda.is_available() else "cpu"
    print(f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, {device}, python "
          f"{platform.python_version()}, torch {torch.__version__}, model {args.model}, "
          f"concurrency {args.concurrency}, {args.rounds} rounds per arm, flush every {args.flush_interval_s} s, "
          f"journal every {args.journal_interval_s or 'never'} s")
    print(f"instrumented_vs_bare_itl_p50={itl_ratio:.4f}")
    print(f"instrumented_vs_bare_throughput={tput_ratio:.4f}")


if __name__ == "__main__":
    main()
