"""How often a comparison calls identical configurations a regression, and the smallest regression it catches.

Runs the reference server (in this process: the tiny model on the CPU behind its HTTP gateway, traced with
``tokentrace.instrument``) once per run, each run ``--requests`` streamed completions of ``--tokens`` tokens,
``--concurrency`` at a time, into a temporary store:

* ``--aa`` runs of one configuration (A/A): every pair of them compared one run against one (up to ``--pairs``
  pairs), and ``--pairs`` random splits into three against three (``analyzers.compare``, the documented
  default noise for single runs). A pair with any regression is a false alarm.
* ``--planted`` runs for each planted decode-step delay of ``--sizes`` (``decode_step=<ms>``: a real sleep in
  each decoding engine step, inside decode.compute): each compared with A runs one against one and three against
  three; detected when a decode.compute ITL row (its median or its mean per token) is a regression.

Prints decode.compute's median per later token in each configuration, the noise measured from the A runs (per
class: the spread of ln(value) between runs, what ``analyzers.compare.DEFAULT_NOISE`` documents), the false-alarm
rates, the detection rate of each planted size,
when not flagged, whether the comparison said how many runs a side it would need, the smallest planted delay
detected in at least 90% of trials with 1 and with 3 runs per side, and last
``aa_false_alarm_rate=<x>`` (1-vs-1 and 3-vs-3 pairs together).

    .venv/bin/python benchmarks/comparison.py --aa 12 --planted 5 --sizes 0.2,3,10 --seed 3
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import torch  # noqa: E402

import tokentrace  # noqa: E402
from analyzers.compare import compare, measure_noise, values_of  # noqa: E402
from analyzers.source import Source  # noqa: E402
from reference_server.engine import EngineConfig  # noqa: E402
from reference_server.serving.backend import LocalBackend  # noqa: E402
from reference_server.serving.delays import DelayConfig  # noqa: E402
from reference_server.serving.gateway import GatewayConfig, create_app  # noqa: E402
from reference_server.serving.gateway_server import serve_in_thread  # noqa: E402

STAGE_ROW = "stage.decode.compute.itl"  # where a planted decode-step delay must show (its median or its mean)


def one_run(store: Path, run: str, *, delay: str, requests: int, tokens: int, concurrency: int) -> None:
    """One traced run of the reference server: ``requests`` streamed completions, ``concurrency`` at a time."""
    delays = DelayConfig.parse(delay)
    config = EngineConfig(model="tiny", device="cpu", block_size=4, num_device_blocks=512, max_num_seqs=16,
                          max_num_batched_tokens=512)
    app = create_app(LocalBackend(config, delays=delays), config=GatewayConfig(delays=delays))
    handle = tokentrace.instrument(app, store=store, run=run, flush_interval_s=0.2)

    def send(url: str, i: int) -> None:
        body = {"model": "tiny", "prompt": f"request {i} " + "lorem ipsum " * 8, "max_tokens": tokens,
                "stream": True, "ignore_eos": True, "temperature": 0}
        with httpx.Client(base_url=url, timeout=120) as client, \
                client.stream("POST", "/v1/completions", json=body) as r:
            for _ in r.iter_lines():
                pass

    try:
        with serve_in_thread(app) as server, ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda i: send(server.url, i), range(requests)))
    finally:
        handle.close()


def _flags(base: list, cand: list) -> tuple[list[str], bool, float]:
    """(the rows flagged as regressions, a decode.compute ITL row a regression, the fewest runs a side the
    comparison said those rows would need: NaN when flagged or beyond 1000)."""
    df = compare(base, cand)
    rows = df[df["metric"] == STAGE_ROW]
    flagged = df[df["regression"].astype(bool)]
    hit = bool(rows["regression"].astype(bool).any())
    need = float(rows["runs_needed"].min()) if len(rows) and not hit else float("nan")
    return (flagged["metric"] + "." + flagged["statistic"]).tolist(), hit, need


def _splits(n_a: int, k: int, num: int, rng: random.Random) -> list[tuple[list[int], list[int]]]:
    out = []
    for _ in range(num):
        drawn = rng.sample(range(n_a), 2 * k)
        out.append((drawn[:k], drawn[k:]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--aa", type=int, default=12, help="runs of the unchanged configuration (at least 6)")
    p.add_argument("--planted", type=int, default=6, help="runs per planted size (at least 3)")
    p.add_argument("--sizes", default="0.2,3,10", help="planted decode-step delays, ms, comma-separated")
    p.add_argument("--pairs", type=int, default=20, help="comparisons per rate (1v1 pairs, 3v3 splits)")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.aa < 6 or args.planted < 3 or args.pairs < 1:
        p.error("--aa must be at least 6, --planted at least 3 and --pairs at least 1")
    sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="tt-comparison-bench-"))
    shape = dict(requests=args.requests, tokens=args.tokens, concurrency=args.concurrency)
    try:
        start = time.perf_counter()
        plan = [("aa", i, "") for i in range(args.aa)]
        plan += [(f"d{size:g}", i, f"decode_step={size:g}ms") for size in sizes for i in range(args.planted)]
        rng.shuffle(plan)  # interleaved: drift over the benchmark's minutes falls on every configuration alike
        values: dict[str, list] = {}
        for name, i, delay in plan:
            run = f"{name}-{i}"
            one_run(root, run, delay=delay, **shape)
            values.setdefault(name, []).append(values_of(Source.of_run(tokentrace.open(root, run))))
        aa = values["aa"]
        noise = measure_noise(aa, source="these A/A runs")
        print(f"{args.aa} A/A runs and {args.planted} per planted size, {args.requests} requests x {args.tokens} "
              f"tokens, {args.concurrency} at a time; {time.perf_counter() - start:.0f} s of runs")
        print("noise (sd of ln value between A runs): "
              + ", ".join(f"{k} {v:.2f}" for k, v in sorted(noise.sigma.items()) if "." not in k or
                          k.startswith("latency.")))
        medians = {name: sorted(v.values[STAGE_ROW, "p50"] for v in runs) for name, runs in values.items()}
        print(f"{STAGE_ROW} p50 (median per later token, ms), median of the runs: "
              + ", ".join(f"{name} {m[len(m) // 2]:.2f}" for name, m in sorted(medians.items())))
        print("noise per row: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(noise.sigma.items()) if "." in k
                                             and not k.startswith("latency.")))
        pairs1 = list(itertools.combinations(range(args.aa), 2))
        rng.shuffle(pairs1)
        pairs1 = [([a], [b]) for a, b in pairs1[:args.pairs]]
        pairs3 = _splits(args.aa, 3, args.pairs, rng)
        alarms = {}
        for label, pairs in (("1v1", pairs1), ("3v3", pairs3)):
            flagged = [_flags([aa[i] for i in a], [aa[i] for i in b])[0] for a, b in pairs]
            hits = sum(bool(f) for f in flagged)
            alarms[label] = (hits, len(pairs))
            rows = Counter(r for f in flagged for r in f)
            print(f"A/A {label}: {hits} of {len(pairs)} comparisons flagged a regression"
                  + (f" (rows: {', '.join(f'{r} x{n}' for r, n in rows.most_common())})" if rows else ""))
        smallest = {}
        for k in (1, 3):
            for size in sizes:
                planted = values[f"d{size:g}"]
                trials, told = [], []
                for _ in range(args.pairs):
                    base = rng.sample(range(args.aa), k)
                    cand = rng.sample(range(len(planted)), k)
                    _, hit, need = _flags([aa[i] for i in base], [planted[i] for i in cand])
                    trials.append(hit)
                    if not hit and need == need:  # not flagged, and the comparison said how many runs it needs
                        told.append(need)
                rate = sum(trials) / len(trials)
                said = (f"; when not, the report said it needs more runs in {len(told)} of {len(trials) - sum(trials)}"
                        f" (median {sorted(told)[len(told) // 2]:.0f} a side)" if told else "")
                print(f"planted decode_step={size:g}ms, {k} vs {k} run(s): decode.compute flagged in "
                      f"{sum(trials)} of {len(trials)}{said}")
                if rate >= 0.9 and k not in smallest:
                    smallest[k] = size
        for k in (1, 3):
            found = f"decode_step={smallest[k]:g}ms" if k in smallest else f"none of {args.sizes} ms"
            print(f"smallest planted regression detected at 90% power with {k} run(s) per side: {found}")
        print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
              f"python {platform.python_version()}")
        hits = sum(h for h, _ in alarms.values())
        total = sum(n for _, n in alarms.values())
        print(f"aa_false_alarm_rate={hits / total:.3f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
