"""Rules for a request's own stages: what its prefill, transfer, preemptions, decode steps and the
stages around them say, in its time to first token and in each token gap over the ITL target.

* ``schedule.queue``: :mod:`analyzers.diagnosis.queueing`.
* ``schedule.preempted``: ``preemption``, the preempted time plus every prefill computed after the
  first preemption (the recompute it paid again); in a gap, one finding for both.
* ``prefill.compute``: :mod:`analyzers.diagnosis.prefill` (``head_of_line``, ``coscheduled_prefill``,
  ``prefix_miss``, ``long_prefill``).
* ``transfer.kv``: ``kv_transfer``, all of it.
* ``decode.queue`` that ends by the request's first compute on its instance (a disaggregated decode
  worker's admission: back-pressure, the wait for room in a full decode pool after the KV transfer, or
  its first place in a batch), or longer than ``WAIT_STEPS`` x the instance's median step (a wait for a
  place in a batch): explained as ``schedule.queue`` is (:mod:`analyzers.diagnosis.queueing`), in the
  TTFT as in a gap.
* Each span works toward its token index, but never one before the first token its process emitted for
  the request (a disaggregated decode worker's queue, preemption and recompute spans tagged 0 work toward
  its first token), as the read path counts them. The TTFT's spans: those working toward token 0 or a
  token held back until the first visible content (sent with it), started before it; a gap's: those
  working toward its token, and a prefill there (a recompute: the prompt's own works toward token 0) is
  ``preemption``. A held-back
  token's output stages (``detokenize``, ``stream.relay``, ``stream.send``) ran beside the engine computing
  the tokens after it: in the TTFT they count only past the end of the engine's last span toward the first
  visible content (before it, they delayed nothing).
* ``decode.queue`` / ``decode.compute`` of a gap otherwise: ``batch_interference`` for the share of the
  instance's steps while the request waited there (not those it sat out preempted or recomputing) spent on
  co-scheduled prefill tokens (prefill / (prefill + decode) tokens of each step), or, for a step of more
  than ``BATCH_FACTOR`` x the instance's median
  batch, the step time beyond the instance's median decode-only step; ``engine_stall`` for a step of its usual
  batch that took at least ``STALL_MS`` and ``STALL_STEPS`` x that median, the time beyond the median; ``slow_stage``
  (decode.compute) when that median decode-only step is itself at least ``SLOW_DECODE_SHARE`` of
  the ITL target and ``SLOW_STAGE_MS``.
* ``decode.draft`` / ``decode.verify``: ``speculation``, the draft time of rejected proposals
  (draft time x rejected / proposed) of the speculative steps that emitted the token.
* Gateway and stream stages (``gateway.*``, ``cache.lookup``, ``cache.load``, ``detokenize``,
  ``stream.relay``, ``stream.send``): a stage is slow for every request, not by queueing, when its
  median span over the whole run is at least ``SLOW_STAGE_MS`` and ``SLOW_STAGE_SHARE`` of the
  phase's target (TTFT target in the TTFT, ITL target in a gap). ``event_loop_lag`` (or, by why the
  loop ran late, ``gil_contention`` or ``cpu_starved``: :mod:`analyzers.diagnosis.event_loop`) for the part
  of the span during which an event loop ran late (``loop_lags``), past the stage's median span when the
  stage is slow (within its usual length a late loop costs it nothing: a planted wait or a slow write
  takes that long anyway); the rest, up to the median span, is ``slow_stage`` when the stage is slow;
  a span beyond the median is this request's own outlier, not the stage's.
"""

from __future__ import annotations

import math

import pandas as pd

from analyzers.diagnosis.causes import (
    BATCH_INTERFERENCE,
    ENGINE_STALL,
    KV_TRANSFER,
    PREEMPTION,
    SLOW_STAGE,
    SPECULATION,
    Finding,
)
from analyzers.diagnosis.event_loop import loop_lag_findings
from analyzers.diagnosis.prefill import prefill_findings
from analyzers.diagnosis.queueing import STALL_MS, STALL_STEPS, queue_findings
from analyzers.diagnosis.run_context import RunContext
from tokentrace.schema import Stage, col

