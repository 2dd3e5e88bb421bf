"""Observer hook points: what events arrive, in which order, with which fields."""

from __future__ import annotations

import pytest

import reference_server.engine.engine as engine_module
from reference_server.engine import Engine, EngineConfig, EngineObserver, RecordingObserver
from reference_server.engine.hooks import (
    CacheLookup,
    RequestAdded,
    RequestFinished,
    RequestQueued,
    RequestScheduled,
    StepEnd,
    StepStart,
    TokenEmitted,
)
from reference_server.model import SamplingParams

SAMPLING = SamplingParams(max_tokens=3, ignore_eos=True)


def make_engine(**kw) -> Engine:
    return Engine(EngineConfig(model="tiny", block_size=4, num_device_blocks=32, device="cpu", **kw))


def test_one_request_sees_added_queued_scheduled_tokens_finished_in_order():
    obs = RecordingObserver()
    with make_engine(max_num_batched_tokens=8) as e:
        e.add_observer(obs)
        e.add_request("r", "0123456789", SAMPLING, tenant="default", slo_class="batch", arrival_ns=123)
        while e.has_unfinished():
            e.step()
    kinds = [type(ev).__name__ for ev in obs.for_request("r")]
    assert kinds == [
        "RequestAdded", "RequestQueued", "CacheLookup", "RequestScheduled",  # 11 prompt tokens: chunk 8
        "RequestScheduled", "TokenEmitted",  # chunk 3, first token
        "RequestScheduled", "TokenEmitted", "RequestScheduled", "TokenEmitted", "RequestFinished",
    ]
    added = obs.of_type(RequestAdded)[0]
    assert (added.tenant, added.slo_class, added.arrival_ns, added.num_prompt_tokens) == ("default", "batch", 123, 11)
    assert obs.of_type(RequestQueued)[0].num_waiting == 1
    chunks = [(s.step, s.start_pos, s.num_tokens, s.is_prefill) for s in obs.of_type(RequestScheduled)]
    assert chunks == [(1, 0, 8, True), (2, 8, 3, True), (3, 11, 1, False), (4, 12, 1, False)]
    tokens = obs.of_type(TokenEmitted)
    assert [t.index for t in tokens] == [0, 1, 2] and [t.step for t in tokens] == [2, 3, 4]
    assert all(t.sampled_ns <= t.emit_ns for t in tokens)
    finished = obs.of_type(RequestFinished)[0]
    assert (finished.reason, finished.num_output_tokens, finished.num_cached_tokens) == ("length", 3, 0)
    lookup = obs.of_type(CacheLookup)[0]
    assert lookup.start_ns <= lookup.end_ns and (lookup.num_query_tokens, lookup.num_hit_tokens) == (11, 0)


def test_step_events_bracket_each_iteration_with_batch_and_queue_state():
    obs = RecordingObserver()
    with make_engine(max_num_batched_tokens=8, max_num_seqs=1) as e:
        e.add_observer(obs)
        e.add_request("a", "abc", SAMPLING)
        e.add_request("b", "xyz", SAMPLING)
        e.step()
        e.step()
    steps = [ev for ev in obs.events if isinstance(ev, (StepStart, StepEnd))]
    assert [(type(s).__name__, s.step) for s in steps] == [
        ("StepStart", 1), ("StepEnd", 1), ("StepStart", 2), ("StepEnd", 2)]
    first, second = obs.of_type(StepEnd)
    assert [(b.request_id, b.num_prefill_tokens, b.num_decode_tokens) for b in first.batch] == [("a", 4, 0)]
    assert [(b.request_id, b.num_prefill_tokens, b.num_decode_tokens) for b in second.batch] == [("a", 0, 1)]
    assert (first.num_waiting, first.num_running, first.num_preempted) == (1, 1, 0)
    assert first.num_blocks_used == (1, 0, 0) and first.num_blocks_total == (32, 0, 0)
    assert first.start_ns <= first.compute_start_ns <= first.compute_end_ns <= first.end_ns
    assert (first.num_prefill_tokens, second.num_decode_tokens) == (4, 1)


class Exploding(EngineObserver):
    def on_token_emitted(self, event):
        raise RuntimeError("observer bug")


def test_a_failing_observer_is_counted_and_never_breaks_the_engine():
    obs = RecordingObserver()
    with make_engine() as e:
        e.add_observer(Exploding())
        e.add_observer(obs)
        out = e.generate(["hello"], SAMPLING)[0]
        assert len(out.token_ids) == 3
        assert e.stats().num_observer_errors == 3
    assert len(obs.of_type(TokenEmitted)) == 3  # later observers still called


def test_remove_observer_stops_events():
    obs = RecordingObserver()
    with make_engine() as e:
        e.add_observer(obs)
        e.generate(["a"], SAMPLING)
        n = len(obs.events)
        e.remove_observer(obs)
        e.generate(["b"], SAMPLING)
        with pytest.raises(ValueError, match="not attached"):
            e.remove_observer(obs)
    assert len(obs.events) == n > 0


def test_without_observers_no_event_is_built(monkeypatch):
    """Events the engine builds for observers only. (The scheduler's plan events, such as
    CacheLookup, are the plan's own record and are built every step.)"""
    def forbidden(*args, **kwargs):
        raise AssertionError("event built with no observer attached")

    for name in ("StepStart", "StepEnd", "TokenEmitted", "RequestScheduled", "RequestAdded",
                 "RequestFinished", "TierTransfer", "BatchEntry"):
        monkeypatch.setattr(engine_module, name, forbidden)
    with make_engine() as e:
        assert len(e.generate(["hello", "world"], SAMPLING)) == 2
