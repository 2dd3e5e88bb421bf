"""Synthetic tokentrace runs written straight to Parquet, for dashboard tests and its benchmark.

A run has three traced processes (a gateway, one colocated engine, and the load
generator as role ``client``) and every table of the schema, generated with numpy
in a few vectorised passes and written through :class:`~tokentrace.store.writer.StoreWriter`
(real store layout, real schema). Stage intervals tile each token's interval, as
the reference engine's do:

* token 0: gateway.receive, schedule.queue, prefill.compute, stream.send;
* token i >= 1: decode.queue, decode.compute, stream.send (with ``speculative=True``, the first token of a
  speculative step decode.queue, decode.draft, decode.verify, stream.send, and the tokens after it in the
  step only their own stream.send: :mod:`synthetic_speculation`).

``sessions`` (a share of the requests) makes multi-turn sessions with the retention policy's cache events
(:mod:`synthetic_sessions`). Both options draw from a generator of their own, so a run without them is the
same as before they existed.

``slowdown`` multiplies the compute stages, so a candidate run generated with
``slowdown=1.5`` against a baseline with 1.0 carries a planted regression.
All times are ns on one clock (clock offsets 0). Deterministic for a seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
from synthetic_sessions import plan_sessions, session_arrivals, session_cache_events
from synthetic_speculation import plan_speculation

from tokentrace.schema import (
    CACHE_EVENTS,
    INSTANCES,
    REQUESTS,
    SPANS,
    SPEC_STEPS,
    STEPS,
    TOKENS,
    CacheEventKind,
    RequestStatus,
    Role,
    Stage,
    Tier,
    col,
)
from tokentrace.store.manifest import DROPPED, SAMPLED_OUT
from tokentrace.store.writer import StoreWriter

__all__ = ["SyntheticRun", "write_run", "GATEWAY_ID", "ENGINE_ID", "CLIENT_ID", "TENANTS", "SLO_CLASSES"]

GATEWAY_ID = 11
ENGINE_ID = 12
CLIENT_ID = 13
TENANTS = ("acme", "globex", "initech")
SLO_CLASSES = ("interactive", "batch")
_MS = 1_000_000  # ns per ms
_STEP_NS = 10 * _MS  # engine step length
_CHUNK = 2_000_000  # rows per written part file


@dataclass(frozen=True, slots=True)
class SyntheticRun:
    """What :func:`write_run` wrote: its id and, per request, its output token count."""

    run_id: str
    path: Path
    request_ids: np.ndarray  # int64, one per request
    num_output_tokens: np.ndarray  # int64, one per request


def _write(writer: StoreWriter, table, columns: dict[str, np.ndarray | list]) -> None:
    num_rows = len(next(iter(columns.values())))
    arrays = {}
    for c in table.columns:  # schema order and types; columns not given are null
        values = columns.get(c.name)
        if values is None:
            arrays[c.name] = pa.nulls(num_rows, c.type)
        elif isinstance(values, (pa.Array, pa.ChunkedArray)):
            arrays[c.name] = values.cast(c.type)
        else:
            arrays[c.name] = pa.array(values, type=c.type)
    data = pa.table(arrays)
    for offset in range(0, data.num_rows, _CHUNK):
        writer.write(table, data.slice(offset, _CHUNK))


def _instances(writer: StoreWriter, ids: list[int]) -> None:
    roles = [Role.GATEWAY, Role.COLOCATED, Role.CLIENT]
    names = ["gateway-0", "engine-0", "client-0"]
    for iid, role, name in zip(ids, roles, names):
        writer.register_instance(iid, role, name)
    _write(writer, INSTANCES, {
        col.INSTANCE_ID: ids, col.ROLE: pa.array([int(r) for r in roles], pa.int8()), col.NAME: names,
        col.HOST: ["synthetic"] * 3, col.PID: [100, 101, 102], col.MONO_ANCHOR_NS: [0, 0, 0],
        col.WALL_ANCHOR_NS: [1_700_000_000 * 10**9] * 3, col.CLOCK_OFFSET_NS: [0, 0, 0],
        col.CLOCK_RTT_NS: [1000, 1000, 1000],
    })


def _generate(rng: np.random.Generator, n: int, mean_output_tokens: float, slowdown: float,
              rate_rps: float, *, sessions: float = 0.0, speculative: bool = False,
              extra: np.random.Generator | None = None) -> SimpleNamespace:
    """Every request's and token's times (ns) and attributes, as named numpy arrays. ``sessions`` (a share of
    the requests) and ``speculative`` draw from ``extra``, so ``rng``'s draws, and a run without them, stay
    as they are."""
    rid = rng.integers(1, 2**62, size=n, dtype=np.int64)
    arrival = (np.cumsum(rng.exponential(1e9 / rate_rps, size=n)) + 1e9).astype(np.int64)
    n_out = np.minimum(1 + rng.poisson(max(mean_output_tokens - 1.0, 0.0), size=n), 64).astype(np.int64)
    prompt = rng.integers(16, 512, size=n).astype(np.int64)
    cached = np.where(rng.random(n) < 0.5, (prompt // 32) * 16, 0).astype(np.int64)
    tenant_idx = rng.integers(0, len(TENANTS), size=n)
    slo_idx = rng.integers(0, len(SLO_CLASSES), size=n)
    plan = (plan_sessions(extra, share=sessions, n_out=n_out, prompt=prompt, cached=cached, tenant_idx=tenant_idx,
                          slo_idx=slo_idx) if sessions else None)

    # token 0 stages, ns
    receive = rng.integers(100_000, 400_000, size=n)
    queue = rng.exponential(4 * _MS, size=n).astype(np.int64) + tenant_idx * _MS
    prefill = ((prompt - cached) * 20_000 * slowdown).astype(np.int64) + _MS
    send0 = rng.integers(50_000, 150_000, size=n)

    # tokens >= 1: one row per token, request-major
    req_of_tok = np.repeat(np.arange(n), n_out)
    starts = np.cumsum(n_out) - n_out  # each request's token 0 row
    tok_idx = (np.arange(req_of_tok.size) - np.repeat(starts, n_out)).astype(np.int64)
    later = tok_idx > 0
    m = int(later.sum())
    dq = rng.exponential(0.5 * _MS, size=m).astype(np.int64)
    dc = (rng.normal(8.0, 1.0, size=m).clip(4.0, 20.0) * _MS * slowdown).astype(np.int64)
    ds = rng.integers(50_000, 150_000, size=m)
    itl = np.zeros(req_of_tok.size, dtype=np.int64)
    itl[later] = dq + dc + ds
    send = np.zeros(req_of_tok.size, dtype=np.int64)  # each token's stream.send part of its interval
    send[later] = ds
    if plan is not None:  # a turn arrives after the previous one can have finished (speculation at most doubles a step)
        plain = receive + queue + prefill + send0 + np.bincount(req_of_tok, weights=itl, minlength=n).astype(np.int64)
        session_arrivals(plan, arrival, 3 * plain + 10 * _MS)
    first_sent = arrival + receive + queue + prefill + send0
    t0 = int(arrival.min())
    spec = None
    if speculative:
        plain_sent = first_sent[req_of_tok] + _within_request(itl, n_out)
        full = {name: np.zeros(req_of_tok.size, dtype=np.int64) for name in ("dq", "dc", "ds")}
        full["dq"][later], full["dc"][later], full["ds"][later] = dq, dc, ds
        plain_step = (plain_sent - send - t0) // _STEP_NS
        spec = plan_speculation(extra, n_out=n_out, later=later, plain_start_ns=plain_sent - itl, dc=full["dc"],
                                plain_batch=np.bincount(plain_step[later], minlength=int(plain_step.max()) + 1)[plain_step],
                                slowdown=slowdown)
        itl, send = spec.intervals(later, full["dq"], full["dc"], full["ds"])
    head = spec.head if spec is not None else np.ones(req_of_tok.size, dtype=bool)  # tokens that open a step

    # sent time of token i = first_sent + cumulative ITL within the request
    sent = first_sent[req_of_tok] + _within_request(itl, n_out)
    tok_start = np.where(later, sent - itl, arrival[req_of_tok])
    emit = np.empty_like(sent)  # engine sampled the token; the stream send follows (a step's tokens at its end)
    emit[later] = (sent - send)[np.maximum.accumulate(np.where(head, np.arange(head.size), 0))][later]
    emit[~later] = first_sent - send0
    finish = sent[np.cumsum(n_out) - 1]
    step_of_tok = ((emit - t0) // _STEP_NS).astype(np.int64)

    return SimpleNamespace(**{k: v for k, v in locals().items() if k not in ("rng", "extra", "mean_output_tokens",
                                                                           "rate_rps", "full", "plain_sent",
                                                                           "plain_step", "plain")})


def _within_request(itl: np.ndarray, n_out: np.ndarray) -> np.ndarray:
    """Per token row: the sum of its request's intervals up to and including its own (0 for token 0)."""
    cum = np.cumsum(itl)
    return cum - np.repeat(cum[np.cumsum(n_out) - n_out], n_out)


