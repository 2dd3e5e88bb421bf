"""A synthetic run of an engine that speculates, written straight to Parquet (real layout, real schema).

One colocated engine (a 63-bit instance id, as real runs have) serves requests that arrive over a few seconds.
Every engine step decodes all running requests (at most ``max_batch``); in a step that speculates (half of
them) each request allowed to speculate (85% of requests) proposes ``k`` draft tokens and accepts a
geometric prefix of them, the others decode one token beside it (a mixed batch). Times, in ms:

* plain step: 5 + 0.6 x batch;
* speculative step: a draft phase of 0.8 x k, then a verify pass of 5 + 0.6 x batch x (k + 1) positions: cheap
  per token in small batches, dearer than plain decoding in large ones;
* each token is sent 0.05 ms after the one before it.

Stage spans tile every token's interval as the contract says: the first token of a speculative step carries
decode.queue, decode.draft, decode.verify and stream.send; the tokens after it only their own stream.send;
a plain token decode.queue, decode.compute and stream.send. Deterministic for a seed.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
from synthetic_store import _write

from tokentrace.schema import (
    INSTANCES,
    REQUESTS,
    SPANS,
    SPEC_STEPS,
    STEPS,
    TOKENS,
    DraftSource,
    RequestStatus,
    Role,
    Stage,
    col,
)
from tokentrace.store.writer import StoreWriter

__all__ = ["write_speculative_run", "ENGINE_ID"]

ENGINE_ID = 7_211_549_077_130_511_873  # a 63-bit id: a person must never see it
_MS = 1_000_000
_SEND_NS = 50_000
_TENANTS = ("acme", "globex")


def _ns(ms: float) -> int:
    return int(round(ms * _MS))


def write_speculative_run(store: Path, run_id: str, *, num_requests: int = 60, k: int = 4, max_batch: int = 16,
                          seed: int = 0) -> Path:
    """Write the run (see the module doc); returns its folder."""
    rng = np.random.default_rng(seed)
    rows: dict[str, list[dict]] = defaultdict(list)
    arrival = np.cumsum(rng.exponential(40.0, size=num_requests)) + 10.0  # ms
    n_out = rng.integers(16, 48, size=num_requests)
    speculates = rng.random(num_requests) < 0.85
    rid = [int(x) for x in rng.integers(1, 2**62, size=num_requests)]
    sent: dict[int, list[float]] = {}  # request index -> send time of each delivered token, ms
    for i in range(num_requests):
        first = arrival[i] + 15.0
        rows[SPANS.name] += [_span(rid[i], Stage.SCHEDULE_QUEUE, arrival[i], arrival[i] + 5.0, 0),
                             _span(rid[i], Stage.PREFILL_COMPUTE, arrival[i] + 5.0, first, 0),
                             _span(rid[i], Stage.STREAM_SEND, first, first + 0.05, 0)]
        sent[i] = [first + 0.05]
    t, step = float(arrival[0]) + 15.1, 0
    active: list[int] = []
    waiting = list(range(num_requests))
    while waiting or active:
        while waiting and sent[waiting[0]][0] <= t and len(active) < max_batch:
            active.append(waiting.pop(0))
        if not active:
            t = sent[waiting[0]][0]
            continue
        step += 1
        b = len(active)
        spec_step = rng.random() < 0.5 and any(speculates[i] for i in active)
        draft = 0.8 * k if spec_step else 0.0
        compute = 5.0 + 0.6 * b * ((k + 1) if spec_step else 1)
        start, end = t, t + draft + compute
        rows[STEPS.name].append({col.INSTANCE_ID: ENGINE_ID, col.STEP: step, col.START_NS: _ns(start),
                                 col.END_NS: _ns(end), col.NUM_SEQS: b, col.NUM_PREFILL_TOKENS: 0,
                                 col.NUM_DECODE_TOKENS: b, col.NUM_WAITING: len(waiting), col.NUM_RUNNING: b,
                                 col.NUM_PREEMPTED: 0})
        num_spec = sum(1 for i in active if spec_step and speculates[i])
        for i in list(active):
            have = len(sent[i])
            prev = sent[i][-1]
            if spec_step and speculates[i]:
                accepted = min(int(rng.geometric(0.35)) - 1, k)
                emitted = min(accepted + 1, int(n_out[i]) - have)
                rows[SPEC_STEPS.name].append({
                    col.INSTANCE_ID: ENGINE_ID, col.REQUEST_ID: rid[i], col.STEP: step,
                    col.DRAFT_SOURCE: int(DraftSource.MODEL), col.NUM_PROPOSED: k, col.NUM_ACCEPTED: accepted,
                    col.FIRST_TOKEN_INDEX: have, col.DRAFT_START_NS: _ns(start), col.DRAFT_END_NS: _ns(start + draft),
                    col.VERIFY_START_NS: _ns(start + draft), col.VERIFY_END_NS: _ns(end), col.BATCH_SIZE: b,
                    col.NUM_SPEC_SEQS: num_spec})
                rows[SPANS.name] += [_span(rid[i], Stage.DECODE_QUEUE, prev, start, have),
                                     _span(rid[i], Stage.DECODE_DRAFT, start, start + draft, have, step),
                                     _span(rid[i], Stage.DECODE_VERIFY, start + draft, end, have, step)]
            else:
                emitted = 1
                rows[SPANS.name] += [_span(rid[i], Stage.DECODE_QUEUE, prev, start + draft, have),
                                     _span(rid[i], Stage.DECODE_COMPUTE, start + draft, end, have, step)]
            out = end
            for j in range(emitted):
                out_prev, out = out, out + 0.05
                rows[SPANS.name].append(_span(rid[i], Stage.STREAM_SEND, out_prev if j else end, out, have + j))
                rows[TOKENS.name].append({col.REQUEST_ID: rid[i], col.TOKEN_INDEX: have + j, col.EMIT_NS: _ns(end),
                                          col.SENT_NS: _ns(out), col.STEP: step, col.INSTANCE_ID: ENGINE_ID})
                sent[i].append(out)
            if len(sent[i]) >= n_out[i]:
                active.remove(i)
        t = end + 0.05 * (k + 1)  # the next step starts once this one's tokens are out
    for i in range(num_requests):
        rows[TOKENS.name].append({col.REQUEST_ID: rid[i], col.TOKEN_INDEX: 0, col.EMIT_NS: _ns(sent[i][0] - 0.05),
                                  col.SENT_NS: _ns(sent[i][0]), col.STEP: -1, col.INSTANCE_ID: ENGINE_ID})
        rows[REQUESTS.name].append({
            col.REQUEST_ID: rid[i], col.REQUEST_KEY: f"req-{i}", col.INSTANCE_ID: ENGINE_ID,
            col.TENANT: _TENANTS[i % 2], col.SLO_CLASS: "interactive", col.ARRIVAL_NS: _ns(arrival[i]),
            col.FIRST_TOKEN_NS: _ns(sent[i][0]), col.FINISH_NS: _ns(sent[i][-1]), col.NUM_PROMPT_TOKENS: 64,
            col.NUM_CACHED_TOKENS: 0, col.NUM_OUTPUT_TOKENS: len(sent[i]), col.STATUS: int(RequestStatus.OK),
            col.ERROR: "", col.TRACE_ID: ""})
    writer = StoreWriter(store, run_id=run_id, config={"synthetic": {"speculative": True, "k": k}})
    try:
        writer.register_instance(ENGINE_ID, Role.COLOCATED, "engine-0")
        _write(writer, INSTANCES, {
            col.INSTANCE_ID: [ENGINE_ID], col.ROLE: pa.array([int(Role.COLOCATED)], pa.int8()),
            col.NAME: ["engine-0"], col.HOST: ["synthetic"], col.PID: [100], col.MONO_ANCHOR_NS: [0],
            col.WALL_ANCHOR_NS: [1_700_000_000 * 10**9], col.CLOCK_OFFSET_NS: [0], col.CLOCK_RTT_NS: [1000]})
        for table in (REQUESTS, SPANS, TOKENS, STEPS, SPEC_STEPS):
            _write(writer, table, {c.name: [r.get(c.name) for r in rows[table.name]] for c in table.columns})
    finally:
        writer.close()
    return Path(store) / run_id


def _span(rid: int, stage: Stage, start: float, end: float, token: int, step: int = -1) -> dict:
    return {col.REQUEST_ID: rid, col.STAGE: int(stage), col.TOKEN_INDEX: token, col.START_NS: _ns(start),
            col.END_NS: _ns(end), col.INSTANCE_ID: ENGINE_ID, col.STEP: step}