__all__ = ["ttft_findings", "gap_findings", "SLOW_STAGE_MS", "SLOW_STAGE_SHARE", "SLOW_DECODE_SHARE", "BATCH_FACTOR"]

SLOW_STAGE_MS = 5.0  # a stage whose median span over the run is at least this ...
SLOW_STAGE_SHARE = 0.1  # ... and at least this share of its phase's target (TTFT or ITL) is slow for every request
SLOW_DECODE_SHARE = 0.5  # decode steps alone take half the ITL target or more
BATCH_FACTOR = 1.5  # a step of 1.5x the instance's median batch is a larger batch
WAIT_STEPS = 2.0  # a decode.queue longer than two typical steps of its instance is a wait for a place in a batch

_EDGE_STAGES = (Stage.GATEWAY_ACCEPT, Stage.GATEWAY_RECEIVE, Stage.GATEWAY_TOKENIZE, Stage.GATEWAY_ROUTE,
                Stage.CACHE_LOOKUP, Stage.CACHE_LOAD, Stage.DETOKENIZE, Stage.STREAM_RELAY, Stage.STREAM_SEND)
_OUTPUT_STAGES = (Stage.DETOKENIZE, Stage.STREAM_RELAY, Stage.STREAM_SEND)


def ttft_findings(ctx: RunContext, rid: int, arrival: int, first_token: int, spans: pd.DataFrame,
                  ttft_target_ns: float) -> list[Finding]:
    """Findings for the time to first token of ``rid`` (its spans that start before ``first_token``)."""
    c = col
    held = ctx.last_held.get(int(rid), 0)  # tokens delivered by the first visible content count in TTFT
    toward = ctx.toward(rid, spans)
    window = spans[(spans[c.START_NS] < first_token) & (toward <= max(held, 0))]
    admitted = _admitted(spans)
    out: list[Finding] = []
    preempted = window[window[c.STAGE] == int(Stage.SCHEDULE_PREEMPTED)]
    first_preempt = int(preempted[c.START_NS].min()) if len(preempted) else None
    engine = window[~window[c.STAGE].isin([int(x) for x in _EDGE_STAGES])]
    engine_done = int(engine[c.END_NS].max()) if len(engine) else None  # its last work toward the first content
    for at, s in zip(window.index, window.itertuples(index=False)):
        stage = Stage(int(getattr(s, c.STAGE)))
        start, end = int(getattr(s, c.START_NS)), min(int(getattr(s, c.END_NS)), first_token)
        if stage in _OUTPUT_STAGES and 0 <= toward[at] < held and engine_done is not None:
            start = max(start, engine_done)  # a held token's relay ran beside the engine computing the next ones
        if end <= start:
            continue
        inst = int(getattr(s, c.INSTANCE_ID))
        if stage == Stage.SCHEDULE_QUEUE:
            out += queue_findings(ctx, rid, arrival, start, end, inst)
        elif stage == Stage.DECODE_QUEUE and (_before_admission(admitted, inst, end) or _is_wait(ctx, inst, end - start)):
            out += queue_findings(ctx, rid, arrival, start, end, inst, stage.label)
        elif stage == Stage.TRANSFER_KV:
            out.append(_kv_transfer(ctx, inst, start, end, "before its first token"))
        elif stage in _EDGE_STAGES:
            out += _edge(ctx, stage, start, end, ttft_target_ns)
    out += _preemption(ctx, window, first_preempt)
    out += prefill_findings(ctx, rid, window, first_preempt)
    return out