def write_run(
    store: Path,
    run_id: str,
    *,
    num_requests: int,
    mean_output_tokens: float = 6.0,
    slowdown: float = 1.0,
    rate_rps: float = 40.0,
    seed: int = 0,
    omit: tuple[str, ...] = (),
    dropped: int = 0,
    instance_ids: tuple[int, int, int] = (GATEWAY_ID, ENGINE_ID, CLIENT_ID),
    slo_ms: dict[str, tuple[float, float]] | None = None,
    sessions: float = 0.0,
    speculative: bool = False,
) -> SyntheticRun:
    """Write one synthetic run of ``num_requests`` requests into ``store``; tables named in ``omit`` are left out.

    ``instance_ids``: the gateway's, the engine's and the client's ids (real runs have 63-bit ones).
    ``slo_ms``: SLO class -> (TTFT, TPOT) targets in ms, written into the run's config.
    ``sessions``: the share of requests that are turns of multi-turn sessions, with the retention policy's
    cache events (:mod:`synthetic_sessions`); ``speculative``: the engine speculates in some periods, with
    ``spec_steps`` rows and draft/verify spans (:mod:`synthetic_speculation`). Both off by default: the
    requests then carry no session and no step speculates."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not 0.0 <= sessions <= 1.0:
        raise ValueError(f"sessions must be a share between 0 and 1, got {sessions}")
    rng = np.random.default_rng(seed)
    n = num_requests
    g = _generate(rng, n, mean_output_tokens, slowdown, rate_rps, sessions=sessions, speculative=speculative,
                  extra=np.random.default_rng([seed, 1]))
    config: dict = {"synthetic": {"num_requests": n, "slowdown": slowdown}}
    if sessions or speculative:
        config["synthetic"].update(sessions=sessions, speculative=speculative)
    if slo_ms:
        config["slo"] = {k: {"ttft_ms": ttft, "tpot_ms": tpot} for k, (ttft, tpot) in slo_ms.items()}
    writer = StoreWriter(store, run_id=run_id, config=config)
    try:
        ids = list(instance_ids)
        _instances(writer, ids)
        if REQUESTS.name not in omit:
            _requests(writer, ids, g, rng)
        if SPANS.name not in omit:
            _spans(writer, ids, g)
        if TOKENS.name not in omit:
            _tokens(writer, ids, g.rid, g.req_of_tok, g.tok_idx, g.emit, g.sent, g.step_of_tok)
        num_seqs = _step_seqs(g)
        if STEPS.name not in omit:
            _steps(writer, ids, g, num_seqs, rng)
        if CACHE_EVENTS.name not in omit:
            _cache_events(writer, ids, g, rng)
        if g.spec is not None and SPEC_STEPS.name not in omit:
            _spec_steps(writer, ids, g, num_seqs)
        writer.update_counters({DROPPED: dropped, SAMPLED_OUT: 0})
    finally:
        writer.close()
    return SyntheticRun(run_id, Path(store) / run_id, g.rid, g.n_out)


def _requests(writer, ids, g, rng) -> None:
    rid, n = g.rid, g.rid.size
    tenants = np.array(TENANTS, dtype=object)[g.tenant_idx]
    slos = np.array(SLO_CLASSES, dtype=object)[g.slo_idx]
    keys = np.char.add("req-", np.arange(n).astype(str)).astype(object)
    client_lag = 300_000  # ns the client sees the first byte later
    arrival, first_sent, finish = g.arrival, g.first_sent, g.finish
    per = {
        col.REQUEST_ID: np.concatenate([rid, rid, rid]),
        col.REQUEST_KEY: np.concatenate([keys, keys, keys]),
        col.INSTANCE_ID: np.repeat(np.array(ids, dtype=np.int64), n),
        col.TENANT: np.concatenate([tenants, tenants, tenants]),
        col.SLO_CLASS: np.concatenate([slos, slos, slos]),
        col.ARRIVAL_NS: np.concatenate([arrival, arrival + 500_000, arrival - 200_000]),
        col.FIRST_TOKEN_NS: np.concatenate([first_sent, first_sent, first_sent + client_lag]),
        col.FINISH_NS: np.concatenate([finish, finish, finish + client_lag]),
        col.NUM_PROMPT_TOKENS: np.concatenate([g.prompt, g.prompt, g.prompt]),
        col.NUM_CACHED_TOKENS: np.concatenate([g.cached, g.cached, g.cached]),
        col.NUM_OUTPUT_TOKENS: np.concatenate([g.n_out, g.n_out, g.n_out]),
        col.STATUS: pa.array(np.full(3 * n, int(RequestStatus.OK), dtype=np.int8)),
        col.ERROR: np.full(3 * n, "", dtype=object),
        col.TRACE_ID: np.full(3 * n, "", dtype=object),
    }
    if g.plan is not None:  # every process's row of a turn names its session and turn, as the client sent them
        name = np.full(n, None, dtype=object)
        name[g.plan.members] = np.char.add("session-", g.plan.session.astype(str)).astype(object)
        turn = np.full(n, -1, dtype=np.int32)
        turn[g.plan.members] = g.plan.turn
        turns = pa.array(np.tile(turn, 3), mask=np.tile(turn < 0, 3))
        per[col.SESSION], per[col.SESSION_TURN] = np.tile(name, 3), turns
    _write(writer, REQUESTS, per)


def _spans(writer, ids, g) -> None:
    rid, n = g.rid, g.rid.size
    # token 0: four back-to-back stages from arrival
    b0 = g.arrival
    b1 = b0 + g.receive
    b2 = b1 + g.queue
    b3 = b2 + g.prefill
    b4 = b3 + g.send0
    later = g.later
    first_steps = g.step_of_tok[~later]
    zero = {
        col.REQUEST_ID: np.tile(rid, 4),
        col.STAGE: np.repeat([int(Stage.GATEWAY_RECEIVE), int(Stage.SCHEDULE_QUEUE), int(Stage.PREFILL_COMPUTE),
                              int(Stage.STREAM_SEND)], n),
        col.TOKEN_INDEX: np.zeros(4 * n, dtype=np.int32),
        col.START_NS: np.concatenate([b0, b1, b2, b3]),
        col.END_NS: np.concatenate([b1, b2, b3, b4]),
        col.INSTANCE_ID: np.repeat(np.array([ids[0], ids[1], ids[1], ids[0]], dtype=np.int64), n),
        col.STEP: np.concatenate([np.full(n, -1), np.full(n, -1), first_steps, np.full(n, -1)]),
    }
    # tokens >= 1: a step's first token waits (decode.queue) and computes (decode.compute, or decode.draft then
    # decode.verify); every token is then sent (stream.send, the whole interval of a speculative step's later ones)
    spec = g.spec.spec if g.spec is not None else np.zeros(later.size, dtype=bool)
    heads = later & g.head
    plain, drafted = heads & ~spec, later & spec
    dq = np.zeros(later.size, dtype=np.int64)
    dq[later] = g.dq
    s = g.tok_start
    pieces = [(Stage.DECODE_QUEUE, heads, s, s + dq, False), (Stage.DECODE_COMPUTE, plain, s + dq, g.sent - g.send, True)]
    if g.spec is not None:
        draft_end = s + dq + g.spec.draft_ns
        pieces += [(Stage.DECODE_DRAFT, drafted, s + dq, draft_end, True),
                   (Stage.DECODE_VERIFY, drafted, draft_end, g.sent - g.send, True)]
    pieces.append((Stage.STREAM_SEND, later, g.sent - g.send, g.sent, False))
    rest = {col.REQUEST_ID: [], col.STAGE: [], col.TOKEN_INDEX: [], col.START_NS: [], col.END_NS: [],
            col.INSTANCE_ID: [], col.STEP: []}
    for stage, rows, start, end, on_step in pieces:
        k = int(rows.sum())
        rest[col.REQUEST_ID].append(rid[g.req_of_tok[rows]])
        rest[col.STAGE].append(np.full(k, int(stage)))
        rest[col.TOKEN_INDEX].append(g.tok_idx[rows].astype(np.int32))
        rest[col.START_NS].append(start[rows])
        rest[col.END_NS].append(end[rows])
        rest[col.INSTANCE_ID].append(np.full(k, ids[0] if stage == Stage.STREAM_SEND else ids[1], dtype=np.int64))
        rest[col.STEP].append(g.step_of_tok[rows] if on_step else np.full(k, -1))
    for part in (zero, {name: np.concatenate(parts) for name, parts in rest.items()}):
        _write(writer, SPANS, part)


def _tokens(writer, ids, rid, req_of_tok, tok_idx, emit, sent, step_of_tok) -> None:
    k = req_of_tok.size
    r = rid[req_of_tok]
    ti = pa.array(tok_idx.astype(np.int32))
    _write(writer, TOKENS, {
        col.REQUEST_ID: r, col.TOKEN_INDEX: ti, col.EMIT_NS: emit, col.SENT_NS: sent,
        col.RECV_NS: pa.nulls(k, pa.int64()), col.STEP: step_of_tok,
        col.INSTANCE_ID: np.full(k, ids[1], dtype=np.int64),
    })
    _write(writer, TOKENS, {  # the client's view: when each chunk arrived
        col.REQUEST_ID: r, col.TOKEN_INDEX: ti, col.EMIT_NS: pa.nulls(k, pa.int64()),
        col.SENT_NS: pa.nulls(k, pa.int64()), col.RECV_NS: sent + 300_000,
        col.STEP: pa.nulls(k, pa.int64()), col.INSTANCE_ID: np.full(k, ids[2], dtype=np.int64),
    })


def _step_seqs(g) -> np.ndarray:
    """Sequences per engine step (index: step): requests decoding in it plus requests prefilled in it."""
    num_steps = int(g.step_of_tok.max()) + 1
    return (np.bincount(g.step_of_tok[g.later & g.head], minlength=num_steps)
            + np.bincount(g.step_of_tok[~g.later], minlength=num_steps))


def _steps(writer, ids, g, num_seqs, rng) -> None:
    step_of_tok, later = g.step_of_tok, g.later
    uncached_prompt = g.prompt[g.req_of_tok] - g.cached[g.req_of_tok]
    num_steps = num_seqs.size
    decode = np.bincount(step_of_tok[later], minlength=num_steps)
    prefill_tok = np.bincount(step_of_tok[~later], weights=uncached_prompt[~later], minlength=num_steps)
    active = num_seqs > 0
    k = np.flatnonzero(active)
    seqs = num_seqs[k]
    # a step runs longer with more work in it (ns)
    dur = (2 * _MS + seqs * 300_000 + prefill_tok[k] * 2_000).clip(max=_STEP_NS - 1).astype(np.int64)
    start = g.t0 + k * _STEP_NS
    waiting = rng.poisson(2.0, size=k.size)
    _write(writer, STEPS, {
        col.INSTANCE_ID: np.full(k.size, ids[1], dtype=np.int64), col.STEP: k.astype(np.int64),
        col.START_NS: start, col.END_NS: start + dur, col.NUM_SEQS: seqs.astype(np.int64),
        col.NUM_PREFILL_TOKENS: prefill_tok[k].astype(np.int64), col.NUM_DECODE_TOKENS: decode[k].astype(np.int64),
        col.NUM_WAITING: waiting.astype(np.int64), col.NUM_RUNNING: seqs.astype(np.int64),
        col.NUM_PREEMPTED: (rng.random(k.size) < 0.02).astype(np.int64),
        col.NUM_BLOCKS_USED_DEVICE: (seqs * 8).astype(np.int64), col.NUM_BLOCKS_TOTAL_DEVICE: np.full(k.size, 4096),
        col.NUM_BLOCKS_USED_HOST: (seqs * 2).astype(np.int64), col.NUM_BLOCKS_TOTAL_HOST: np.full(k.size, 16384),
        col.NUM_BLOCKS_USED_DISK: pa.nulls(k.size, pa.int64()), col.NUM_BLOCKS_TOTAL_DISK: pa.nulls(k.size, pa.int64()),
    })


def _cache_events(writer, ids, g, rng) -> None:
    rid, prompt, cached, n = g.rid, g.prompt, g.cached, g.rid.size
    lookup_ns = g.arrival + g.receive + g.queue
    hit = cached > 0
    kinds = np.where(hit, int(CacheEventKind.HIT), int(CacheEventKind.MISS))
    tiers = np.where(hit & (rng.random(n) < 0.3), int(Tier.HOST), int(Tier.DEVICE))
    blocks = np.where(hit, cached // 16, (prompt - cached) // 16)
    lookup_step = np.full(n, -1, dtype=np.int64)
    if g.plan is not None:  # a turn's carried blocks are reused from the device; its lookup's step is the carry's
        tiers[g.plan.members[g.plan.later]] = int(Tier.DEVICE)
        lookup_step = g.step_of_tok[~g.later]
    # every 8th request also evicts blocks, every 16th offloads then loads them back from host
    extra = np.arange(n)[::8]
    ex_kinds = np.tile([int(CacheEventKind.EVICT), int(CacheEventKind.OFFLOAD), int(CacheEventKind.LOAD)], extra.size)
    ex_req = np.repeat(extra, 3)
    all_req = np.concatenate([np.arange(n), ex_req])
    kind = np.concatenate([kinds, ex_kinds])
    tier = np.concatenate([tiers, np.where(ex_kinds == int(CacheEventKind.EVICT), int(Tier.DEVICE), int(Tier.HOST))])
    nblocks = np.concatenate([blocks, np.full(ex_req.size, 4)])
    start = lookup_ns[all_req]
    moved = np.isin(kind, [int(CacheEventKind.OFFLOAD), int(CacheEventKind.LOAD)])
    end = start + np.where(moved, 200_000, 0)
    step = np.concatenate([lookup_step, np.full(ex_req.size, -1)])
    if g.plan is not None:
        kept = session_cache_events(g.plan, lookup_ns=lookup_ns, finish_ns=g.finish, admission_step=lookup_step,
                                    t0=g.t0, step_ns=_STEP_NS)
        all_req, kind, start, end, step, nblocks = (np.concatenate([a, b]) for a, b in (
            (all_req, kept["request"]), (kind, kept["kind"]), (start, kept["start"]), (end, kept["end"]),
            (step, kept["step"]), (nblocks, kept["blocks"])))
        tier = np.concatenate([tier, np.full(kept["request"].size, int(Tier.DEVICE))])
        moved = np.concatenate([moved, np.zeros(kept["request"].size, dtype=bool)])
    _write(writer, CACHE_EVENTS, {
        col.INSTANCE_ID: np.full(all_req.size, ids[1], dtype=np.int64), col.REQUEST_ID: rid[all_req],
        col.KIND: pa.array(kind.astype(np.int8)), col.TIER: pa.array(tier.astype(np.int8)),
        col.NUM_BLOCKS: nblocks.astype(np.int64), col.NUM_TOKENS: (nblocks * 16).astype(np.int64),
        col.NUM_BYTES: np.where(moved, nblocks * 65536, -1).astype(np.int64),
        col.START_NS: start, col.END_NS: end, col.STEP: step,
    })


def _spec_steps(writer, ids, g, num_seqs) -> None:
    """One row per speculative step of a request: its first token's row carries the step."""
    sp = g.spec
    rows = np.flatnonzero(sp.spec)
    step = g.step_of_tok[rows]
    draft_start = g.tok_start[rows] + g.dq[rows - g.req_of_tok[rows] - 1]  # dq is drawn per token >= 1
    draft_end = draft_start + sp.draft_ns[rows]
    spec_seqs = np.bincount(step, minlength=num_seqs.size)
    _write(writer, SPEC_STEPS, {
        col.INSTANCE_ID: np.full(rows.size, ids[1], dtype=np.int64), col.REQUEST_ID: g.rid[g.req_of_tok[rows]],
        col.STEP: step, col.DRAFT_SOURCE: pa.array(sp.source[rows]), col.NUM_PROPOSED: sp.k[rows],
        col.NUM_ACCEPTED: sp.accepted[rows], col.FIRST_TOKEN_INDEX: pa.array(g.tok_idx[rows].astype(np.int32)),
        col.DRAFT_START_NS: draft_start, col.DRAFT_END_NS: draft_end, col.VERIFY_START_NS: draft_end,
        col.VERIFY_END_NS: draft_end + sp.verify_ns[rows], col.BATCH_SIZE: num_seqs[step],
        col.NUM_SPEC_SEQS: spec_seqs[step],
    })
