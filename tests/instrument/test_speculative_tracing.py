"""Speculative decoding traced end to end: decode.draft / decode.verify spans, spec_steps rows,
and the attribution invariant through the gateway (in process, colocated workers, and
disaggregated prefill and decode workers under ``tokentrace run``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import torch

import tokentrace
from instrument.reference_engine import EngineTracer
from reference_server.engine import Engine, EngineConfig
from reference_server.model import SamplingParams
from reference_server.serving.backend import LocalBackend
from reference_server.serving.gateway import create_app
from reference_server.serving.gateway_server import serve_in_thread
from tokentrace.recorder import BufferedRecorder
from tokentrace.recorder.sink import InMemorySink
from tokentrace.schema import SPANS, SPEC_STEPS, TOKENS, DraftSource, Stage, col
from tokentrace.store import open_run

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the serving_tiling and deployments helpers
from deployments import traced_server  # noqa: E402
from serving_tiling import clipped_stage_times, handover_ns, unattributed_share  # noqa: E402
from test_reference_serving import assert_no_overlap_within_instance, send_requests  # noqa: E402

torch.set_num_threads(1)

MAX_TOKENS = 8
SPEC_ARGS = ["--speculative", "ngram", "--num-speculative-tokens", "3"]
TABLES = ("spans", "requests", "tokens", "instances", "steps", "cache_events", "spec_steps")


def spec_config(**kw) -> EngineConfig:
    return EngineConfig(model="tiny", device="cpu", block_size=4, num_device_blocks=512, max_num_seqs=16,
                        speculative="ngram", num_speculative_tokens=3, **kw)


def load(store: Path, run: str) -> dict:
    r = open_run(store, run)
    return {name: r.table(name) for name in TABLES}


def check_speculative_tiling(t: dict, *, num_requests: int, max_unattributed: float,
                             source: DraftSource = DraftSource.NGRAM) -> pd.DataFrame:
    """Every token tiled, the speculative steps' first tokens carry draft + verify (no compute),
    their further tokens neither; one spec_steps row per speculative step and request."""
    spans = t["spans"].to_pandas()
    assert_no_overlap_within_instance(spans)
    times = clipped_stage_times(t)
    assert len(times) == num_requests * MAX_TOKENS
    assert unattributed_share(times) < max_unattributed
    spec = t["spec_steps"].to_pandas()
    assert len(spec) > 0, "no request speculated"
    assert (spec[col.DRAFT_SOURCE] == source).all()
    assert (spec[col.NUM_PROPOSED].between(1, 3)).all()
    assert (spec[col.NUM_ACCEPTED] <= spec[col.NUM_PROPOSED]).all()
    assert (spec[col.DRAFT_START_NS] <= spec[col.DRAFT_END_NS]).all()
    assert (spec[col.DRAFT_END_NS] <= spec[col.VERIFY_START_NS]).all()
    assert (spec[col.VERIFY_START_NS] < spec[col.VERIFY_END_NS]).all()
    assert (spec[col.NUM_SPEC_SEQS] <= spec[col.BATCH_SIZE]).all()
    engine_spans = spans[spans[col.INSTANCE_ID].isin(spec[col.INSTANCE_ID].unique())]
    by_token = engine_spans.groupby([col.REQUEST_ID, col.TOKEN_INDEX])[col.STAGE].agg(set)
    for row in spec.itertuples(index=False):
        rid, first = getattr(row, col.REQUEST_ID), getattr(row, col.FIRST_TOKEN_INDEX)
        stages = by_token[(rid, first)]
        assert {Stage.DECODE_DRAFT, Stage.DECODE_VERIFY} <= stages and Stage.DECODE_COMPUTE not in stages
        for later in range(first + 1, min(first + getattr(row, col.NUM_ACCEPTED) + 1, MAX_TOKENS)):
            assert not stages_of(by_token, rid, later) & {Stage.DECODE_DRAFT, Stage.DECODE_VERIFY,
                                                          Stage.DECODE_COMPUTE}
    return times


def stages_of(by_token: pd.Series, rid: int, index: int) -> set:
    return by_token.get((rid, index), set())


def test_engine_tracer_tiles_a_speculative_step_exactly() -> None:
    """Engine-only: per token the spans tile ``(emit_{i-1}, emit_i]`` exactly, also for the
    several tokens a speculative step emits."""
    sink = InMemorySink()
    rec = BufferedRecorder(sink, instance_id=7, flush_interval_s=60)
    engine = Engine(spec_config())
    engine.add_observer(EngineTracer(rec))
    prompts = ["abcabcabcabcabc", "the cat and the cat and the cat", "xyz"]
    engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    rec.close()
    spans, tokens = sink.table(SPANS.name).to_pandas(), sink.table(TOKENS.name).to_pandas()
    spec = sink.table(SPEC_STEPS.name).to_pandas()
    assert len(spec) > 0 and (spec[col.NUM_ACCEPTED] > 0).any()  # some steps emitted several tokens
    emit = tokens.set_index([col.REQUEST_ID, col.TOKEN_INDEX])[col.EMIT_NS]
    for (rid, index), g in spans[spans[col.TOKEN_INDEX] >= 0].groupby([col.REQUEST_ID, col.TOKEN_INDEX]):
        g = g.sort_values(col.START_NS)
        assert (g[col.START_NS].iloc[1:].to_numpy() == g[col.END_NS].iloc[:-1].to_numpy()).all()  # no gap
        assert g[col.END_NS].iloc[-1] == emit[(rid, index)]
        if index > 0:
            assert g[col.START_NS].iloc[0] == emit[(rid, index - 1)]
    # a step's further tokens are its own detokenize only (plus the queue gap, if any)
    multi = spec[spec[col.NUM_ACCEPTED] > 0].iloc[0]
    second = spans[(spans[col.REQUEST_ID] == multi[col.REQUEST_ID])
                   & (spans[col.TOKEN_INDEX] == multi[col.FIRST_TOKEN_INDEX] + 1)]
    assert set(second[col.STAGE]) <= {Stage.DETOKENIZE, Stage.DECODE_QUEUE}


def test_local_stack_with_speculation_tiles_every_token(tmp_path: Path) -> None:
    app = create_app(LocalBackend(spec_config()))
    handle = tokentrace.instrument(app, store=tmp_path, run="spec", flush_interval_s=0.2)
    try:
        with serve_in_thread(app) as server:
            assert send_requests(server.url, 3, max_tokens=MAX_TOKENS) == [200] * 3
    finally:
        handle.close()
    check_speculative_tiling(load(tmp_path, "spec"), num_requests=3, max_unattributed=0.01)


def _check_deployment(t: dict, num_requests: int, source: DraftSource = DraftSource.NGRAM) -> None:
    times = check_speculative_tiling(t, num_requests=num_requests, max_unattributed=0.10, source=source)
    # what is left unattributed lies exactly at the cross-process hand-overs
    residual = times.set_index([col.REQUEST_ID, col.TOKEN_INDEX])["unattributed"] - handover_ns(t, times)
    assert residual.abs().sum() / times["latency_ns"].sum() < 0.001


def test_colocated_cluster_with_speculation_under_tokentrace_run(tmp_path: Path) -> None:
    with traced_server(tmp_path, "colo", ["--mode", "colocated", "--instances", "1", *SPEC_ARGS]) as url:
        assert send_requests(url, 3, max_tokens=MAX_TOKENS) == [200] * 3
    _check_deployment(load(tmp_path, "colo"), 3)


def test_disaggregated_cluster_with_speculation_under_tokentrace_run(tmp_path: Path) -> None:
    """With a draft model: on the decode worker it first catches up with a prompt it never saw
    (the prefill worker computed it)."""
    args = ["--mode", "disagg", "--prefill", "1", "--decode", "1", "--speculative", "model",
            "--speculative-draft-model", "tiny", "--num-speculative-tokens", "3"]
    with traced_server(tmp_path, "pd", args) as url:
        assert send_requests(url, 3, max_tokens=MAX_TOKENS) == [200] * 3
    _check_deployment(load(tmp_path, "pd"), 3, DraftSource.MODEL)