def _preemption(ctx: RunContext, window: pd.DataFrame, first_preempt: int | None) -> list[Finding]:
    if first_preempt is None:
        return []
    c = col
    pre = window[window[c.STAGE] == int(Stage.SCHEDULE_PREEMPTED)]
    held = float((pre[c.END_NS] - pre[c.START_NS]).sum())
    redo = window[(window[c.STAGE] == int(Stage.PREFILL_COMPUTE)) & (window[c.START_NS] >= first_preempt)]
    again = float((redo[c.END_NS] - redo[c.START_NS]).sum())
    evidence = (f"was preempted {len(pre)} time(s) for {held / 1e6:,.1f} ms"
                + (f" and recomputed {again / 1e6:,.1f} ms of prefill after it" if again > 0 else ""))
    return [Finding(PREEMPTION, (held + again) / 1e6, evidence, stage=Stage.SCHEDULE_PREEMPTED.label)]


def _edge(ctx: RunContext, stage: Stage, start: int, end: int, target_ns: float) -> list[Finding]:
    out: list[Finding] = []
    median = ctx.stage_median_ns.get(stage, math.nan)
    slow = math.isfinite(median) and median >= max(SLOW_STAGE_MS * 1e6, SLOW_STAGE_SHARE * target_ns)
    # A stage slow for every request takes its median span anyway: a late loop within it costs nothing more.
    lag_from = min(start + int(median), end) if slow else start
    lag = ctx.lag_overlap_ns(lag_from, end)
    out += loop_lag_findings(ctx, lag_from, end, f"an event loop running late during its {stage.label}",
                             stage=stage.label)
    rest = min((end - start) - lag, median)
    if rest > 0 and slow:
        out.append(Finding(SLOW_STAGE, rest / 1e6, f"spent {(end - start) / 1e6:,.1f} ms in {stage.label}, which "
                           f"takes {median / 1e6:,.1f} ms per span for every request (median over the run)",
                           stage=stage.label))
    return out


def gap_findings(ctx: RunContext, rid: int, token: int, lo: int, hi: int, spans: pd.DataFrame,
                 itl_target_ns: float) -> list[Finding]:
    """Findings for token ``token``'s gap ``(lo, hi]`` of request ``rid``."""
    c = col
    toward = ctx.toward(rid, spans)
    mine = spans[((toward == token) | (spans[c.TOKEN_INDEX] < 0)) & (spans[c.END_NS] > lo) & (spans[c.START_NS] < hi)]
    out: list[Finding] = []
    admitted = _admitted(spans)
    decode_inst, decode_spans = None, []
    preempted_ns, recompute_ns = 0, 0
    for s in mine.itertuples(index=False):
        stage = Stage(int(getattr(s, c.STAGE)))
        start, end = max(int(getattr(s, c.START_NS)), lo), min(int(getattr(s, c.END_NS)), hi)
        if end <= start:
            continue
        if stage == Stage.SCHEDULE_PREEMPTED:
            preempted_ns += end - start
        elif stage == Stage.SCHEDULE_QUEUE:
            out += queue_findings(ctx, rid, lo, start, end, int(getattr(s, c.INSTANCE_ID)))
        elif stage == Stage.PREFILL_COMPUTE:  # the prompt's own prefill works toward token 0: in a gap, a recompute
            recompute_ns += end - start
        elif stage == Stage.TRANSFER_KV:
            out.append(_kv_transfer(ctx, int(getattr(s, c.INSTANCE_ID)), start, end, f"before token {token}"))
        elif stage == Stage.DECODE_QUEUE and (_before_admission(admitted, int(getattr(s, c.INSTANCE_ID)), end)
                                              or _is_wait(ctx, int(getattr(s, c.INSTANCE_ID)), end - start)):
            out += queue_findings(ctx, rid, lo, start, end, int(getattr(s, c.INSTANCE_ID)), stage.label)
        elif stage in (Stage.DECODE_QUEUE, Stage.DECODE_COMPUTE):
            decode_inst = int(getattr(s, c.INSTANCE_ID)) if decode_inst is None else decode_inst
            decode_spans.append((start, end))
        elif stage in _EDGE_STAGES:
            out += _edge(ctx, stage, start, end, itl_target_ns)
    if preempted_ns + recompute_ns > 0:  # one cause: the time held out and the prefill it paid again
        again = f" and recomputed {recompute_ns / 1e6:,.1f} ms of prefill" if recompute_ns > 0 else ""
        held = f"was preempted for {preempted_ns / 1e6:,.1f} ms" if preempted_ns > 0 else "was preempted"
        out.append(Finding(PREEMPTION, (preempted_ns + recompute_ns) / 1e6, f"{held}{again} before token {token}",
                           stage=Stage.SCHEDULE_PREEMPTED.label))
    if decode_inst is not None and decode_spans:
        out += _decode(ctx, rid, token, decode_inst, decode_spans, itl_target_ns)
    out += _speculation(ctx, rid, token)
    return out


