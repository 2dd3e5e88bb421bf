"""What the rules know about the run around a request: load, arrivals, long prompts, steps, typical stages.

Built once per diagnosis from the :class:`~analyzers.diagnosis.evidence.Evidence` frames and the load
verdict, then read by every rule (:mod:`analyzers.diagnosis.queueing`, :mod:`analyzers.diagnosis.stages`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from analyzers.diagnosis.evidence import Evidence
from analyzers.loop_lag import BLOCKING, LATE_CAUSES, SHARE
from analyzers.timing import LAST_TOKEN
from tokentrace.schema import Role, Stage, col

__all__ = ["RunContext", "LONG_PROMPT_FACTOR", "LONG_PROMPT_MIN_TOKENS", "overlap_ns"]

LONG_PROMPT_FACTOR = 4.0  # a long prompt: at least 4x the run's median prompt ...
LONG_PROMPT_MIN_TOKENS = 64  # ... and at least this many tokens


def _pool_label(role: object) -> str | None:
    try:
        return Role(int(role)).label  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


def overlap_ns(starts: np.ndarray, ends: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Each interval's overlap with ``[lo, hi)``, ns (0 where they do not meet)."""
    return np.clip(np.minimum(ends, hi) - np.maximum(starts, lo), 0, None)


@dataclass(eq=False)
class RunContext:
    """Indexes over the evidence; see the module doc. ``load``: ``analyzers.load.LoadReport.row``."""

    ev: Evidence
    load: dict[str, Any]
    keys: dict[int, str] = field(init=False)
    prompts: dict[int, float] = field(init=False)
    tenants: dict[int, str] = field(init=False)
    median_prompt: float = field(init=False)
    long_prompt: float = field(init=False)
    reusable_tokens: float = field(init=False)
    offered_rps: float = field(init=False)
    tenant_rps: dict[str, float] = field(init=False)
    memo: dict[tuple, Any] = field(init=False, default_factory=dict)  # per-run results the rules compute once

    def __post_init__(self) -> None:
        c = col
        req = self.ev.requests
        self.keys = dict(zip(req[c.REQUEST_ID].astype("int64"), req[c.REQUEST_KEY].fillna("").astype(str)))
        prompts = req[c.NUM_PROMPT_TOKENS].astype("float64")
        self.prompts = dict(zip(req[c.REQUEST_ID].astype("int64"), prompts))
        self.tenants = dict(zip(req[c.REQUEST_ID].astype("int64"), req[c.TENANT].fillna("").astype(str)))
        median = float(prompts.median()) if prompts.notna().any() else math.nan
        self.median_prompt = median
        self.long_prompt = max(LONG_PROMPT_FACTOR * median, LONG_PROMPT_MIN_TOKENS) if math.isfinite(median) else math.inf
        cached = req[c.NUM_CACHED_TOKENS].astype("float64")
        self.reusable_tokens = float(cached.max()) if cached.notna().any() and cached.max() > 0 else 0.0
        arrivals = req[c.ARRIVAL_NS].to_numpy("int64")
        self._arrivals = arrivals
        end = req[c.FINISH_NS].astype("Float64").fillna(req[LAST_TOKEN].astype("Float64"))
        self._ends = end.fillna(np.iinfo("int64").max).to_numpy("float64")
        self._ids = req[c.REQUEST_ID].to_numpy("int64")
        self._arrival_by_id = dict(zip(self._ids, arrivals))
        self._tenant_of = req[c.TENANT].fillna("").astype(str).to_numpy()
        window_s = (arrivals.max() - arrivals.min()) / 1e9 if len(arrivals) >= 2 else 0.0
        self.offered_rps = (len(arrivals) - 1) / window_s if window_s > 0 else math.nan
        counts = pd.Series(self._tenant_of).value_counts()
        self.tenant_rps = {str(t): (n / window_s if window_s > 0 else math.nan) for t, n in counts.items()}
        self._steps = {int(i): g.reset_index(drop=True) for i, g in self.ev.steps.groupby(c.INSTANCE_ID)}
        pre = self.ev.prefills
        pre = pre.assign(prompt=pre[c.REQUEST_ID].map(self.prompts))
        self._long_prefills = pre[pre["prompt"] >= self.long_prompt]
        spans = self._long_prefills.groupby([c.INSTANCE_ID, c.REQUEST_ID]).agg(lo=(c.START_NS, "min"),
                                                                               hi=(c.END_NS, "max")).reset_index()
        self._long_windows = {int(i): g for i, g in spans.groupby(c.INSTANCE_ID)}
        self._long_by_step = {(int(i), int(s)): g for (i, s), g in
                              self._long_prefills.dropna(subset=[c.STEP]).groupby([c.INSTANCE_ID, c.STEP])}
        self._prefills_by_step = {(int(i), int(s)): g for (i, s), g in
                                  pre.dropna(subset=[c.STEP]).groupby([c.INSTANCE_ID, c.STEP])}
        self.tokens_per_block = self._tokens_per_block()
        carry = self.ev.carried
        self.carried = dict(zip(carry[c.REQUEST_ID].astype("int64"), carry["carried_tokens"].astype("float64")))
        lost = self.ev.evicted_prefix
        # (lookup time, prompt tokens past the hit that its first such lookup found evicted); with none in the run,
        # the store cannot tell an evicted prefix from one never seen (older stores, engines that keep no record).
        self.evicted_prefix = {int(r): (int(t), float(n)) for r, t, n in
                               zip(lost[c.REQUEST_ID], lost["lookup_ns"], lost["evicted_tokens"])}
        self._recomputes = self._recompute_spans(pre, req)
        seats = self.ev.seats.assign(tenant=self.ev.seats[c.REQUEST_ID].map(self.tenants).fillna(""))
        self._seats = {(int(i), int(st)): g for (i, st), g in seats.groupby([c.INSTANCE_ID, c.STEP])}
        held = self.ev.held
        self.last_held = dict(zip(held[c.REQUEST_ID].astype("int64"), held["last_held"].astype("int64")))
        emitted = self.ev.emitted
        self.first_emitted = {(int(r), int(i)): int(t) for r, i, t in
                              zip(emitted[c.REQUEST_ID], emitted[c.INSTANCE_ID], emitted["first_emitted"])}
        roles = self.ev.roles.dropna(subset=[c.ROLE])
        self._pools = {int(i): _pool_label(r) for i, r in zip(roles[c.INSTANCE_ID], roles[c.ROLE])}
        typical = self.ev.stage_typical
        self.stage_median_ns = {Stage(int(s)): float(m) for s, m in zip(typical[c.STAGE], typical["median_ns"])}
        self._decode_step_ns: dict[int, float] = {}
        self._median_seqs: dict[int, float] = {}
        for i, g in self._steps.items():
            pure = g[(g[c.NUM_PREFILL_TOKENS] == 0) & (g[c.NUM_DECODE_TOKENS] > 0)]
            dur = (pure[c.END_NS] - pure[c.START_NS]).astype("float64")
            self._decode_step_ns[i] = float(dur.median()) if len(dur) else math.nan
            decode = g[g[c.NUM_DECODE_TOKENS] > 0][c.NUM_SEQS]
            self._median_seqs[i] = float(decode.median()) if len(decode) else math.nan

    def _recompute_spans(self, pre: pd.DataFrame, req: pd.DataFrame) -> dict[int, pd.DataFrame]:
        """Per instance, the prefill spans of requests that recomputed an evicted prefix (``evicted_prefix``, found
        at a lookup before their first prefill), each with the share of its time that was the recompute: the lost
        tokens' share of the prompt tokens it computed, divided among the requests prefilling in the same step."""
        c = col
        if not self.evicted_prefix or not len(pre):
            return {}
        cached = dict(zip(req[c.REQUEST_ID].astype("int64"), req[c.NUM_CACHED_TOKENS].astype("float64").fillna(0.0)))
        first = pre.groupby(c.REQUEST_ID)[c.START_NS].min()
        frac: dict[int, float] = {}
        for rid, (lookup_ns, lost) in self.evicted_prefix.items():
            computed = self.prompts.get(rid, math.nan) - cached.get(rid, 0.0)
            if rid in first.index and lookup_ns <= int(first[rid]) and computed > 0 and lost > 0:
                frac[rid] = min(lost, computed) / computed
        if not frac:
            return {}
        per_step = pre.groupby([c.INSTANCE_ID, c.STEP])[c.REQUEST_ID].transform("size").fillna(1.0)
        mine = pre.assign(share=pre[c.REQUEST_ID].map(frac) / per_step)
        mine = mine[mine["share"] > 0]
        return {int(i): g for i, g in mine.groupby(c.INSTANCE_ID)}

    def recomputes_in(self, instance: int, lo: int, hi: int, but: int) -> tuple[float, dict[int, float]]:
        """Time inside ``[lo, hi)`` the instance spent recomputing evicted prefixes of requests other than ``but``
        (:meth:`_recompute_spans`), ns, and those requests with the tokens each recomputed."""
        g = self._recomputes.get(int(instance))
        if g is None:
            return 0.0, {}
        g = g[g[col.REQUEST_ID] != but]
        ov = overlap_ns(g[col.START_NS].to_numpy("int64"), g[col.END_NS].to_numpy("int64"), lo, hi)
        if not ov.any():
            return 0.0, {}
        ns = float((ov * g["share"].to_numpy("float64")).sum())
        who = g[col.REQUEST_ID].to_numpy("int64")[ov > 0]
        return ns, {int(r): self.evicted_prefix[int(r)][1] for r in dict.fromkeys(who)}

    def _tokens_per_block(self) -> float:
        """Tokens a KV block holds: from cache hits (tokens / blocks), else from steps that prefilled one sequence
        from an empty device tier (prefill tokens / blocks in use after it); NaN when neither says."""
        c = col
        steps = self.ev.steps
        used = steps[c.NUM_BLOCKS_USED_DEVICE].astype("Float64")
        prev = used.groupby(steps[c.INSTANCE_ID]).shift(1)
        alone = steps[(steps[c.NUM_SEQS] == 1) & (steps[c.NUM_PREFILL_TOKENS] > 0) & (prev == 0) & (used > 0)]
        if not len(alone):
            return math.nan
        return float((alone[c.NUM_PREFILL_TOKENS] / alone[c.NUM_BLOCKS_USED_DEVICE].astype("float64")).median())

    # ------------------------------------------------------------ requests

    def key(self, rid: int) -> str:
        return self.keys.get(int(rid), str(rid))

    def arrival_of(self, rid: int) -> int:
        return int(self._arrival_by_id[int(rid)])

    def ahead_of(self, rid: int, arrival: int) -> np.ndarray:
        """Indexes (into the requests frame) of the requests in the system when ``rid`` arrived: arrived
        before it and not yet ended."""
        return np.flatnonzero((self._arrivals < arrival) & (self._ends > arrival) & (self._ids != rid))

    def arrivals_of(self, index: np.ndarray) -> np.ndarray:
        return self._arrivals[index]

    def tenants_of(self, index: np.ndarray) -> np.ndarray:
        return self._tenant_of[index]

    def ids_of(self, index: np.ndarray) -> np.ndarray:
        return self._ids[index]

    def ends_of(self, index: np.ndarray) -> np.ndarray:
        """When those requests left the system (finish, else last token; +inf-like when neither), ns."""
        return self._ends[index]

    def toward(self, rid: int, spans: pd.DataFrame) -> pd.Series:
        """The token each of ``rid``'s spans works toward: its index, but never one before the first token its
        process emitted for the request (a disaggregated decode worker's spans tagged 0 work toward its first
        token), as the read path counts them (:func:`analyzers.attribution.span_pieces_sql`); negative indexes
        (request-wide spans) stay."""
        c = col
        index = spans[c.TOKEN_INDEX].astype("int64")
        floor = pd.Series([self.first_emitted.get((int(rid), int(i)), 0) for i in spans[c.INSTANCE_ID]],
                          index=spans.index, dtype="int64")
        return index.where(index < 0, np.maximum(index, floor))

    def pool_of(self, instance: int) -> str | None:
        """The pool (role label: prefill, decode, colocated, ...) of ``instance``; None when the store does not say."""
        return self._pools.get(int(instance))

    # ------------------------------------------------------------ steps

    def steps_in(self, instance: int, lo: int, hi: int) -> pd.DataFrame:
        """Steps of ``instance`` that overlap ``[lo, hi)``, with ``overlap_ns``."""
        g = self._steps.get(int(instance))
        if g is None or not len(g):
            return pd.DataFrame(columns=[col.STEP, "overlap_ns"])
        ov = overlap_ns(g[col.START_NS].to_numpy("int64"), g[col.END_NS].to_numpy("int64"), lo, hi)
        return g[ov > 0].assign(overlap_ns=ov[ov > 0])

    def steps_during(self, instance: int, intervals: list[tuple[int, int]]) -> pd.DataFrame:
        """Steps of ``instance`` that overlap any of ``intervals`` (disjoint ``[lo, hi)``), with ``overlap_ns``: the
        time each shares with them."""
        g = self._steps.get(int(instance))
        if g is None or not len(g) or not intervals:
            return pd.DataFrame(columns=[col.STEP, "overlap_ns"])
        starts, ends = g[col.START_NS].to_numpy("int64"), g[col.END_NS].to_numpy("int64")
        ov = sum(overlap_ns(starts, ends, lo, hi) for lo, hi in intervals)
        return g[ov > 0].assign(overlap_ns=ov[ov > 0])

    def long_prefills_in(self, instance: int, step: int, but: int) -> pd.DataFrame:
        """Prefill intervals of long-prompt requests other than ``but`` in that step."""
        g = self._long_by_step.get((int(instance), int(step)))
        if g is None:
            return self._long_prefills.iloc[0:0]
        return g[g[col.REQUEST_ID] != but]

    def prefills_in(self, instance: int, step: int, but: int) -> pd.DataFrame:
        """Prefill intervals of requests other than ``but`` in that step."""
        g = self._prefills_by_step.get((int(instance), int(step)))
        if g is None:
            return self.ev.prefills.iloc[0:0]
        return g[g[col.REQUEST_ID] != but]

    def long_prefill_windows(self, instance: int, lo: int, hi: int, but: int) -> tuple[int, dict[int, float]]:
        """Time inside ``[lo, hi)`` during which a long prompt other than ``but`` was being prefilled on ``instance``
        (from its first prefill chunk's start to its last one's end, windows merged), ns, and those requests
        with their prompt lengths."""
        g = self._long_windows.get(int(instance))
        if g is None:
            return 0, {}
        g = g[(g[col.REQUEST_ID] != but) & (g["hi"] > lo) & (g["lo"] < hi)].sort_values("lo")
        covered, end = 0, lo
        for a, b in zip(g["lo"].clip(lower=lo), g["hi"].clip(upper=hi)):
            a = max(int(a), end)
            if b > a:
                covered += int(b) - a
                end = int(b)
        return covered, {int(r): self.prompts.get(int(r), math.nan) for r in g[col.REQUEST_ID]}

    def seats_in(self, instance: int, lo: int, hi: int) -> pd.DataFrame:
        """The requests each step of ``instance`` overlapping ``[lo, hi)`` computed: request_id, tenant, one row
        per request and step."""
        steps = self.steps_in(instance, lo, hi)
        parts = [self._seats[(int(instance), int(s))] for s in steps[col.STEP] if (int(instance), int(s)) in self._seats]
        return pd.concat(parts) if parts else self.ev.seats.iloc[0:0].assign(tenant="")

    def step_ns(self, instance: int) -> float:
        """Median duration of all the instance's steps, ns (NaN if none)."""
        key = ("step_ns", int(instance))
        if key not in self.memo:
            g = self._steps.get(int(instance))
            dur = (g[col.END_NS] - g[col.START_NS]).astype("float64") if g is not None else pd.Series(dtype="float64")
            self.memo[key] = float(dur.median()) if len(dur) else math.nan
        return self.memo[key]

    def idle_in(self, instance: int, lo: int, hi: int, min_ns: float) -> tuple[int, int]:
        """Of ``[lo, hi)``, the time the instance ran no step, counting only stretches without one of at least
        ``min_ns``; and the longest such stretch (ns). An instance with no steps at all is not counted idle."""
        g = self._steps.get(int(instance))
        if g is None or not len(g) or hi <= lo:
            return 0, 0
        key = ("step_bounds", int(instance))
        if key not in self.memo:
            order = np.argsort(g[col.START_NS].to_numpy("int64"), kind="stable")
            self.memo[key] = (g[col.START_NS].to_numpy("int64")[order], g[col.END_NS].to_numpy("int64")[order])
        starts, ends = self.memo[key]
        i = max(int(np.searchsorted(ends, lo, side="right")) - 1, 0)  # steps end in order: they do not overlap
        total, longest, cur = 0, 0, lo
        while cur < hi:
            while i < len(starts) and ends[i] <= cur:
                i += 1
            nxt = min(int(starts[i]), hi) if i < len(starts) else hi
            if nxt > cur:
                if nxt - cur >= min_ns:
                    total += nxt - cur
                    longest = max(longest, nxt - cur)
                cur = nxt
            if i >= len(starts):
                break
            cur = max(cur, int(ends[i]))
        return total, longest

    def decode_step_ns(self, instance: int) -> float:
        """Median duration of the instance's decode-only steps (no prefill tokens), ns (NaN if none)."""
        return self._decode_step_ns.get(int(instance), math.nan)

    def median_seqs(self, instance: int) -> float:
        return self._median_seqs.get(int(instance), math.nan)

    def evicted_before(self, instance: int, t: int) -> int:
        """Blocks the instance evicted before ``t``."""
        e = self.ev.evictions
        mine = e[(e[col.INSTANCE_ID] == instance) & (e[col.START_NS] < t)]
        return int(mine[col.NUM_BLOCKS].sum())

    def lag_overlap_ns(self, lo: int, hi: int) -> int:
        """Time inside ``[lo, hi)`` during which an event loop ran late (union over instances not needed:
        one loop per gateway), ns."""
        lags = self.ev.loop_lags
        if not len(lags):
            return 0
        return int(overlap_ns(lags[col.START_NS].to_numpy("int64"), lags[col.END_NS].to_numpy("int64"), lo, hi).sum())

    def lag_overlap_by_cause(self, lo: int, hi: int) -> dict[str | None, float]:
        """:meth:`lag_overlap_ns` split by why the loop ran late (``analyzers.loop_lag.LATE_CAUSES``; ``None``: rows
        that recorded no CPU times), ns; only the causes with time."""
        lags = self.ev.loop_lags
        if not len(lags):
            return {}
        ov = overlap_ns(lags[col.START_NS].to_numpy("int64"), lags[col.END_NS].to_numpy("int64"), lo, hi)
        hit = ov > 0
        if not hit.any():
            return {}
        out: dict[str | None, float] = {}
        unsplit = lags[SHARE[BLOCKING]].isna().to_numpy() & hit
        if unsplit.any():
            out[None] = float(ov[unsplit].sum())
        for cause in LATE_CAUSES:
            ns = float((ov * lags[SHARE[cause]].fillna(0.0).to_numpy("float64")).sum())
            if ns > 0:
                out[cause] = ns
        return out
