"""Benchmark: what KV retention between turns is worth to an agent workload on the reference engine.

The same agent sessions (``tokentrace.app.bench.sessions.MIXES["agent"]``, lengths x``--length-scale``)
run in-process on the reference engine (model ``--model``, block size 16, ``--device-blocks`` device
blocks, a host tier of ``--host-blocks``; without one ``offload`` behaves as ``lru``) once per
retention policy: ``lru`` (no session awareness), ``keep``, ``offload`` and ``drop``. ``--sessions``
sessions run concurrently; each turn's prompt is the previous prompt, the previous answer's token ids
and new input, sent the think time (the mix's tool-call time x ``--time-scale``) after the previous
answer. Other traffic without a session (``--noise-rate`` requests/s of ``--noise-tokens`` distinct
tokens) churns the prefix cache meanwhile, so a thinking session's blocks are the least recently used
ones. The engine is traced by the real engine tracer into an in-memory sink and analyzed by
``analyzers.sessions``.

Per policy it prints the carried prefix tokens, the share reused (and from the host tier), the
lost tokens, the extra prefill they cost, the load time, and the sum of every turn's TTFT.
Defaults: the tiny model, 4 sessions, lengths x0.2, think times as the mix's (0.2-1 s), 160 device
blocks, no host tier, 20 req/s of 256-token other traffic. Run:
``.venv/bin/python benchmarks/session_retention.py`` (about 30 s on 2 CPU cores; ``--model small``
makes prefill time realistic on a CPU). The last line is ``reuse_keep_over_lru=<keep's reuse fraction
/ lru's>``: how much more of each turn's carried prefix survives the think time when the engine pins
a session's blocks than under plain LRU.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from analyzers.sessions import retention_summary, session_summary  # noqa: E402
from analyzers.source import Source  # noqa: E402
from instrument.reference_engine import EngineTracer  # noqa: E402
from reference_server.engine.config import RETENTION_POLICIES, EngineConfig  # noqa: E402
from reference_server.engine.engine import Engine  # noqa: E402
from reference_server.model import SamplingParams  # noqa: E402
from tokentrace.app.bench.sessions import MIXES  # noqa: E402
from tokentrace.recorder import BufferedRecorder  # noqa: E402
from tokentrace.recorder.sink import InMemorySink  # noqa: E402
from tokentrace.schema import Role  # noqa: E402


def _plan(num_sessions: int, length_scale: float, time_scale: float, seed: int) -> list[list[tuple[list[int], int, float]]]:
    """Per session, per turn: (new input token ids, answer tokens, think seconds after it)."""
    mix, rng = MIXES["agent"], np.random.default_rng(seed)
    out = []
    for _ in range(num_sessions):
        n = int(mix.turns.sample(1, rng)[0])
        inputs = [int(mix.opening.sample(1, rng)[0])] + [int(x) for x in mix.new_input.sample(n - 1, rng)]
        answers, thinks = mix.answer.sample(n, rng), mix.think.sample(n, rng)
        out.append([(rng.integers(0, 256, max(1, round(inputs[k] * length_scale))).tolist(),
                     max(1, round(int(answers[k]) * length_scale)), float(thinks[k]) * time_scale)
                    for k in range(n)])
    return out


def run_policy(policy: str, plan: list, args: argparse.Namespace) -> dict[str, float]:
    sink = InMemorySink()
    rec = BufferedRecorder(sink, instance_id=1, flush_interval_s=0.2)
    rec.instance(role=Role.COLOCATED, name="engine")
    engine = Engine(EngineConfig(model=args.model, block_size=16, num_device_blocks=args.device_blocks,
                                 num_host_blocks=args.host_blocks, device="cpu", kv_retention=policy,
                                 max_num_batched_tokens=1024))
    engine.add_observer(EngineTracer(rec))
    context = [[] for _ in plan]
    turn = [0] * len(plan)
    ready = [0.0] * len(plan)  # monotonic s when the session's next turn is due
    in_flight: dict[str, int] = {}
    outputs: dict[str, list[int]] = {}
    noise_rng = np.random.default_rng(args.seed + 1)
    next_noise, num_noise = 0.0, 0
    start = time.monotonic()
    while any(t < len(p) for t, p in zip(turn, plan)) or in_flight:
        now = time.monotonic()
        if args.noise_rate > 0 and now - start >= next_noise:  # other traffic: no session, churns the cache
            engine.add_request(f"noise-{num_noise}", noise_rng.integers(0, 256, args.noise_tokens).tolist(),
                               SamplingParams(max_tokens=1))
            outputs[f"noise-{num_noise}"] = []
            num_noise += 1
            next_noise += noise_rng.exponential(1.0 / args.noise_rate)
        for s, p in enumerate(plan):
            if turn[s] < len(p) and ready[s] <= now and s not in in_flight.values():
                new, answer, _ = p[turn[s]]
                context[s] = context[s] + new
                key = f"s{s}-t{turn[s]}"
                engine.add_request(key, list(context[s]), SamplingParams(max_tokens=answer, ignore_eos=True),
                                   session=f"s{s}")
                in_flight[key], outputs[key] = s, []
        if not engine.has_unfinished():
            time.sleep(0.001)
            continue
        for out in engine.step():
            outputs[out.request_id].append(out.token_id)
            if out.finished and out.request_id.startswith("noise-"):
                del outputs[out.request_id]
            elif out.finished:
                s = in_flight.pop(out.request_id)
                context[s] = context[s] + outputs.pop(out.request_id)
                ready[s] = time.monotonic() + plan[s][turn[s]][2]
                turn[s] += 1
    wall = time.monotonic() - start
    rec.close()
    src = Source.of_tables(**{n: sink.table(n) for n in ("requests", "spans", "tokens", "cache_events", "instances")})
    r = retention_summary(src).iloc[0]
    sums = session_summary(src)
    return {"carried": float(r["carried_tokens"]), "reuse": float(r["reuse_fraction"]),
            "host": float(r["reused_host_tokens"]), "lost": float(r["lost_tokens"]),
            "extra_prefill_ms": float(r["extra_prefill_ms"]), "load_ms": float(r["load_ms"]),
            "ttft_sum_ms": float(sums["ttft_sum_ms"].sum()), "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--length-scale", type=float, default=0.2)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--device-blocks", type=int, default=160)
    p.add_argument("--host-blocks", type=int, default=0)
    p.add_argument("--noise-rate", type=float, default=20.0, help="requests/s of other traffic (no session)")
    p.add_argument("--noise-tokens", type=int, default=256, help="prompt tokens of each such request")
    p.add_argument("--model", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}, "
          f"torch {torch.__version__}; model {args.model}, {args.sessions} agent sessions, lengths "
          f"x{args.length_scale:g}, think x{args.time_scale:g}, {args.device_blocks} device / "
          f"{args.host_blocks} host blocks of 16 tokens; other traffic {args.noise_rate:g} req/s of "
          f"{args.noise_tokens} tokens")
    plan = _plan(args.sessions, args.length_scale, args.time_scale, args.seed)
    results = {}
    for policy in RETENTION_POLICIES:
        m = results[policy] = run_policy(policy, plan, args)
        print(f"{policy:8s} carried {m['carried']:7.0f} tok  reused {m['reuse']:6.1%} (host {m['host']:6.0f})  "
              f"lost {m['lost']:6.0f} tok  extra prefill {m['extra_prefill_ms']:8.1f} ms  load {m['load_ms']:6.1f} ms"
              f"  TTFT sum {m['ttft_sum_ms']:8.1f} ms  wall {m['wall_s']:5.1f} s")
    print(f"reuse_keep_over_lru={results['keep']['reuse'] / max(results['lru']['reuse'], 1e-9):.2f}")


if __name__ == "__main__":
    main()