_KV_SIDES = {  # which piece of a KV handoff a process records (docs/instrument-serving.md), and what it is
    "prefill": "(the prefill worker's part: from its token 0 to its first chunk written)",
    "gateway": "(in flight: from the first chunk's write to the decode worker reading it)",
    "decode": "(the decode worker's part: receiving its chunks)",
}


def _kv_transfer(ctx: RunContext, instance: int, start: int, end: int, when: str) -> Finding:
    """A KV handoff's time, saying which piece it was: the recording process tells (prefill: up to its first
    chunk written, gateway: in flight, decode: receiving)."""
    side = _KV_SIDES.get(ctx.pool_of(instance) or "")
    where = f" {side}" if side else ""
    return Finding(KV_TRANSFER, (end - start) / 1e6, f"waited {(end - start) / 1e6:,.1f} ms for its KV transfer "
                   f"{when}{where}", stage=Stage.TRANSFER_KV.label)


def _admitted(spans: pd.DataFrame) -> dict[int, int]:
    """Per instance, when the request's first compute (prefill or decode) began there, ns."""
    c = col
    work = spans[spans[c.STAGE].isin([int(Stage.PREFILL_COMPUTE), int(Stage.DECODE_COMPUTE)])]
    return {int(i): int(t) for i, t in work.groupby(c.INSTANCE_ID)[c.START_NS].min().items()}


def _before_admission(admitted: dict[int, int], inst: int, end: int) -> bool:
    """A ``decode.queue`` interval that ends by the request's first compute on its instance (or on an instance
    that never computed it): the wait of a disaggregated decode worker's admission, for room in a full decode pool
    (back-pressure after the KV transfer) or for its first place in a batch, not for the next step."""
    return end <= admitted.get(int(inst), end)


def _is_wait(ctx: RunContext, inst: int, queue_ns: int) -> bool:
    """A decode.queue interval longer than ``WAIT_STEPS`` of the instance's typical steps: the token waited for
    a place in a batch (admission on a full decode instance), not for the step being formed."""
    typical = ctx.step_ns(inst)
    return math.isfinite(typical) and queue_ns > WAIT_STEPS * typical


