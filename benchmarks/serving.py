"""Disaggregated vs colocated serving: inter-token latency and goodput under a prefill-heavy load.

The same number of engine workers serves the same open-loop workload twice, each time
as a full stack started by the launcher (``python -m reference_server``) in a child
process: (a) ``--mode colocated --instances 2`` and (b) ``--mode disagg --prefill 1
--decode 1``. The workload is prefill heavy and mixed: half the requests carry a long
prompt (``LONG_PROMPT`` tokens), half a short one, all ask for ``OUTPUT_TOKENS`` greedy
tokens; arrivals are Poisson at ``RATE`` requests/s (seeded, identical in both runs).

A client in this process (httpx, streaming ``/v1/completions`` over loopback) stamps
``time.monotonic_ns()`` when it sends a request and when each token chunk arrives. From
those: TTFT (first chunk - send), ITL (gaps between consecutive chunks of one request),
TPOT ((last - first) / (n - 1)), and goodput = requests per second that met the SLO
(TTFT <= ``SLO_TTFT_S`` and TPOT <= ``SLO_TPOT_S``). In colocated serving a long prompt's
prefill chunk shares engine steps with other requests' decodes, so their inter-token gaps
stretch to a prefill step; a decode-only worker never runs a prefill.

Workers run one torch thread each (``OMP_NUM_THREADS=1``), so both layouts use the same
compute. Baseline: the colocated run. Last line: ``disagg_vs_colocated_itl_p99=<ratio>``
(disagg ITL p99 / colocated ITL p99; below 1 means disaggregation helps).

Run: ``.venv/bin/python benchmarks/serving.py [--requests 30] [--rate 1.0] [--model small]``
(about 2-3 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
LONG_PROMPT = 480  # characters = byte tokens (+1 bos) of a long prompt
SHORT_PROMPT = 24
OUTPUT_TOKENS = 32
SLO_TTFT_S = 3.0
SLO_TPOT_S = 0.15


@dataclass
class Result:
    send_ns: int
    chunk_ns: list[int] = field(default_factory=list)  # client monotonic clock, one per token chunk
    error: str | None = None

    @property
    def ttft_s(self) -> float:
        return (self.chunk_ns[0] - self.send_ns) / 1e9

    @property
    def tpot_s(self) -> float:
        n = len(self.chunk_ns)
        return (self.chunk_ns[-1] - self.chunk_ns[0]) / 1e9 / (n - 1) if n > 1 else 0.0

    @property
    def itls_s(self) -> list[float]:
        return [(b - a) / 1e9 for a, b in zip(self.chunk_ns, self.chunk_ns[1:])]


def workload(n: int, rate: float, seed: int) -> list[tuple[float, str]]:
    """(arrival offset s, prompt) per request: alternating long and short, Poisson arrivals."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        length = LONG_PROMPT if i % 2 == 0 else SHORT_PROMPT
        prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(length))
        out.append((t, prompt))
        t += rng.expovariate(rate)
    return out


def start_stack(mode_args: list[str], model: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "reference_server", "--port", "0", "--model", model, "--block-size", "16",
           "--num-device-blocks", "1024", "--router", "load", *mode_args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return proc, line.split()[1]


def stop_stack(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}
    res = Result(time.monotonic_ns())
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"http {resp.status_code}"
                return res
            async for line in resp.aiter_lines():
                if line.startswith("data: {") and '"choices":[{' in line.replace(" ", ""):
                    res.chunk_ns.append(time.monotonic_ns())
    except httpx.HTTPError as exc:
        res.error = repr(exc)
    if len(res.chunk_ns) != OUTPUT_TOKENS and res.error is None:
        res.error = f"{len(res.chunk_ns)} chunks"
    return res


async def run_load(url: str, model: str, reqs: list[tuple[float, str]]) -> tuple[list[Result], float]:
    limits = httpx.Limits(max_connections=len(reqs) + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        for _ in range(2):  # warm-up (first-step allocations), not measured
            await one_request(client, url, model, "warm up " * 8)
        start = time.monotonic()

        async def fire(offset: float, prompt: str) -> Result:
            await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
            return await one_request(client, url, model, prompt)

        results = await asyncio.gather(*(fire(o, p) for o, p in reqs))
        return list(results), time.monotonic() - start


def summarize(name: str, results: list[Result], duration_s: float) -> dict[str, float]:
    ok = [r for r in results if r.error is None]
    itls = np.array([x for r in ok for x in r.itls_s])
    ttfts = np.array([r.ttft_s for r in ok])
    good = [r for r in ok if r.ttft_s <= SLO_TTFT_S and r.tpot_s <= SLO_TPOT_S]
    s = {
        "ok": len(ok), "failed": len(results) - len(ok),
        "ttft_p50_ms": 1e3 * float(np.percentile(ttfts, 50)), "ttft_p99_ms": 1e3 * float(np.percentile(ttfts, 99)),
        "itl_p50_ms": 1e3 * float(np.percentile(itls, 50)), "itl_p99_ms": 1e3 * float(np.percentile(itls, 99)),
        "tpot_mean_ms": 1e3 * float(np.mean([r.tpot_s for r in ok])),
        "goodput_rps": len(good) / duration_s, "slo_attainment": len(good) / len(results),
        "throughput_tok_s": sum(len(r.chunk_ns) for r in ok) / duration_s,
    }
    print(f"{name:>10}: " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in s.items()),
          flush=True)
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--rate", type=float, default=1.0, help="Poisson arrival rate, requests/s")
    ap.add_argument("--model", default="small")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import torch
    print(f"machine: {platform.node()} {platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()} "
          f"python={platform.python_version()} torch={torch.__version__} cuda={torch.cuda.is_available()}")
    print(f"workload: {args.requests} requests, Poisson {args.rate}/s, prompts {LONG_PROMPT}/{SHORT_PROMPT} "
          f"tokens alternating, {OUTPUT_TOKENS} output tokens, model {args.model}; "
          f"SLO ttft<={SLO_TTFT_S}s tpot<={SLO_TPOT_S * 1e3:.0f}ms")
    reqs = workload(args.requests, args.rate, args.seed)
    summaries = {}
    for name, mode_args in (("colocated", ["--mode", "colocated", "--instances", "2"]),
                            ("disagg", ["--mode", "disagg", "--prefill", "1", "--decode", "1"])):
        proc, url = start_stack(mode_args, args.model)
        try:
            results, duration = asyncio.run(run_load(url, args.model, reqs))
        finally:
            stop_stack(proc)
        summaries[name] = summarize(name, results, duration)
    c, d = summaries["colocated"], summaries["disagg"]
    goodput = f"{d['goodput_rps'] / c['goodput_rps']:.3f}" if c["goodput_rps"] > 0 else "inf (colocated met no SLO)"
    print(f"ratios (disagg / colocated): itl_p99={d['itl_p99_ms'] / c['itl_p99_ms']:.3f} "
          f"ttft_p99={d['ttft_p99_ms'] / c['ttft_p99_ms']:.3f} goodput={goodput}")
    print(f"disagg_vs_colocated_itl_p99={d['itl_p99_ms'] / c['itl_p99_ms']:.3f}")


if __name__ == "__main__":
    main()
