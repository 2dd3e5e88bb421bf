"""Sessions analyzer against planted truth: the session workload of ``session_runs`` (its doc gives the
numbers) run on the reference engine under each KV retention policy, traced by the real engine tracer,
analyzed from the recorded tables."""

from __future__ import annotations

import pyarrow as pa
import pytest
from session_runs import CARRIED
from session_runs import run_sessions as _run

from analyzers.sessions import TURN, retention_summary, session_fairness, session_summary, session_turns
from analyzers.source import Source
from tokentrace.schema import CACHE_EVENTS, REQUESTS, CacheEventKind, col


def _turns(src: Source) -> dict[tuple[str, int], dict]:
    return {(r[col.SESSION], r[TURN]): r for r in session_turns(src).to_dict("records")}


@pytest.mark.parametrize(("policy", "num_device_blocks", "num_host_blocks", "filler", "reused_tier"), [
    ("keep", 64, 0, 0, "device"),  # everything kept: every carried token reused
    ("lru", 64, 0, 12, "device"),  # a big cache: the filler takes plain free blocks only
    ("offload", 12, 32, 12, "host"),  # offloaded at turn end, loaded back: reused from the host tier
])
def test_full_cross_turn_reuse_when_the_kv_survives(policy, num_device_blocks, num_host_blocks, filler, reused_tier):
    src, _ = _run(policy=policy, num_turns=3 if policy == "keep" else 2, num_device_blocks=num_device_blocks,
                  num_host_blocks=num_host_blocks, filler=filler)
    turns = _turns(src)
    assert {k for k in turns} >= {("sess-A", 0), ("sess-A", 1), ("sess-B", 0), ("sess-B", 1)}
    for (session, turn), r in turns.items():
        if turn == 0:
            assert r["carried_tokens"] != r["carried_tokens"] or r["carried_tokens"] is None  # no previous turn
            continue
        assert r["carried_tokens"] == CARRIED[turn], (session, turn)
        assert r["reused_tokens"] == CARRIED[turn] and r["lost_tokens"] == 0
        assert r[f"reused_{reused_tier}_tokens"] == CARRIED[turn]
        assert r["reuse_fraction"] == 1.0 and r["extra_prefill_ms"] == 0
        assert r["think_ms"] > 0
        if reused_tier == "host":
            assert r["load_ms"] > 0  # the carried KV came up from the host tier
    summary = retention_summary(src).iloc[0]
    assert summary["num_sessions"] == 2 and summary["lost_tokens"] == 0
    assert summary["reused_tokens"] == summary["carried_tokens"] == sum(
        CARRIED[t] for (_, t) in turns if t > 0)


def test_keep_pins_each_finished_turn_until_the_next_is_admitted():
    src, tables = _run(policy="keep", num_turns=2, num_device_blocks=64, filler=0)
    events = tables["cache_events"].to_pylist()
    retained = [e for e in events if e[col.KIND] == CacheEventKind.RETAIN]
    # A-0 and B-0 released at their next turn's admission (6 blocks each); A-1 and B-1 still pinned at the end.
    assert sorted(e[col.NUM_BLOCKS] for e in retained) == [6, 6]
    assert all(e[col.END_NS] > e[col.START_NS] for e in retained)
    assert retention_summary(src).iloc[0]["retained_blocks"] == 12


@pytest.mark.parametrize(("policy", "num_device_blocks", "filler"), [
    ("drop", 64, 0),  # forgotten at turn end, however big the cache
    ("lru", 12, 12),  # a tiny cache: the filler between turns evicts every cached block
])
def test_kv_lost_during_think_time_is_recomputed_and_its_cost_reported(policy, num_device_blocks, filler):
    src, tables = _run(policy=policy, num_turns=2, num_device_blocks=num_device_blocks, filler=filler)
    turns = _turns(src)
    for s in ("sess-A", "sess-B"):
        r = turns[(s, 1)]
        assert r["carried_tokens"] == 24 and r["reused_tokens"] == 0 and r["lost_tokens"] == 24
        assert r[col.NUM_CACHED_TOKENS] == 0 and r["reuse_fraction"] == 0
        # the turn computed its whole prompt (33 tokens); 24 of them it would not have had to
        assert r["extra_prefill_ms"] > 0
        prefill_ms = sum((sp[col.END_NS] - sp[col.START_NS]) / 1e6 for sp in tables["spans"].to_pylist()
                         if sp[col.REQUEST_ID] == r[col.REQUEST_ID] and sp[col.STAGE] == 6)
        assert r["extra_prefill_ms"] == pytest.approx(prefill_ms * 24 / 33)
    kinds = [e[col.KIND] for e in tables["cache_events"].to_pylist()]
    if policy == "drop":
        dropped = [e for e in tables["cache_events"].to_pylist() if e[col.KIND] == CacheEventKind.DROP]
        assert [e[col.NUM_BLOCKS] for e in dropped][:2] == [6, 6]
    else:
        assert CacheEventKind.EVICT in kinds
    summary = session_summary(src)
    assert summary["lost_tokens"].tolist() == [24, 24] and summary["num_turns"].tolist() == [2, 2]


def test_fairness_counts_sessions_and_requests():
    src, _ = _run(policy="lru", num_turns=2, num_device_blocks=64, filler=0)
    fair = session_fairness(src)
    assert fair["num_sessions"].tolist() == [2] and fair["num_requests"].tolist() == [4]
    assert fair["session_share"].tolist() == [1.0]


def test_a_run_without_sessions_gives_empty_tables():
    src = Source.of_tables()
    assert session_turns(src).empty and session_summary(src).empty and retention_summary(src).empty


def test_only_the_admission_that_carried_counts_not_a_lookup_after_a_preemption():
    """A turn that found nothing at admission (step 12), was preempted and recomputed, and then hit its own
    blocks (step 15) reused nothing of what it carried: the hand-made events of such a run."""
    requests = pa.Table.from_pylist([
        {col.REQUEST_ID: 1, col.REQUEST_KEY: "t0", col.INSTANCE_ID: 5, col.SESSION: "s", col.ARRIVAL_NS: 0,
         col.FINISH_NS: 10, col.NUM_PROMPT_TOKENS: 205, col.STATUS: 0},
        {col.REQUEST_ID: 2, col.REQUEST_KEY: "t1", col.INSTANCE_ID: 5, col.SESSION: "s", col.ARRIVAL_NS: 20,
         col.FINISH_NS: 40, col.NUM_PROMPT_TOKENS: 224, col.NUM_CACHED_TOKENS: 0, col.STATUS: 0},
    ], schema=REQUESTS.schema)
    events = pa.Table.from_pylist([
        {col.INSTANCE_ID: 5, col.REQUEST_ID: 2, col.KIND: CacheEventKind.CARRY, col.TIER: 0, col.NUM_BLOCKS: 13,
         col.NUM_TOKENS: 208, col.START_NS: 21, col.END_NS: 21, col.STEP: 12},
        {col.INSTANCE_ID: 5, col.REQUEST_ID: 2, col.KIND: CacheEventKind.HIT, col.TIER: 0, col.NUM_BLOCKS: 14,
         col.NUM_TOKENS: 224, col.START_NS: 30, col.END_NS: 30, col.STEP: 15},
    ], schema=CACHE_EVENTS.schema)
    turns = _turns(Source.of_tables(requests=requests, cache_events=events))
    t1 = turns[("s", 1)]
    assert (t1["carried_tokens"], t1["reused_tokens"], t1["lost_tokens"]) == (208, 0, 208)
    assert t1["think_ms"] == pytest.approx(10 / 1e6)
