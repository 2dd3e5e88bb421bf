"""``tokentrace demo``: the reference engine, instrumented, driven by a real trace.

What it does, step by step (each step prints its progress):

1. reads a slice of the Mooncake conversation trace (arrival times, lengths and
   prefix-sharing hash ids), scaled to a CPU and says how;
2. builds the reference engine (Llama-style model, paged KV cache with prefix
   caching and a host tier, continuous batching) with three tenants;
3. instruments it with :func:`tokentrace.instrument` into a Parquet store;
4. replays the trace open-loop: each request is added at its (scaled) arrival
   time while the engine keeps stepping;
5. closes the store and prints the latency summary and the stage breakdown.

Like the CLI, this module is part of the facade: it imports the reference
server, the adapters and the analyzers lazily, inside :func:`run_demo`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table as RichTable

from tokentrace.workloads import Workload, build_prompt, default_traces_dir, read_mooncake_jsonl

__all__ = ["DemoOptions", "run_demo"]

TENANTS = ("acme", "globex", "initech")
SLO_MIX = ("interactive", "interactive", "batch")  # two in three requests are interactive


@dataclass(frozen=True, slots=True)
class DemoOptions:
    store: Path
    num_requests: int = 48
    model: str = "small"
    time_scale: float = 1.0  # Mooncake arrivals are already seconds apart
    length_scale: float = 1 / 64  # 14k-token contexts become ~220 tokens
    trace: Path | None = None
    run: str | None = None


def _workload(opts: DemoOptions) -> Workload:
    path = opts.trace or default_traces_dir() / "mooncake_conversation.jsonl"
    if not Path(path).is_file():
        raise ValueError(f"trace file not found: {path} (set TOKENTRACE_TRACES or pass --trace)")
    return read_mooncake_jsonl(path, time_scale=opts.time_scale, length_scale=opts.length_scale,
                               max_requests=opts.num_requests)


def _engine(opts: DemoOptions, max_len: int) -> Any:
    from reference_server.engine.config import EngineConfig, TenantConfig
    from reference_server.engine.engine import Engine

    tenants = (TenantConfig("acme"), TenantConfig("globex", weight=2.0), TenantConfig("initech"))
    block_size = 16
    config = EngineConfig(
        model=opts.model, block_size=block_size, num_device_blocks=max(256, 4 * max_len // block_size),
        num_host_blocks=256, max_num_batched_tokens=256, max_num_seqs=32, scheduling_policy="slo",
        tenants=tenants, default_tenant="acme",
    )
    return Engine(config)


def _replay(engine: Any, workload: Workload, console: Console) -> int:
    """Add each request at its arrival time while stepping the engine; returns failures."""
    from reference_server.model import SamplingParams

    block_tokens = workload.scaling.block_tokens
    pending = list(enumerate(workload.requests))
    failures = 0
    start = time.monotonic()
    columns = (TextColumn("[bold]replaying"), BarColumn(), MofNCompleteColumn(), TextColumn("finished"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("replay", total=len(pending))
        while pending or engine.has_unfinished():
            now = time.monotonic() - start
            while pending and pending[0][1].arrival_s <= now:
                i, req = pending.pop(0)
                prompt = build_prompt(req, block_tokens=block_tokens, salt=i)
                sampling = SamplingParams(max_tokens=req.num_output_tokens, ignore_eos=True)
                try:
                    engine.add_request(f"demo-{i}", prompt, sampling, tenant=TENANTS[i % 3],
                                       slo_class=SLO_MIX[i % 3])
                except ValueError as e:
                    failures += 1
                    console.print(f"[yellow]request {i} rejected: {e}")
                    progress.advance(task)
            if engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        progress.advance(task)
            elif pending:
                time.sleep(min(0.05, max(0.0, pending[0][1].arrival_s - (time.monotonic() - start))))
    return failures


def _print_results(store: Path, run_id: str, console: Console) -> None:
    import tokentrace
    from analyzers.latency import latency_summary
    from analyzers.stage_breakdown import stage_breakdown, unattributed_share

    run = tokentrace.open(store, run=run_id)
    spans, requests, tokens, instances = (run.table(n) for n in ("spans", "requests", "tokens", "instances"))
    lat = latency_summary(requests, tokens, instances)
    table = RichTable(title="Latency (server view)")
    for name in ("metric", "count", "mean", "p50", "p90", "p99"):
        table.add_column(name, justify="right" if name != "metric" else "left")
    for _, r in lat.iterrows():
        table.add_row(r["metric"].upper(), str(r["count"]),
                      *(f"{r[k]:.1f} ms" for k in ("mean_ms", "p50_ms", "p90_ms", "p99_ms")))
    console.print(table)
    bd = stage_breakdown(spans, requests, tokens, instances)
    table = RichTable(title="Where the time went: share of each stage")
    for name in ("stage", "TTFT mean", "TTFT tail 1%", "ITL mean", "ITL tail 1%"):
        table.add_column(name, justify="right" if name != "stage" else "left")
    for _, r in bd.iterrows():
        if r[["ttft_share", "itl_share", "ttft_tail_share", "itl_tail_share"]].fillna(0).abs().sum() < 1e-4:
            continue
        table.add_row(r["stage"], *(f"{100 * r[k]:.1f}%" for k in
                                    ("ttft_share", "ttft_tail_share", "itl_share", "itl_tail_share")))
    console.print(table)
    share = unattributed_share(spans, requests, tokens, instances)
    console.print(f"unattributed time: {100 * share:.3f}% of token latency")


def run_demo(opts: DemoOptions, *, console: Console | None = None) -> str:
    """Run the demo end to end; returns the run id written under ``opts.store``."""
    import torch

    import tokentrace

    console = console or Console()
    workload = _workload(opts)
    console.print(f"[bold]1/4[/] workload: {workload.scaling.describe()}")
    max_len = max(r.num_prompt_tokens + r.num_output_tokens for r in workload) + 2
    engine = _engine(opts, max_len)
    console.print(f"[bold]2/4[/] engine: preset {opts.model!r} on {engine.runner.device}, "
                  f"{torch.get_num_threads()} threads, tenants {', '.join(TENANTS)}")
    handle = tokentrace.instrument(engine, store=opts.store, run=opts.run,
                                   trace_config={"workload": workload.scaling.as_dict()})
    console.print(f"[bold]3/4[/] tracing into {opts.store} (run {handle.run_id})")
    try:
        failures = _replay(engine, workload, console)
    finally:
        handle.close()
        engine.close()
    console.print(f"[bold]4/4[/] store written; {failures} request(s) rejected\n")
    _print_results(opts.store, handle.run_id, console)
    console.print(f"\nInspect the store: [bold]tokentrace inspect {opts.store} --run {handle.run_id}[/]")
    return handle.run_id
