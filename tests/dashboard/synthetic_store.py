"""Synthetic tokentrace runs written straight to Parquet, for dashboard tests and its benchmark.

A run has three traced processes (a gateway, one colocated engine, and the load
generator as role ``client``) and every table of the schema, generated with numpy
in a few vectorised passes and written through :class:`~tokentrace.store.writer.StoreWriter`
(real store layout, real schema). Stage intervals tile each token's interval, as
the reference engine's do:

* token 0: gateway.receive, schedule.queue, prefill.compute, stream.send;
* token i >= 1: decode.queue, decode.compute, stream.send.

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

from tokentrace.schema import (
    CACHE_EVENTS,
    INSTANCES,
    REQUESTS,
    SPANS,
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
              rate_rps: float) -> SimpleNamespace:
    """Every request's and token's times (ns) and attributes, as named numpy arrays."""
    rid = rng.integers(1, 2**62, size=n, dtype=np.int64)
    arrival = (np.cumsum(rng.exponential(1e9 / rate_rps, size=n)) + 1e9).astype(np.int64)
    n_out = np.minimum(1 + rng.poisson(max(mean_output_tokens - 1.0, 0.0), size=n), 64).astype(np.int64)
    prompt = rng.integers(16, 512, size=n).astype(np.int64)
    cached = np.where(rng.random(n) < 0.5, (prompt // 32) * 16, 0).astype(np.int64)
    tenant_idx = rng.integers(0, len(TENANTS), size=n)
    slo_idx = rng.integers(0, len(SLO_CLASSES), size=n)

    # token 0 stages, ns
    receive = rng.integers(100_000, 400_000, size=n)
    queue = rng.exponential(4 * _MS, size=n).astype(np.int64) + tenant_idx * _MS
    prefill = ((prompt - cached) * 20_000 * slowdown).astype(np.int64) + _MS
    send0 = rng.integers(50_000, 150_000, size=n)
    first_sent = arrival + receive + queue + prefill + send0

    # tokens >= 1: one row per token, request-major
    req_of_tok = np.repeat(np.arange(n), n_out)
    tok_idx = (np.arange(req_of_tok.size) - np.repeat(np.cumsum(n_out) - n_out, n_out)).astype(np.int64)
    later = tok_idx > 0
    m = int(later.sum())
    dq = rng.exponential(0.5 * _MS, size=m).astype(np.int64)
    dc = (rng.normal(8.0, 1.0, size=m).clip(4.0, 20.0) * _MS * slowdown).astype(np.int64)
    ds = rng.integers(50_000, 150_000, size=m)
    itl = np.zeros(req_of_tok.size, dtype=np.int64)
    itl[later] = dq + dc + ds
    # sent time of token i = first_sent + cumulative ITL within the request
    cum = np.cumsum(itl)
    base = np.repeat(cum[np.cumsum(n_out) - n_out], n_out)
    sent = first_sent[req_of_tok] + (cum - base)
    tok_start = np.where(later, sent - itl, arrival[req_of_tok])
    emit = np.empty_like(sent)  # engine sampled the token; the stream send follows
    emit[later] = sent[later] - ds
    emit[~later] = first_sent - send0
    finish = first_sent + (cum[np.cumsum(n_out) - 1] - cum[np.cumsum(n_out) - n_out])
    t0 = int(arrival.min())
    step_of_tok = ((emit - t0) // _STEP_NS).astype(np.int64)

    return SimpleNamespace(**{k: v for k, v in locals().items() if k not in ("rng", "mean_output_tokens",
                                                                           "rate_rps", "slowdown")})


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
) -> SyntheticRun:
    """Write one synthetic run of ``num_requests`` requests into ``store``; tables named in ``omit`` are left out.

    ``instance_ids``: the gateway's, the engine's and the client's ids (real runs have 63-bit ones).
    ``slo_ms``: SLO class -> (TTFT, TPOT) targets in ms, written into the run's config."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = np.random.default_rng(seed)
    n = num_requests
    g = _generate(rng, n, mean_output_tokens, slowdown, rate_rps)
    config: dict = {"synthetic": {"num_requests": n, "slowdown": slowdown}}
    if slo_ms:
        config["slo"] = {k: {"ttft_ms": ttft, "tpot_ms": tpot} for k, (ttft, tpot) in slo_ms.items()}
    writer = StoreWriter(store, run_id=run_id, config=config)
    try:
        ids = list(instance_ids)
        _instances(writer, ids)
        if REQUESTS.name not in omit:
            _requests(writer, ids, g.rid, g.arrival, g.first_sent, g.finish, g.prompt, g.cached, g.n_out,
                      g.tenant_idx, g.slo_idx, rng)
        if SPANS.name not in omit:
            _spans(writer, ids, g.rid, g.arrival, g.receive, g.queue, g.prefill, g.send0, g.req_of_tok, g.tok_idx, g.later,
                   g.tok_start, g.dq, g.dc, g.ds, g.step_of_tok)
        if TOKENS.name not in omit:
            _tokens(writer, ids, g.rid, g.req_of_tok, g.tok_idx, g.emit, g.sent, g.step_of_tok)
        if STEPS.name not in omit:
            _steps(writer, ids, g.t0, g.step_of_tok, g.later, g.prompt[g.req_of_tok] - g.cached[g.req_of_tok], rng)
        if CACHE_EVENTS.name not in omit:
            _cache_events(writer, ids, g.rid, g.arrival + g.receive + g.queue, g.prompt, g.cached, rng)
        writer.update_counters({DROPPED: dropped, SAMPLED_OUT: 0})
    finally:
        writer.close()
    return SyntheticRun(run_id, Path(store) / run_id, g.rid, g.n_out)


