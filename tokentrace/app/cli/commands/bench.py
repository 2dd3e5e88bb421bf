"""``tokentrace bench``: the typer command (the CLI module registers :func:`bench_command`).

Bad input (an unknown workload, a malformed ``--tenants`` or ``--slo``) is one
sentence on stderr and exit code 2. Request failures are counted and shown; the
exit code is 1 when any request failed only with ``--fail-on-error``, and 1 when a
sender process died (``--processes``; one sentence on stderr).
Heavy imports (the runner, pyarrow) happen inside the command, so registering it
costs the ``tokentrace`` CLI nothing.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn, Optional

import typer

from tokentrace.app.cli import EXIT_USAGE, check_path, usage_error

__all__ = ["register", "bench_command", "EXIT_FAILED_REQUESTS", "EXIT_USAGE"]

EXIT_FAILED_REQUESTS = 1


def bench_command(
    url: Annotated[str, typer.Option(help="Server base URL, e.g. http://127.0.0.1:8000.")] = "http://127.0.0.1:8000",
    endpoint: Annotated[str, typer.Option(help="completions or chat.")] = "completions",
    model: Annotated[str, typer.Option(help="Model name; empty = the first of GET /v1/models.")] = "",
    workload: Annotated[str, typer.Option(help="synthetic, azure-code, azure-conv, mooncake, or a .csv/.jsonl trace path.")] = "synthetic",
    time_scale: Annotated[float, typer.Option(help="Multiply trace arrival times (<1 = faster).")] = 1.0,
    length_scale: Annotated[float, typer.Option(help="Multiply trace prompt and output lengths.")] = 1.0,
    max_requests: Annotated[int, typer.Option(help="Requests in the plan (trace: its first N).")] = 100,
    duration: Annotated[float, typer.Option(help="Send nothing after this many seconds.")] = 600.0,
    drain: Annotated[float, typer.Option(help="Seconds in-flight requests get after --duration before being cancelled.")] = 30.0,
    rate: Annotated[float, typer.Option(help="Requests per second (inf = all at once).")] = math.inf,
    arrival: Annotated[str, typer.Option(help="poisson, gamma, constant or trace.")] = "poisson",
    burstiness: Annotated[float, typer.Option(help="Gamma shape: 1 = Poisson, <1 burstier.")] = 1.0,
    concurrency: Annotated[int, typer.Option(help="At most this many requests in flight (0 = unbounded).")] = 0,
    tenants: Annotated[str, typer.Option(help="name:api_key:share,... (one API key per tenant).")] = "",
    slo_class_mix: Annotated[str, typer.Option(help="interactive:0.8,batch:0.2 -> X-SLO-Class header.")] = "",
    slo: Annotated[str, typer.Option(help="Goodput targets, e.g. ttft=500ms,tpot=50ms[,e2el=2s].")] = "",
    input_len: Annotated[str, typer.Option(help="Synthetic prompt lengths: fixed:N, uniform:A-B, lognormal:median=M,sigma=S, pareto:min=M,alpha=A.")] = "fixed:128",
    output_len: Annotated[str, typer.Option(help="Synthetic output lengths (same forms as --input-len).")] = "fixed:32",
    system_prompts: Annotated[int, typer.Option(help="Synthetic: number of shared system prompts.")] = 0,
    system_prompt_share: Annotated[float, typer.Option(help="Synthetic: share of requests with a shared system prompt.")] = 0.0,
    system_prompt_len: Annotated[int, typer.Option(help="Synthetic: tokens per shared system prompt.")] = 256,
    block_size: Annotated[int, typer.Option(help="Server KV block size: Mooncake prompt blocks are aligned to it (0 = no alignment).")] = 16,
    timeout: Annotated[float, typer.Option(help="Seconds of silence before a request times out.")] = 60.0,
    store: Annotated[Optional[Path], typer.Option(help="Record the client's view into this store.")] = None,
    run: Annotated[Optional[str], typer.Option("--run", help="Run id in the store (default: a new one).")] = None,
    output: Annotated[str, typer.Option(help="text or json.")] = "text",
    fail_on_error: Annotated[bool, typer.Option("--fail-on-error", help="Exit 1 if any request failed.")] = False,
    seed: Annotated[int, typer.Option(help="Seed of every random choice (lengths, arrivals, tenants).")] = 0,
    processes: Annotated[int, typer.Option(help="Client processes that send and time the requests (the plan dealt round-robin); this one only records and reports. 0 = send from this process.")] = 1,
    sessions: Annotated[str, typer.Option(help="Multi-turn sessions instead of single requests: agent, chat, or trace (conversations rebuilt from --workload, a Mooncake trace). Sent from this process.")] = "",
    num_sessions: Annotated[int, typer.Option(help="Sessions in the plan (agent, chat; trace: its first --max-requests requests make the sessions).")] = 10,
    session_rate: Annotated[Optional[float], typer.Option(help="Sessions starting per second, Poisson (inf = all at once). Default: 1 for agent and chat, the trace's own starts for trace.")] = None,
    think_time: Annotated[str, typer.Option(help="Think/tool-call time between turns instead of the mix's: fixed:S, uniform:A-B, exp:mean=M, lognormal:median=M,sigma=S.")] = "",
    turns: Annotated[str, typer.Option(help="Turns per session instead of the mix's (fixed:N, uniform:A-B, ...).")] = "",
    repeat: Annotated[int, typer.Option(help="Run the same plan this many times, one after another, each its own run (--run R: R-1 ... R-N), for comparisons that know run-to-run noise (tokentrace report --baseline STORE:'R-*').")] = 1,
) -> None:
    """Drive an OpenAI-compatible server and measure it from the client side."""
    from tokentrace.app.bench.arrivals import Arrivals
    from tokentrace.app.bench.client import RequestOptions
    from tokentrace.app.bench.plan import build_plan, parse_mix, parse_tenants
    from tokentrace.app.bench.runner import RunLimits
    from tokentrace.app.bench.senders import shard_limits
    from tokentrace.app.bench.summary import parse_slo
    from tokentrace.app.bench.synthetic import LengthDist, SyntheticSpec

    if output not in ("text", "json"):
        _usage_error(f"--output must be text or json, got {output!r}")
    check_path(store, "store")
    if repeat < 1:
        _usage_error(f"--repeat must be at least 1, got {repeat}")
    if repeat > 1 and sessions:
        _usage_error("--repeat is for request runs; repeat a --sessions run by running the command again")
    if sessions:
        _sessions_command(sessions, url=url, endpoint=endpoint, model=model, workload=workload,
                          time_scale=time_scale, length_scale=length_scale, max_requests=max_requests,
                          duration=duration, drain=drain, concurrency=concurrency, tenants=tenants,
                          slo_class_mix=slo_class_mix, slo=slo, timeout=timeout, store=store, run=run, output=output,
                          fail_on_error=fail_on_error, seed=seed, num_sessions=num_sessions,
                          session_rate=session_rate, think_time=think_time, turns=turns, block_size=block_size)
        return
    try:
        opts = RequestOptions(base_url=url, endpoint=endpoint, model=model, read_timeout_s=timeout)
        limits = RunLimits(duration_s=duration, drain_s=drain, concurrency=concurrency)
        if processes < 0:
            raise ValueError(f"--processes must be >= 0, got {processes}")
        if processes:
            shard_limits(limits, processes)  # --concurrency is split between the processes
        spec = SyntheticSpec(LengthDist.parse(input_len), LengthDist.parse(output_len), system_prompts,
                             system_prompt_share, system_prompt_len)
        slo_ms = parse_slo(slo) if slo else {}
        plan = build_plan(
            workload=workload, synthetic=spec, arrivals=Arrivals(arrival, rate, burstiness),
            max_requests=max_requests, time_scale=time_scale, length_scale=length_scale,
            server_block_size=block_size or None, tenants=parse_tenants(tenants) if tenants else (),
            slo_mix=parse_mix(slo_class_mix) if slo_class_mix else None, key_prefix=_key_prefix(run, seed),
            seed=seed,
        )
    except ValueError as err:
        _usage_error(str(err))
    settings = {"endpoint": endpoint, "max_concurrency": concurrency,
                "request_rate": rate if math.isfinite(rate) else "inf", "burstiness": burstiness, "url": url,
                "processes": processes}
    if repeat == 1:
        _run_and_report(plan, opts, limits, slo_ms=slo_ms, store=store, run_id=run, output=output,
                        fail_on_error=fail_on_error, processes=processes, settings=settings)
        return
    from tokentrace.app.bench.plan import repeat_run_ids, with_key_prefix

    for i, run_id in enumerate(repeat_run_ids(run, repeat), start=1):
        if output == "text":
            print(f"run {i} of {repeat}: {run_id}")
        _run_and_report(with_key_prefix(plan, _key_prefix(run_id, seed)), opts, limits, slo_ms=slo_ms, store=store,
                        run_id=run_id, output=output, fail_on_error=fail_on_error, processes=processes,
                        settings={**settings, "repeat": i, "repeats": repeat})


def _sessions_command(kind: str, *, url: str, endpoint: str, model: str, workload: str, time_scale: float,
                      length_scale: float, max_requests: int, duration: float, drain: float, concurrency: int,
                      tenants: str, slo_class_mix: str, slo: str, timeout: float, store: Path | None, run: str | None,
                      output: str, fail_on_error: bool, seed: int, num_sessions: int, session_rate: float | None,
                      think_time: str, turns: str, block_size: int) -> None:
    """``--sessions``: build the session plan, run it from this process, report as a request run does."""
    from dataclasses import replace

    from tokentrace.app.bench.client import RequestOptions
    from tokentrace.app.bench.plan import aligned_block_tokens, parse_mix, parse_tenants, resolve_workload_path
    from tokentrace.app.bench.runner import RunLimits
    from tokentrace.app.bench.sessions import (
        MIXES,
        ThinkTime,
        build_session_plan,
        describe_mix,
        mix_sessions,
        trace_sessions,
    )
    from tokentrace.app.bench.summary import parse_slo
    from tokentrace.app.bench.synthetic import LengthDist
    from tokentrace.app.bench.workloads import load_trace

    try:
        opts = RequestOptions(base_url=url, endpoint=endpoint, model=model, read_timeout_s=timeout)
        limits = RunLimits(duration_s=duration, drain_s=drain, concurrency=concurrency)
        slo_ms = parse_slo(slo) if slo else {}
        if num_sessions < 1:
            raise ValueError(f"--num-sessions must be >= 1, got {num_sessions}")
        if kind == "trace":
            path = resolve_workload_path("mooncake" if workload == "synthetic" else workload)
            loaded = load_trace(path, time_scale=time_scale, length_scale=length_scale, max_requests=max_requests)
            made = trace_sessions(loaded, seed=seed,
                                  block_tokens=aligned_block_tokens(loaded.scaling.block_tokens, block_size or None))
            desc = [f"sessions rebuilt from {loaded.scaling.describe()} (turns chained by hash-id prefix)"]
            rate = session_rate
        elif kind in MIXES:
            mix = MIXES[kind]
            if think_time:
                mix = replace(mix, think=ThinkTime.parse(think_time))
            if turns:
                mix = replace(mix, turns=LengthDist.parse(turns))
            made = mix_sessions(mix, num_sessions, length_scale=length_scale, time_scale=time_scale, seed=seed)
            desc = [describe_mix(mix, num_sessions=num_sessions)
                    + (f"; lengths x{length_scale:g}, think x{time_scale:g}" if (length_scale, time_scale) != (1, 1)
                       else "")]
            rate = 1.0 if session_rate is None else session_rate
        else:
            raise ValueError(f"unknown --sessions {kind!r}; choose agent, chat or trace")
        plan = build_session_plan(made, session_rate=rate, tenants=parse_tenants(tenants) if tenants else (),
                                  slo_mix=parse_mix(slo_class_mix) if slo_class_mix else None,
                                  key_prefix=_key_prefix(run, seed), seed=seed, description=desc,
                                  config={"workload": f"sessions:{kind}", "seed": seed})
    except ValueError as err:
        _usage_error(str(err))
    _run_sessions_and_report(plan, opts, limits, slo_ms=slo_ms, store=store, run_id=run, output=output,
                             fail_on_error=fail_on_error,
                             settings={"endpoint": endpoint, "max_concurrency": concurrency, "url": url,
                                       "sessions": kind})


def _run_sessions_and_report(plan: Any, opts: Any, limits: Any, *, slo_ms: dict[str, float], store: Path | None,
                             run_id: str | None, output: str, fail_on_error: bool, settings: dict[str, Any]) -> None:
    from dataclasses import replace

    from tokentrace.app.bench.progress import LiveProgress
    from tokentrace.app.bench.sessions import run_sessions
    from tokentrace.app.bench.summary import summarize

    if not opts.model:
        opts = replace(opts, model=_first_model(opts.base_url))
    settings = {**settings, "model": opts.model}
    info = sys.stderr if output == "json" else sys.stdout
    for line in plan.description:
        print(line, file=info)
    progress = LiveProgress(plan.num_turns) if output == "text" and sys.stderr.isatty() else None
    try:
        result, sent = run_sessions(plan, opts, limits, store=store, run_id=run_id, progress=progress,
                                    config={"settings": settings, "slo_ms": slo_ms})
    except OSError as err:
        _usage_error(f"cannot write the store {store}: {err}")
    _report(summarize(sent, result.outcomes, slo_ms=slo_ms, start_ns=result.start_ns,
                      settings={**settings, "run_id": result.run_id, "workload": plan.config}),
            result, output=output, fail_on_error=fail_on_error)


def _run_and_report(plan: Any, opts: Any, limits: Any, *, slo_ms: dict[str, float], store: Path | None,
                    run_id: str | None, output: str, fail_on_error: bool, processes: int,
                    settings: dict[str, Any]) -> None:
    from dataclasses import replace

    from tokentrace.app.bench.progress import LiveProgress
    from tokentrace.app.bench.runner import run_bench
    from tokentrace.app.bench.senders import SenderFailed
    from tokentrace.app.bench.summary import summarize

    if not opts.model:
        opts = replace(opts, model=_first_model(opts.base_url))
    settings = {**settings, "model": opts.model}
    info = sys.stderr if output == "json" else sys.stdout
    for line in plan.description:
        print(line, file=info)
    progress = LiveProgress(len(plan.requests)) if output == "text" and sys.stderr.isatty() else None
    try:
        result = run_bench(plan, opts, limits, store=store, run_id=run_id, progress=progress,
                           config={"settings": settings, "slo_ms": slo_ms}, processes=processes)
    except OSError as err:
        _usage_error(f"cannot write the store {store}: {err}")
    except SenderFailed as err:  # what came back before is in the store
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(EXIT_FAILED_REQUESTS) from None
    _report(summarize(plan.requests, result.outcomes, slo_ms=slo_ms, start_ns=result.start_ns,
                      settings={**settings, "run_id": result.run_id, "workload": plan.config}),
            result, output=output, fail_on_error=fail_on_error)


def _report(summary: Any, result: Any, *, output: str, fail_on_error: bool) -> None:
    """Print a finished run's summary (text or JSON) and where its client view went; with ``fail_on_error``,
    exit with ``EXIT_FAILED_REQUESTS`` when a request failed."""
    from tokentrace.app.bench.summary import render_text

    if output == "json":
        print(json.dumps(summary.as_dict(), indent=2, default=str))
    else:
        print(render_text(summary))
        if result.run_path is not None:
            print(f"client view recorded in {result.run_path} (run {result.run_id})")
    if fail_on_error and summary.num_failed:
        raise typer.Exit(EXIT_FAILED_REQUESTS)


def _key_prefix(run_id: str | None, seed: int) -> str:
    """Prefix of the X-Request-Id keys: unique per invocation so runs never share request ids."""
    import secrets

    return f"bench-{run_id or secrets.token_hex(4)}-s{seed}"


def _first_model(base_url: str) -> str:
    """The first model id from ``GET /v1/models``; "" if the server does not answer that."""
    import httpx

    try:
        resp = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=5.0)
        data = resp.json().get("data") or []
        return str(data[0].get("id", "")) if data else ""
    except (httpx.HTTPError, ValueError, AttributeError, IndexError):
        return ""


def _usage_error(message: str) -> NoReturn:
    usage_error(message)


def register(app: typer.Typer) -> None:
    app.command("bench")(bench_command)
