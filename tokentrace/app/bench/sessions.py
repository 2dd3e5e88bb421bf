"""Session workloads: multi-turn conversations and agent loops whose context grows turn by turn.

A session is a run of turns. Turn 0's prompt is the session's opening input (a task and
its context); turn ``k``'s prompt is turn ``k-1``'s prompt, turn ``k-1``'s answer (the text
the server streamed back) and turn ``k``'s new input, so every turn's prompt starts with
everything the session said before: a server that kept the session's KV serves that prefix
from its cache. Between turns the session *thinks* (a user reading, a tool call running)
for a time drawn from a distribution or taken from a trace; the next turn is sent that
long after the previous answer completed. Sessions (not requests) arrive open-loop.

Mixes (:data:`MIXES`), lengths in byte tokens and times in seconds before scaling:

* ``agent``: 4-8 short turns on a long context: a 1024-token task, 64-token tool results,
  24-token tool calls, 0.2-1 s tool-call time;
* ``chat``: 2-5 turns: a 256-token opening, 64-token follow-ups, 128-token answers,
  1-4 s of reading time.

:func:`trace_sessions` rebuilds sessions from a Mooncake trace instead: a request whose
hash ids extend an earlier request's (all but possibly its last, partial, block) is that
conversation's next turn; its new input is what its prompt adds to the previous prompt and
answer, and its think time is the trace's gap between the two turns' arrivals (in the
original service that gap also held the previous answer's generation).

Scaling keeps prefixes faithful: ``length_scale`` multiplies the opening, new-input and
answer lengths of every turn, and each turn is still built by appending to the previous
one, so a turn's prefix is exactly the previous turn's context whatever the scale.
Every request carries ``X-Session-Id`` and ``X-Session-Turn``.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from tokentrace.app.bench.client import RequestOptions, new_pool, send_request
from tokentrace.app.bench.dispatch import Listener, RunLimits
from tokentrace.app.bench.plan import Tenant
from tokentrace.app.bench.progress import NullProgress, ProgressListener
from tokentrace.app.bench.requests import Outcome, PlannedRequest, TextRequest
from tokentrace.app.bench.runner import BENCH_CONFIG_KEY, BenchRun, OutcomeCollector, open_recorder
from tokentrace.app.bench.synthetic import LengthDist, random_text
from tokentrace.app.bench.workloads import Workload, build_prompt
from tokentrace.store.manifest import read_manifest
from tokentrace.store.writer import StoreWriter

__all__ = ["ThinkTime", "SessionMix", "MIXES", "TurnSpec", "SessionSpec", "SessionPlan", "mix_sessions",
           "trace_sessions", "build_session_plan", "drive_sessions", "run_sessions", "describe_mix"]


@dataclass(frozen=True, slots=True)
class ThinkTime:
    """Seconds between a turn's answer and the next turn: ``fixed:S``, ``uniform:A-B``,
    ``exp:mean=M`` or ``lognormal:median=M,sigma=S``."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> "ThinkTime":
        kind, _, params = spec.strip().partition(":")
        kind = kind.strip().lower()
        try:
            if kind == "fixed":
                out = cls("fixed", float(params))
            elif kind == "uniform":
                lo, _, hi = params.partition("-")
                out = cls("uniform", float(lo), float(hi))
            elif kind in ("exp", "lognormal"):
                named = dict(p.split("=", 1) for p in params.split(",") if p.strip())
                named = {k.strip(): float(v) for k, v in named.items()}
                out = (cls("exp", named["mean"]) if kind == "exp"
                       else cls("lognormal", named["median"], named.get("sigma", 1.0)))
            else:
                raise ValueError(kind)
        except (ValueError, KeyError):
            raise ValueError(f"bad think time {spec!r}; use fixed:S, uniform:A-B, exp:mean=M or "
                             "lognormal:median=M,sigma=S (seconds)") from None
        if not all(math.isfinite(x) and x >= 0 for x in (out.a, out.b)) or (kind == "uniform" and out.b < out.a):
            raise ValueError(f"bad think time {spec!r}: seconds must be finite, >= 0 and in order")
        return out

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, self.a)
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b, n)
        if self.kind == "exp":
            return rng.exponential(self.a, n)
        return np.exp(rng.normal(math.log(max(self.a, 1e-9)), self.b, n))

    def describe(self) -> str:
        return {"fixed": f"{self.a:g} s", "uniform": f"uniform {self.a:g}-{self.b:g} s",
                "exp": f"exponential, mean {self.a:g} s"}.get(self.kind, f"lognormal, median {self.a:g} s")


