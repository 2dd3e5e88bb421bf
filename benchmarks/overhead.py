"""Tracing overhead on the reference server: full token-level tracing vs none, interleaved A/B.

One process serves the reference gateway app with an in-process engine
(``LocalBackend``) on uvicorn; a client on another thread keeps ``--concurrency``
streaming completions in flight. Rounds alternate bare / traced (``tokentrace.instrument(app,
store=...)`` attached before the round, closed - flushed and detached - after it), so slow
drift of a shared machine hits both arms alike. Per round: output tokens per second of
wall time and the client-side inter-token latency p50 (median over requests of each
request's mean time between SSE chunks).

Output tokens are counted as generated (``max_tokens`` per stream that ended by length), not as
SSE chunks. Each arm's output tokens per engine step are printed too: with the ``tiny`` model a step
costs about the same whatever its batch, so an arm whose streams were batched less well spends more
CPU per token for that reason alone, apart from the tracer's own work. Each arm's CPU time per output token is also printed by thread (the client, the server's
event loop, the engine loop, the recorder's threads): the tracer's cost in the loop and the engine
shows apart from the client's and the model's noise. Each arm's event-loop wake-ups per output token are
printed too (voluntary context switches of the loop's thread: a count, which the load of a shared machine
barely moves): each wake-up costs the loop a whole iteration (tens of microseconds of CPU on a quiet
machine, over 100 on a loaded one). With the ``small`` preset a decode step takes longer than the loop-lag
sampler's 10 ms base period; its tick follows the loop's own writes and their rhythm
(``instrument.loop_lag``), so it should not wake a loop that waits for the next step: traced wake-ups
per token near the bare figure say it does not.

With ``--features``, every round also runs tracing without each optional feature (the crash
journal, the loop-lag sampler, kernel receive timestamps) and with live metrics, and the cost of
each feature is printed (the median over rounds of the throughput it takes, with the per-round
spread, and in microseconds of the process's CPU time per output token), so a regression names its
cause. ``bare`` rounds run with uvicorn's protocols unpatched. CPU time per token moves far less than
throughput when other jobs share the machine (its per-round spread says how much): on a busy machine
it is the figure to read, and the throughput ratio needs a quiet one.

Before the last two lines it prints the reference tracers' own CPU per output token on a replayed
decode (no server: the engine's and the gateway's per-token events built and handed to their tracers,
the least of 40 replays), the direct cost that the rounds' CPU figures hold among the noise of a
shared machine's caches, batching and thread switches.

Prints one line per round, the medians per arm, the share of the process's CPU time each of the
recorder's background threads took in traced rounds, the flush thread (parts) and the journal
thread (the crash journal) apart (CPU time, not wall time: it does not move with the load of a
shared machine, so it isolates what the flush and the crash journal cost), the gateway's loop-lag
sampler's ticks in traced rounds beside the times a traced write moved the pending tick on (the loop
was working: no tick ran, ``instrument.loop_lag``), the machine, and last::

    instrumented_vs_bare_throughput=<median over rounds of traced tokens/s / bare tokens/s>

Target: >= 0.98 (at most 2% overhead). Run: ``python benchmarks/overhead.py [--model tiny]
[--flush-interval-s 1] [--journal-interval-s 0]`` (defaults: the ``small`` preset, a 5 s flush
period and a 0.25 s crash journal as ``tokentrace run`` uses; the ``tiny`` preset makes a token
so cheap (~0.4 ms on 2 CPU cores) that the tracer's ~10 us per token shows as ~3%).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import torch  # noqa: E402

import tokentrace  # noqa: E402
import tokentrace.session as tokentrace_session  # noqa: E402
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
    p.add_argument("--features", action="store_true",
                   help="also run traced without each optional feature (and with live metrics): each one's cost")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    return p.parse_args(argv)


async def _one(client: httpx.AsyncClient, i: int, model: str, max_tokens: int, gaps: list[float]) -> int:
    """Stream one completion; its output tokens: ``max_tokens`` when it ended by length (``ignore_eos``:
    it generated exactly that many), else its token chunks. A chunk may carry several tokens (the
    detokenizer holds a partial UTF-8 character back), so chunks alone undercount."""
    body = {"model": model, "prompt": f"request {i}: " + "the quick brown fox " * 4, "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True, "temperature": 0}
    n, first, last = 0, 0.0, 0.0
    by_length = False
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                last = time.perf_counter()
                first = first or last
                n += 1
                by_length = by_length or '"finish_reason":"length"' in line
    if n > 1:  # mean gap of the request: chunks read in one burst make single gaps meaningless
        gaps.append((last - first) / (n - 1))
    return max_tokens if by_length else n


async def _round(url: str, args: argparse.Namespace) -> tuple[float, float, int]:
    """(output tokens per second, client ITL p50 in ms, output tokens) of one round."""
    gaps: list[float] = []
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async def guarded(i: int) -> int:
            async with sem:
                return await _one(client, i, args.model, args.max_tokens, gaps)

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(guarded(i) for i in range(args.requests)))
        wall = time.perf_counter() - t0
    return sum(counts) / wall, statistics.median(gaps) * 1e3, sum(counts)


THREAD_GROUPS = ("client", "loop", "engine", "recorder")
"""Where the process's CPU time goes, by thread: the benchmark's client (the main thread), the server's
event loop (uvicorn: the gateway, its tracer and middleware), the engine loop (the engine and its
tracer), the recorder's background threads (flush and journal)."""


