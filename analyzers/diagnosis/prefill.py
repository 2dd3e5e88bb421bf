"""Rules for a request's own prefill (``prefill.compute``) in its time to first token.

Of each prefill step, the share that computed other requests' prompt tokens (the
step's prefill tokens beyond the request's own: at most what was left of its uncomputed prompt, walking
its steps in order): ``head_of_line`` where the step computed another request's long prompt (the request
itself not long), ``coscheduled_prefill`` otherwise, naming those requests and their prompt lengths (a step
in which no other request's prefill span lies is not claimed);
``prefix_miss`` for the extra prefill it paid for prompt tokens past its prefix hit that an earlier
request had computed and the cache had evicted before its lookup (its first ``miss_evicted`` event, made
before its first prefill: one after it is a readmission after a preemption, which finds its own blocks gone):
its prefill time x evicted / (prompt - cached). In a run without ``miss_evicted`` events (older stores,
engines that remember no evicted block hashes): ``prefix_miss`` when it had fewer than ``R`` tokens cached and its
instance had evicted at least a prompt's worth of cached blocks (its full blocks) before it
arrived, ``R`` being what its session's previous turn computed (``carry`` events), else the most
cached tokens of any request of the run, at most its full blocks (without those events, in a run where
nothing was ever reused, a prompt that shared nothing cannot be told from one whose prefix was evicted,
and no miss is claimed): its prefill time x (``R`` - cached) / (prompt - cached); ``long_prefill`` for
the rest of a long prompt's own prefill
(a long prompt: at least ``LONG_PROMPT_FACTOR`` x the run's median, :mod:`analyzers.diagnosis.run_context`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from analyzers.diagnosis.causes import COSCHEDULED_PREFILL, HEAD_OF_LINE, LONG_PREFILL, PREFIX_MISS, Finding
from analyzers.diagnosis.run_context import RunContext
from tokentrace.schema import Stage, col

__all__ = ["prefill_findings"]


def prefill_findings(ctx: RunContext, rid: int, window: pd.DataFrame, first_preempt: int | None) -> list[Finding]:
    """Findings for the prefill spans among ``window`` (the request's TTFT spans) before its first preemption."""
    c = col
    pre = window[window[c.STAGE] == int(Stage.PREFILL_COMPUTE)]
    if first_preempt is not None:
        pre = pre[pre[c.START_NS] < first_preempt]  # the recompute is the preemption's
    if not len(pre):
        return []
    out: list[Finding] = []
    req = ctx.ev.requests
    row = req[req[c.REQUEST_ID] == rid].iloc[0]
    prompt, cached = _num(row[c.NUM_PROMPT_TOKENS]), _num(row[c.NUM_CACHED_TOKENS])
    hol, shared = _shared_steps(ctx, rid, pre, prompt, cached)
    if hol.ns > 0:
        which = ", ".join(f"{ctx.key(o)}'s {p:,.0f}-token" for o, p in list(hol.others.items())[:3])
        out.append(Finding(HEAD_OF_LINE, hol.ns / 1e6, f"shared its prefill steps with {which} prefill "
                           f"({hol.budget:,} prefill tokens per step), {hol.ns / 1e6:,.1f} ms of them the others' work",
                           stage=Stage.PREFILL_COMPUTE.label, requests=tuple(ctx.key(o) for o in hol.others)))
    if shared.ns > 0:
        which = ", ".join(f"{ctx.key(o)} ({p:,.0f} tokens)" for o, p in list(shared.others.items())[:3])
        more = f" and {len(shared.others) - 3} more" if len(shared.others) > 3 else ""
        out.append(Finding(COSCHEDULED_PREFILL, shared.ns / 1e6, f"had its prefill run in {shared.num_steps} step(s) "
                           f"that also computed {shared.tokens:,} prompt tokens of other requests ({which}{more}; up "
                           f"to {shared.budget:,} prefill tokens per step): {shared.ns / 1e6:,.1f} ms of them the "
                           f"others' work", stage=Stage.PREFILL_COMPUTE.label,
                           requests=tuple(ctx.key(o) for o in shared.others)))
    others_ns = hol.ns + shared.ns
    miss = _prefix_miss(ctx, row, pre, prompt, cached, others_ns)
    if miss is not None:
        out.append(miss)
    if prompt >= ctx.long_prompt:
        own_ns = float((pre[c.END_NS] - pre[c.START_NS]).sum()) - others_ns - (miss.ms * 1e6 if miss else 0.0)
        if own_ns > 0:
            out.append(Finding(LONG_PREFILL, own_ns / 1e6, f"computed its own {prompt:,.0f}-token prefill for "
                               f"{own_ns / 1e6:,.1f} ms (a long prompt: the run's median is "
                               f"{ctx.median_prompt:,.0f} tokens)", stage=Stage.PREFILL_COMPUTE.label))
    return out


@dataclass
class _OthersWork:
    """Prefill-step time spent on other requests' prompt tokens (ns), the steps, their tokens and who they were."""

    ns: float = 0.0
    num_steps: int = 0
    tokens: int = 0
    budget: int = 0
    others: dict[int, float] = field(default_factory=dict)  # request id -> prompt tokens

    def add(self, ns: float, tokens: int, total: int, others: dict[int, float]) -> None:
        self.ns += ns
        self.num_steps += 1
        self.tokens += tokens
        self.budget = max(self.budget, total)
        self.others.update(others)


def _shared_steps(ctx: RunContext, rid: int, pre: pd.DataFrame, prompt: float,
                  cached: float) -> tuple[_OthersWork, _OthersWork]:
    """Of ``rid``'s prefill steps, the share each spent on other requests' prompt tokens: its own tokens in a step
    are at most what was left of its uncomputed prompt (the most it can have computed there), the rest of the
    step's prefill tokens were others'. Steps with another request's long prompt (a short request's) are
    ``head_of_line``'s, the others ``coscheduled_prefill``'s."""
    c = col
    hol, shared = _OthersWork(), _OthersWork()
    if not math.isfinite(prompt):
        return hol, shared
    left = max(prompt - (cached if math.isfinite(cached) else 0.0), 1.0)
    for s in pre.sort_values(c.START_NS).itertuples(index=False):
        step, inst = getattr(s, c.STEP), int(getattr(s, c.INSTANCE_ID))
        if step is None or pd.isna(step):
            continue
        start, end = int(getattr(s, c.START_NS)), int(getattr(s, c.END_NS))
        steps = ctx.steps_in(inst, start, end)
        tokens = steps[steps[c.STEP] == step][c.NUM_PREFILL_TOKENS] if len(steps) else steps[c.STEP]
        total = float(tokens.iloc[0]) if len(tokens) else math.nan
        if not (math.isfinite(total) and total > 0):
            continue
        mine = min(left, total)
        left = max(left - mine, 0.0)
        if total <= mine:
            continue
        ns = (end - start) * (1 - mine / total)
        longs = ctx.long_prefills_in(inst, int(step), rid)
        if len(longs) and prompt < ctx.long_prompt:
            hol.add(ns, int(total - mine), int(total),
                    {int(o): ctx.prompts.get(int(o), math.nan) for o in longs[c.REQUEST_ID].unique()})
        else:
            others = ctx.prefills_in(inst, int(step), rid)
            if len(others):  # tokens no other request's prefill span accounts for are not claimed as theirs
                shared.add(ns, int(total - mine), int(total),
                           {int(o): ctx.prompts.get(int(o), math.nan) for o in others[c.REQUEST_ID].unique()})
    return hol, shared


def _prefix_miss(ctx: RunContext, row: pd.Series, pre: pd.DataFrame, prompt: float, cached: float,
                 others_ns: float) -> Finding | None:
    cached = cached if math.isfinite(cached) else 0.0
    if not (math.isfinite(prompt) and prompt > cached):
        return None
    if ctx.evicted_prefix:
        return _evicted_prefix(ctx, row, pre, prompt, cached, others_ns)
    return _prefix_miss_bound(ctx, row, pre, prompt, cached, others_ns)


def _evicted_prefix(ctx: RunContext, row: pd.Series, pre: pd.DataFrame, prompt: float, cached: float,
                    others_ns: float) -> Finding | None:
    """The store says which prompt blocks past the hit the cache had held and evicted (``miss_evicted``)."""
    lookup_ns, lost = ctx.evicted_prefix.get(int(row[col.REQUEST_ID]), (0, 0.0))
    if lookup_ns > int(pre[col.START_NS].min()):
        return None  # a lookup after its first prefill: its readmission after a preemption found its own blocks gone
    lost = min(lost, prompt - cached)
    if lost <= 0:
        return None
    compute_ns = float((pre[col.END_NS] - pre[col.START_NS]).sum()) - others_ns
    extra = compute_ns * lost / (prompt - cached)
    if extra <= 0:
        return None
    evidence = (f"had {cached:,.0f} of its {prompt:,.0f} prompt tokens cached: the next {lost:,.0f} had been "
                f"computed by an earlier request and evicted before it arrived, {extra / 1e6:,.1f} ms of prefill "
                f"to compute them again")
    return Finding(PREFIX_MISS, extra / 1e6, evidence, stage=Stage.PREFILL_COMPUTE.label)


def _prefix_miss_bound(ctx: RunContext, row: pd.Series, pre: pd.DataFrame, prompt: float, cached: float,
                       others_ns: float) -> Finding | None:
    """Without ``miss_evicted`` events: the most it could have reused bounds the miss (module doc)."""
    c = col
    per_block = ctx.tokens_per_block
    full = prompt // per_block * per_block if math.isfinite(per_block) and per_block > 0 else prompt
    # The most it could have reused: what its session's previous turn computed (carry), else the longest prefix
    # any request of the run had cached. Without either, a prompt that shared nothing cannot be told from one
    # whose prefix was evicted, and no miss is claimed.
    carried = ctx.carried.get(int(row[c.REQUEST_ID]), 0.0)
    bound = min(carried if carried > 0 else ctx.reusable_tokens, full)
    if bound <= 0 or cached >= bound:
        return None
    inst = int(pre[c.INSTANCE_ID].iloc[0])
    evicted = ctx.evicted_before(inst, int(row[c.ARRIVAL_NS]))
    needed = math.ceil(full / per_block) if math.isfinite(per_block) and per_block > 0 else 1
    if evicted < max(needed, 1):
        return None
    compute_ns = float((pre[c.END_NS] - pre[c.START_NS]).sum()) - others_ns
    missed = bound - cached
    extra = compute_ns * missed / (prompt - cached)
    if extra <= 0:
        return None
    seen = (f"its session's previous turn had computed {carried:,.0f} of its tokens" if carried > 0
            else f"prefixes of {ctx.reusable_tokens:,.0f} tokens hit elsewhere in the run")
    evidence = (f"had {cached:,.0f} of its {prompt:,.0f} prompt tokens cached after its instance had evicted "
                f"{evicted:,} cached block(s), at least a prompt's worth ({seen}): up to {extra / 1e6:,.1f} ms of "
                f"prefill for {missed:,.0f} tokens it could have reused")
    return Finding(PREFIX_MISS, extra / 1e6, evidence, stage=Stage.PREFILL_COMPUTE.label)


def _num(value: object) -> float:
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan
    return v
