"""The demo's load: a slice of the Mooncake conversation trace, several tenants and SLO classes.

Built with the load generator's own machinery (:mod:`tokentrace.app.bench`), run in
the demo's process, recording the client's view into the same store run as the
traced server. The tenants file the server reads and the tenant mix the client
sends come from one table, :data:`DEMO_TENANTS`, so keys always match.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

__all__ = ["DEMO_TENANTS", "DEMO_SLO_MIX", "DemoTenant", "LoadSpec", "write_tenants_file", "build_load_plan",
           "run_load", "mean_output_tokens", "fit_to_context"]


@dataclass(frozen=True, slots=True)
class DemoTenant:
    """A tenant of the demo: name, API key, share of the requests, scheduling weight, default class."""

    name: str
    api_key: str
    share: float
    weight: float
    default_slo_class: str


DEMO_TENANTS: tuple[DemoTenant, ...] = (
    DemoTenant("acme", "sk-demo-acme", 0.5, 2.0, "interactive"),  # the big interactive customer
    DemoTenant("globex", "sk-demo-globex", 0.3, 1.0, "interactive"),
    DemoTenant("initech", "sk-demo-initech", 0.2, 1.0, "batch"),  # offline summarisation jobs
)
DEMO_SLO_MIX: dict[str, float] = {"interactive": 0.7, "batch": 0.3}
"""Share of requests per SLO class (the ``X-SLO-Class`` header each request sends)."""


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """What to replay and how it is scaled to the machine."""

    trace: Path
    num_requests: int
    time_scale: float  # x trace arrival times (< 1: faster)
    length_scale: float  # x prompt lengths (and output lengths unless output_scale is given)
    block_size: int = 16  # the server's KV block size: prompt blocks are aligned to it
    output_scale: float | None = None  # x output lengths; None: length_scale
    seed: int = 0
    duration_s: float = 240.0  # nothing is sent after this; in-flight requests then get drain_s
    drain_s: float = 60.0


def write_tenants_file(folder: Path) -> Path:
    """Write the server's tenants file (JSON) for :data:`DEMO_TENANTS` into ``folder``; its path."""
    doc = {"tenants": {t.name: {"api_keys": [t.api_key], "weight": t.weight,
                                "default_slo_class": t.default_slo_class} for t in DEMO_TENANTS}}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "demo-tenants.json"
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return path


def build_load_plan(spec: LoadSpec, *, key_prefix: str) -> Any:
    """The bench :class:`~tokentrace.app.bench.plan.Plan`: trace arrivals, tenants and classes.

    ``ValueError`` when the trace is missing or a scale is out of range.
    """
    from tokentrace.app.bench.arrivals import Arrivals
    from tokentrace.app.bench.plan import Tenant, build_plan

    tenants = [Tenant(t.name, t.api_key, t.share) for t in DEMO_TENANTS]
    plan = build_plan(workload=str(spec.trace), arrivals=Arrivals("trace"), max_requests=spec.num_requests,
                      time_scale=spec.time_scale, length_scale=spec.length_scale,
                      server_block_size=spec.block_size, tenants=tenants, slo_mix=dict(DEMO_SLO_MIX),
                      key_prefix=key_prefix, seed=spec.seed)
    if spec.output_scale is None or spec.output_scale == spec.length_scale:
        return plan
    return _with_output_lengths(plan, spec)


def _with_output_lengths(plan: Any, spec: LoadSpec) -> Any:
    """``plan`` with each request's output length taken from the trace at ``spec.output_scale``.

    Prompts are shortened much more than outputs (a CPU prefills a 13k-token prompt slowly, but a
    request of one or two output tokens has no per-token timing to show): the trace's own output
    lengths, scaled, are the requests' ``max_tokens`` (the load generator asks the server to ignore
    end-of-sequence, so each request produces exactly that many tokens).
    """
    from tokentrace.app.bench.workloads import load_trace

    if not (spec.output_scale is not None and spec.output_scale > 0):
        raise ValueError(f"--output-scale must be a positive number, got {spec.output_scale}")
    trace = load_trace(spec.trace, time_scale=spec.time_scale, length_scale=spec.output_scale,
                       max_requests=spec.num_requests)
    lengths = [r.num_output_tokens for r in trace.requests]
    if len(lengths) != len(plan.requests):  # the plan keeps the trace's requests in order: one length each
        raise ValueError(f"the trace has {len(lengths)} requests for a plan of {len(plan.requests)}")
    requests = tuple(dataclasses.replace(r, text=dataclasses.replace(r.text, max_tokens=n))
                     for r, n in zip(plan.requests, lengths))
    mean = sum(lengths) / len(lengths) if lengths else 0.0
    line = (f"output lengths x{spec.output_scale:g} of the trace's instead: {mean:.1f} tokens per request on "
            f"average ({min(lengths, default=0)}-{max(lengths, default=0)})")
    config = {**plan.config, "output_scale": spec.output_scale}
    return dataclasses.replace(plan, requests=requests, description=(*plan.description, line), config=config)


def fit_to_context(plan: Any, context_tokens: int) -> Any:
    """``plan`` with each prompt that would not fit a model of ``context_tokens`` positions cut at its end, so
    that its tokens (the text is ASCII and the reference models read one token per byte), the begin-of-sequence
    token and its output fit; a line of the description says how many were cut. ``plan`` itself when all fit."""
    requests, num_cut = [], 0
    for r in plan.requests:
        over = r.text.num_prompt_tokens + 1 + r.text.max_tokens - context_tokens
        if over > 0:
            num_cut += 1
            r = dataclasses.replace(r, text=dataclasses.replace(r.text, prompt=r.text.prompt[:max(
                len(r.text.prompt) - over, 1)]))
        requests.append(r)
    if num_cut == 0:
        return plan
    line = (f"{num_cut} of {len(requests)} prompt(s) cut at the end to fit the model's {context_tokens:,} positions "
            f"with their output")
    return dataclasses.replace(plan, requests=tuple(requests), description=(*plan.description, line))


def mean_output_tokens(plan: Any) -> float:
    """The planned output tokens per request, on average (what the demo promises per-token timing on)."""
    return sum(r.text.max_tokens for r in plan.requests) / len(plan.requests) if plan.requests else 0.0


def run_load(plan: Any, spec: LoadSpec, *, url: str, model: str, store: Path, run_id: str,
             console: Console) -> Any:
    """Send the plan to ``url``, recording the client view into ``store``/``run_id``; the BenchRun.

    Blocks until every request finished or the duration and drain bounds cut it.
    A Ctrl-C cancels the in-flight requests, closes the recorder (what arrived is
    stored) and re-raises ``KeyboardInterrupt``. ``OSError`` if the store cannot be written.
    """
    from tokentrace.app.bench.client import RequestOptions
    from tokentrace.app.bench.progress import LiveProgress
    from tokentrace.app.bench.runner import RunLimits, run_bench

    opts = RequestOptions(base_url=url, model=model, read_timeout_s=120.0)
    limits = RunLimits(duration_s=spec.duration_s, drain_s=spec.drain_s)
    progress = LiveProgress(len(plan.requests), console=console, refresh_per_s=2.0)
    config = {"settings": {"url": url, "model": model, "launcher": "tokentrace demo"}}
    # The server's tenant weights go into the run's manifest, where the tenants analyzer reads them.
    tenants = {t.name: {"weight": t.weight, "default_slo_class": t.default_slo_class} for t in DEMO_TENANTS}
    return run_bench(plan, opts, limits, store=store, run_id=run_id, progress=progress, config=config,
                     run_config={"tenants": tenants})
