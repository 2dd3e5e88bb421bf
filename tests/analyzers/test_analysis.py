"""RunAnalysis over real Parquet stores: the DuckDB path agrees with the in-memory path, bad
files and missing tables degrade gracefully, and every analysis runs on a traced engine run."""

from __future__ import annotations

import math
import warnings

import pandas as pd
import pytest

import tokentrace
from analyzers.analysis import RunAnalysis
from analyzers.source import Source
from tokentrace.schema import Role, Stage, col


def _populate(h):
    """Two instances whose clocks differ by 1 s (instance 2 reads 1 s less; its offset says +1 s).

    r1 on instance 1: arrival 0, tokens 10, 14, 20. r2 on instance 2 (times recorded 1 s early):
    arrival 5, tokens 25, 27. Spans tile both requests' tokens.
    """
    h.instance(1, Role.COLOCATED).instance(2, Role.COLOCATED, offset_ms=1000)
    h.request(1, 0, 20, tenant="a").tokens(1, [10, 14, 20], steps=[1, 2, 3])
    h.span(1, Stage.SCHEDULE_QUEUE, 0, 4, 0).span(1, Stage.PREFILL_COMPUTE, 4, 10, 0, step=1)
    h.span(1, Stage.DECODE_COMPUTE, 10, 14, 1, step=2).span(1, Stage.DECODE_COMPUTE, 14, 19, 2, step=3)
    h.step(1, 4, 10, prefill=8, running=1).step(2, 10, 14, decode=1, running=1).step(3, 14, 19, decode=1)
    s = -1000  # instance 2's clock
    h.request(2, 5 + s, 27 + s, tenant="b", cls="batch", inst=2).tokens(2, [25 + s, 27 + s], inst=2)
    h.span(2, Stage.SCHEDULE_QUEUE, 5 + s, 19 + s, 0, inst=2).span(2, Stage.PREFILL_COMPUTE, 19 + s, 25 + s, 0, inst=2)
    h.span(2, Stage.DECODE_COMPUTE, 25 + s, 27 + s, 1, inst=2)
    return h


@pytest.fixture
def written(handmade, tmp_path):
    h = _populate(handmade)
    return h, tokentrace.open(h.write(tmp_path / "store"))


def test_parquet_path_equals_in_memory_path(written):
    h, run = written
    disk, memory = run.analyze(), h.analysis()
    assert isinstance(disk, RunAnalysis)
    for method in ("latency", "stage_breakdown", "slo", "critical_path", "batch"):
        pd.testing.assert_frame_equal(getattr(disk, method)(), getattr(memory, method)(), check_dtype=False)
    pd.testing.assert_frame_equal(disk.latency(by="tenant"), memory.latency(by="tenant"), check_dtype=False)


def test_clock_offsets_are_applied_on_the_parquet_path(written):
    _, run = written
    lat = run.analyze().latency(by="tenant").set_index([col.TENANT, "metric"])
    assert lat.loc[("b", "ttft"), "mean_ms"] == pytest.approx(20.0)
    assert lat.loc[("b", "e2e"), "mean_ms"] == pytest.approx(22.0)
    shares = run.analyze().stage_breakdown().set_index("stage")
    assert shares.loc["schedule.queue", "ttft_share"] == pytest.approx(18 / 30)


def test_a_corrupt_file_is_skipped_with_a_warning(written):
    h, run = written
    good = run.analyze().stage_breakdown()
    bad = run.path / "spans" / "instance=1" / "part-000099.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = run.analyze().stage_breakdown()
    assert any("part-000099" in str(w.message) for w in caught)
    pd.testing.assert_frame_equal(good, again)


def test_missing_tables_give_empty_answers(handmade, tmp_path):
    h = handmade.request(1, 0, 20).tokens(1, [10, 20])
    a = tokentrace.open(h.write(tmp_path / "store")).analyze()
    assert a.latency().set_index("metric").loc["ttft", "mean_ms"] == pytest.approx(10.0)
    shares = a.stage_breakdown().set_index("stage")["ttft_share"]
    assert shares["unattributed"] == 1.0
    assert a.cache().tiers.empty and a.queues().timeline.empty and a.batch().empty
    assert a.pd_ratio().utilisation.empty and a.interference().empty
    assert a.unattributed_share() == 1.0