def _thread_group(name: str) -> str | None:
    if name == "MainThread":
        return "client"
    if name.startswith("uvicorn"):
        return "loop"
    if name == "engine-loop":
        return "engine"
    if name.startswith("tokentrace-"):
        return "recorder"
    return None


def _thread_clocks() -> dict[int, tuple[str, int]]:
    """Thread id -> (group, CPU-time clock) of every thread in a group (Linux; empty elsewhere)."""
    if not hasattr(time, "pthread_getcpuclockid"):
        return {}
    out = {}
    for t in threading.enumerate():
        group = _thread_group(t.name)
        if group is not None and t.ident is not None:
            out[t.ident] = (group, time.pthread_getcpuclockid(t.ident))
    return out


def _read_clocks(clocks: dict[int, tuple[str, int]]) -> dict[int, float]:
    out = {}
    for ident, (_, clock) in clocks.items():
        try:
            out[ident] = time.clock_gettime(clock)
        except OSError:  # the thread ended
            pass
    return out


def _loop_wakeups() -> int:
    """Voluntary context switches of the server's event-loop thread so far (Linux; 0 elsewhere): one each
    time the loop sleeps in ``epoll_wait`` (or waits for the GIL) and wakes up again. A count, not a time,
    so the load of a shared machine barely moves it per output token: a traced arm that wakes the loop more
    often (the loop-lag sampler's ticks on an otherwise waiting loop) shows it here, apart from the noise of
    the CPU times."""
    total = 0
    for t in threading.enumerate():
        if _thread_group(t.name) != "loop" or t.native_id is None:
            continue
        try:
            with open(f"/proc/self/task/{t.native_id}/status") as status:
                for line in status:
                    if line.startswith("voluntary_ctxt_switches:"):
                        total += int(line.split()[1])
        except OSError:  # not Linux, or the thread ended
            pass
    return total


RECORDER_THREADS = ("tokentrace-flush", "tokentrace-journal")
"""The recorder's background threads: parts (flush) and the crash journal (a tree from before the
journal thread has the flush thread only)."""


def _recorder_thread_clocks() -> dict[str, int]:
    """The CPU-time clock of each of the recorder's background threads running now (Linux)."""
    if not hasattr(time, "pthread_getcpuclockid"):
        return {}
    return {t.name: time.pthread_getcpuclockid(t.ident) for t in threading.enumerate()
            if t.name in RECORDER_THREADS and t.ident is not None}


ARMS = ("bare", "traced", "no-journal", "no-loop-lag", "no-kernel-ts", "live-metrics")
"""Each round runs every arm once, in an order rotated by the round (drift hits every arm alike):

* ``bare``: no tracing, and uvicorn's protocols unpatched (a traced round patches them for the process);
* ``traced``: tracing as ``tokentrace run`` sets it up (crash journal, loop-lag sampler, kernel receive
  timestamps; no live metrics);
* ``no-journal``, ``no-loop-lag``, ``no-kernel-ts``: ``traced`` without that one feature;
* ``live-metrics``: ``traced`` plus live Prometheus metrics (``metrics_port=0``).
"""
FEATURES = (("journal", "no-journal", "traced"), ("loop-lag sampler", "no-loop-lag", "traced"),
            ("kernel timestamps", "no-kernel-ts", "traced"), ("live metrics", "traced", "live-metrics"))
"""(feature, arm without it, arm with it): its cost is the throughput the feature takes."""