@dataclass(frozen=True, slots=True)
class SessionMix:
    """A kind of session: how many turns, how long each part, how long the think time."""

    name: str
    turns: LengthDist
    opening: LengthDist  # turn 0's input, tokens
    new_input: LengthDist  # each later turn's new input (user message, tool result), tokens
    answer: LengthDist  # max_tokens of each turn
    think: ThinkTime


MIXES: dict[str, SessionMix] = {
    "agent": SessionMix("agent", LengthDist.parse("uniform:4-8"), LengthDist.parse("fixed:1024"),
                        LengthDist.parse("uniform:32-96"), LengthDist.parse("uniform:16-32"),
                        ThinkTime.parse("uniform:0.2-1")),
    "chat": SessionMix("chat", LengthDist.parse("uniform:2-5"), LengthDist.parse("fixed:256"),
                       LengthDist.parse("uniform:32-96"), LengthDist.parse("fixed:128"),
                       ThinkTime.parse("uniform:1-4")),
}
"""The named session mixes (see the module doc)."""


@dataclass(frozen=True, slots=True)
class TurnSpec:
    """One turn: its new input's text (turn 0: the opening), its answer length, the think time after it."""

    new_input: str
    max_tokens: int
    think_s: float  # after this turn's answer, before the next turn (ignored after the last)


@dataclass(frozen=True, slots=True)
class SessionSpec:
    """One session: when it starts, as whom, and its turns."""

    index: int
    session_id: str  # sent as X-Session-Id
    start_s: float  # offset of turn 0 from the run start
    turns: tuple[TurnSpec, ...]
    tenant: str = ""
    api_key: str = ""
    slo_class: str = ""


@dataclass(frozen=True, slots=True)
class SessionPlan:
    """Sessions in start order plus what produced them (for the manifest and the printout)."""

    sessions: tuple[SessionSpec, ...]
    description: tuple[str, ...]
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def num_turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


def _scaled(n: int, length_scale: float) -> int:
    return max(1, round(n * length_scale))


def mix_sessions(mix: SessionMix, num_sessions: int, *, length_scale: float = 1.0, time_scale: float = 1.0,
                 seed: int = 0) -> list[tuple[list[TurnSpec], float]]:
    """Turns of ``num_sessions`` sessions of ``mix`` (scaled), each with a start offset of 0
    (the arrival process sets them)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_sessions):
        n = int(mix.turns.sample(1, rng)[0])
        inputs = [int(mix.opening.sample(1, rng)[0])] + [int(x) for x in mix.new_input.sample(n - 1, rng)]
        answers = mix.answer.sample(n, rng)
        thinks = mix.think.sample(n, rng)
        turns = [TurnSpec(random_text(_scaled(inputs[k], length_scale), rng), _scaled(int(answers[k]), length_scale),
                          float(thinks[k]) * time_scale) for k in range(n)]
        out.append((turns, 0.0))
    return out


def trace_sessions(workload: Workload, *, seed: int = 0,
                   block_tokens: int | None = None) -> list[tuple[list[TurnSpec], float]]:
    """Sessions rebuilt from a Mooncake trace's hash ids (see the module doc), with their trace start
    offsets. The workload's lengths and times come scaled by its reader. A session's opening follows
    its hash ids block by block (:func:`~tokentrace.app.bench.workloads.build_prompt`, blocks of
    ``block_tokens``, default the workload's), so sessions that share a prefix in the trace (a system
    prompt) share it here too; later turns' new input is unique to the session."""
    rng = np.random.default_rng(seed)
    block = block_tokens or workload.scaling.block_tokens
    chains: list[list[Any]] = []  # [last hash ids, [requests]]
    for req in workload.requests:
        best, best_len = None, 0
        for chain in chains:
            last = chain[0]
            k = 0
            for a, b in zip(last, req.hash_ids):
                if a != b:
                    break
                k += 1
            if k > max(best_len, 1) and k >= len(last) - 1:
                best, best_len = chain, k
        if best is None:
            chains.append([req.hash_ids, [req]])
        else:
            best[0] = req.hash_ids
            best[1].append(req)
    out = []
    for _, reqs in chains:
        turns = []
        context = 0
        for k, r in enumerate(reqs):
            new = r.num_prompt_tokens if k == 0 else max(1, r.num_prompt_tokens - context)
            think = reqs[k + 1].arrival_s - r.arrival_s if k + 1 < len(reqs) else 0.0
            text = (build_prompt(r, block_tokens=block, salt=seed * 1_000_003 + len(out)) if k == 0
                    else random_text(new, rng))
            turns.append(TurnSpec(text, r.num_output_tokens, max(0.0, think)))
            context += new + r.num_output_tokens
        out.append((turns, reqs[0].arrival_s))
    out.sort(key=lambda item: item[1])
    return out