def _decode(ctx: RunContext, rid: int, token: int, inst: int, decode_spans: list[tuple[int, int]],
            itl_target_ns: float) -> list[Finding]:
    """The gap's time in ``decode.queue`` / ``decode.compute`` (``decode_spans``, clipped to the gap): only the
    steps while it waited there, never those while it was preempted or recomputing."""
    c = col
    decode_ns = sum(b - a for a, b in decode_spans)
    steps = ctx.steps_during(inst, decode_spans)
    typical, median_seqs = ctx.decode_step_ns(inst), ctx.median_seqs(inst)
    prefill_ns, batch_ns, prefill_tokens, largest, holders = 0.0, 0.0, 0, 0, {}
    stall_ns, slowest = 0.0, 0
    for s in steps.itertuples(index=False):
        p, d = int(getattr(s, c.NUM_PREFILL_TOKENS)), int(getattr(s, c.NUM_DECODE_TOKENS))
        ov = float(getattr(s, "overlap_ns"))
        seqs = int(getattr(s, c.NUM_SEQS))
        if p > 0 and p + d > 0:
            prefill_ns += ov * p / (p + d)
            prefill_tokens += p
            for other in ctx.long_prefills_in(inst, int(getattr(s, c.STEP)), rid)[c.REQUEST_ID].unique():
                holders[int(other)] = ctx.prompts.get(int(other), math.nan)
        elif math.isfinite(median_seqs) and seqs > BATCH_FACTOR * median_seqs and math.isfinite(typical):
            batch_ns += max(ov - typical, 0.0)
            largest = max(largest, seqs)
        elif math.isfinite(typical) and (took := int(getattr(s, c.END_NS)) - int(getattr(s, c.START_NS))) >= max(
                STALL_MS * 1e6, STALL_STEPS * typical):  # a step of its usual batch that took many times its usual time
            stall_ns += max(ov - typical, 0.0)
            slowest = max(slowest, took)
    out: list[Finding] = []
    if prefill_ns > 0:
        named = "".join(f", {ctx.key(o)}'s {p:,.0f}-token" for o, p in list(holders.items())[:3])
        out.append(Finding(BATCH_INTERFERENCE, prefill_ns / 1e6, f"waited {prefill_ns / 1e6:,.1f} ms before token {token} while its decode steps also computed "
                           f"{prefill_tokens:,} prefill tokens{named and ' (' + named[2:] + ' prefill)'}", stage=Stage.DECODE_COMPUTE.label,
                           requests=tuple(ctx.key(o) for o in holders)))
    if batch_ns > 0:
        out.append(Finding(BATCH_INTERFERENCE, batch_ns / 1e6, f"waited {batch_ns / 1e6:,.1f} ms more than a typical decode "
                           f"step before token {token}, in a batch of {largest} sequences against a median of "
                           f"{median_seqs:,.0f}", stage=Stage.DECODE_COMPUTE.label))
    if stall_ns > 0:
        out.append(Finding(ENGINE_STALL, stall_ns / 1e6, f"waited {stall_ns / 1e6:,.1f} ms more than a typical decode "
                           f"step before token {token} in a step of its usual batch that took {slowest / 1e6:,.1f} ms "
                           f"against a median of {typical / 1e6:,.1f} ms (the engine made no progress for most of it)",
                           stage=Stage.DECODE_COMPUTE.label))
    if math.isfinite(typical) and typical >= max(SLOW_DECODE_SHARE * itl_target_ns, SLOW_STAGE_MS * 1e6):
        rest = max(decode_ns - prefill_ns - batch_ns - stall_ns, 0.0)
        if rest > 0:
            out.append(Finding(SLOW_STAGE, rest / 1e6, f"waited for decode steps that alone take {typical / 1e6:,.1f} ms "
                               f"(median over the run), {typical / itl_target_ns * 100:,.0f}% of the ITL target",
                               stage=Stage.DECODE_COMPUTE.label))
    return out


def _speculation(ctx: RunContext, rid: int, token: int) -> list[Finding]:
    c = col
    spec = ctx.ev.speculation
    if not len(spec):
        return []
    mine = spec[(spec[c.REQUEST_ID] == rid) & (spec[c.FIRST_TOKEN_INDEX] == token)]
    wasted = 0.0
    for s in mine.itertuples(index=False):
        proposed = int(getattr(s, c.NUM_PROPOSED))
        if proposed > 0:
            draft = int(getattr(s, c.DRAFT_END_NS)) - int(getattr(s, c.DRAFT_START_NS))
            wasted += draft * (proposed - int(getattr(s, c.NUM_ACCEPTED))) / proposed
    if wasted <= 0:
        return []
    return [Finding(SPECULATION, wasted / 1e6, f"lost {wasted / 1e6:,.1f} ms to rejected draft work before token "
                    f"{token}", stage=Stage.DECODE_DRAFT.label)]