@contextlib.contextmanager
def _arm_settings(arm: str) -> Iterator[None]:
    """The process-wide switches of one arm, restored after it."""
    try:  # (a tree from before the loop-lag sampler and transport timing has neither: nothing to switch)
        from instrument import transport
        from instrument.loop_lag import LoopLagSampler
    except ImportError:
        yield
        return
    ensure_running = LoopLagSampler.ensure_running
    if arm == "no-loop-lag":
        LoopLagSampler.ensure_running = lambda self: None  # type: ignore[method-assign]
    if arm in ("bare", "no-kernel-ts"):
        _unpatch_transport(transport)
    try:
        yield
    finally:
        LoopLagSampler.ensure_running = ensure_running  # type: ignore[method-assign]


def _unpatch_transport(transport: Any) -> None:
    """Undo :func:`instrument.transport.install` (uvicorn's protocol methods back as they were)."""
    with transport._lock:
        for cls in list(transport._patched):
            for name in ("data_received", "connection_made", "on_response_complete"):
                method = getattr(cls, name)
                if hasattr(method, "__wrapped__"):
                    setattr(cls, name, method.__wrapped__)
            transport._patched.discard(cls)


def _instrument(app: Any, arm: str, store: str, run: str, args: argparse.Namespace) -> Any:
    if arm == "bare":
        return None
    journal = None if arm == "no-journal" else (args.journal_interval_s or None)
    options: dict[str, Any] = {"metrics_port": 0} if arm == "live-metrics" else {}
    if "journal_interval_s" not in getattr(tokentrace_session, "RECORDER_OPTIONS", ()):
        return tokentrace.instrument(app, store=store, run=run, flush_interval_s=args.flush_interval_s, **options)

    if arm == "no-kernel-ts":
        from instrument import transport

        install = transport.install
        transport.install = lambda: False  # type: ignore[assignment]  # the instrument call must not re-patch
        try:
            return tokentrace.instrument(app, store=store, run=run, flush_interval_s=args.flush_interval_s,
                                         journal_interval_s=journal, **options)
        finally:
            transport.install = install  # type: ignore[assignment]
    return tokentrace.instrument(app, store=store, run=run, flush_interval_s=args.flush_interval_s,
                                 journal_interval_s=journal, **options)  # (a tree from before the journal: above)


def _count_ticks(app: Any, ticks: dict[str, int]) -> None:
    """Add the gateway's loop-lag sampler's counts of the round now ending (its tracer is new each round)."""
    for observer in app.state.gateway.hooks.observers:
        sampler = getattr(observer, "loop_lag", None)  # the reference gateway's tracer
        if sampler is not None and hasattr(sampler, "num_deferred"):  # (a tree from before the pokes: none)
            ticks["ticks"] += sampler.num_ticks
            ticks["late"] += sampler.num_late
            ticks["deferred"] += sampler.num_deferred


def _hot_path_us_per_token(num_seqs: int = 8, num_tokens: int = 32, repeats: int = 40) -> float:
    """The reference tracers' CPU per output token on a replayed decode: the engine's and the gateway's
    events of ``num_seqs`` streams of ``num_tokens`` tokens built and handed to an ``EngineTracer``
    and a ``GatewayTracer`` on one recorder, as a traced server does for every token (the events are
    built only when a tracer listens: their cost is tracing's). No server, no other thread: the
    least CPU time of ``repeats`` replays (this thread's clock), which the load of a shared machine
    moves little, unlike the rounds above. ``nan`` on a tree whose tracers differ."""
    try:
        from instrument.reference_cluster import ServingEngineTracer, TokenRelay
        from instrument.reference_gateway import GatewayTracer
        from reference_server.engine import hooks
        from reference_server.serving import gateway_hooks as gh
        from tokentrace.recorder import BufferedRecorder
        from tokentrace.recorder.untraced import NullSink  # the tracers' work, not the store's
    except ImportError:
        return float("nan")
    best = float("inf")
    for _ in range(repeats + 3):  # (the first replays warm up)
        rec = BufferedRecorder(NullSink(), instance_id=1, flush_interval_s=600, journal_interval_s=None)
        try:
            relay = TokenRelay()
            engine, gateway = ServingEngineTracer(rec, relay=relay), GatewayTracer(rec, relay=relay)
            t = 1_000_000_000
            keys = [f"cmpl-{i}" for i in range(num_seqs)]
            for key in keys:
                gateway.on_request_received(gh.RequestReceived(key, t, "/v1/completions", "default", None, None,
                                                               None))
                engine.on_request_added(hooks.RequestAdded(key, "default", "", t, t + 10, 20))
            cpu0 = time.thread_time_ns()
            for step in range(num_tokens):
                start = t
                for key in keys:
                    engine.on_request_scheduled(hooks.RequestScheduled(key, step, start, 20 + step, 1, False))
                for key in keys:
                    t += 1000
                    engine.on_token_emitted(hooks.TokenEmitted(key, step, step, 5, "x", t, t + 100))
                engine.on_step_end(hooks.StepEnd(step, start, start + 100, t - 500, t + 200,
                                                 tuple(hooks.BatchEntry(key, 0, 1) for key in keys),
                                                 0, num_seqs, 0, (10, 0, 0), (100, 0, 0)))
                for key in keys:
                    t += 1000
                    gateway.on_chunk_written(gh.ChunkWritten(key, step, 5, "colocated-0", t, t + 10, t + 20, t + 30,
                                                             t + 40, 100, -1, True))
            best = min(best, (time.thread_time_ns() - cpu0) / (num_seqs * num_tokens) / 1e3)
            gateway.loop_lag.close()
        except TypeError:  # another tree's event or tracer signatures
            return float("nan")
        finally:
            rec.close()
    return best