def build_session_plan(sessions: Sequence[tuple[list[TurnSpec], float]], *, session_rate: float | None,
                       tenants: Sequence[Tenant] = (), slo_mix: dict[str, float] | None = None,
                       key_prefix: str = "bench", seed: int = 0, description: Sequence[str] = (),
                       config: dict[str, Any] | None = None) -> SessionPlan:
    """Sessions with start offsets (Poisson at ``session_rate`` sessions/s; ``None``: the offsets
    given, e.g. a trace's), tenants and SLO classes drawn per session. ``ValueError`` for bad input."""
    if not sessions:
        raise ValueError("the session workload has no sessions")
    rng = np.random.default_rng(seed + 3)
    if session_rate is not None:
        if not session_rate > 0:
            raise ValueError(f"--session-rate must be positive, got {session_rate}")
        gaps = rng.exponential(1.0 / session_rate, len(sessions)) if math.isfinite(session_rate) else \
            np.zeros(len(sessions))
        starts = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    else:
        starts = np.asarray([s for _, s in sessions], dtype=float)
    tenant_of = rng.choice(len(tenants), size=len(sessions), p=_norm([t.share for t in tenants])) if tenants else None
    classes = list(slo_mix or {})
    class_of = rng.choice(len(classes), size=len(sessions), p=_norm(list(slo_mix.values()))) if slo_mix else None
    specs = []
    for i, (turns, _) in enumerate(sessions):
        t = tenants[tenant_of[i]] if tenant_of is not None else None
        specs.append(SessionSpec(i, f"{key_prefix}-sess{i:05d}", float(starts[i]), tuple(turns),
                                 t.name if t else "", t.api_key if t else "",
                                 classes[class_of[i]] if class_of is not None else ""))
    plan_config = dict(config or {})
    plan_config["sessions"] = {"num_sessions": len(specs), "num_turns": sum(len(s.turns) for s in specs),
                               "session_rate": "trace" if session_rate is None else _json_float(session_rate)}
    if tenants:
        plan_config["tenants"] = [{"name": t.name, "share": t.share} for t in tenants]
    desc = [*description, f"{len(specs)} sessions, {plan_config['sessions']['num_turns']} turns, "
            + ("starts from the trace" if session_rate is None else f"{session_rate:g} sessions/s (Poisson)")]
    return SessionPlan(tuple(specs), tuple(desc), plan_config)


def _norm(weights: list[float]) -> np.ndarray:
    p = np.asarray(weights, dtype=float)
    return p / p.sum()


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else "inf"


