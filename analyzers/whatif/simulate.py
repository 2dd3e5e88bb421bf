"""Discrete-event replay of a workload through a deployment of simulated engines.

Events, in time order (ns): a request reaches an engine (its gateway arrival plus its own gateway time);
an engine starts a step (right away when it was idle, else after the busy gap that follows its previous
step) or ends one (the step-time model of its role). Routing sends each request to the engine of its pool
with the fewest requests in it (the earliest engine on a tie), as a load-aware router does.

Disaggregated deployments: a request's prefill engine generates its first token and frees its blocks; after
the hand-over time (the fitted KV transfer) the request joins the least-loaded decode engine as running,
its KV in place, or waits and recomputes when the decode engine has no room. Colocated engines do both.

Instances are dedicated devices: each engine runs at the speed its role's step-time model says whatever
the number of engines (see docs/whatif.md for what this means on a machine whose CPUs they share).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from analyzers.whatif.engine_model import SimEngine, SimRequest, SimStep
from analyzers.whatif.models import StageCosts, StepTimeModel
from tokentrace.schema import Role

__all__ = ["EngineSetup", "Deployment", "Arrival", "Outcome", "StepRecord", "simulate"]


@dataclass(frozen=True, slots=True)
class EngineSetup:
    """One engine to simulate: its role, limits and step-time model."""

    role: Role
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_device_blocks: int
    scheduling_policy: str
    chunked_prefill: bool
    model: StepTimeModel

    def build(self) -> SimEngine:
        return SimEngine(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                         block_size=self.block_size, num_device_blocks=self.num_device_blocks,
                         scheduling_policy=self.scheduling_policy, chunked_prefill=self.chunked_prefill)


@dataclass(frozen=True, slots=True)
class Deployment:
    """Engines (colocated, or prefill and decode pools) and the costs around them."""

    engines: tuple[EngineSetup, ...]
    stages: StageCosts

    @property
    def is_disaggregated(self) -> bool:
        return any(e.role is Role.PREFILL for e in self.engines)


@dataclass(frozen=True, slots=True)
class Arrival:
    """A request to replay (ns)."""

    rid: int
    arrival_ns: int  # at the server (gateway)
    gateway_ns: int  # arrival -> its engine
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    slo_class: str
    ttft_target_ns: int
    priority: int
    tenant: str
    first_visible_index: int = 0  # tokens before the first with visible text: they go out with it


@dataclass(slots=True)
class Outcome:
    """A replayed request: when each of its tokens reached the client (ns); empty if never served."""

    arrival: Arrival
    delivered_ns: list[int] = field(default_factory=list)
    num_preemptions: int = 0


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One simulated engine step, as a tracer would record it (ns)."""

    engine: int  # index into the deployment's engines
    step: int  # the engine's step number, from 0
    start_ns: int
    end_ns: int
    plan: SimStep
    num_waiting: int  # after scheduling
    num_running: int


_ARRIVE, _START, _END, _HANDOFF = 0, 1, 2, 3  # event kinds; at equal times arrivals come first


def simulate(deployment: Deployment, arrivals: list[Arrival], *, seed: int | None = 0,
             record: Callable[[StepRecord], None] | None = None, phase: float = 0.0) -> list[Outcome]:
    """Replay ``arrivals`` through ``deployment``; one outcome per arrival, in the same order.

    ``seed``: each step's duration is its model's mean times one of the model's measured ratios of steps of its
    kind (with or without prefill tokens), and each busy gap one of its measured gaps, drawn with this seed;
    ``None``: the means alone (no variation). Which ratio (the model's ``variation``): ``ratio``, drawn at random
    and kept for the next step with the model's persistence (as a quantile, so a slow period slows both kinds
    alike); ``residual``, a measured residual added instead; ``timeline``, the ratio of the run's own step that
    started nearest the same moment (as a quantile among its kind's; the run's time from its start again past
    its end), so that the run's slow and fast periods fall where they fell. Nearest start, not the step in
    progress: a step that was long by its own variation covers more of the run's time, and taking the one in
    progress picked it more often (the replay of one run 2-5% over each request's TPOT). ``phase``: with
    ``timeline``, the replay at time ``t`` reads the run at ``t`` plus this share of the run's span (wrapping
    around): 0 puts the run's slow periods where they were, another value as much later in the replay (a run of
    another configuration meets the machine's slow periods at other moments). ``record``: called with every
    step when it ends."""
    sim = _Cluster(deployment, None if seed is None else np.random.default_rng(seed))
    sim.record = record
    sim.phase = float(phase) % 1.0
    return sim.run(arrivals)


