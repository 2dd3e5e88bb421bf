"""Tenant shares, Jain's fairness index and noisy-neighbour detection."""

from __future__ import annotations

import math

import numpy as np
import pytest

from analyzers.tenants import fairness, jain_index, noisy_neighbours, tenant_shares, tenants
from tokentrace.schema import Stage, col


@pytest.fixture
def shared(handmade):
    """Tenant a: r1, prompt 10, 2 tokens. Tenant b: r2, prompt 30, 3 tokens.

    Step 1 (0-10 ms, 40 prefill tokens): both prefill -> 20 tokens each -> 5 ms each.
    Step 2 (10-20, 2 decode tokens): both decode -> 5 ms each. Step 3 (20-30): only r2 -> 10 ms.
    Compute: a 10 ms, b 20 ms. Tokens: a 12, b 33.
    """
    h = handmade
    h.request(1, 0, 20, tenant="a", prompt=10).tokens(1, [10, 20])
    h.request(2, 0, 30, tenant="b", prompt=30).tokens(2, [10, 20, 30])
    h.step(1, 0, 10, seqs=2, prefill=40).step(2, 10, 20, seqs=2, decode=2).step(3, 20, 30, seqs=1, decode=1)
    for rid in (1, 2):
        h.span(rid, Stage.PREFILL_COMPUTE, 0, 10, 0, step=1).span(rid, Stage.DECODE_COMPUTE, 10, 20, 1, step=2)
    h.span(2, Stage.DECODE_COMPUTE, 20, 30, 2, step=3)
    return h


SHARES = [("a", "compute_s", 0.010), ("b", "compute_s", 0.020), ("a", "num_tokens", 12), ("b", "num_tokens", 33),
          ("b", "compute_share", 2 / 3), ("a", "request_share", 0.5), ("b", "token_share", 33 / 45)]


@pytest.mark.parametrize(("tenant", "column", "expected"), SHARES)
def test_shares(shared, tenant, column, expected):
    assert tenant_shares(shared.source()).set_index(col.TENANT).loc[tenant, column] == pytest.approx(expected)


def test_jain_index_by_requests_tokens_and_compute(shared):
    j = fairness(tenant_shares(shared.source())).set_index("basis")["jain_index"]
    assert j["requests"] == pytest.approx(1.0)
    assert j["tokens"] == pytest.approx(45 ** 2 / (2 * (12 ** 2 + 33 ** 2)))
    assert j["compute"] == pytest.approx(30 ** 2 / (2 * (10 ** 2 + 20 ** 2)))


def test_weights_normalise_the_index(shared):
    # b has weight 2: its compute (20 ms) per unit of weight equals a's (10 ms) -> perfectly fair.
    for report in (tenants(shared.source(), weights={"b": 2.0}),
                   tenants(shared.source({"config": {"tenants": {"b": {"weight": 2}}}}))):
        j = report.jain.set_index("basis")["jain_index"]
        assert j["compute"] == pytest.approx(1.0)
        assert report.shares.set_index(col.TENANT).loc["b", "weight"] == 2.0
    with pytest.raises(ValueError):
        tenant_shares(shared.source(), weights={"a": -1})


@pytest.mark.parametrize(("x", "expected"), [([1, 1, 1], 1.0), ([1, 0, 0], 1 / 3), ([], math.nan)])
def test_jain_index_bounds(x, expected):
    value = jain_index(np.array(x, dtype=float))
    assert (math.isnan(value) and math.isnan(expected)) or value == pytest.approx(expected)


@pytest.fixture
def burst(handmade):
    """Five 1 s windows. 'agg' sends 1 request per window, 10 in window 3; 'vic' sends 1 per window,
    TTFT 10 ms except 100 ms in window 3. agg's TTFT is always 10 ms."""
    h, rid = handmade, 0
    for w in range(5):
        for j in range(10 if w == 3 else 1):
            rid += 1
            t = w * 1000 + 100 + j
            h.request(rid, t, t + 10, tenant="agg").tokens(rid, [t + 10])
        rid += 1
        t = w * 1000 + 100
        ttft = 100 if w == 3 else 10
        h.request(rid, t, t + ttft, tenant="vic").tokens(rid, [t + ttft])
    return h.source()


def test_five_windows_and_one_burst_are_shown_but_not_judged(burst):
    # The old detector flagged this pair (correlation 1, p99 100 vs 10 ms); five windows and one burst
    # cannot tell a neighbour from chance (the interference tests are in test_held_out.py).
    df = noisy_neighbours(burst, window_s=1.0, z_threshold=1.5).set_index(["aggressor", "victim"])
    pair = df.loc[("agg", "vic")]
    assert pair["num_windows"] == 5 and pair["num_burst_windows"] == 1 and pair["num_victim_burst"] == 1
    assert pair["victim_p99_burst_ms"] == pytest.approx(100.0)
    assert pair["victim_mean_normal_ms"] == pytest.approx(10.0)
    assert not bool(pair["enough_data"]) and not bool(pair["flagged"])


def test_no_pairs_with_one_tenant(handmade):
    h = handmade.request(1, 0, 10).tokens(1, [10])
    assert noisy_neighbours(h.source()).empty
    with pytest.raises(ValueError):
        noisy_neighbours(h.source(), window_s=-1)
    with pytest.raises(ValueError):
        noisy_neighbours(h.source(), permutations=5)