async def drive_sessions(plan: SessionPlan, opts: RequestOptions, limits: RunLimits, *,
                         listener: Listener) -> tuple[list[PlannedRequest], list[Outcome], int]:
    """Run every session of ``plan`` (see the module doc) on this event loop; the requests sent, their
    outcomes (in completion order) and the run start (monotonic ns). A session ends early when a turn
    fails or the duration bound passes; turns in flight ``drain_s`` after it are cancelled."""
    sent: list[PlannedRequest] = []
    outcomes: list[Outcome] = []
    sem = asyncio.Semaphore(limits.concurrency) if limits.concurrency else None
    counter = itertools.count()
    async with new_pool(opts) as pool:
        start_ns = time.monotonic_ns()
        deadline_ns = start_ns + int(limits.duration_s * 1e9)

        async def session(spec: SessionSpec) -> None:
            await _sleep_until(start_ns + int(spec.start_s * 1e9))
            context = ""  # completions: the whole text so far
            messages: list[tuple[str, str]] = []  # chat: the history
            for k, turn in enumerate(spec.turns):
                if time.monotonic_ns() > deadline_ns:
                    return
                context += turn.new_input
                messages.append(("user", turn.new_input))
                req = PlannedRequest(
                    index=next(counter), key=f"{spec.session_id}-t{k:03d}",
                    text=TextRequest("", context, turn.max_tokens),
                    offset_s=(time.monotonic_ns() - start_ns) / 1e9, tenant=spec.tenant, api_key=spec.api_key,
                    slo_class=spec.slo_class, session=spec.session_id, session_turn=k,
                    messages=tuple(messages) if opts.endpoint == "chat" else ())
                sent.append(req)
                listener.on_sent(req)
                if sem is not None:
                    await sem.acquire()
                try:
                    outcome = await send_request(pool, req, opts, keep_text=True)
                finally:
                    if sem is not None:
                        sem.release()
                outcomes.append(outcome)
                listener.on_done(req, replace(outcome, text=""))
                if not outcome.ok:
                    return
                context += outcome.text
                messages.append(("assistant", outcome.text))
                if k + 1 < len(spec.turns):
                    await asyncio.sleep(turn.think_s)

        tasks = [asyncio.create_task(session(s)) for s in plan.sessions]
        done, pending = await asyncio.wait(tasks, timeout=limits.duration_s + limits.drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:  # a failure of this code (never a request's: those are outcomes) is not hidden
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    return sent, outcomes, start_ns


async def _sleep_until(t_ns: int) -> None:
    delay = (t_ns - time.monotonic_ns()) / 1e9
    if delay > 0:
        await asyncio.sleep(delay)


def describe_mix(mix: SessionMix, *, num_sessions: int) -> str:
    return (f"{num_sessions} {mix.name} sessions: {mix.turns.describe()} turns, opening {mix.opening.describe()}, "
            f"new input {mix.new_input.describe()}, answers {mix.answer.describe()} tokens, "
            f"think {mix.think.describe()}")


def run_sessions(plan: SessionPlan, opts: RequestOptions, limits: RunLimits, *, store: str | Path | None = None,
                 run_id: str | None = None, progress: ProgressListener | None = None,
                 config: dict[str, Any] | None = None,
                 run_config: dict[str, Any] | None = None) -> tuple[BenchRun, list[PlannedRequest]]:
    """Run a session plan from this process, recording into ``store`` if given (as
    :func:`~tokentrace.app.bench.runner.run_bench` does for a request plan). Returns the run and the
    requests sent (the plan's turns, as they were built). ``run_config`` goes into the manifest at the top level
    (e.g. the server's tenant weights)."""
    recorder = None
    if store is not None:
        recorder = open_recorder(store, run_id=run_id, config={
            **(run_config or {}), BENCH_CONFIG_KEY: {**plan.config, **(config or {}), "processes": 0}})
    collector = OutcomeCollector(recorder, progress or NullProgress())
    try:
        sent, outcomes, start_ns = asyncio.run(drive_sessions(plan, opts, limits, listener=collector))
    finally:
        if progress is not None:
            progress.close()
        if recorder is not None:
            recorder.close()
    by_index = {o.index: o for o in outcomes}
    ordered = tuple(replace(by_index[r.index], text="") for r in sent if r.index in by_index)
    if recorder is None:
        return BenchRun(ordered, plan.num_turns, start_ns=start_ns), sent
    sink = recorder.sink
    assert isinstance(sink, StoreWriter)
    recorded = BENCH_CONFIG_KEY in read_manifest(sink.run_path).get("config", {})
    return BenchRun(ordered, plan.num_turns, sink.run_id, sink.run_path, recorder.counters, recorded,
                    start_ns), sent
