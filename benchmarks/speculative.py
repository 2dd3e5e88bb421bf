"""Benchmark: speculative decoding against plain decoding on the bundled trained model (CPU).

Same process, same prompts, greedy decoding (so both modes emit the very same tokens, which
the benchmark checks): the prompts are the openings of the documentation topics held out
of the model's training (``reference_server.model.train.corpus``), continued for
``--max-tokens`` tokens. For each draft source (``ngram``: prompt lookup; ``model``: the
bundled ``trained-draft``; ``early_exit``: the target's first layers) and each batch size,
the plain and the speculative engines take turns, ``--repeats`` runs each; the best run of
each counts (a shared machine only ever adds time).

Reported per row: decode throughput (output tokens after each request's first, per second
of the steps after the prefill step, on this process's CPU time: torch runs one thread, so
CPU time tracks work while wall time also counts other tenants of the machine), the mean and
p90 inter-token latency (gaps between a request's token emits, on wall time: a speculative
step's further tokens come out at once), the acceptance rate (accepted / proposed) and the
tokens a speculative step emitted on average. Speculation runs with the proposal budget
lifted (``k`` fixed at ``--k`` whatever the batch) and with the default policy
(``speculative_budget=16``: ``k`` shrinks with the batch), so the table shows where fixed-k
speculation stops paying and what the policy keeps.

Run: ``.venv/bin/python benchmarks/speculative.py`` (a few minutes on 2 shared
cores). The last line is ``spec_vs_plain_decode_throughput=<ratio>``: speculative / plain
decode throughput at batch 1 for the ``--headline`` source.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reference_server.engine import Engine, EngineConfig, EngineObserver  # noqa: E402
from reference_server.engine.hooks import SpeculativeStep, StepEnd, TokenEmitted  # noqa: E402
from reference_server.model import SamplingParams  # noqa: E402
from reference_server.model.train import corpus  # noqa: E402

SOURCES = ("ngram", "model", "early_exit")


class _Timing(EngineObserver):
    """Per step: CPU and wall time, whether it ran prefill; token emits; speculative steps."""

    def __init__(self) -> None:
        self.decode_cpu_s = 0.0
        self.decode_tokens = 0
        self.emits: dict[str, list[int]] = {}
        self.spec: list[SpeculativeStep] = []
        self._cpu0 = time.process_time()

    def on_step_end(self, event: StepEnd) -> None:
        cpu = time.process_time()
        if event.num_prefill_tokens == 0:
            self.decode_cpu_s += cpu - self._cpu0
        self._cpu0 = cpu

    def on_token_emitted(self, event: TokenEmitted) -> None:
        self.emits.setdefault(event.request_id, []).append(event.emit_ns)
        if event.index > 0:
            self.decode_tokens += 1

    def on_speculative_step(self, event: SpeculativeStep) -> None:
        self.spec.append(event)


@dataclass(frozen=True, slots=True)
class Result:
    tokens_per_cpu_s: float
    itl_mean_ms: float
    itl_p90_ms: float
    acceptance: float  # accepted / proposed; nan without speculation
    tokens_per_spec_step: float
    outputs: tuple[tuple[int, ...], ...]


def run_once(cfg: EngineConfig, prompts: list[str], max_tokens: int) -> Result:
    engine = Engine(cfg)
    timing = _Timing()
    engine.add_observer(timing)
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    engine.close()
    gaps = sorted((b - a) / 1e6 for e in timing.emits.values() for a, b in zip(e, e[1:]))
    proposed = sum(s.num_proposed for s in timing.spec)
    accepted = sum(s.num_accepted for s in timing.spec)
    return Result(timing.decode_tokens / timing.decode_cpu_s, statistics.mean(gaps), gaps[int(0.9 * (len(gaps) - 1))],
                  accepted / proposed if proposed else float("nan"),
                  (accepted + len(timing.spec)) / len(timing.spec) if timing.spec else float("nan"),
                  tuple(c.token_ids for c in outs))


def best_of(configs: dict[str, EngineConfig], prompts: list[str], args: argparse.Namespace) -> dict[str, Result]:
    """Each configuration run ``--repeats`` times, taking turns; the fastest run of each."""
    runs: dict[str, list[Result]] = {name: [] for name in configs}
    for _ in range(args.repeats):
        for name, cfg in configs.items():
            runs[name].append(run_once(cfg, prompts, args.max_tokens))
    return {name: max(rs, key=lambda r: r.tokens_per_cpu_s) for name, rs in runs.items()}


def prompts_of(num: int, num_bytes: int) -> list[str]:
    """Openings of the held-out documentation topics (cut on a character boundary)."""
    _, held = corpus()
    topics = [t for t in held.split(b"\n\n") if len(t) >= num_bytes]
    return [t[:num_bytes].decode("utf-8", errors="ignore") for t in topics[:num]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="trained")
    parser.add_argument("--draft-model", default="trained-draft")
    parser.add_argument("--k", type=int, default=4, help="proposals per speculative step")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-bytes", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--headline", default="ngram", choices=SOURCES, help="source of the last line's ratio")
    parser.add_argument("--sources", default=",".join(SOURCES))
    args = parser.parse_args()
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    sources = args.sources.split(",")
    if not sizes or min(sizes) < 1 or any(s not in SOURCES for s in sources) or args.headline not in sources:
        parser.error("batch sizes must be >= 1 and sources among " + ", ".join(SOURCES) + " (headline included)")
    torch.set_num_threads(1)
    all_prompts = prompts_of(max(sizes), args.prompt_bytes)
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, python {platform.python_version()}, "
          f"torch {torch.__version__} (1 thread), device cpu; target {args.model!r}, draft {args.draft_model!r}, "
          f"k={args.k}, greedy, {args.max_tokens} output tokens, prompts: {args.prompt_bytes}-byte openings of "
          f"held-out documentation topics; best of {args.repeats}")
    base = dict(model=args.model, device="cpu", num_device_blocks=1024, max_num_seqs=max(sizes),
                speculative_draft_model=args.draft_model, num_speculative_tokens=args.k)
    print(f"{'source':>10} {'batch':>5} {'policy':>7} | {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} | "
          f"{'ITL ms plain':>12} {'spec':>6} {'p90 plain':>9} {'spec':>6} | {'accept':>6} {'tok/step':>8}")
    headline = float("nan")
    ratios: dict[tuple[str, str], list[tuple[int, float]]] = {}
    policies = {"fixed-k": lambda batch: args.k * batch, "default": lambda batch: 16}
    for batch in sizes:
        prompts = all_prompts[:batch]
        configs = {"plain": EngineConfig(**base)}
        for source in sources:
            for policy, budget in policies.items():
                configs[f"{source}/{policy}"] = EngineConfig(**base, speculative=source,
                                                             speculative_budget=budget(batch))
        results = best_of(configs, prompts, args)
        plain = results["plain"]
        for source in sources:
            for policy in policies:
                spec = results[f"{source}/{policy}"]
                if spec.outputs != plain.outputs:
                    raise SystemExit(f"{source} at batch {batch}: greedy outputs differ from plain decoding")
                ratio = spec.tokens_per_cpu_s / plain.tokens_per_cpu_s
                ratios.setdefault((source, policy), []).append((batch, ratio))
                if batch == 1 and source == args.headline and policy == "default":
                    headline = ratio
                print(f"{source:>10} {batch:>5} {policy:>7} | {plain.tokens_per_cpu_s:>11.0f} "
                      f"{spec.tokens_per_cpu_s:>10.0f} {ratio:>6.2f} | {plain.itl_mean_ms:>12.2f} "
                      f"{spec.itl_mean_ms:>6.2f} {plain.itl_p90_ms:>9.2f} {spec.itl_p90_ms:>6.2f} | "
                      f"{spec.acceptance:>6.2f} {spec.tokens_per_spec_step:>8.2f}", flush=True)
    for (source, policy), rows in ratios.items():
        below = [b for b, r in rows if r < 1.0]
        where = f"below 1 from batch {below[0]}" if below else f"above 1 up to batch {rows[-1][0]}"
        print(f"{source} ({policy}): speculative / plain decode throughput {where}")
    print(f"spec_vs_plain_decode_throughput={headline:.2f}")


if __name__ == "__main__":
    main()
