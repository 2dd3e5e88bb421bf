"""compare(): runs tested at the level of runs against run-to-run noise, on hand-made runs with hand-set levels."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from analyzers.compare import (
    COMPARE_COLUMNS,
    DEFAULT_NOISE,
    FAMILIES,
    PRIMARY,
    NoiseModel,
    compare,
    explain,
    family_of,
    measure_noise,
    values_of,
)
from tokentrace.schema import Stage

MS_NOISE = NoiseModel(sigma={"latency.mean": 0.02, "latency.p50": 0.02, "latency.p90": 0.02, "latency.p99": 0.02,
                             "stage": 0.02, "context": 0.02}, runs=20, source="hand-set: 2%")


def _run(make_store, prefill_ms: float, decode_ms: float, *, hit: float = 0.0, wobble: float = 0.0, n: int = 20):
    """n requests of 64 prompt tokens (``hit`` of them cached): prefill ``prefill_ms``, then 4 tokens of decode
    ``decode_ms`` each, every one scaled by (1 + wobble); an engine step per token, 2 requests waiting."""
    h = make_store()
    scale = 1 + wobble
    step = 0
    for rid in range(1, n + 1):
        arrival = rid * 1000.0
        t = arrival + prefill_ms * scale
        h.span(rid, Stage.PREFILL_COMPUTE, arrival, t, 0)
        times = [t]
        for i in range(1, 5):
            h.span(rid, Stage.DECODE_COMPUTE, t, t + decode_ms * scale, i)
            h.step(step, t, t + decode_ms * scale, decode=1, waiting=2)
            step += 1
            t += decode_ms * scale
            times.append(t)
        h.request(rid, arrival, t, prompt=64, cached=int(64 * hit)).tokens(rid, times)
    return h.source()


def _row(df: pd.DataFrame, metric: str, statistic: str = "mean") -> pd.Series:
    return df.set_index(["metric", "statistic"]).loc[(metric, statistic)]


def test_a_run_against_itself_is_noise_everywhere(make_store):
    src = _run(make_store, 10, 5)
    df = compare([src], [src], noise=MS_NOISE)
    assert list(df.columns) == COMPARE_COLUMNS
    assert not df["significant"].any() and set(df["verdict"]) <= {"noise", "untested"}
    assert (df.loc[df["verdict"] == "noise", "delta"] == 0).all()


def test_one_run_a_side_flags_a_change_past_the_noise_it_is_given(make_store):
    base, cand = _run(make_store, 10, 5), _run(make_store, 10, 10)
    df = compare([base], [cand], noise=MS_NOISE)
    row = _row(df, "stage.decode.compute.itl")
    assert row["regression"] and row["verdict"] == "regression" and row["rel_change"] == pytest.approx(1.0)
    assert row["noise_source"] == "hand-set: 2%" and row["runs_baseline"] == 1 and row["n_baseline"] == 20
    assert not _row(df, "stage.prefill.compute.ttft")["significant"]
    # ln(1.02..) CI around the +100%: both ends above 0
    assert 0 < row["rel_ci_low"] < 1.0 < row["rel_ci_high"]


def test_the_same_change_within_the_default_noise_says_what_it_would_need(make_store):
    base, cand = _run(make_store, 10, 5), _run(make_store, 10, 6)  # +20% decode, one run a side
    df = compare([base], [cand])
    row = _row(df, "stage.decode.compute.itl")
    assert row["verdict"] == "noise" and not row["regression"] and row["noise_source"] == DEFAULT_NOISE.source
    assert row["min_detectable"] > 0.2 and row["runs_needed"] >= 2


def test_several_runs_a_side_measure_their_own_noise(make_store):
    base = [_run(make_store, 10, 5, wobble=w) for w in (-0.02, 0.0, 0.02)]
    cand = [_run(make_store, 10, 6, wobble=w) for w in (-0.02, 0.0, 0.02)]  # +20%, runs 2% apart
    df = compare(base, cand, noise=MS_NOISE)  # each row's own spread between these runs
    row = _row(df, "stage.decode.compute.itl")
    assert row["regression"] and row["runs_baseline"] == 3 and row["runs_candidate"] == 3
    assert row["noise_source"] == "measured: the spread of these 3 + 3 runs" and row["noise"] < 0.1
    assert row["min_detectable"] < 0.2
    assert not _row(df, "stage.prefill.compute.ttft")["significant"]


def test_context_rows_and_the_sentence_that_ties_them_to_a_stage(make_store):
    base = [_run(make_store, 10, 5, hit=0.75, wobble=w) for w in (-0.02, 0.0, 0.02)]
    cand = [_run(make_store, 40, 5, hit=0.25, wobble=w) for w in (-0.02, 0.0, 0.02)]  # a lost prefix: 4x prefill
    df = compare(base, cand, noise=MS_NOISE)
    hit = _row(df, "cache.hit_rate", "value")
    assert hit["unit"] == "fraction" and hit["significant"] and not hit["regression"]
    assert hit["baseline"] == pytest.approx(0.75) and hit["candidate"] == pytest.approx(0.25)
    assert _row(df, "schedule.queue_depth", "value")["baseline"] == pytest.approx(2.0)
    assert _row(df, "schedule.preemptions", "value")["baseline"] == 0
    assert explain(df) == ["hit rate fell from 75% to 25%, so prefill.compute +30 ms per first token"]


def test_a_run_without_steps_has_no_context_figures(make_store):
    h = make_store()
    h.request(1, 0.0, 12.0, prompt=8).tokens(1, [10.0, 12.0])
    values = values_of(h.source()).values
    assert math.isnan(values["engine.utilisation", "value"]) and math.isnan(values["schedule.queue_depth", "value"])
    assert math.isnan(values["cache.hit_rate", "value"])  # cached tokens not reported: not measured, not 0%


def test_several_runs_a_side_are_steadied_by_the_rows_own_figure_never_a_class(make_store):
    base = [_run(make_store, 10, 5, wobble=w) for w in (-0.02, 0.0, 0.02)]
    cand = [_run(make_store, 10, 6, wobble=w) for w in (-0.02, 0.0, 0.02)]
    noisy = NoiseModel(sigma={**MS_NOISE.sigma, "stage.decode.compute.itl.mean": 0.6}, runs=12, source="A/A")
    row = _row(compare(base, cand, noise=noisy), "stage.decode.compute.itl")
    # three runs a side that agree within 2% do not outweigh twelve A/A runs 60% apart: +20% stays within noise
    assert row["verdict"] == "noise" and row["noise"] > 0.3
    assert row["noise_source"] == "measured: the spread of these 3 + 3 runs, steadied by this row's figure from A/A"
    # a class's figure (60% for every stage) is not the row's: the runs' own spread judges it
    classy = NoiseModel(sigma={**MS_NOISE.sigma, "stage": 0.6}, runs=12, source="A/A")
    row = _row(compare(base, cand, noise=classy), "stage.decode.compute.itl")
    assert row["regression"] and row["noise"] < 0.05
    assert row["noise_source"] == "measured: the spread of these 3 + 3 runs"


def test_three_runs_that_disagree_are_not_a_regression(make_store):
    base = [_run(make_store, 10, 5, wobble=w) for w in (-0.3, 0.0, 0.3)]
    cand = [_run(make_store, 10, 6, wobble=w) for w in (-0.3, 0.0, 0.3)]  # +20% inside a 30% spread
    row = _row(compare(base, cand, noise=MS_NOISE), "stage.decode.compute.itl")
    assert row["verdict"] == "noise" and row["noise"] > 0.2 and row["runs_needed"] > 3


def test_holm_families_primary_latency_stage_context(make_store):
    base, cand = _run(make_store, 10, 5), _run(make_store, 10, 10)
    df = compare([base], [cand], noise=MS_NOISE).set_index(["metric", "statistic"])
    assert {family_of(m, s) for m, s in df.index} == set(FAMILIES)
    assert [k for k in df.index if family_of(*k) == "primary"] == list(PRIMARY)
    # each family adjusted on its own (Holm over its 6 rows), the three families of times a third of the rate each
    primary = df.loc[list(PRIMARY)].dropna(subset=["p_value"])
    assert len(primary) == 6 and (primary["p_adjusted"] <= 3 * 6 * primary["p_value"] + 1e-12).all()
    smallest = primary["p_value"].min()
    assert primary["p_adjusted"].min() == pytest.approx(min(1.0, 3 * 6 * smallest))
    assert family_of("stage.decode.compute.itl", "p50") == "stage" and family_of("itl", "mean") == "latency"


def test_stage_median_per_token_sees_a_step_delay_the_mean_blurs(make_store):
    h = make_store()
    step = 0
    for rid in range(1, 11):
        t = rid * 1000.0
        h.span(rid, Stage.PREFILL_COMPUTE, t - 5, t, 0)
        times = [t]
        for i in range(1, 6):
            ms = 200.0 if (rid, i) == (3, 2) else 1.0  # one stalled step among fifty
            h.span(rid, Stage.DECODE_COMPUTE, t, t + ms, i)
            h.step(step, t, t + ms, decode=1)
            step += 1
            t += ms
            times.append(t)
        h.request(rid, rid * 1000.0 - 5, t, prompt=8).tokens(rid, times)
    values = values_of(h.source()).values
    assert values["stage.decode.compute.itl", "p50"] == pytest.approx(1.0)
    assert values["stage.decode.compute.itl", "mean"] == pytest.approx((49 + 200) / 50)
    assert values["stage.decode.compute.ttft", "p50"] == 0 and values["stage.prefill.compute.ttft", "p50"] == 5


def test_stages_too_small_to_matter_are_not_tested(make_store):
    h = make_store()
    for rid in range(1, 4):
        h.span(rid, Stage.GATEWAY_TOKENIZE, rid * 100.0, rid * 100.0 + 0.15, 0)
        h.span(rid, Stage.PREFILL_COMPUTE, rid * 100.0 + 0.15, rid * 100.0 + 20, 0)
        h.request(rid, rid * 100.0, rid * 100.0 + 20).tokens(rid, [rid * 100.0 + 20])
    df = compare([h.source()], [h.source()])
    # 0.15 ms of a 20 ms TTFT is under 2% of it (0.4 ms): no verdict on it, and no share of the false-alarm rate
    assert _row(df, "stage.gateway.tokenize.ttft")["verdict"] == "untested"
    assert _row(df, "stage.prefill.compute.ttft")["verdict"] == "noise"


def test_measured_noise_per_row_and_per_class(make_store):
    runs = [_run(make_store, 10, 5, wobble=w) for w in (-0.1, 0.0, 0.1)]
    noise = measure_noise(runs, source="three hand-made runs")
    expected = pd.Series([math.log(0.9 * 5 + 0.1), math.log(5 + 0.1), math.log(1.1 * 5 + 0.1)]).std()
    assert noise.sigma["stage.decode.compute.itl.mean"] == pytest.approx(expected)
    assert noise.of("stage.decode.compute.itl", "mean") == pytest.approx(expected)
    assert noise.of("stage.no.such.itl", "mean") == noise.sigma["stage"] and noise.runs == 3
    with pytest.raises(ValueError, match="at least 3 runs"):
        measure_noise(runs[:2], source="too few")


@pytest.mark.parametrize("kwargs", [{"confidence": 1.0}, {"power": 0.0}, {"min_effect": -1.0}])
def test_bad_arguments(make_store, kwargs):
    src = _run(make_store, 10, 5, n=2)
    with pytest.raises(ValueError):
        compare([src], [src], **kwargs)
    with pytest.raises(ValueError, match="at least one baseline run"):
        compare([], [src])


# Real runs of the reference server (in this process, behind its HTTP gateway, traced), made once for the module:
# three of one configuration (A) and three with a 50 ms sleep planted in every decoding step (B).
@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    import sys
    from pathlib import Path

    import tokentrace

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from comparison import one_run  # the benchmark's traced reference-server run

    store = tmp_path_factory.mktemp("real-compare")
    plan = [("a-1", ""), ("b-1", "decode_step=50ms"), ("a-2", ""), ("b-2", "decode_step=50ms"),
            ("a-3", ""), ("b-3", "decode_step=50ms")]  # interleaved, as docs/report.md advises
    for run, delay in plan:
        one_run(store, run, delay=delay, requests=8, tokens=8, concurrency=2)
    return store, {run: tokentrace.open(store, run) for run, _ in plan}


def test_real_runs_a_planted_decode_step_is_flagged_in_decode_compute(real_runs):
    _, runs = real_runs
    base = [runs[f"a-{i}"] for i in (1, 2, 3)]
    df = runs["b-1"].analyze().compare(base, others=[runs["b-2"], runs["b-3"]])
    row = _row(df, "stage.decode.compute.itl")
    assert row["regression"] and row["runs_baseline"] == 3 and row["runs_candidate"] == 3
    assert row["delta"] > 40  # ms per token: the planted 50 ms, less what the baseline's compute already took
    assert _row(df, "stage.decode.compute.itl", "p50")["regression"]
    # first the stage that grew most; a step that prefills one request while decoding another also carries the
    # sleep into prefill.compute, so that stage may rise too, but by less than every later token's 50 ms
    assert explain(df)[0].startswith("decode.compute +")


def test_real_runs_of_one_configuration_one_against_one(real_runs):
    _, runs = real_runs
    df = runs["a-2"].analyze().compare([runs["a-1"]])
    row = _row(df, "stage.decode.compute.itl")
    assert not row["regression"] and row["noise_source"] == DEFAULT_NOISE.source
    assert row["min_detectable"] > 1.0  # one run a side on a shared CPU: only a several-fold change shows
    same = runs["a-1"].analyze().compare([runs["a-1"]])
    assert not same["significant"].any()


def test_real_runs_through_the_report_command(real_runs):
    from typer.testing import CliRunner

    from tokentrace.app.cli import app, register_commands

    register_commands()
    store, _ = real_runs
    result = CliRunner().invoke(app, ["report", str(store), "--run", "b-1", "--baseline", f"{store}:a-*",
                                      "--candidate", f"{store}:b-*", "--format", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["baseline"]["run_id"] == "a-1" and any("decode.compute" in r for r in doc["regressions"])
    note = doc["sections"]["diff"]["note"]
    assert "3 / 3 run(s) per side" in note and "smallest change detected" in note
