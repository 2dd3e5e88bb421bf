"""EngineTracer: the reference engine's hooks become stage intervals that tile time."""

from __future__ import annotations

import torch

from instrument.reference_engine import EngineTracer
from reference_server.engine.config import EngineConfig
from reference_server.engine.engine import Engine
from reference_server.model import SamplingParams
from tokentrace.recorder import BufferedRecorder
from tokentrace.recorder.sink import InMemorySink
from tokentrace.schema import CacheEventKind, RequestStatus, Stage, col, request_id_of

torch.set_num_threads(1)


def _run(config: EngineConfig, prompts: dict[str, str], *, max_tokens: int = 6, abort_after: dict | None = None):
    sink = InMemorySink()
    rec = BufferedRecorder(sink, instance_id=7, flush_interval_s=0.05)
    engine = Engine(config)
    tracer = EngineTracer(rec)
    engine.add_observer(tracer)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, sp)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        for rid, at in (abort_after or {}).items():
            if steps == at:
                engine.abort(rid)
    rec.close()
    return sink, tracer


def _rows(sink: InMemorySink, name: str) -> list[dict]:
    return sink.table(name).to_pylist()


def _assert_tiles(spans: list[dict], start: int, end: int) -> None:
    spans = sorted(spans, key=lambda s: s[col.START_NS])
    assert spans, "no spans"
    assert spans[0][col.START_NS] == start
    for a, b in zip(spans, spans[1:]):
        assert a[col.END_NS] == b[col.START_NS], (Stage(a[col.STAGE]).label, Stage(b[col.STAGE]).label)
    assert spans[-1][col.END_NS] == end
    for s in spans:
        assert s[col.END_NS] > s[col.START_NS]


def _check_invariant(sink: InMemorySink, keys: list[str]) -> None:
    spans, tokens, requests = _rows(sink, "spans"), _rows(sink, "tokens"), _rows(sink, "requests")
    for key in keys:
        rid = request_id_of(key)
        req = next(r for r in requests if r[col.REQUEST_ID] == rid)
        toks = sorted((t for t in tokens if t[col.REQUEST_ID] == rid), key=lambda t: t[col.TOKEN_INDEX])
        mine = [s for s in spans if s[col.REQUEST_ID] == rid]
        # Per request: [arrival, last token) is tiled.
        _assert_tiles(mine, req[col.ARRIVAL_NS], toks[-1][col.EMIT_NS])
        # Per token: token 0 = [arrival, emit_0], token i = (emit_{i-1}, emit_i].
        prev = req[col.ARRIVAL_NS]
        for t in toks:
            _assert_tiles([s for s in mine if s[col.TOKEN_INDEX] == t[col.TOKEN_INDEX]], prev, t[col.EMIT_NS])
            prev = t[col.EMIT_NS]


def test_stages_tile_every_request_and_token():
    prompts = {f"r{i}": f"a shared system prompt, then question number {i}" for i in range(5)}
    sink, tracer = _run(EngineConfig(model="tiny", block_size=4, num_device_blocks=128), prompts)
    _check_invariant(sink, list(prompts))
    stages = {Stage(s[col.STAGE]) for s in _rows(sink, "spans")}
    assert {Stage.SCHEDULE_QUEUE, Stage.CACHE_LOOKUP, Stage.PREFILL_COMPUTE, Stage.DECODE_COMPUTE,
            Stage.DETOKENIZE} <= stages
    assert tracer.num_in_flight == 0
    requests = _rows(sink, "requests")
    assert len(requests) == 5
    assert all(r[col.STATUS] == RequestStatus.OK and r[col.NUM_OUTPUT_TOKENS] == 6 for r in requests)
    assert len(_rows(sink, "tokens")) == 30
    assert len(_rows(sink, "steps")) > 0


