"""The run's plan: which requests to send, when, as which tenant and SLO class.

:func:`build_plan` combines a workload (synthetic, or a replayed Azure / Mooncake
trace, scaled as the user asked), an arrival process, a tenant mix and an SLO
class mix into a list of :class:`~tokentrace.app.bench.requests.PlannedRequest`,
deterministically for a given seed. The scaling and every choice are returned
in :attr:`Plan.config` for the run's manifest and the printed summary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from tokentrace.app.bench.arrivals import Arrivals
from tokentrace.app.bench.prefix import PREFIX_BOUND_KEY, prefix_bound
from tokentrace.app.bench.requests import PlannedRequest, TextRequest
from tokentrace.app.bench.synthetic import SyntheticSpec, random_text, synthetic_requests
from tokentrace.app.bench.workloads import Workload, build_prompt, default_traces_dir, load_trace

__all__ = ["TRACE_FILES", "Tenant", "Plan", "parse_tenants", "parse_mix", "resolve_workload_path",
           "trace_text_requests", "build_plan", "repeat_run_ids", "with_key_prefix"]

TRACE_FILES: dict[str, str] = {
    "azure-code": "azure_llm_2023_code.csv",
    "azure-conv": "azure_llm_2023_conv.csv",
    "mooncake": "mooncake_conversation.jsonl",
}
"""Named workloads -> files of ``../shared/data/traces``."""
TRACE_ORIGINS: dict[str, str] = {
    "azure-code": "Azure/AzurePublicDataset, data/AzureLLMInferenceTrace_code.csv, CC-BY 4.0",
    "azure-conv": "Azure/AzurePublicDataset, data/AzureLLMInferenceTrace_conv.csv, CC-BY 4.0",
    "mooncake": "kvcache-ai/Mooncake, FAST25-release/traces/conversation_trace.jsonl, Apache-2.0",
}
"""Where each named workload's file comes from (repository, path, licence), for the error when it is absent."""


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant of a multi-tenant mix: name, API key and share of the requests."""

    name: str
    api_key: str
    share: float


@dataclass(frozen=True, slots=True)
class Plan:
    """Requests in send order plus what produced them (for the manifest and the printout)."""

    requests: tuple[PlannedRequest, ...]
    description: tuple[str, ...]  # human lines: workload, scaling, arrivals, tenants
    config: dict[str, Any] = field(default_factory=dict)  # JSON-ready, goes into the manifest


def parse_tenants(spec: str) -> list[Tenant]:
    """Parse ``name:key:share,...`` (share optional, default 1; shares are relative weights)."""
    tenants = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        fields = part.split(":")
        if len(fields) not in (2, 3) or not fields[0] or not fields[1]:
            raise ValueError(f"bad tenant {part!r}; expected name:api_key[:share], e.g. acme:sk-acme:0.7")
        try:
            share = float(fields[2]) if len(fields) == 3 else 1.0
        except ValueError:
            raise ValueError(f"bad tenant share in {part!r}: not a number") from None
        if not (share > 0 and math.isfinite(share)):
            raise ValueError(f"tenant share must be positive in {part!r}")
        tenants.append(Tenant(fields[0], fields[1], share))
    if not tenants:
        raise ValueError("--tenants is empty; expected name:api_key[:share],...")
    return tenants


def parse_mix(spec: str) -> dict[str, float]:
    """Parse an SLO class mix ``interactive:0.8,batch:0.2`` (relative weights, normalized)."""
    mix: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, sep, weight = part.partition(":")
        try:
            w = float(weight) if sep else 1.0
        except ValueError:
            raise ValueError(f"bad SLO class weight in {part!r}: not a number") from None
        if not name or not (w > 0 and math.isfinite(w)):
            raise ValueError(f"bad SLO class mix entry {part!r}; expected name:weight with weight > 0")
        mix[name] = mix.get(name, 0.0) + w
    if not mix:
        raise ValueError("--slo-class-mix is empty; expected name:weight,...")
    total = sum(mix.values())
    return {k: v / total for k, v in mix.items()}


def resolve_workload_path(workload: str, traces_dir: Path | None = None) -> Path:
    """The trace file for a named workload (``azure-code``, ...) or a path; ``ValueError`` if absent."""
    if workload in TRACE_FILES:
        path = (traces_dir or default_traces_dir()) / TRACE_FILES[workload]
    else:
        path = Path(workload)
    if not path.is_file():
        origin = f"; it is {TRACE_ORIGINS[workload]} (put it there or point TOKENTRACE_TRACES at its folder)" \
            if workload in TRACE_ORIGINS else ""
        raise ValueError(f"workload {workload!r}: trace file {path} not found{origin} (named workloads: synthetic, "
                         f"{', '.join(TRACE_FILES)}, or a .csv/.jsonl path; without a trace: --workload synthetic, "
                         f"or --sessions chat or agent)")
    return path


def trace_text_requests(workload: Workload, *, block_tokens: int, seed: int = 0) -> list[TextRequest]:
    """Text for each trace request: Mooncake prompts follow their hash ids block by block
    (:func:`~tokentrace.app.bench.workloads.build_prompt`); others are random text of the trace's length."""
    rng = np.random.default_rng(seed)
    out = []
    for i, req in enumerate(workload.requests):
        if req.hash_ids:
            prompt = build_prompt(req, block_tokens=block_tokens, salt=seed * 1_000_003 + i)
        else:
            prompt = random_text(req.num_prompt_tokens, rng)
        out.append(TextRequest("", prompt, req.num_output_tokens))
    return out