def _requests(writer, ids, rid, arrival, first_sent, finish, prompt, cached, n_out, tenant_idx, slo_idx, rng) -> None:
    n = rid.size
    tenants = np.array(TENANTS, dtype=object)[tenant_idx]
    slos = np.array(SLO_CLASSES, dtype=object)[slo_idx]
    keys = np.char.add("req-", np.arange(n).astype(str)).astype(object)
    client_lag = 300_000  # ns the client sees the first byte later
    per = {
        col.REQUEST_ID: np.concatenate([rid, rid, rid]),
        col.REQUEST_KEY: np.concatenate([keys, keys, keys]),
        col.INSTANCE_ID: np.repeat(np.array(ids, dtype=np.int64), n),
        col.TENANT: np.concatenate([tenants, tenants, tenants]),
        col.SLO_CLASS: np.concatenate([slos, slos, slos]),
        col.ARRIVAL_NS: np.concatenate([arrival, arrival + 500_000, arrival - 200_000]),
        col.FIRST_TOKEN_NS: np.concatenate([first_sent, first_sent, first_sent + client_lag]),
        col.FINISH_NS: np.concatenate([finish, finish, finish + client_lag]),
        col.NUM_PROMPT_TOKENS: np.concatenate([prompt, prompt, prompt]),
        col.NUM_CACHED_TOKENS: np.concatenate([cached, cached, cached]),
        col.NUM_OUTPUT_TOKENS: np.concatenate([n_out, n_out, n_out]),
        col.STATUS: pa.array(np.full(3 * n, int(RequestStatus.OK), dtype=np.int8)),
        col.ERROR: np.full(3 * n, "", dtype=object),
        col.TRACE_ID: np.full(3 * n, "", dtype=object),
    }
    _write(writer, REQUESTS, per)


def _spans(writer, ids, rid, arrival, receive, queue, prefill, send0, req_of_tok, tok_idx, later,
           tok_start, dq, dc, ds, step_of_tok) -> None:
    n = rid.size
    # token 0: four back-to-back stages from arrival
    b0 = arrival
    b1 = b0 + receive
    b2 = b1 + queue
    b3 = b2 + prefill
    b4 = b3 + send0
    first_steps = step_of_tok[~later]
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
    r = rid[req_of_tok[later]]
    s = tok_start[later]
    ti = tok_idx[later].astype(np.int32)
    m = r.size
    rest = {
        col.REQUEST_ID: np.tile(r, 3),
        col.STAGE: np.repeat([int(Stage.DECODE_QUEUE), int(Stage.DECODE_COMPUTE), int(Stage.STREAM_SEND)], m),
        col.TOKEN_INDEX: np.tile(ti, 3),
        col.START_NS: np.concatenate([s, s + dq, s + dq + dc]),
        col.END_NS: np.concatenate([s + dq, s + dq + dc, s + dq + dc + ds]),
        col.INSTANCE_ID: np.repeat(np.array([ids[1], ids[1], ids[0]], dtype=np.int64), m),
        col.STEP: np.concatenate([np.full(m, -1), step_of_tok[later], np.full(m, -1)]),
    }
    for part in (zero, rest):
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


def _steps(writer, ids, t0, step_of_tok, later, uncached_prompt, rng) -> None:
    num_steps = int(step_of_tok.max()) + 1
    decode = np.bincount(step_of_tok[later], minlength=num_steps)
    prefill_tok = np.bincount(step_of_tok[~later], weights=uncached_prompt[~later], minlength=num_steps)
    prefill_seqs = np.bincount(step_of_tok[~later], minlength=num_steps)
    active = (decode + prefill_seqs) > 0
    k = np.flatnonzero(active)
    seqs = (decode + prefill_seqs)[k]
    # a step runs longer with more work in it (ns)
    dur = (2 * _MS + seqs * 300_000 + prefill_tok[k] * 2_000).clip(max=_STEP_NS - 1).astype(np.int64)
    start = t0 + k * _STEP_NS
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


def _cache_events(writer, ids, rid, lookup_ns, prompt, cached, rng) -> None:
    n = rid.size
    hit = cached > 0
    kinds = np.where(hit, int(CacheEventKind.HIT), int(CacheEventKind.MISS))
    tiers = np.where(hit & (rng.random(n) < 0.3), int(Tier.HOST), int(Tier.DEVICE))
    blocks = np.where(hit, cached // 16, (prompt - cached) // 16)
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
    _write(writer, CACHE_EVENTS, {
        col.INSTANCE_ID: np.full(all_req.size, ids[1], dtype=np.int64), col.REQUEST_ID: rid[all_req],
        col.KIND: pa.array(kind.astype(np.int8)), col.TIER: pa.array(tier.astype(np.int8)),
        col.NUM_BLOCKS: nblocks.astype(np.int64), col.NUM_TOKENS: (nblocks * 16).astype(np.int64),
        col.NUM_BYTES: np.where(moved, nblocks * 65536, -1).astype(np.int64),
        col.START_NS: start, col.END_NS: start + np.where(moved, 200_000, 0), col.STEP: np.full(all_req.size, -1),
    })
