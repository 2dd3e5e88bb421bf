"""The demo's session load (``tokentrace demo --sessions agent``): multi-turn sessions instead of the trace's
single requests, from the demo's tenants, against a server that keeps (or not) each session's KV between turns.

Built with the load generator's session machinery (:mod:`tokentrace.app.bench.sessions`): each turn's prompt is
the previous prompt, the previous answer and new input; the next turn is sent the think time after the answer.
Lengths are scaled to a CPU like the trace replay's (the agent mix's 1024-token task becomes 64 tokens at
``length_scale`` 1/16); the scaling is printed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from tokentrace.app.demo.load import DEMO_SLO_MIX, DEMO_TENANTS

__all__ = ["SESSION_MIXES", "SessionLoadSpec", "build_session_load", "run_session_load"]

SESSION_MIXES = ("agent", "chat")


class SessionLoadSpec:
    """What the session load sends: a mix, how many sessions, how fast they start, how it is scaled."""

    __slots__ = ("mix", "num_sessions", "session_rate", "length_scale", "time_scale", "seed", "duration_s",
                 "drain_s")

    def __init__(self, mix: str, *, num_sessions: int, session_rate: float, length_scale: float,
                 time_scale: float, seed: int = 0, duration_s: float = 150.0, drain_s: float = 30.0) -> None:
        if mix not in SESSION_MIXES:
            raise ValueError(f"unknown session mix {mix!r}; choose one of {', '.join(SESSION_MIXES)}")
        if num_sessions < 1:
            raise ValueError(f"the session count must be >= 1, got {num_sessions}")
        if not (length_scale > 0 and time_scale > 0):
            raise ValueError("--length-scale and --time-scale must be positive")
        self.mix, self.num_sessions, self.session_rate = mix, num_sessions, session_rate
        self.length_scale, self.time_scale, self.seed = length_scale, time_scale, seed
        self.duration_s, self.drain_s = duration_s, drain_s


def build_session_load(spec: SessionLoadSpec, *, key_prefix: str) -> Any:
    """The :class:`~tokentrace.app.bench.sessions.SessionPlan`: sessions of the mix from the demo's tenants."""
    from tokentrace.app.bench.plan import Tenant
    from tokentrace.app.bench.sessions import MIXES, build_session_plan, describe_mix, mix_sessions

    mix = MIXES[spec.mix]
    made = mix_sessions(mix, spec.num_sessions, length_scale=spec.length_scale, time_scale=spec.time_scale,
                        seed=spec.seed)
    desc = [describe_mix(mix, num_sessions=spec.num_sessions)
            + f"; lengths x{spec.length_scale:g}, think times x{spec.time_scale:g}"]
    return build_session_plan(made, session_rate=spec.session_rate,
                              tenants=[Tenant(t.name, t.api_key, t.share) for t in DEMO_TENANTS],
                              slo_mix=dict(DEMO_SLO_MIX), key_prefix=key_prefix, seed=spec.seed, description=desc,
                              config={"workload": f"sessions:{spec.mix}", "seed": spec.seed})


def run_session_load(plan: Any, spec: SessionLoadSpec, *, url: str, model: str, store: Path, run_id: str,
                     console: Console) -> Any:
    """Run the sessions against ``url``, recording the client view into ``store``/``run_id``; the BenchRun."""
    from tokentrace.app.bench.client import RequestOptions
    from tokentrace.app.bench.progress import LiveProgress
    from tokentrace.app.bench.runner import RunLimits
    from tokentrace.app.bench.sessions import run_sessions

    opts = RequestOptions(base_url=url, model=model, read_timeout_s=120.0)
    limits = RunLimits(duration_s=spec.duration_s, drain_s=spec.drain_s)
    progress = LiveProgress(plan.num_turns, console=console, refresh_per_s=2.0)
    tenants = {t.name: {"weight": t.weight, "default_slo_class": t.default_slo_class} for t in DEMO_TENANTS}
    result, _ = run_sessions(plan, opts, limits, store=store, run_id=run_id, progress=progress,
                             config={"settings": {"url": url, "model": model, "launcher": "tokentrace demo"}},
                             run_config={"tenants": tenants})
    return result