def aligned_block_tokens(block_tokens: int, server_block_size: int | None) -> int:
    """Mooncake block length rounded to a multiple of the server's KV block size (at least one block)."""
    if not server_block_size:
        return block_tokens
    if server_block_size < 1:
        raise ValueError(f"server block size must be >= 1, got {server_block_size}")
    return max(1, round(block_tokens / server_block_size)) * server_block_size


def build_plan(
    *,
    workload: str = "synthetic",
    synthetic: SyntheticSpec | None = None,
    arrivals: Arrivals = Arrivals(),
    max_requests: int = 100,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    server_block_size: int | None = None,
    tenants: Sequence[Tenant] = (),
    slo_mix: dict[str, float] | None = None,
    key_prefix: str = "bench",
    seed: int = 0,
) -> Plan:
    """The plan for one run (see module doc). ``ValueError`` for bad input.

    Trace workloads keep the first ``max_requests`` requests of the file (scaled by
    ``time_scale`` and ``length_scale``); the arrival kind ``trace`` uses their
    timestamps, other kinds ignore them. ``server_block_size`` aligns Mooncake prompt
    blocks to the server's KV blocks.
    """
    if max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests}")
    texts, trace_offsets, desc, config = _workload_texts(workload, synthetic, max_requests, time_scale,
                                                         length_scale, server_block_size, seed)
    offsets = arrivals.offsets(len(texts), seed=seed + 1, trace_offsets_s=trace_offsets)
    desc.append(f"arrivals: {arrivals.describe()}")
    config["arrivals"] = {"kind": arrivals.kind, "rate": _json_float(arrivals.rate),
                          "burstiness": arrivals.burstiness}
    rng = np.random.default_rng(seed + 2)
    tenant_of = _assign([t.share for t in tenants], len(texts), rng)
    mix = slo_mix or {}
    class_of = _assign(list(mix.values()), len(texts), rng)
    classes = list(mix)
    if tenants:
        desc.append("tenants: " + ", ".join(f"{t.name} {t.share:g}" for t in tenants))
        config["tenants"] = [{"name": t.name, "share": t.share} for t in tenants]  # keys stay out of the manifest
    if mix:
        desc.append("SLO classes: " + ", ".join(f"{k} {v:.0%}" for k, v in mix.items()))
        config["slo_class_mix"] = mix
    requests = tuple(
        PlannedRequest(
            index=i, key=f"{key_prefix}-{i:06d}", text=text, offset_s=float(offsets[i]),
            tenant=tenants[tenant_of[i]].name if tenants else "",
            api_key=tenants[tenant_of[i]].api_key if tenants else "",
            slo_class=classes[class_of[i]] if classes else "",
        )
        for i, text in enumerate(texts)
    )
    return Plan(requests, tuple(desc), config)


def repeat_run_ids(run_id: str | None, repeat: int) -> list[str]:
    """Run ids of ``repeat`` runs of one plan (``tokentrace bench --repeat``): ``<run_id>-1`` ... ``-<repeat>``,
    or, without a run id, a fresh common stem (``bench-<8 hex digits>``) numbered the same way."""
    import secrets

    stem = run_id or f"bench-{secrets.token_hex(4)}"
    return [f"{stem}-{i}" for i in range(1, repeat + 1)]


def with_key_prefix(plan: Plan, key_prefix: str) -> Plan:
    """The plan with its requests' keys (``X-Request-Id``) under another prefix, so that a repeated run never
    sends a key an earlier run sent; everything else the same."""
    return replace(plan, requests=tuple(replace(r, key=f"{key_prefix}-{r.index:06d}") for r in plan.requests))


def _workload_texts(workload: str, synthetic: SyntheticSpec | None, max_requests: int, time_scale: float,
                    length_scale: float, server_block_size: int | None, seed: int
                    ) -> tuple[list[TextRequest], list[float] | None, list[str], dict[str, Any]]:
    """(texts, trace arrival offsets or None, description lines, manifest config) of a workload."""
    config: dict[str, Any] = {"workload": workload, "seed": seed}
    if workload == "synthetic":
        spec = synthetic or SyntheticSpec()
        config["synthetic"] = spec.as_dict()
        return synthetic_requests(spec, max_requests, seed=seed), None, [spec.describe()], config
    loaded = load_trace(resolve_workload_path(workload), time_scale=time_scale,
                        length_scale=length_scale, max_requests=max_requests)
    block_tokens = aligned_block_tokens(loaded.scaling.block_tokens, server_block_size)
    texts = trace_text_requests(loaded, block_tokens=block_tokens, seed=seed)
    desc = [f"workload {loaded.scaling.describe()}"]
    config["scaling"] = {**loaded.scaling.as_dict(), "prompt_block_tokens": block_tokens}
    if any(r.hash_ids for r in loaded.requests):
        desc.append(f"prompt blocks of {block_tokens} tokens follow the trace's hash ids")
        config[PREFIX_BOUND_KEY] = prefix_bound(loaded.requests, block_tokens=block_tokens,
                                                server_block_size=server_block_size)
    return texts, [r.arrival_s for r in loaded.requests], desc, config


def _assign(weights: list[float], n: int, rng: np.random.Generator) -> np.ndarray:
    """Index of the weighted choice for each of ``n`` requests (zeros when no weights)."""
    if not weights:
        return np.zeros(n, dtype=np.int64)
    p = np.asarray(weights, dtype=float)
    return rng.choice(len(p), size=n, p=p / p.sum())


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else "inf"
