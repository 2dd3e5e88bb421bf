"""Tenant analyses with many tenants: ranked pairs instead of all pairs, the sample stated, the same numbers.

No wall-clock limit is asserted (benchmarks/tenants.py measures the time against the tenant count); what is
asserted is what makes the time scale: how many pairs are tested, that the one planted aggressor is among
them, and that the vectorised arithmetic gives what the per-pair formulas give.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from analyzers.latency import latency
from analyzers.neighbours import _effects, _p_value, noisy_neighbours
from analyzers.stage_breakdown import breakdown
from tokentrace.schema import col

REPO = Path(__file__).resolve().parents[2]


def _reference_effect(x: np.ndarray, y: np.ndarray, w: np.ndarray, burst: np.ndarray) -> float:
    """The per-pair definition: a weighted line (np.polyfit) through the windows outside the bursts."""
    if not burst.any() or burst.all():
        return math.nan
    xs, ys, ws = x[~burst], y[~burst], w[~burst]
    if np.unique(xs).size < 2:
        resid = y - float(np.average(ys, weights=ws))
    else:
        slope, intercept = np.polyfit(xs, ys, 1, w=np.sqrt(ws))
        resid = y - (slope * x + intercept)
    return float(np.average(resid[burst], weights=w[burst]))


@pytest.mark.parametrize("seed", range(6))
def test_vectorised_effects_equal_the_per_pair_line_fit(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 25))
    x = np.sort(rng.choice(40, n, replace=False)).astype(float)
    y, w = rng.normal(20, 5, n), rng.integers(1, 9, n).astype(float)
    labels = rng.random((50, n)) < 0.2
    labels[0] = False  # no burst: undefined
    labels[1] = True  # only bursts: undefined
    labels[2] = True
    labels[2, 0] = False  # one window to fit: the line is its mean
    got = _effects(x, y, w, labels)
    want = np.array([_reference_effect(x, y, w, row) for row in labels])
    assert np.allclose(got, want, rtol=1e-9, atol=1e-9, equal_nan=True)
    assert math.isnan(got[0]) and math.isnan(got[1])


def test_permutation_p_value_counts_shuffles_at_least_the_observed():
    x = np.arange(20, dtype=float)
    y = np.full(20, 10.0)
    burst = np.zeros(20, dtype=bool)
    burst[[4, 12]] = True
    y[burst] = 40.0  # the two burst windows are far above every other: few shuffles match them
    w = np.ones(20)
    observed = float(_effects(x, y, w, burst)[0])
    p = _p_value(x, y, w, burst, observed, num=999, rng=np.random.default_rng(0))
    assert 1 / 1000 <= p < 0.05  # C(20, 2) = 190 labelings, one of them the observed
    assert math.isnan(_p_value(x, y, w, burst, math.nan, num=99, rng=np.random.default_rng(0)))


@pytest.fixture
def crowd(handmade):
    """60 tenants over twenty 1 s windows: 'agg' sends 1 request a window and 30 in windows 5 and 14; 'vic-0' ..
    'vic-3' send 3 a window, TTFT 10 ms, 80 ms in agg's burst windows; 'light-0' .. 'light-54' one request each."""
    h, rid = handmade, 0
    for w in range(20):
        bursting = w in (5, 14)
        for j in range(30 if bursting else 1):
            rid += 1
            t = w * 1000 + 100 + j
            h.request(rid, t, t + 10, tenant="agg").tokens(rid, [t + 10])
        for v in range(4):
            for j in range(3):
                rid += 1
                t = w * 1000 + 200 + 50 * v + j
                ttft = 80 if bursting else 10
                h.request(rid, t, t + ttft, tenant=f"vic-{v}").tokens(rid, [t + ttft])
    for i in range(55):
        rid += 1
        t = (i % 20) * 1000 + 900
        h.request(rid, t, t + 10, tenant=f"light-{i}").tokens(rid, [t + 10])
    return h.source()


def test_many_tenants_test_the_ranked_pairs_and_say_so(crowd):
    df = noisy_neighbours(crowd, window_s=1.0, top_k=5, permutations=200)
    assert df.attrs["num_tenants"] == 60 and df.attrs["num_pairs"] == 60 * 59
    assert df.attrs["num_pairs_tested"] == len(df) <= 5 * 5
    assert set(df["victim"]) == {"agg", "vic-0", "vic-1", "vic-2", "vic-3"}  # the tenants with enough windows
    assert "agg" in set(df["aggressor"])  # the one that bursts ranks first
    pairs = df.set_index(["aggressor", "victim"])
    for v in range(4):
        pair = pairs.loc[("agg", f"vic-{v}")]
        assert pair["effect_ms"] == pytest.approx(70.0, abs=1.0)
        assert bool(pair["enough_data"]) and pair["num_burst_windows"] == 2


def test_few_tenants_test_every_pair(crowd):
    df = noisy_neighbours(crowd, window_s=1.0, top_k=60, permutations=20)
    assert len(df) == df.attrs["num_pairs"] == df.attrs["num_pairs_tested"] == 60 * 59
    with pytest.raises(ValueError, match="top_k"):
        noisy_neighbours(crowd, top_k=1)


def test_latency_and_breakdown_by_tenant_have_every_tenant(crowd):
    lat = latency(crowd, by="tenant")
    assert len(lat) == 60 * 4  # four metric rows per tenant
    ttft = lat[lat["metric"] == "ttft"].set_index(col.TENANT)
    assert ttft.loc["vic-0", "count"] == 60 and ttft.loc["light-7", "count"] == 1
    assert ttft.loc["vic-0", "p50_ms"] == pytest.approx(10.0)
    bd = breakdown(crowd, by="tenant")
    assert bd[col.TENANT].nunique() == 60
    whole = bd[bd["stage"] == "unattributed"].set_index(col.TENANT)  # no spans: all of TTFT unattributed
    assert whole.loc["vic-3", "ttft_share"] == pytest.approx(1.0)
    assert whole.loc["vic-3", "ttft_mean_ms"] == pytest.approx(ttft.loc["vic-3", "mean_ms"])


def test_a_report_on_thousands_of_tenants_finishes_and_states_its_sample(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from tenants import generate
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    generate(tmp_path / "store", "run", num_tenants=2_000, num_requests=6_000, duration_s=600)
    done = subprocess.run([sys.executable, "-m", "tokentrace.app.cli", "report", str(tmp_path / "store")],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "With 2,000 tenants," in done.stdout and "ordered pairs were tested" in done.stdout
