"""Sampling: deterministic head sampling by rate, slow and failed requests always kept."""

from __future__ import annotations

import math

import pytest

from instrument.sampling import (
    PENDING_BYTES,
    SAMPLED_OUT_REQUESTS,
    SAMPLED_PROMOTED,
    SAMPLED_TAIL_KEPT,
    SamplingPolicy,
    SamplingRecorder,
)
from tokentrace.recorder import BufferedRecorder
from tokentrace.recorder.sink import InMemorySink
from tokentrace.schema import (
    REQUESTS,
    SPANS,
    SPEC_STEPS,
    TOKENS,
    DraftSource,
    RequestStatus,
    Stage,
    col,
    request_id_of,
)
from tokentrace.store import SAMPLED_OUT, StoreWriter, open_run

MS = 1_000_000


def _sampler(sink=None, **kw) -> tuple[SamplingRecorder, InMemorySink]:
    sink = sink or InMemorySink()
    return SamplingRecorder(BufferedRecorder(sink, instance_id=1), **kw), sink


def _request(rec, key: str, t: int, *, ttft_ns: int = MS, e2e_ns: int = 2 * MS, num_tokens: int = 2,
             status: int = RequestStatus.OK) -> int:
    """A request with a queue span, one decode span per later token and ``num_tokens`` tokens."""
    rid = rec.request_begin(key, tenant="t", arrival_ns=t)
    rec.span(rid, Stage.SCHEDULE_QUEUE, t, t + ttft_ns, 0)
    for i in range(num_tokens):
        at = t + ttft_ns + i * (e2e_ns - ttft_ns) // max(1, num_tokens - 1)
        if i:
            rec.span(rid, Stage.DECODE_COMPUTE, at - 10, at, i)
        rec.token(rid, i, emit_ns=at)
    rec.request_end(rid, finish_ns=t + e2e_ns, status=status, num_output_tokens=num_tokens)
    return rid


def _kept_keys(sink: InMemorySink) -> set[str]:
    return set(sink.table(REQUESTS.name).column(col.REQUEST_KEY).to_pylist())


def test_rate_keeps_about_rate_times_n_and_the_same_requests_everywhere():
    n, rate = 2000, 0.25
    keys = [f"req-{i}" for i in range(n)]
    kept = []
    for _ in range(2):  # two processes (or two runs) decide alike
        rec, sink = _sampler(rate=rate, keep_failed=False)
        for i, key in enumerate(keys):
            _request(rec, key, i * 10 * MS)
        rec.close()
        kept.append(_kept_keys(sink))
        assert rec.sampling_counters[SAMPLED_OUT_REQUESTS] == n - len(kept[-1])
        # 5 events per request: the request row, a queue span, a decode span, 2 tokens
        assert rec.sampling_counters[SAMPLED_OUT] == 5 * (n - len(kept[-1]))
        assert sink.num_rows(TOKENS.name) == 2 * len(kept[-1])
    assert kept[0] == kept[1]
    sigma = math.sqrt(n * rate * (1 - rate))
    assert abs(len(kept[0]) - rate * n) < 4 * sigma
    assert kept[0] == {k for k in keys if request_id_of(k, "t") < rate * 2**63}


def test_slow_and_failed_requests_are_always_kept_whole():
    rec, sink = _sampler(rate=0.0, slow_ttft_ns=10 * MS, slow_e2e_ns=100 * MS)
    _request(rec, "fast", 0)
    _request(rec, "slow-ttft", 0, ttft_ns=11 * MS, e2e_ns=20 * MS, num_tokens=3)
    _request(rec, "slow-e2e", 0, ttft_ns=MS, e2e_ns=101 * MS)
    _request(rec, "failed", 0, status=RequestStatus.ERROR)
    _request(rec, "no-token-stuck", 0, ttft_ns=MS, e2e_ns=50 * MS, num_tokens=0)
    _request(rec, "fast-2", 0, ttft_ns=10 * MS, e2e_ns=100 * MS)  # at the thresholds: not over
    rec.close()
    assert _kept_keys(sink) == {"slow-ttft", "slow-e2e", "failed", "no-token-stuck"}
    slow = request_id_of("slow-ttft", "t")
    spans = [r for r in sink.table(SPANS.name).to_pylist() if r[col.REQUEST_ID] == slow]
    tokens = [r for r in sink.table(TOKENS.name).to_pylist() if r[col.REQUEST_ID] == slow]
    assert len(spans) == 3 and sorted(t[col.TOKEN_INDEX] for t in tokens) == [0, 1, 2]
    row = next(r for r in sink.table(REQUESTS.name).to_pylist() if r[col.REQUEST_ID] == slow)
    assert row[col.TENANT] == "t" and row[col.ARRIVAL_NS] == 0 and row[col.FINISH_NS] == 20 * MS
    assert rec.sampling_counters[SAMPLED_TAIL_KEPT] == 4
    assert rec.sampling_counters[SAMPLED_OUT] == 5 + 5  # "fast" and "fast-2"
    assert rec.num_pending == 0 and rec.num_buffered_bytes == 0