def _spread(values: list[float]) -> str:
    return f"{min(values):.4f}..{max(values):.4f}" if values else "-"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    arms = ARMS if args.features else ARMS[:2]
    torch.set_num_threads(args.threads)
    cfg = EngineConfig(model=args.model, device=args.device, block_size=16, num_device_blocks=1024,
                       max_num_seqs=64, max_num_batched_tokens=2048)
    backend = LocalBackend(cfg)
    app = create_app(backend, config=GatewayConfig())
    results: dict[str, list[tuple[float, float]]] = {arm: [] for arm in arms}
    cpu_per_token: dict[str, list[float]] = {arm: [] for arm in arms}  # process CPU us per output token
    tokens_per_step: dict[str, list[float]] = {arm: [] for arm in arms}  # output tokens per engine step
    wakeups: dict[str, list[float]] = {arm: [] for arm in arms}  # event-loop wake-ups per output token
    group_cpu: dict[str, dict[str, list[float]]] = {arm: {g: [] for g in THREAD_GROUPS} for arm in arms}
    thread_cpu_s = dict.fromkeys(RECORDER_THREADS, 0.0)  # traced rounds: each recorder thread's CPU time
    process_cpu_s = 0.0  # and the whole process's
    ticks = dict.fromkeys(("ticks", "late", "deferred"), 0)  # the loop-lag sampler's, in traced rounds
    traced_tokens = 0  # output tokens of the traced rounds
    with tempfile.TemporaryDirectory() as store, serve_in_thread(app) as server:
        asyncio.run(_round(server.url, args))  # warm-up: model, allocator, connections
        for r in range(args.rounds):
            for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
                with _arm_settings(arm):
                    handle = _instrument(app, arm, store, f"ab-{r}-{arm}", args)
                    clocks = _recorder_thread_clocks() if arm == "traced" else {}
                    cpu0 = ({name: time.clock_gettime(c) for name, c in clocks.items()}, time.process_time())
                    threads = _thread_clocks()
                    threads_start = _read_clocks(threads)
                    steps_start = backend.engine.stats().num_steps  # (the engine is idle between rounds)
                    wakeups_start = _loop_wakeups()
                    cpu_start = time.process_time()
                    try:
                        tput, itl, num_tokens = asyncio.run(_round(server.url, args))
                        cpu_per_token[arm].append((time.process_time() - cpu_start) / max(num_tokens, 1) * 1e6)
                        tokens_per_step[arm].append(num_tokens / max(backend.engine.stats().num_steps - steps_start, 1))
                        wakeups[arm].append((_loop_wakeups() - wakeups_start) / max(num_tokens, 1))
                        traced_tokens += num_tokens if arm == "traced" else 0
                        used = dict.fromkeys(THREAD_GROUPS, 0.0)
                        for ident, t in _read_clocks(threads).items():
                            if ident in threads_start:
                                used[threads[ident][0]] += t - threads_start[ident]
                        for group, cpu_s in used.items():
                            group_cpu[arm][group].append(cpu_s / max(num_tokens, 1) * 1e6)
                    finally:
                        if handle is not None:
                            if clocks:
                                for name, c in clocks.items():
                                    thread_cpu_s[name] += time.clock_gettime(c) - cpu0[0][name]
                                process_cpu_s += time.process_time() - cpu0[1]
                            if arm == "traced":
                                _count_ticks(app, ticks)
                            handle.close()
                            dropped = handle.counters["dropped"] + handle.counters["sink_errors"]
                            if dropped:
                                print(f"warning: round {r} {arm} lost {dropped} events", file=sys.stderr)
                results[arm].append((tput, itl))
                print(f"round {r} {arm:12s} tokens/s={tput:9.1f} itl_p50_ms={itl:7.3f}", flush=True)
    med = {arm: (statistics.median(t for t, _ in v), statistics.median(i for _, i in v)) for arm, v in results.items()}
    for arm, (tput, itl) in med.items():
        print(f"{arm:12s} median tokens/s={tput:9.1f} itl_p50_ms={itl:7.3f}")
    # Each round ran every arm within seconds: the median of the per-round ratios cancels the slow drift
    # of a shared machine better than a ratio of medians; the spread over rounds says how far to trust it.
    ratios = [t / b for (t, _), (b, _) in zip(results["traced"], results["bare"])]
    tput_ratio = statistics.median(ratios)
    itl_ratio = statistics.median(t / b for (_, t), (_, b) in zip(results["traced"], results["bare"]))
    for arm, values in cpu_per_token.items():
        print(f"{arm:12s} median process CPU per output token {statistics.median(values):8.1f} us")
    print("median output tokens per engine step (the batch; a smaller one costs more CPU per token by itself): "
          + " ".join(f"{arm} {statistics.median(v):.2f}" for arm, v in tokens_per_step.items()))
    if any(any(v) for v in wakeups.values()):
        print("median event-loop wake-ups per output token (voluntary context switches of its thread; a count the "
              "load moves little): " + " ".join(f"{arm} {statistics.median(v):.2f}" for arm, v in wakeups.items()))
    if any(any(v) for v in group_cpu["bare"].values()):
        print("median CPU per output token by thread (us): " + " ".join(f"{g:>9s}" for g in THREAD_GROUPS))
        for arm, groups in group_cpu.items():
            print(f"  {arm:12s}" + " " * 31 + " ".join(f"{statistics.median(groups[g]):9.2f}" for g in THREAD_GROUPS))
    if args.features:
        for feature, without, with_ in FEATURES:
            costs = [1 - w / o for (w, _), (o, _) in zip(results[with_], results[without])]
            cpu = [w - o for w, o in zip(cpu_per_token[with_], cpu_per_token[without])]
            print(f"cost of {feature:18s} {100 * statistics.median(costs):+6.2f}% of throughput "
                  f"(per-round spread {100 * min(costs):+.2f}..{100 * max(costs):+.2f}%), "
                  f"{statistics.median(cpu):+.1f} us of CPU per token (spread {min(cpu):+.1f}..{max(cpu):+.1f})")
    if process_cpu_s:
        for name, cpu_s in thread_cpu_s.items():
            print(f"{name} thread CPU in traced rounds: {cpu_s * 1e3:.0f} ms of {process_cpu_s:.1f} s "
                  f"({100 * cpu_s / process_cpu_s:.2f}% of the process)")
    if ticks["ticks"] or ticks["deferred"]:
        print(f"loop-lag sampler in traced rounds: {ticks['ticks']} ticks ({ticks['late']} late; "
              f"{ticks['ticks'] / max(traced_tokens, 1):.2f} per output token), "
              f"the pending tick moved on {ticks['deferred']} times by a traced write on a loop with nothing waiting")
    device = torch.cuda.get_device_name() if args.device == "cuda" and torch.cuda.is_available() else "cpu"
    print(f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, load average "
          f"{os.getloadavg()[0]:.1f}, {device}, python {platform.python_version()}, torch {torch.__version__}, "
          f"model {args.model}, concurrency {args.concurrency}, {args.rounds} rounds per arm, flush every "
          f"{args.flush_interval_s} s, journal every {args.journal_interval_s or 'never'} s")
    print(f"traced/bare throughput per round: spread {_spread(ratios)} over {len(ratios)} rounds")
    cpu_ratio = statistics.median(b / t for t, b in zip(cpu_per_token["traced"], cpu_per_token["bare"]))
    print(f"bare/traced CPU per token (a load-robust stand-in for the throughput ratio on a shared machine): "
          f"{cpu_ratio:.4f}")
    server = ("loop", "engine", "recorder")
    if any(group_cpu["traced"]["recorder"]) or any(group_cpu["traced"]["loop"]):
        server_ratio = statistics.median(
            sum(group_cpu["bare"][g][i] for g in server) / sum(group_cpu["traced"][g][i] for g in server)
            for i in range(len(group_cpu["bare"]["loop"])))
        print(f"bare/traced server CPU per token (event loop, engine loop and recorder threads, without the "
              f"benchmark's client): {server_ratio:.4f}")
    print(f"reference tracers' CPU per output token on a replayed decode (events built and traced, no server; "
          f"least of 40 replays): {_hot_path_us_per_token():.2f} us")
    print(f"instrumented_vs_bare_itl_p50={itl_ratio:.4f}")
    print(f"instrumented_vs_bare_throughput={tput_ratio:.4f}")


if __name__ == "__main__":
    main()