def test_chunked_prefill_gives_one_compute_interval_per_chunk():
    prompt = "x" * 40  # 41 tokens with BOS: three chunks at a 16-token budget
    sink, _ = _run(EngineConfig(model="tiny", block_size=4, num_device_blocks=64, max_num_batched_tokens=16),
                   {"long": prompt}, max_tokens=3)
    _check_invariant(sink, ["long"])
    prefill = [s for s in _rows(sink, "spans") if s[col.STAGE] == Stage.PREFILL_COMPUTE]
    assert len(prefill) == 3
    assert all(s[col.TOKEN_INDEX] == 0 for s in prefill)


def test_preemption_shows_up_as_its_own_stage():
    # 12 blocks of 4 tokens cannot hold three 20-token sequences growing by 8: preemption.
    prompts = {f"p{i}": f"prompt number {i} ends." for i in range(3)}
    sink, _ = _run(EngineConfig(model="tiny", block_size=4, num_device_blocks=14, max_num_batched_tokens=64),
                   prompts, max_tokens=8)
    _check_invariant(sink, list(prompts))
    preempted = [s for s in _rows(sink, "spans") if s[col.STAGE] == Stage.SCHEDULE_PREEMPTED]
    assert preempted, "expected at least one preemption with 14 blocks"


def test_abort_ends_the_request_row_as_aborted():
    prompts = {"keep": "a first prompt", "drop": "a second prompt"}
    sink, tracer = _run(EngineConfig(model="tiny", block_size=4, num_device_blocks=64), prompts,
                        max_tokens=8, abort_after={"drop": 3})
    rows = {r[col.REQUEST_ID]: r for r in _rows(sink, "requests")}
    assert rows[request_id_of("drop")][col.STATUS] == RequestStatus.ABORTED
    assert rows[request_id_of("keep")][col.STATUS] == RequestStatus.OK
    assert tracer.num_in_flight == 0


def test_prefix_hit_is_recorded_as_cache_event():
    prefix = "the same long system prompt shared by both requests. "
    sink = InMemorySink()
    rec = BufferedRecorder(sink, instance_id=8)
    engine = Engine(EngineConfig(model="tiny", block_size=4, num_device_blocks=128))
    engine.add_observer(EngineTracer(rec))
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    for rid, suffix in (("a", "one"), ("b", "two")):  # b arrives after a finished
        engine.add_request(rid, prefix + suffix, sp)
        while engine.has_unfinished():
            engine.step()
    rec.close()
    hits = [e for e in _rows(sink, "cache_events")
            if e[col.KIND] == CacheEventKind.HIT and e[col.REQUEST_ID] == request_id_of("b")]
    assert hits and hits[0][col.NUM_BLOCKS] >= 10
    cached = {r[col.REQUEST_ID]: r[col.NUM_CACHED_TOKENS] for r in _rows(sink, "requests")}
    assert cached[request_id_of("b")] >= 40 and cached[request_id_of("a")] == 0
    _check_invariant(sink, ["a", "b"])


def test_a_prefix_evicted_between_two_requests_is_recorded_as_miss_evicted():
    prefix = "the same long system prompt shared by a and c. "  # 48 tokens: 12 full blocks of 4
    sink = InMemorySink()
    rec = BufferedRecorder(sink, instance_id=9)
    engine = Engine(EngineConfig(model="tiny", block_size=4, num_device_blocks=16))
    engine.add_observer(EngineTracer(rec))
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    for rid, prompt in (("a", prefix + "one"), ("b", "x" * 56), ("c", prefix + "two")):  # b evicts a's blocks
        engine.add_request(rid, prompt, sp)
        while engine.has_unfinished():
            engine.step()
    rec.close()
    events = [e for e in _rows(sink, "cache_events") if e[col.KIND] == CacheEventKind.MISS_EVICTED]
    assert [e[col.REQUEST_ID] for e in events] == [request_id_of("c")]
    cached = {r[col.REQUEST_ID]: r[col.NUM_CACHED_TOKENS] for r in _rows(sink, "requests")}[request_id_of("c")]
    assert events[0][col.NUM_BLOCKS] > 0 and events[0][col.NUM_TOKENS] == 4 * events[0][col.NUM_BLOCKS]
    assert cached + events[0][col.NUM_TOKENS] == 48  # what it found plus what it had lost: a's whole prefix