def test_old_schema_store_reads_like_the_reader(tmp_path):
    from analyzers.latency import latency_summary

    run = tokentrace.open("tests/data/store_v0")
    via_reader = latency_summary(run.table("requests"), run.table("tokens"), run.table("instances"))
    pd.testing.assert_frame_equal(run.analyze().latency(), via_reader)


def test_agreement_delegates_to_the_agreement_analyzer(handmade):
    h = handmade.instance(1, Role.COLOCATED).instance(9, Role.CLIENT)
    h.request(1, 1, 20).tokens(1, [10, 14, 20], kind="sent")
    h.request(1, 0, 21, inst=9).tokens(1, [11, 15, 21], inst=9, kind="recv")
    df = h.analysis().agreement().set_index("metric")
    assert df.loc["ttft", "count"] == 1
    assert df.loc["ttft", "mean_ms"] == pytest.approx(-2.0)  # server 9 ms vs client 11 ms
    # The client's rows are not part of the server view.
    assert h.analysis().latency().set_index("metric").loc["ttft", "mean_ms"] == pytest.approx(9.0)


def test_bad_construction_and_baseline():
    with pytest.raises(ValueError):
        RunAnalysis()
    with pytest.raises(ValueError):
        Source.of_tables(bogus=None)
    a = RunAnalysis.of(Source.of_tables())
    with pytest.raises(ValueError):
        a.diff("not a run")


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    """A real traced run of the tiny reference engine: 8 requests, 2 tenants, 2 SLO classes."""
    import torch

    from reference_server.engine.config import EngineConfig, TenantConfig
    from reference_server.engine.engine import Engine
    from reference_server.model import SamplingParams

    torch.set_num_threads(1)
    store = tmp_path_factory.mktemp("engine-store")
    config = EngineConfig(model="tiny", block_size=4, num_device_blocks=48, max_num_batched_tokens=32,
                          tenants=(TenantConfig("t0"), TenantConfig("t1", weight=2.0)), default_tenant="t0")
    engine = Engine(config)
    handle = tokentrace.instrument(engine, store=store)
    sampling = SamplingParams(max_tokens=5, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"q{i}", "the same prefix " * 3 + f"tail {i}" * (1 + i % 3), sampling,
                           tenant=f"t{i % 2}", slo_class=("interactive", "batch")[i % 2])
    while engine.has_unfinished():
        engine.step()
    handle.close()
    return tokentrace.open(store)


def test_every_analysis_runs_on_a_traced_engine(engine_run):
    a = engine_run.analyze()
    assert a.latency().set_index("metric").loc["ttft", "count"] == 8
    assert a.unattributed_share() < 0.01  # the reference engine's tracer tiles every token
    bd = a.stage_breakdown()
    assert bd["ttft_share"].sum() == pytest.approx(1.0) and bd["itl_share"].sum() == pytest.approx(1.0)
    assert a.slo().set_index(col.SLO_CLASS).loc["*", "num_requests"] == 8
    assert set(a.latency(by="slo_class")[col.SLO_CLASS]) == {"interactive", "batch"}
    assert math.isfinite(a.littles_law().iloc[0]["relative_error"])
    assert a.cache().prefix.iloc[0]["num_requests"] == 8
    assert a.pd_ratio().utilisation.iloc[0]["role"] == "colocated"
    assert a.batch()["num_steps"].sum() > 0
    assert set(a.tenants().shares[col.TENANT]) == {"t0", "t1"}
    assert a.tenants().shares["compute_share"].sum() == pytest.approx(1.0)
    assert len(a.slowest_requests(3)) == 3
    assert set(a.critical_path()["group"]) == {"p50", "p99"}
    assert a.fluidity()["num_deadlines"].iloc[-1] == 8 * 5
    assert not a.diff(engine_run, resamples=20)["significant"].any()
    for part in (a.queues(), a.goodput(), a.interference(), a.noisy_neighbours()):
        assert part is not None