class _Cluster:
    def __init__(self, deployment: Deployment, rng: np.random.Generator | None) -> None:
        self.d = deployment
        self.rng = rng
        self.engines = [e.build() for e in deployment.engines]
        self.setups = list(deployment.engines)
        disagg = deployment.is_disaggregated
        self.entry = [i for i, e in enumerate(self.setups) if e.role in ((Role.PREFILL,) if disagg else
                                                                          (Role.COLOCATED, Role.PREFILL, Role.DECODE))]
        self.decode = [i for i, e in enumerate(self.setups) if e.role is Role.DECODE] if disagg else []
        if disagg and not self.decode:
            raise ValueError("a disaggregated deployment needs at least one decode instance")
        self.busy = [False] * len(self.engines)
        self.pending: list[tuple[SimStep, int] | None] = [None] * len(self.engines)
        self.num_steps = [0] * len(self.engines)
        self.rank = [0.0] * len(self.engines)  # each engine's current step-time ratio, as a quantile (kept while persistent)
        self.pools = [e.model.variation_pools() for e in self.setups]
        self.timelines = [_timeline(e.model) for e in self.setups]
        self.record: Callable[[StepRecord], None] | None = None
        self.phase = 0.0  # ``timeline``: the run's time is read this share of its span later (wrapping around)
        self.events: list[tuple[int, int, int, int, object]] = []
        self.n = 0
        self.emits: dict[int, list[int]] = {}
        self.totals: dict[int, int] = {}  # output tokens of each request over all its engines

    def push(self, t: float, kind: int, engine: int, payload: object = None) -> None:
        self.n += 1
        heapq.heappush(self.events, (int(t), kind, self.n, engine, payload))

    def least_loaded(self, pool: list[int]) -> int:
        return min(pool, key=lambda i: (self.engines[i].num_in_system(), i))

    def run(self, arrivals: list[Arrival]) -> list[Outcome]:
        outcomes = {a.rid: Outcome(a) for a in arrivals}
        for seq_no, a in enumerate(sorted(arrivals, key=lambda a: (a.arrival_ns, a.rid))):
            out = 1 if self.decode else a.num_output_tokens
            req = SimRequest(a.rid, a.arrival_ns + a.gateway_ns, a.num_prompt_tokens, out, a.num_cached_tokens,
                             a.arrival_ns + a.ttft_target_ns, a.priority, a.tenant, seq_no)
            self.emits[a.rid] = req.emit_ns
            self.totals[a.rid] = a.num_output_tokens
            self.push(req.arrival_ns, _ARRIVE, -1, req)
        finals: dict[int, SimRequest] = {}
        while self.events:
            t, kind, _, i, payload = heapq.heappop(self.events)
            if kind == _ARRIVE:
                assert isinstance(payload, SimRequest)
                i = self.least_loaded(self.entry)
                self.engines[i].add(payload)
                self.wake(i, t)
            elif kind == _HANDOFF:
                assert isinstance(payload, SimRequest)
                j = self.least_loaded(self.decode)
                self.engines[j].add_running(payload)
                self.wake(j, t)
            elif kind == _START:
                self.start(i, t)
            else:
                self.end(i, t, finals)
        for rid, req in finals.items():
            o = outcomes[rid]
            o.num_preemptions = req.num_preemptions
        for o in outcomes.values():
            o.delivered_ns = self.deliveries(self.emits[o.arrival.rid], o.arrival.num_output_tokens,
                                             o.arrival.first_visible_index)
        return [outcomes[a.rid] for a in arrivals]

    def wake(self, i: int, t: int) -> None:
        if not self.busy[i]:
            self.busy[i] = True
            self.push(t, _START, i)

    def start(self, i: int, t: int) -> None:
        eng = self.engines[i]
        step = eng.plan()
        while not step.chunks and eng.waiting and not eng.running:
            eng.waiting.pop(0)  # larger than the whole KV pool: the engine would refuse it
            step = eng.plan()
        if not step.chunks:
            self.busy[i] = False
            return
        self.pending[i] = (step, t)
        model = self.setups[i].model
        dur = model.duration_ns(step.num_prefill_tokens, step.num_decode_tokens, step.num_seqs, step.decode_context)
        (ratios, residuals), kind = self.pools[i], int(step.num_prefill_tokens > 0)
        if self.rng is not None and model.variation == "residual" and residuals[kind].size:
            dur = max(dur + residuals[kind][int(self.rng.integers(residuals[kind].size))], 0.05 * dur)
        elif self.rng is not None and model.variation == "timeline" and self.timelines[i] is not None:
            starts, ranks, t_first, span = self.timelines[i]
            at = t_first + (max(t - t_first, 0) + self.phase * span) % span  # past the run's end: from its start
            j = int(np.searchsorted(starts, at))  # the run's step that started nearest this moment
            q = ranks[j - 1 if j == starts.size or (j > 0 and at - starts[j - 1] < starts[j] - at) else j]
            dur *= ratios[kind][min(int(q * ratios[kind].size), ratios[kind].size - 1)]
        elif self.rng is not None and ratios[kind].size:
            if self.num_steps[i] == 0 or self.rng.random() >= model.persistence:
                self.rank[i] = self.rng.random()
            dur *= ratios[kind][int(self.rank[i] * ratios[kind].size)]
        self.push(t + max(dur, 0.0), _END, i)

    def end(self, i: int, t: int, finals: dict[int, SimRequest]) -> None:
        eng = self.engines[i]
        pending = self.pending[i]
        assert pending is not None
        step, start = pending
        self.pending[i] = None
        if self.record is not None:
            self.record(StepRecord(i, self.num_steps[i], start, t, step, len(eng.waiting), len(eng.running)))
        self.num_steps[i] += 1
        for req in eng.complete(step, t):
            if self.decode and self.setups[i].role is Role.PREFILL:
                self.hand_over(req, t)
            else:
                finals[req.rid] = req
        if eng.has_work():
            model = self.setups[i].model
            gap = model.busy_gap_ns(step.num_seqs)
            if self.rng is not None and model.gaps:
                gap = model.gaps[int(self.rng.integers(len(model.gaps)))]
            self.push(t + gap, _START, i)
        else:
            self.busy[i] = False

    def hand_over(self, req: SimRequest, t: int) -> None:
        total = self.totals[req.rid]
        if total <= 1:
            return
        nxt = SimRequest(req.rid, req.arrival_ns, req.num_prompt_tokens, total, 0, req.deadline_ns,
                         req.priority, req.tenant, req.seq_no, num_generated=1, emit_ns=req.emit_ns)
        self.push(t + self.d.stages.handoff(req.num_prompt_tokens), _HANDOFF, -1, nxt)

    def deliveries(self, emits: list[int], num_output: int, first_visible: int) -> list[int]:
        """When each token reached the client: the first visible content (token ``first_visible``) carries the
        tokens before it; later tokens go out a delivery lag after their emit."""
        if len(emits) < num_output:
            return []  # never completed (refused: larger than the KV pool)
        s = self.d.stages
        k = min(first_visible, num_output - 1)
        first = int(emits[k] + s.first_delivery_ns)
        out = [first] * (k + 1)
        for e in emits[k + 1:num_output]:
            out.append(max(int(e + s.delivery_ns), out[-1]))
        return out


def _timeline(model: StepTimeModel) -> tuple[np.ndarray, np.ndarray, float, float] | None:
    """The fitted run's step starts (sorted, reference clock, ns), each step's ratio as a quantile among the ratios
    of the steps of its kind, the first start and the span of the starts; None when the model does not know when
    its steps ran."""
    num = len(model.ratios)
    if not num or len(model.ratio_start_ns) != num or len(model.ratio_prefill) != num:
        return None
    starts = np.asarray(model.ratio_start_ns, dtype=float)
    ratios = np.asarray(model.ratios, dtype=float)
    kinds = np.asarray(model.ratio_prefill, dtype=bool)
    ranks = np.empty(num)
    for want in (False, True):
        sel = np.flatnonzero(kinds == want)
        ranks[sel] = (np.argsort(np.argsort(ratios[sel], kind="stable"), kind="stable") + 0.5) / max(sel.size, 1)
    order = np.argsort(starts, kind="stable")
    return starts[order], ranks[order], float(starts[order[0]]), max(float(starts.max() - starts.min()), 1.0)