def test_sampled_out_counts_reach_the_manifest(tmp_path):
    writer = StoreWriter(tmp_path, run_id="s")
    rec = SamplingRecorder(BufferedRecorder(writer, instance_id=writer.instance_id), rate=0.0, slow_e2e_ns=5 * MS)
    for i in range(10):
        _request(rec, f"r{i}", i * MS, e2e_ns=(10 if i < 3 else 2) * MS)
    rec.close()
    run = open_run(tmp_path, "s")
    counters = run.counters()
    assert counters[SAMPLED_OUT] == 7 * 5 and counters[SAMPLED_OUT_REQUESTS] == 7
    assert run.info().num_sampled_out == 35
    assert run.num_rows(REQUESTS.name) == 3


def test_memory_bound_promotes_the_oldest_request():
    span_bytes = 64
    rec, sink = _sampler(rate=0.0, slow_e2e_ns=10**12, max_buffered_bytes=2 * PENDING_BYTES + 8 * span_bytes)
    old = rec.request_begin("old", arrival_ns=0)
    for i in range(4):
        rec.span(old, Stage.DECODE_COMPUTE, i, i + 1, i)
    young = rec.request_begin("young", arrival_ns=5)
    for i in range(5):  # pushes the total over the bound: "old" is forwarded
        rec.span(young, Stage.DECODE_COMPUTE, 10 + i, 11 + i, i)
    assert rec.sampling_counters[SAMPLED_PROMOTED] == 1
    assert rec.num_buffered_bytes <= 2 * PENDING_BYTES + 8 * span_bytes
    rec.span(old, Stage.DECODE_COMPUTE, 100, 101, 9)  # passes straight through now
    rec.request_end(old, finish_ns=200)
    rec.request_end(young, finish_ns=20)  # fast: dropped
    rec.close()
    assert _kept_keys(sink) == {"old"}
    assert sink.num_rows(SPANS.name) == 5
    assert rec.sampling_counters[SAMPLED_OUT] == 6


def test_stage_begin_end_and_unmatched_end_are_sampled_like_spans():
    rec, sink = _sampler(rate=0.0, keep_failed=True)
    rid = rec.request_begin("x", arrival_ns=0)
    rec.stage_begin(rid, Stage.PREFILL_COMPUTE, 3, 0)
    rec.stage_end(rid, Stage.PREFILL_COMPUTE, 8, 0)
    rec.stage_end(rid, Stage.DECODE_COMPUTE, 9, 1)  # no begin: invalid, counted by the recorder
    rec.request_end(rid, finish_ns=10, status=RequestStatus.TIMEOUT)
    rec.close()
    rows = sink.table(SPANS.name).to_pylist()
    assert [(r[col.STAGE], r[col.START_NS], r[col.END_NS]) for r in rows] == [(Stage.PREFILL_COMPUTE, 3, 8)]
    assert rec.counters["dropped_invalid"] == 1


@pytest.mark.parametrize("kw", [dict(rate=1.5), dict(rate=-0.1), dict(slow_ttft_ns=-1), dict(slow_e2e_ns=0.5)])
def test_bad_policy_is_a_value_error(kw):
    with pytest.raises(ValueError):
        SamplingPolicy(**kw)


def test_rate_one_forwards_everything_without_buffering():
    rec, sink = _sampler(rate=1.0)
    for i in range(20):
        _request(rec, f"k{i}", 0)
    assert rec.num_pending == 0
    rec.close()
    assert sink.num_rows(REQUESTS.name) == 20 and rec.sampling_counters[SAMPLED_OUT] == 0


def test_speculative_step_rows_are_kept_or_dropped_with_their_request():
    rec, sink = _sampler(rate=0.0, slow_e2e_ns=10 * MS)
    for key, e2e in (("fast", 2 * MS), ("slow", 20 * MS)):
        rid = rec.request_begin(key, arrival_ns=0)
        rec.spec_step(rid, 3, DraftSource.NGRAM, 4, 2, 1, 10, 20, 20, 30, 2, 1)
        rec.token(rid, 0, emit_ns=MS)
        rec.request_end(rid, finish_ns=e2e, num_output_tokens=1)
    rec.close()
    rows = sink.table(SPEC_STEPS.name).to_pylist()
    assert [r[col.REQUEST_ID] for r in rows] == [request_id_of("slow")]  # buffered, then kept with it
    assert rows[0][col.NUM_ACCEPTED] == 2 and rows[0][col.VERIFY_END_NS] == 30
